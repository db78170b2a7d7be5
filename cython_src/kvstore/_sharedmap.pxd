from libc.stdint cimport uint64_t

cdef enum:
    SHARED_HDR = 4096   # bytes before the array in a SharedMap file
    W_EPOCH = 2         # slots map header word: + 1 whenever an engine attaches or leaves


cdef class SharedMap:
    cdef char *p
    cdef readonly size_t nbytes
    cdef readonly bint writable
    cdef uint64_t *_word(self, size_t i) except NULL
    cdef uint64_t *_gens(self, Py_ssize_t n) except NULL
