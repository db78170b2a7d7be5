# cython: language_level=3
"""The copy engine: whole batches of blocks between the KV cache and staging slots.

Owns the addressing of a copy: a block id and a staging slot become a list of segments
(source address, destination address, length), one per contiguous run of the block in
the KV allocation (`Row`), built in C. The same segment list is then run by one of two
backends:

- CPU (KV cache in host memory): a memcpy loop without the GIL, so every CPU test
  exercises exactly the addressing the GPU uses;
- CUDA: `cuMemcpyBatchAsync` (one driver call per batch; one `cuMemcpyAsync` per segment
  where the driver predates CUDA 12.8) straight between the KV cache and the pinned
  staging payloads that io_uring writes from and reads into: no host copy between GPU
  and NVMe. Stores run on one low-priority stream, loads on another. A store waits
  (GPU-side) for an event recorded on the compute stream, so it captures what the
  forward wrote, and the compute stream waits (GPU-side) for the store before anything
  enqueued after it, so nothing vLLM enqueues later (zeroing a reallocated block, a
  copy-on-write, the next forward) can change a block before it is copied. A load waits
  for a `mark()` of the compute stream. The store's event is what the I/O thread waits
  for before the slot goes to disk. Events use blocking sync (a waiting thread sleeps, it
  does not spin a core), and only the I/O thread ever waits: the step thread only
  enqueues.

Failures close: a copy call that fails raises `CopyError`, whose `ticket` says when the
memory it touched is safe to reuse (0: now; > 0: once `wait(ticket)` returned; -1:
never, the driver's state is unknown), since a failed batch may have queued some of
its segments.

Never allocates device memory, never calls torch, never holds Python objects in nogil
sections. Lifecycle: `close()` is idempotent (streams drained, events and streams
destroyed, the primary context released); a closed engine refuses work.
"""
from libc.stdint cimport uint64_t, uintptr_t, int64_t
from libc.stdlib cimport malloc, free, realloc, calloc
from libc.string cimport memcpy
from kvstore.includes.cuda cimport (
    CuDriver, CUresult, CUstream, CUevent, CUdeviceptr, CUmemcpyAttributes, CUDA_SUCCESS,
    CUDA_ERROR_NOT_READY, CU_STREAM_NON_BLOCKING, CU_EVENT_BLOCKING_SYNC,
    CU_EVENT_DISABLE_TIMING, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
)
from kvstore._cuda cimport cuda_driver, cuda_check

import threading
import warnings

import numpy as np

from kvstore.errors import KVStoreError

cdef enum:
    TO_STAGING = 0    # stores: KV cache -> staging
    TO_KV = 1         # loads: staging -> KV cache

STORE = TO_STAGING
LOAD = TO_KV


class CopyError(KVStoreError):
    """A copy could not be issued (or not ordered). `ticket` says when the memory the
    copy touched (staging slots, KV blocks) may be reused: 0 now (nothing of the copy is
    queued), > 0 once `wait(ticket)` returned (part of it may be queued), -1 never (the
    driver's state is unknown)."""

    def __init__(self, msg, ticket=0):
        super().__init__(msg)
        self.ticket = ticket


cdef int _grow(SegBuf *s, size_t need) except -1:
    cdef size_t cap
    if need <= s.cap:
        return 0
    cap = max(need, 2 * s.cap, 256)
    cdef void *a = realloc(s.src, cap * sizeof(CUdeviceptr))
    if a == NULL:
        raise MemoryError()
    s.src = <CUdeviceptr *>a
    a = realloc(s.dst, cap * sizeof(CUdeviceptr))
    if a == NULL:
        raise MemoryError()
    s.dst = <CUdeviceptr *>a
    a = realloc(s.length, cap * sizeof(size_t))
    if a == NULL:
        raise MemoryError()
    s.length = <size_t *>a
    s.cap = cap
    return 0


cdef void _plan_c(SegBuf *s, const Row *rows, int nrows, uintptr_t kv_base, uintptr_t stage_base,
                  uint64_t slot_size, const int64_t *blocks, const int64_t *slots, Py_ssize_t n,
                  int direction) noexcept nogil:
    cdef Py_ssize_t i
    cdef int r
    cdef size_t k = 0
    cdef uint64_t kv, st, src, dst, length
    for i in range(n):
        for r in range(nrows):
            kv = kv_base + rows[r].kv_off + <uint64_t>blocks[i] * rows[r].block_stride
            st = stage_base + <uint64_t>slots[i] * slot_size + rows[r].stage_off
            length = rows[r].length
            if direction == TO_STAGING:
                src = kv
                dst = st
            else:
                src = st
                dst = kv
            # Runs adjacent on both sides (regions of one block that follow each other
            # in memory and in the payload) become one segment.
            if k > 0 and s.src[k - 1] + s.length[k - 1] == src and s.dst[k - 1] + s.length[k - 1] == dst:
                s.length[k - 1] += length
            else:
                s.src[k] = src
                s.dst[k] = dst
                s.length[k] = length
                k += 1
    s.n = k


cdef class CopyEngine:
    """Copies of block batches between one KV allocation and one staging memory.

    `rows`: (kv_off, block_stride, stage_off, length, num_blocks) per contiguous run of a
    block (see kvstore.vllm.transfer.KVRegion.rows); `kv_base`/`kv_nbytes`: the KV allocation;
    `stage_base`/`stage_nbytes`/`slot_size`: the staging memory and its slot size.
    `device`: -1 for a KV cache in host memory (synchronous memcpy), else the CUDA
    ordinal of the KV cache (asynchronous DMA; the staging memory must be pinned).

    CUDA contract: `store()` is called on the step thread after the forward that wrote
    the blocks was enqueued on `compute_stream`; it returns a ticket at once, and the
    compute stream's later work waits (GPU-side) for the copy. `wait()` (I/O thread)
    blocks until the copy is in staging. `load()` (I/O thread) returns a ticket; the
    load is done when `wait()` returns. Tickets are CUDA events from a bounded pool,
    each waited (or released) exactly once.
    """

    def __cinit__(self):
        self.rows = NULL
        self.events = NULL
        self.busy = NULL
        self.free_ev = NULL
        self.is_closed = True
        self.device = -1
        self.ctx_retained = False
        self.streams[0] = NULL
        self.streams[1] = NULL
        self.ready = NULL
        for d in range(2):
            self.segs[d].src = NULL
            self.segs[d].dst = NULL
            self.segs[d].length = NULL
            self.segs[d].cap = 0
            self.segs[d].n = 0

    def __init__(self, rows, uintptr_t kv_base, uint64_t kv_nbytes, uintptr_t stage_base,
                 uint64_t stage_nbytes, uint64_t slot_size, *, int device=-1,
                 bint use_batch=True, int max_events=4096):
        rows = list(rows)
        if not rows:
            raise ValueError("CopyEngine needs at least one row")
        if slot_size == 0 or stage_nbytes < slot_size:
            raise ValueError(f"staging of {stage_nbytes} bytes holds no slot of {slot_size} bytes")
        self.rows = <Row *>calloc(len(rows), sizeof(Row))
        if self.rows == NULL:
            raise MemoryError()
        self.nrows = len(rows)
        self.min_blocks = <uint64_t>-1
        for i, (kv_off, bstride, stage_off, length, nblocks) in enumerate(rows):
            if length <= 0 or nblocks <= 0:
                raise ValueError(f"row {i}: length {length} and num_blocks {nblocks} must be positive")
            if kv_off + (nblocks - 1) * bstride + length > kv_nbytes:
                raise ValueError(
                    f"row {i}: block {nblocks - 1} ends at byte {kv_off + (nblocks - 1) * bstride + length}, "
                    f"past the {kv_nbytes}-byte KV allocation")
            if stage_off + length > slot_size:
                raise ValueError(f"row {i}: bytes [{stage_off}, {stage_off + length}) lie outside "
                                 f"a {slot_size}-byte staging slot")
            self.rows[i].kv_off = kv_off
            self.rows[i].block_stride = bstride
            self.rows[i].stage_off = stage_off
            self.rows[i].length = length
            self.rows[i].num_blocks = nblocks
            self.min_blocks = min(self.min_blocks, <uint64_t>nblocks)
        self.kv_base = kv_base
        self.kv_nbytes = kv_nbytes
        self.stage_base = stage_base
        self.slot_size = slot_size
        self.num_slots = stage_nbytes // slot_size
        self.locks = (threading.Lock(), threading.Lock())
        self.copies = 0
        self.segments_issued = 0
        self.is_closed = False
        self.device = device
        if device >= 0:
            try:
                self._open_cuda(device, use_batch, max_events)
            except BaseException:
                self.close()    # init finishes completely or undoes itself
                raise

    def _open_cuda(self, int device, bint use_batch, int max_events):
        cdef int least = 0, greatest = 0
        self.drv = cuda_driver()
        self.max_events = max(2, max_events)
        self.events = <CUevent *>calloc(self.max_events, sizeof(CUevent))
        self.busy = <char *>calloc(self.max_events, 1)
        self.free_ev = <int *>calloc(self.max_events, sizeof(int))
        if self.events == NULL or self.busy == NULL or self.free_ev == NULL:
            raise MemoryError()
        self.nevents = 0
        self.nfree = 0
        self.use_batch = use_batch and self.drv.cuMemcpyBatchAsync != NULL
        try:
            cuda_check(self.drv.cuDeviceGet(&self.cudev, device), f"cuDeviceGet({device})")
            cuda_check(self.drv.cuDevicePrimaryCtxRetain(&self.ctx, self.cudev),
                       f"cuDevicePrimaryCtxRetain(device {device})")
            self.ctx_retained = True
            self._bind()
            cuda_check(self.drv.cuCtxGetStreamPriorityRange(&least, &greatest),
                       "cuCtxGetStreamPriorityRange")
            # `least` is the numerically largest value: the lowest priority the context
            # offers (0 on current GPUs, the default streams' priority), so a copy never
            # outranks the forward pass, and a server that runs its forward on a
            # high-priority stream goes first.
            for d in range(2):
                cuda_check(self.drv.cuStreamCreateWithPriority(&self.streams[d], CU_STREAM_NON_BLOCKING, least),
                           "cuStreamCreateWithPriority")
            cuda_check(self.drv.cuEventCreate(&self.ready, CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        except BaseException:
            self.close()
            raise

    # -- lifecycle ------------------------------------------------------------------
    def close(self):
        """Drain both streams and free every driver object (idempotent)."""
        cdef int i
        if self.device >= 0 and self.ctx_retained:
            self.drv.cuCtxSetCurrent(self.ctx)
            with nogil:
                for i in range(2):
                    if self.streams[i] != NULL:
                        self.drv.cuStreamSynchronize(self.streams[i])
            for i in range(self.nevents):
                if self.events[i] != NULL:
                    self.drv.cuEventDestroy(self.events[i])
                    self.events[i] = NULL
            self.nevents = 0
            self.nfree = 0
            if self.ready != NULL:
                self.drv.cuEventDestroy(self.ready)
                self.ready = NULL
            for i in range(2):
                if self.streams[i] != NULL:
                    self.drv.cuStreamDestroy(self.streams[i])
                    self.streams[i] = NULL
            self.drv.cuDevicePrimaryCtxRelease(self.cudev)
            self.ctx_retained = False
        self._free_memory()
        self.is_closed = True

    cdef void _free_memory(self) noexcept:
        cdef int d
        for d in range(2):
            free(self.segs[d].src)
            free(self.segs[d].dst)
            free(self.segs[d].length)
            self.segs[d].src = NULL
            self.segs[d].dst = NULL
            self.segs[d].length = NULL
            self.segs[d].cap = 0
        free(self.rows)
        self.rows = NULL
        free(self.events)
        free(self.busy)
        free(self.free_ev)
        self.events = NULL
        self.busy = NULL
        self.free_ev = NULL

    def __dealloc__(self):
        if not self.is_closed or self.ctx_retained:
            warnings.warn("CopyEngine was not closed; closing it now", ResourceWarning)
            self.close()
        else:
            self._free_memory()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self) -> bool:
        return self.is_closed

    @property
    def cuda(self) -> bool:
        return self.device >= 0

    @property
    def batch(self) -> bool:
        """True when CUDA copies go through cuMemcpyBatchAsync."""
        return self.device >= 0 and self.use_batch

    @property
    def rows_per_block(self) -> int:
        return self.nrows

    @property
    def events_created(self) -> int:
        return self.nevents

    def _check(self):
        if self.is_closed:
            raise KVStoreError("CopyEngine is closed")

    # -- addressing -----------------------------------------------------------------
    cdef int _plan(self, int direction, blocks, slots) except -1:
        cdef int64_t[::1] b = np.ascontiguousarray(blocks, dtype=np.int64)
        cdef int64_t[::1] s = np.ascontiguousarray(slots, dtype=np.int64)
        cdef Py_ssize_t n = b.shape[0]
        self._check()
        if s.shape[0] != n:
            raise ValueError(f"{n} block ids for {s.shape[0]} staging slots")
        if n:
            bmin, bmax = np.min(b), np.max(b)
            smin, smax = np.min(s), np.max(s)
            if bmin < 0 or <uint64_t>bmax >= self.min_blocks:
                raise ValueError(f"block id out of range 0..{self.min_blocks - 1}: {bmin}..{bmax}")
            if smin < 0 or <uint64_t>smax >= self.num_slots:
                raise ValueError(f"staging slot out of range 0..{self.num_slots - 1}: {smin}..{smax}")
        _grow(&self.segs[direction], <size_t>n * self.nrows)
        if n:
            with nogil:
                _plan_c(&self.segs[direction], self.rows, self.nrows, self.kv_base, self.stage_base,
                        self.slot_size, &b[0], &s[0], n, direction)
        else:
            self.segs[direction].n = 0
        return 0

    def segments(self, int direction, blocks, slots):
        """The segment list of a copy as numpy arrays (src, dst, length), for tests and
        tools; `direction` is STORE (KV -> staging) or LOAD (staging -> KV)."""
        if direction not in (TO_STAGING, TO_KV):
            raise ValueError("direction must be STORE or LOAD")
        with self.locks[direction]:
            self._plan(direction, blocks, slots)
            n = self.segs[direction].n
            src = np.empty(n, dtype=np.uint64)
            dst = np.empty(n, dtype=np.uint64)
            length = np.empty(n, dtype=np.uint64)
            for i in range(n):
                src[i] = self.segs[direction].src[i]
                dst[i] = self.segs[direction].dst[i]
                length[i] = self.segs[direction].length[i]
        return src, dst, length

    # -- the two directions ---------------------------------------------------------
    def store(self, blocks, slots, uintptr_t compute_stream=0):
        """Copy blocks[i] of the KV cache into staging slot slots[i].

        CPU: done on return (returns 0). CUDA: ordered after the work enqueued so far on
        `compute_stream` (the raw CUstream of the forward pass), and the work enqueued on
        it afterwards is ordered after the copy (the fence: a gathered block is not
        written again before it is copied, whoever writes it next on that stream).
        Returns a ticket for `wait()` at once; the step thread never waits for the GPU
        here. Raises CopyError (see its `ticket`) when the copy or its fence cannot be
        issued.
        """
        cdef int ticket = 0
        cdef CUresult rc
        with self.locks[TO_STAGING]:
            self._plan(TO_STAGING, blocks, slots)
            if self.segs[TO_STAGING].n == 0:
                return 0
            if self.device < 0:
                self._issue(TO_STAGING)
                return 0
            try:
                self._bind()
                ticket = self._take_event()
                cuda_check(self.drv.cuEventRecord(self.ready, <CUstream>compute_stream),
                           "cuEventRecord(compute stream)")
                cuda_check(self.drv.cuStreamWaitEvent(self.streams[TO_STAGING], self.ready, 0),
                           "cuStreamWaitEvent(store stream)")
            except Exception as exc:        # nothing of this copy is queued
                self.release(ticket)
                raise CopyError(f"store not issued: {exc}", 0) from exc
            self._issue_tracked(TO_STAGING, ticket)
            rc = self.drv.cuStreamWaitEvent(<CUstream>compute_stream, self.events[ticket - 1], 0)
            if rc != CUDA_SUCCESS:
                # The copy is queued but nothing keeps the compute stream from writing
                # its blocks first: the staged bytes cannot be trusted.
                try:
                    cuda_check(rc, "cuStreamWaitEvent(compute stream behind the store)")
                except Exception as exc:
                    raise CopyError(f"store not ordered before the compute stream's next "
                                    f"work: {exc}", ticket) from exc
            return ticket

    def load(self, slots, blocks, int after=0):
        """Copy staging slot slots[i] into block blocks[i] of the KV cache.

        CPU: done on return (returns 0). CUDA: ordered after ticket `after` (a `mark()`
        of the compute stream, released here), returns a ticket; the blocks hold the
        bytes once `wait(ticket)` returned.
        """
        cdef int ticket = 0
        cdef CUresult rc
        with self.locks[TO_KV]:
            self._plan(TO_KV, blocks, slots)
            if self.device < 0:
                if self.segs[TO_KV].n:
                    self._issue(TO_KV)
                return 0
            try:
                self._bind()
                if after:
                    cuda_check(self.drv.cuStreamWaitEvent(self.streams[TO_KV], self._event_of(after), 0),
                               "cuStreamWaitEvent(load stream)")
                if self.segs[TO_KV].n:
                    ticket = self._take_event()
            except Exception as exc:        # nothing of this copy is queued
                raise CopyError(f"load not ordered after the compute stream: {exc}", 0) from exc
            finally:
                self.release(after)
            if self.segs[TO_KV].n == 0:
                return 0
            self._issue_tracked(TO_KV, ticket)
            return ticket

    def mark(self, uintptr_t compute_stream=0):
        """A ticket for the work enqueued so far on `compute_stream` (0 on CPU): a load
        given it as `after` does not start before that work is done. Raises CopyError
        when the mark cannot be made (a load must then not run: it would be unordered)."""
        cdef int ticket = 0
        cdef CUresult rc
        if self.device < 0:
            return 0
        self._check()
        try:
            self._bind()
            ticket = self._take_event()
            rc = self.drv.cuEventRecord(self.events[ticket - 1], <CUstream>compute_stream)
            if rc != CUDA_SUCCESS:
                self.release(ticket)
                cuda_check(rc, "cuEventRecord(compute stream)")
        except CopyError:
            raise
        except Exception as exc:
            raise CopyError(f"cannot mark the compute stream: {exc}", 0) from exc
        return ticket

    def wait(self, int ticket):
        """Block this thread (sleeping, GIL released) until the copy of `ticket` is done,
        then recycle the ticket. 0 (a CPU copy) returns at once."""
        cdef CUevent ev
        cdef CUresult rc
        if ticket == 0:
            return
        ev = self._event_of(ticket)
        self._bind()
        with nogil:
            rc = self.drv.cuEventSynchronize(ev)
        self.release(ticket)
        cuda_check(rc, "cuEventSynchronize (a KV copy failed on the GPU)")

    def done(self, int ticket) -> bool:
        """True when the copy of `ticket` has finished (never blocks)."""
        cdef CUresult rc
        if ticket == 0:
            return True
        ev = self._event_of(ticket)
        self._bind()
        rc = self.drv.cuEventQuery(ev)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        cuda_check(rc, "cuEventQuery")
        return True

    def bind_thread(self):
        """Make this engine's device current on the calling thread (the I/O thread calls
        it first, so that no copy of rank N ever creates a context on GPU 0)."""
        if self.device >= 0:
            self._check()
            self._bind()

    def synchronize(self):
        """Wait until both copy streams are idle (shutdown, tests)."""
        cdef CUresult rc = CUDA_SUCCESS
        cdef int d
        if self.device < 0:
            return
        self._check()
        self._bind()
        for d in range(2):
            with nogil:
                rc = self.drv.cuStreamSynchronize(self.streams[d])
            cuda_check(rc, "cuStreamSynchronize")

    # -- internals ------------------------------------------------------------------
    def _issue_tracked(self, int direction, int ticket):
        """Run the planned segments of `direction` on its stream and record `ticket` (taken
        before) behind them; a failure raises `_failed`'s CopyError."""
        try:
            self._issue(direction)
            cuda_check(self.drv.cuEventRecord(self.events[ticket - 1], self.streams[direction]),
                       "cuEventRecord(store stream)" if direction == TO_STAGING
                       else "cuEventRecord(load stream)")
        except Exception as exc:
            raise self._failed(direction, exc, ticket) from exc

    def _failed(self, int direction, exc, int ticket):
        """The CopyError for a copy that failed after its first segment may have been
        queued on `direction`'s stream (`ticket`: the copy's own, taken before it was
        issued): with the ticket recorded behind whatever was queued, the memory it
        touches is safe once it is waited; else the stream drained (loads: the I/O thread
        may wait), else -1."""
        cdef CUresult rc
        cdef CUstream stream = self.streams[direction]
        what = "store" if direction == TO_STAGING else "load"
        rc = self.drv.cuEventRecord(self.events[ticket - 1], stream)
        if rc == CUDA_SUCCESS:
            return CopyError(f"{what} failed: {exc}; its memory is in use until ticket "
                             f"{ticket} is waited", ticket)
        self.release(ticket)
        if direction == TO_KV:
            with nogil:
                rc = self.drv.cuStreamSynchronize(stream)
            if rc == CUDA_SUCCESS:
                return CopyError(f"{what} failed: {exc}", 0)
        return CopyError(f"{what} failed and the copy stream's state is unknown: {exc}", -1)

    cdef int _bind(self) except -1:
        return cuda_check(self.drv.cuCtxSetCurrent(self.ctx), f"cuCtxSetCurrent(device {self.device})")

    cdef int _take_event(self) except -1:
        cdef int i
        if self.nfree:
            self.nfree -= 1
            i = self.free_ev[self.nfree]
        else:
            if self.nevents >= self.max_events:
                raise KVStoreError(f"{self.max_events} KV copies are in flight and none was waited "
                                   "for: a caller does not wait() its tickets")
            i = self.nevents
            cuda_check(self.drv.cuEventCreate(&self.events[i], CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING),
                       "cuEventCreate")
            self.nevents += 1
        self.busy[i] = 1
        return i + 1

    cdef CUevent _event_of(self, int ticket) except NULL:
        self._check()
        if ticket < 1 or ticket > self.nevents or not self.busy[ticket - 1]:
            raise KVStoreError(f"copy ticket {ticket} is not in flight (waited twice?)")
        return self.events[ticket - 1]

    def release(self, int ticket):
        """Recycle a ticket that will not be waited for (a `mark()` no load used)."""
        if ticket == 0 or self.busy == NULL or ticket > self.nevents:
            return
        if self.busy[ticket - 1]:
            self.busy[ticket - 1] = 0
            self.free_ev[self.nfree] = ticket - 1
            self.nfree += 1

    cdef int _issue(self, int direction) except -1:
        """Run the planned segments of `direction`: memcpy (CPU) or DMA on its stream."""
        cdef SegBuf *s = &self.segs[direction]
        cdef size_t i, fail = 0
        cdef CUresult rc = CUDA_SUCCESS
        cdef CUmemcpyAttributes attr
        cdef size_t attr_idx = 0
        cdef CUstream stream
        self.copies += 1
        self.segments_issued += s.n
        if self.device < 0:
            with nogil:
                for i in range(s.n):
                    memcpy(<void *><uintptr_t>s.dst[i], <const void *><uintptr_t>s.src[i], s.length[i])
            return 0
        stream = self.streams[direction]
        if self.use_batch:
            attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM if direction == TO_STAGING else CU_MEMCPY_SRC_ACCESS_ORDER_ANY
            attr.srcLocHint.type = 0
            attr.srcLocHint.id = 0
            attr.dstLocHint.type = 0
            attr.dstLocHint.id = 0
            attr.flags = 0
            with nogil:
                rc = self.drv.cuMemcpyBatchAsync(s.dst, s.src, s.length, s.n, &attr, &attr_idx, 1,
                                                 &fail, stream)
            if rc != CUDA_SUCCESS:
                cuda_check(rc, f"cuMemcpyBatchAsync of {s.n} segments (first failing: {fail}, "
                               f"0x{s.src[fail] if fail < s.n else 0:x} -> 0x{s.dst[fail] if fail < s.n else 0:x})")
            return 0
        with nogil:
            for i in range(s.n):
                rc = self.drv.cuMemcpyAsync(s.dst[i], s.src[i], s.length[i], stream)
                if rc != CUDA_SUCCESS:
                    fail = i
                    break
        if rc != CUDA_SUCCESS:
            cuda_check(rc, f"cuMemcpyAsync of segment {fail} of {s.n} "
                           f"(0x{s.src[fail]:x} -> 0x{s.dst[fail]:x}, {s.length[fail]} bytes)")
        return 0
