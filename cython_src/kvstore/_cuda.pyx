# cython: language_level=3
"""The CUDA driver, resolved at run time.

Owns the one `libcuda.so.1` handle of the process and the table of driver entry points
kvstore uses (`CuDriver`). Nothing is linked and no CUDA toolkit is needed to build:
symbols come from dlsym (versioned names where the ABI changed), and
`cuMemcpyBatchAsync` through `cuGetProcAddress` at the CUDA 12.8 ABI (the one vLLM's
simple_kv_offload uses), so one build runs on 12.x and 13.x drivers. A driver without it
(< 12.8) leaves the pointer NULL and the copy engine issues one cuMemcpyAsync per segment.
Also owns pinning of host memory (`host_register`) for staging. Never touches torch.
"""
from libc.stdint cimport uintptr_t
from kvstore.includes.cuda cimport (
    CuDriver, CUresult, CUcontext, CUdevice, CUDA_SUCCESS, CU_MEMHOSTREGISTER_PORTABLE, dlopen, dlsym, dlerror,
    RTLD_NOW, RTLD_LOCAL,
    cuCtxGetStreamPriorityRange_t, cuCtxSetCurrent_t, cuDeviceGet_t, cuDevicePrimaryCtxRelease_t, cuDevicePrimaryCtxRetain_t, cuDriverGetVersion_t, cuEventCreate_t, cuEventDestroy_t, cuEventQuery_t, cuEventRecord_t, cuEventSynchronize_t, cuGetErrorName_t, cuGetProcAddress_t, cuInit_t, cuMemHostRegister_t, cuMemHostUnregister_t, cuMemcpyAsync_t, cuMemcpyBatchAsync_t, cuStreamCreateWithPriority_t, cuStreamDestroy_t, cuStreamSynchronize_t, cuStreamWaitEvent_t,
)

from kvstore.errors import KVStoreError


class CudaError(KVStoreError):
    """A CUDA driver call failed (the message names the call and the CUresult)."""

    def __init__(self, msg, code=None):
        super().__init__(msg)
        self.code = code


cdef CuDriver _drv
cdef bint _loaded = False
cdef str _load_error = None


cdef void *_sym(void *lib, const char *name) except NULL:
    cdef void *p = dlsym(lib, name)
    if p == NULL:
        raise CudaError(f"libcuda.so.1 has no {name.decode()}: the NVIDIA driver is too old "
                        "(kvstore needs a CUDA 12 driver or newer)")
    return p


cdef CuDriver *cuda_driver() except NULL:
    """The loaded driver table (loads it on first use; CudaError when there is none)."""
    global _loaded, _load_error
    if _loaded:
        return &_drv
    if _load_error is not None:
        raise CudaError(_load_error)
    cdef void *lib = dlopen(b"libcuda.so.1", RTLD_NOW | RTLD_LOCAL)
    if lib == NULL:
        err = dlerror()
        _load_error = ("cannot load the NVIDIA driver library libcuda.so.1 "
                       f"({err.decode() if err != NULL else 'not found'}); the CUDA copy path "
                       "needs an NVIDIA driver (use a CPU KV cache otherwise)")
        raise CudaError(_load_error)
    _drv.lib = lib
    _drv.cuInit = <cuInit_t>_sym(lib, b"cuInit")
    _drv.cuDriverGetVersion = <cuDriverGetVersion_t>_sym(lib, b"cuDriverGetVersion")
    _drv.cuGetErrorName = <cuGetErrorName_t>_sym(lib, b"cuGetErrorName")
    _drv.cuDeviceGet = <cuDeviceGet_t>_sym(lib, b"cuDeviceGet")
    _drv.cuDevicePrimaryCtxRetain = <cuDevicePrimaryCtxRetain_t>_sym(lib, b"cuDevicePrimaryCtxRetain")
    _drv.cuDevicePrimaryCtxRelease = <cuDevicePrimaryCtxRelease_t>_sym(lib, b"cuDevicePrimaryCtxRelease_v2")
    _drv.cuCtxSetCurrent = <cuCtxSetCurrent_t>_sym(lib, b"cuCtxSetCurrent")
    _drv.cuCtxGetStreamPriorityRange = <cuCtxGetStreamPriorityRange_t>_sym(lib, b"cuCtxGetStreamPriorityRange")
    _drv.cuStreamCreateWithPriority = <cuStreamCreateWithPriority_t>_sym(lib, b"cuStreamCreateWithPriority")
    _drv.cuStreamDestroy = <cuStreamDestroy_t>_sym(lib, b"cuStreamDestroy_v2")
    _drv.cuStreamWaitEvent = <cuStreamWaitEvent_t>_sym(lib, b"cuStreamWaitEvent")
    _drv.cuStreamSynchronize = <cuStreamSynchronize_t>_sym(lib, b"cuStreamSynchronize")
    _drv.cuEventCreate = <cuEventCreate_t>_sym(lib, b"cuEventCreate")
    _drv.cuEventRecord = <cuEventRecord_t>_sym(lib, b"cuEventRecord")
    _drv.cuEventSynchronize = <cuEventSynchronize_t>_sym(lib, b"cuEventSynchronize")
    _drv.cuEventQuery = <cuEventQuery_t>_sym(lib, b"cuEventQuery")
    _drv.cuEventDestroy = <cuEventDestroy_t>_sym(lib, b"cuEventDestroy_v2")
    _drv.cuMemcpyAsync = <cuMemcpyAsync_t>_sym(lib, b"cuMemcpyAsync")
    _drv.cuMemHostRegister = <cuMemHostRegister_t>_sym(lib, b"cuMemHostRegister_v2")
    _drv.cuMemHostUnregister = <cuMemHostUnregister_t>_sym(lib, b"cuMemHostUnregister")
    cdef CUresult rc = _drv.cuInit(0)
    if rc != CUDA_SUCCESS:
        _load_error = f"cuInit failed (CUresult {rc}): no usable NVIDIA GPU"
        raise CudaError(_load_error, rc)
    _drv.cuDriverGetVersion(&_drv.version)
    # The batch copy at the CUDA 12.8 ABI (9 arguments, failIdx included), whatever the
    # driver's own newest version of the symbol is.
    cdef void *fn = NULL
    cdef int status = 0
    cdef void *gpa = dlsym(lib, b"cuGetProcAddress_v2")
    _drv.cuMemcpyBatchAsync = NULL
    if _drv.version >= 12080:
        if gpa != NULL and (<cuGetProcAddress_t>gpa)(b"cuMemcpyBatchAsync", &fn, 12080, 0, &status) == CUDA_SUCCESS:
            _drv.cuMemcpyBatchAsync = <cuMemcpyBatchAsync_t>fn
        else:
            _drv.cuMemcpyBatchAsync = <cuMemcpyBatchAsync_t>dlsym(lib, b"cuMemcpyBatchAsync")
    _loaded = True
    return &_drv



cdef int cuda_check(CUresult rc, str what) except -1:
    cdef const char *name = NULL
    if rc == CUDA_SUCCESS:
        return 0
    if _loaded:
        _drv.cuGetErrorName(rc, &name)
    raise CudaError(f"{what} failed: {name.decode() if name != NULL else 'CUresult'} ({rc})", rc)


def driver_info() -> dict:
    """What the loaded driver offers: version and whether the batch copy is there
    (raises CudaError without a driver)."""
    cdef CuDriver *d = cuda_driver()
    return {"driver_version": d.version, "batch_copy": d.cuMemcpyBatchAsync != NULL}


def available() -> bool:
    """True when libcuda.so.1 loads and cuInit succeeds."""
    try:
        cuda_driver()
        return True
    except CudaError:
        return False


cdef CUcontext _primary(CuDriver *d, int device) except NULL:
    """Retain device's primary context (the one torch and vLLM use) and make it current."""
    cdef CUdevice dev
    cdef CUcontext ctx = NULL
    cuda_check(d.cuDeviceGet(&dev, device), f"cuDeviceGet({device})")
    cuda_check(d.cuDevicePrimaryCtxRetain(&ctx, dev), f"cuDevicePrimaryCtxRetain(device {device})")
    rc = d.cuCtxSetCurrent(ctx)
    if rc != CUDA_SUCCESS:
        d.cuDevicePrimaryCtxRelease(dev)
        cuda_check(rc, f"cuCtxSetCurrent(device {device})")
    return ctx


def host_register(uintptr_t address, size_t nbytes, int device=0):
    """Pin host memory for DMA (cuMemHostRegister, portable to every context), in the
    primary context of `device`, which stays retained until host_unregister."""
    cdef CuDriver *d = cuda_driver()
    cdef CUresult rc
    cdef CUdevice dev
    _primary(d, device)
    with nogil:
        rc = d.cuMemHostRegister(<void *>address, nbytes, CU_MEMHOSTREGISTER_PORTABLE)
    if rc != CUDA_SUCCESS:
        d.cuDeviceGet(&dev, device)
        d.cuDevicePrimaryCtxRelease(dev)
    cuda_check(rc, f"cuMemHostRegister of {nbytes} bytes at 0x{address:x}")


def host_unregister(uintptr_t address, int device=0):
    """Undo host_register (no copy may still use the memory)."""
    cdef CuDriver *d = cuda_driver()
    cdef CUresult rc
    cdef CUdevice dev
    _primary(d, device)
    with nogil:
        rc = d.cuMemHostUnregister(<void *>address)
    d.cuDeviceGet(&dev, device)
    d.cuDevicePrimaryCtxRelease(dev)   # the retain of _primary here
    d.cuDevicePrimaryCtxRelease(dev)   # the retain of host_register
    cuda_check(rc, f"cuMemHostUnregister at 0x{address:x}")
