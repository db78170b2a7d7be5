from libc.stdint cimport uint64_t, int64_t, uintptr_t
from kvstore.includes.uring cimport io_uring

cdef enum:
    OP_READ = 0
    OP_WRITE = 1
    OP_FSYNC = 2
    MAX_BUFFERS = 64

cdef struct Op:
    int opcode
    int fd
    int fixed_file       # registered file index, or -1
    int fixed_buf        # registered buffer index, or -1
    char *addr           # where the next byte goes / comes from
    unsigned int remaining
    uint64_t offset      # file offset of the next byte
    int64_t done         # bytes transferred so far
    int64_t result       # final: bytes, or -errno
    unsigned int forced_short  # test seam: truncate the first submission
    int finished

cdef struct Batch:
    Op *ops
    Py_ssize_t n
    Py_ssize_t *queue    # circular queue of op indices waiting for submission
    Py_ssize_t qhead
    Py_ssize_t qlen
    Py_ssize_t inflight
    Py_ssize_t completed

cdef class Ring:
    cdef:
        io_uring _ring
        bint _open
        unsigned int depth
        list _buffers            # HostBuffers usable as I/O memory (registered or not)
        object _iov              # liburing iovec keeping registered views alive
        bint _bufs_registered
        uintptr_t _buf_start[64]
        uintptr_t _buf_end[64]
        int _nbufs
        int *_files
        int _nfiles
        bint _files_registered
        dict _fd_names
        public object fault_injector

    cdef int _pump(self, Batch *b) except -1
    cdef int _pump_nogil(self, Batch *b) except -1 nogil
    cdef int _fill(self, Batch *b) noexcept nogil
    cdef Py_ssize_t _reap(self, Batch *b) noexcept nogil
    cdef void _requeue(self, Batch *b, Py_ssize_t i) noexcept nogil
    cdef _check_op(self, int opcode, int fd, uint64_t offset, uintptr_t addr, uint64_t length)
    cdef _inject(self, Batch *b, int opcode, fds, offsets, lengths)
