# The CUDA driver API as kvstore calls it: resolved at run time from libcuda.so.1
# (dlopen + dlsym / cuGetProcAddress), never linked, no CUDA toolkit at build time. Only
# the handful of types and entry points the copy engine uses are declared here, with the
# ABI of the versioned symbols named in kvstore/_cuda.pyx.
from libc.stdint cimport uint64_t

cdef extern from "<dlfcn.h>" nogil:
    void *dlopen(const char *filename, int flag)
    void *dlsym(void *handle, const char *symbol)
    int dlclose(void *handle)
    char *dlerror()
    int RTLD_NOW, RTLD_LOCAL

ctypedef int CUresult
ctypedef int CUdevice
ctypedef void *CUcontext
ctypedef void *CUstream
ctypedef void *CUevent
ctypedef unsigned long long CUdeviceptr

cdef enum:
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_READY = 600
    CU_STREAM_NON_BLOCKING = 1
    CU_EVENT_BLOCKING_SYNC = 1
    CU_EVENT_DISABLE_TIMING = 2
    CU_MEMHOSTREGISTER_PORTABLE = 1
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
    CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3

# cuMemcpyBatchAsync's per-copy attributes (CUDA 12.8 ABI: enums are 32-bit ints).
cdef struct CUmemLocation:
    int type
    int id

cdef struct CUmemcpyAttributes:
    int srcAccessOrder
    CUmemLocation srcLocHint
    CUmemLocation dstLocHint
    unsigned int flags

ctypedef CUresult (*cuInit_t)(unsigned int) noexcept nogil
ctypedef CUresult (*cuDriverGetVersion_t)(int *) noexcept nogil
ctypedef CUresult (*cuGetErrorName_t)(CUresult, const char **) noexcept nogil
ctypedef CUresult (*cuGetProcAddress_t)(const char *, void **, int, uint64_t, int *) noexcept nogil
ctypedef CUresult (*cuDeviceGet_t)(CUdevice *, int) noexcept nogil
ctypedef CUresult (*cuDevicePrimaryCtxRetain_t)(CUcontext *, CUdevice) noexcept nogil
ctypedef CUresult (*cuDevicePrimaryCtxRelease_t)(CUdevice) noexcept nogil
ctypedef CUresult (*cuCtxSetCurrent_t)(CUcontext) noexcept nogil
ctypedef CUresult (*cuCtxGetStreamPriorityRange_t)(int *, int *) noexcept nogil
ctypedef CUresult (*cuStreamCreateWithPriority_t)(CUstream *, unsigned int, int) noexcept nogil
ctypedef CUresult (*cuStreamDestroy_t)(CUstream) noexcept nogil
ctypedef CUresult (*cuStreamWaitEvent_t)(CUstream, CUevent, unsigned int) noexcept nogil
ctypedef CUresult (*cuStreamSynchronize_t)(CUstream) noexcept nogil
ctypedef CUresult (*cuEventCreate_t)(CUevent *, unsigned int) noexcept nogil
ctypedef CUresult (*cuEventRecord_t)(CUevent, CUstream) noexcept nogil
ctypedef CUresult (*cuEventSynchronize_t)(CUevent) noexcept nogil
ctypedef CUresult (*cuEventQuery_t)(CUevent) noexcept nogil
ctypedef CUresult (*cuEventDestroy_t)(CUevent) noexcept nogil
ctypedef CUresult (*cuMemcpyAsync_t)(CUdeviceptr, CUdeviceptr, size_t, CUstream) noexcept nogil
ctypedef CUresult (*cuMemHostRegister_t)(void *, size_t, unsigned int) noexcept nogil
ctypedef CUresult (*cuMemHostUnregister_t)(void *) noexcept nogil
# CUDA 12.8 ABI (with failIdx); CUDA 13's cuMemcpyBatchAsync_v2 drops failIdx.
ctypedef CUresult (*cuMemcpyBatchAsync_t)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                                          CUmemcpyAttributes *, size_t *, size_t, size_t *,
                                          CUstream) noexcept nogil

cdef struct CuDriver:
    void *lib
    int version
    cuInit_t cuInit
    cuDriverGetVersion_t cuDriverGetVersion
    cuGetErrorName_t cuGetErrorName
    cuDeviceGet_t cuDeviceGet
    cuDevicePrimaryCtxRetain_t cuDevicePrimaryCtxRetain
    cuDevicePrimaryCtxRelease_t cuDevicePrimaryCtxRelease
    cuCtxSetCurrent_t cuCtxSetCurrent
    cuCtxGetStreamPriorityRange_t cuCtxGetStreamPriorityRange
    cuStreamCreateWithPriority_t cuStreamCreateWithPriority
    cuStreamDestroy_t cuStreamDestroy
    cuStreamWaitEvent_t cuStreamWaitEvent
    cuStreamSynchronize_t cuStreamSynchronize
    cuEventCreate_t cuEventCreate
    cuEventRecord_t cuEventRecord
    cuEventSynchronize_t cuEventSynchronize
    cuEventQuery_t cuEventQuery
    cuEventDestroy_t cuEventDestroy
    cuMemcpyAsync_t cuMemcpyAsync
    cuMemHostRegister_t cuMemHostRegister
    cuMemHostUnregister_t cuMemHostUnregister
    cuMemcpyBatchAsync_t cuMemcpyBatchAsync    # NULL: the driver predates CUDA 12.8
