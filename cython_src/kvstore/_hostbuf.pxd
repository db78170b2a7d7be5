from libc.stdint cimport uintptr_t

cdef class HostBuffer:
    cdef:
        char *ptr
        size_t nbytes_
        int exports
        bint is_closed
        bint unmapped

    cdef int _unmap(self) except -1
