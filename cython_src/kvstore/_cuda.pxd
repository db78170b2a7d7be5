from kvstore.includes.cuda cimport CuDriver, CUresult

cdef CuDriver *cuda_driver() except NULL
cdef int cuda_check(CUresult rc, str what) except -1
