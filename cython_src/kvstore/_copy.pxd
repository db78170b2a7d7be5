from libc.stdint cimport uint64_t, uintptr_t
from kvstore.includes.cuda cimport CuDriver, CUcontext, CUdevice, CUstream, CUevent, CUdeviceptr

cdef struct Row:
    # One contiguous run of bytes of every block: a block's page of one layer, or the
    # adjacent pages of several layers (block-major layouts).
    uint64_t kv_off          # offset of this run of block 0 in the KV allocation
    uint64_t block_stride    # bytes from block b to block b+1
    uint64_t stage_off       # offset of the run inside a staging slot (header included)
    uint64_t length
    uint64_t num_blocks

cdef struct SegBuf:
    CUdeviceptr *src
    CUdeviceptr *dst
    size_t *length
    size_t cap
    size_t n

cdef class CopyEngine:
    cdef:
        Row *rows
        int nrows
        uint64_t min_blocks
        uintptr_t kv_base
        uint64_t kv_nbytes
        uintptr_t stage_base
        uint64_t slot_size
        uint64_t num_slots
        int device
        SegBuf segs[2]
        object locks
        bint is_closed
        # CUDA (device >= 0)
        CuDriver *drv
        CUdevice cudev
        CUcontext ctx
        bint ctx_retained
        CUstream streams[2]
        CUevent ready
        CUevent *events
        char *busy
        int nevents
        int max_events
        int *free_ev
        int nfree
        bint use_batch
        public uint64_t copies
        public uint64_t segments_issued

    cdef int _plan(self, int direction, blocks, slots) except -1
    cdef int _bind(self) except -1
    cdef int _take_event(self) except -1
    cdef int _issue(self, int direction) except -1
    cdef CUevent _event_of(self, int ticket) except NULL
    cdef void _free_memory(self) noexcept
