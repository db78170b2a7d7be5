# mmap/munmap/madvise and the constants the staging memory needs.
cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int madvise(void *addr, size_t length, int advice)
    void *MAP_FAILED
    int PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS, MAP_POPULATE
    int MADV_DONTFORK

cdef extern from "<errno.h>" nogil:
    int errno
