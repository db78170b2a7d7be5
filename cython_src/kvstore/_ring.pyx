# cython: language_level=3
"""The io_uring ring of the I/O core.

Owns one io_uring instance: its queue depth, the staging buffers and slot-file fds it has
registered, and the submit/reap loop that moves a whole batch of reads, writes or
fdatasyncs with the GIL released around every blocking kernel call. It never interprets
bytes (headers and checksums belong to SlotFile) and never holds Python objects inside a
`nogil` section.

Contract of `submit`: every op of a batch is driven to an end before the call returns:
a short transfer is resubmitted for its remainder, EAGAIN/EINTR are retried, and any other
failure becomes that op's negative errno in the result array. Buffers are therefore never
left referenced by the kernel when the call returns, even when it raises.

The submit/reap loop never takes the GIL, not even when io_uring_enter fails: it enters
the kernel through csrc/kvstore_enter.h (liburing's submit-and-wait, returning -errno)
rather than the `liburing` binding's wrappers, which raise OSError (with the GIL) on every
negative result. EINTR (a signal), EAGAIN and EBUSY (the kernel short of requests, a
completion queue to flush) are resumed inside the GIL-free loop; only another errno
ends it, and is raised as OSError once the GIL is back.

`slot_io` is the same loop for whole slots, with the slot codec (C functions of _slotfile,
which owns the format) run per op inside the GIL-free section: a write's header is stamped
(payload XXH3, header CRC) just before its first submission, and a read is checked the moment
it completes, while the rest of the batch is still in flight. A slot whose payload lives
apart from its header (caller memory) moves as one readv/writev of two iovecs.
"""
import logging
import os
import warnings

import numpy as np
cimport numpy as cnp
cimport cython

from cpython.mem cimport PyMem_Malloc, PyMem_Free
from libc.errno cimport EAGAIN, EINTR, EIO, EBUSY, ENODATA
from libc.stdint cimport uint64_t, int64_t, uintptr_t, uint32_t, int32_t
from libc.string cimport memset

from kvstore.includes.uring cimport (
    __io_uring, __io_uring_sqe, __io_uring_cqe,
    __io_uring_get_sqe, __io_uring_prep_read, __io_uring_prep_write,
    __io_uring_prep_readv, __io_uring_prep_writev,
    __io_uring_prep_read_fixed, __io_uring_prep_write_fixed, __io_uring_prep_fsync,
    __io_uring_sqe_set_data64, __io_uring_sqe_set_flags,
    __io_uring_cq_ready, __io_uring_cq_advance,
    __IOSQE_FIXED_FILE, __IORING_FSYNC_DATASYNC,
    io_uring, io_uring_queue_init, io_uring_queue_exit,
    io_uring_register_buffers, io_uring_unregister_buffers,
    io_uring_register_files, io_uring_unregister_files, iovec,
    kvs_submit_and_wait, kvs_wait_one, kvs_sq_unconsumed, kvs_pause, kvs_count,
    kvs_stat, kvs_flag_set, kvs_flag_take,
)
from kvstore._hostbuf cimport HostBuffer
from kvstore.includes.format cimport KVS_ALIGN
from kvstore._slotfile cimport check_slot, payload_hash, stamp_header
from liburing.lib.type cimport __iovec

from kvstore.errors import AlignmentError, KVStoreError

cnp.import_array()

log = logging.getLogger("kvstore.ring")
ALIGN = KVS_ALIGN
REGISTER_PIECE = 1 << 30   # the kernel registers at most 1 GiB per buffer
cdef uint64_t EARLY_SUBMIT_BYTES = 1 << 20   # checksum work that is worth a submit first
cdef long RETRY_PAUSE_US = 50   # EAGAIN with none of our requests in the kernel: back off
cdef int PUMP_WOKEN = -2        # _pump_nogil: returned early, another thread called wake()
OPNAMES = ("read", "write", "fdatasync")
_registration_warned = False
ENTER_STATS = ("eintr", "eagain", "ebusy", "waits", "pauses")


def enter_stats():
    """Process-wide counts of the io_uring_enter failures the pump resumed from (eintr,
    eagain, ebusy), and of how it resumed after EAGAIN/EBUSY when a reap found nothing
    (waits: for one completion of a request the kernel holds; pauses: a 50 us sleep, none
    held). For tests and diagnostics; counted without the GIL, atomically."""
    return {name: int(kvs_stat(i)) for i, name in enumerate(ENTER_STATS)}


cdef int _resume(Ring ring, int err) noexcept nogil:
    """The pump's answer to io_uring_enter failing with errno `err`, without the GIL:
    0 to go on with the batch (EINTR: retry; EAGAIN/EBUSY: reap, and if nothing was
    reaped wait for a completion, or pause when the kernel holds none of ours), else
    `err` (the caller raises it once it has the GIL)."""
    cdef __io_uring *r = &ring._ring.ptr
    cdef int ret
    if err == EINTR:
        kvs_count(0)
        return 0
    if err != EAGAIN and err != EBUSY:
        return err
    kvs_count(1 if err == EAGAIN else 2)
    if ring._reap() > 0:
        return 0
    if ring._inflight > <Py_ssize_t>kvs_sq_unconsumed(r):
        # Some of ours are in the kernel's hands: their completions free what it lacks.
        kvs_count(3)
        ret = kvs_wait_one(r)
        if ret < 0 and ret != -EINTR and ret != -EAGAIN and ret != -EBUSY:
            return -ret
    else:
        kvs_count(4)
        kvs_pause(RETRY_PAUSE_US)
    return 0


cdef int _batch_alloc(Batch *b, Py_ssize_t nops, Py_ssize_t nchecks) except -1:
    """A zeroed batch of nops ops (and room for nchecks deferred slot checks)."""
    memset(b, 0, sizeof(Batch))
    b.ops = <Op *>PyMem_Malloc(sizeof(Op) * nops)
    b.queue = <Py_ssize_t *>PyMem_Malloc(sizeof(Py_ssize_t) * nops)
    if nchecks:
        b.checks = <SlotWork **>PyMem_Malloc(sizeof(SlotWork *) * nchecks)
    if b.ops == NULL or b.queue == NULL or (nchecks and b.checks == NULL):
        _batch_free(b)
        raise MemoryError()
    memset(b.ops, 0, sizeof(Op) * nops)
    b.n = nops
    return 0


cdef void _batch_free(Batch *b) noexcept:
    PyMem_Free(b.ops)
    PyMem_Free(b.queue)
    PyMem_Free(b.checks)
    b.ops = NULL
    b.queue = NULL
    b.checks = NULL


cdef inline void _check(SlotWork *w) noexcept nogil:
    w.status = check_slot(w.hdr, w.payload, w.key, w.key_len, w.slot, w.generation,
                          w.payload_len, w.verify == 2)


cdef void _advance_iov(Op *op, size_t n) noexcept nogil:
    """Drop the first n transferred bytes from a vectored op's remaining iovecs."""
    cdef int k
    while n > 0 and op.niov > 0:
        if n >= op.iov[0].iov_len:
            n -= op.iov[0].iov_len
            for k in range(op.niov - 1):
                op.iov[k] = op.iov[k + 1]
            op.niov -= 1
        else:
            op.iov[0].iov_base = <char *>op.iov[0].iov_base + n
            op.iov[0].iov_len -= n
            n = 0


@cython.no_gc_clear   # a started part's __dealloc__ still needs its ring's io_uring
cdef class Ring:
    """An io_uring with a fixed queue depth, registered buffers/files and batched I/O.

    Lifecycle (as uvloop's handles): init either completes or leaves nothing open;
    `close()` is idempotent; a Ring dropped while open releases its fd and warns.
    Staging memory must come from `HostBuffer`s passed to `register_buffers` (the kernel
    registration itself may be refused, e.g. by RLIMIT_MEMLOCK: then the same buffers are
    used unregistered and one log line says so). Not thread-safe: one ring per thread.
    """

    def __cinit__(self, unsigned int queue_depth=32):
        self._open = False
        self._files = NULL
        self._nfiles = 0
        self._nbufs = 0
        self._buffers = []
        self._fd_names = {}
        self._bufs_registered = False
        self._files_registered = False
        self.fault_injector = None
        self._nactive = 0
        self._inflight = 0
        self._wake = 0
        if queue_depth < 1 or queue_depth > 4096:
            raise ValueError(f"queue_depth must be in 1..4096, got {queue_depth}")
        self.depth = queue_depth
        self._ring = io_uring()
        # A failed init must not be followed by queue_exit (it would close fd 0): on
        # failure we simply never mark the ring open.
        io_uring_queue_init(queue_depth, self._ring, 0)
        self._open = True

    def __dealloc__(self):
        if self._open:
            warnings.warn("kvstore Ring dropped while open: closing it; call close()",
                          ResourceWarning, stacklevel=1)
            self._drain()   # no request may outlive the ring
            try:
                io_uring_queue_exit(self._ring)
            except Exception:
                pass
            self._open = False
        if self._files != NULL:
            PyMem_Free(self._files)
            self._files = NULL

    def close(self):
        """Tear the ring down (idempotent); registered buffers and files are released."""
        if not self._open:
            return
        self._drain()   # parts still started (slot_io_start): no request may outlive the ring
        self._open = False
        io_uring_queue_exit(self._ring)  # also drops the kernel's buffer/file registrations
        self._iov = None
        self._buffers = []
        self._nbufs = 0
        self._nmem = 0
        self._nfiles = 0
        if self._files != NULL:
            PyMem_Free(self._files)
            self._files = NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self) -> bool:
        return not self._open

    @property
    def queue_depth(self) -> int:
        return self.depth

    @property
    def ring_fd(self) -> int:
        self._check_open()
        return self._ring.ring_fd

    @property
    def active_batches(self) -> int:
        """Batches started on this ring and not ended (slot_io_start parts, a running
        submit): the ring fills from all of them, oldest first."""
        return self._nactive

    @property
    def buffers_registered(self) -> bool:
        return self._bufs_registered

    @property
    def files_registered(self) -> bool:
        return self._files_registered

    def _check_open(self):
        if not self._open:
            raise KVStoreError("operation on a closed Ring")

    def register_buffers(self, buffers):
        """Make `buffers` the ring's I/O memory; register them with the kernel if allowed.

        Staging is a HostBuffer; other memory (a caller's rows that `Ring.slot_io` moves
        slots into or out of) may be any writable, C-contiguous buffer (numpy array, mmap)
        that the caller keeps alive and unchanged in place while registered. Each buffer
        is registered in pieces of at most 1 GiB (the kernel's limit per buffer). Replaces
        the previous set: call it while no I/O is in flight.

        Returns True when the kernel registration succeeded (fixed-buffer I/O), False when
        it was refused and plain buffers are used instead (logged once per process).
        """
        global _registration_warned
        self._check_open()
        bufs = list(buffers)
        if len(bufs) > MAX_BUFFERS:
            raise ValueError(f"at most {MAX_BUFFERS} buffers per ring, got {len(bufs)}")
        regions = []     # (address, bytes, memoryview of that piece)
        whole = []       # (address, bytes) of each buffer
        cdef HostBuffer hb
        cdef uintptr_t start
        for b in bufs:
            if isinstance(b, HostBuffer):
                hb = b
                if hb.closed:
                    raise KVStoreError("cannot register a closed HostBuffer")
                start = <uintptr_t>hb.ptr
                mv = memoryview(b).cast("B")
            else:
                try:
                    mv = memoryview(b)
                except TypeError:
                    raise TypeError(f"Ring buffers must be kvstore.HostBuffer or writable "
                                    f"contiguous memory, got {type(b).__name__}") from None
                if mv.readonly or not mv.c_contiguous or "O" in mv.format:
                    raise TypeError("Ring buffers must be writable, C-contiguous plain memory")
                mv = mv.cast("B") if (mv.ndim != 1 or mv.format != "B") else mv
                start = <uintptr_t>np.frombuffer(mv, dtype=np.uint8).__array_interface__["data"][0]
            whole.append((start, mv.nbytes, mv))
            for off in range(0, mv.nbytes, REGISTER_PIECE):
                piece = mv[off:off + REGISTER_PIECE]
                regions.append((start + off, piece.nbytes, piece))
        if self._bufs_registered:
            io_uring_unregister_buffers(self._ring)
            self._bufs_registered = False
            self._iov = None
        cdef int i
        # Bounds checks use the whole buffers; fixed-buffer indices the pieces (an op that
        # straddles two pieces simply goes unregistered).
        for i, (addr, nbytes, _) in enumerate(whole):
            self._mem_start[i] = <uintptr_t>addr
            self._mem_end[i] = <uintptr_t>addr + <uintptr_t>nbytes
        self._nmem = len(whole)
        self._buffers = bufs + [w[2] for w in whole] + [r[2] for r in regions]
        self._nbufs = 0
        if not regions:
            return False
        if len(regions) > MAX_BUFFERS:
            log.warning("io_uring buffer registration skipped: %d pieces of at most 1 GiB "
                        "exceed the ring's %d; using unregistered buffers", len(regions), MAX_BUFFERS)
            return False
        for i, (addr, nbytes, _) in enumerate(regions):
            self._buf_start[i] = <uintptr_t>addr
            self._buf_end[i] = <uintptr_t>addr + <uintptr_t>nbytes
        try:
            iov = iovec([r[2] for r in regions])
            io_uring_register_buffers(self._ring, iov, len(regions))
        except (OSError, OverflowError, ValueError) as exc:
            if not _registration_warned:
                _registration_warned = True
                log.warning("io_uring buffer registration refused (%s); using unregistered "
                            "buffers (raise RLIMIT_MEMLOCK, `ulimit -l`, for fixed buffers)", exc)
            return False
        self._nbufs = len(regions)
        self._iov = iov
        self._bufs_registered = True
        return True

    def register_files(self, fds, names=None):
        """Register slot-file fds (fixed files); `names` (same order) appear in errors."""
        self._check_open()
        fds = [int(fd) for fd in fds]
        if self._files_registered:
            io_uring_unregister_files(self._ring)
            self._files_registered = False
        if self._files != NULL:
            PyMem_Free(self._files)
            self._files = NULL
        self._nfiles = 0
        if names is not None:
            self._fd_names.update(zip(fds, names))
        if not fds:
            return False
        self._files = <int *>PyMem_Malloc(sizeof(int) * len(fds))
        if self._files == NULL:
            raise MemoryError()
        for i, fd in enumerate(fds):
            self._files[i] = fd
        self._nfiles = len(fds)
        try:
            io_uring_register_files(self._ring, fds)
        except OSError as exc:
            log.warning("io_uring file registration refused (%s); using plain fds", exc)
            return False
        self._files_registered = True
        return True

    def name_fd(self, int fd, str name):
        """Name an fd for error messages."""
        self._fd_names[fd] = name

    @cython.cdivision(True)   # b.n > 0: no division check, which would take the GIL to raise
    cdef int _fill(self) noexcept nogil:
        """Move queued ops into SQEs while the ring has room and depth allows, the oldest
        active batch first (a started part's ops fill the room its predecessor's tail
        leaves); returns how many it prepared."""
        cdef __io_uring_sqe *sqe
        cdef Op *op
        cdef Batch *b
        cdef Py_ssize_t i
        cdef unsigned int length, left
        cdef int fd, k, nsub, a
        cdef int filled = 0
        cdef SlotWork *w
        for a in range(self._nactive):
            b = self._active[a]
            while b.qlen > 0 and self._inflight < b.max_inflight:
                sqe = __io_uring_get_sqe(&self._ring.ptr)
                if sqe == NULL:
                    return filled
                i = b.queue[b.qhead]
                b.qhead = (b.qhead + 1) % b.n
                b.qlen -= 1
                op = &b.ops[i]
                fd = op.fd if op.fixed_file < 0 else op.fixed_file
                length = op.remaining
                if op.forced_short and op.forced_short < length:
                    length = op.forced_short
                    op.forced_short = 0
                if op.work != NULL and op.opcode == OP_WRITE and not op.work.stamped:
                    w = op.work
                    stamp_header(w.hdr, w.key, w.key_len, w.slot, w.generation, w.payload_len,
                                 payload_hash(w.payload, w.payload_len))
                    w.stamped = 1
                if op.opcode == OP_FSYNC:
                    __io_uring_prep_fsync(sqe, fd, __IORING_FSYNC_DATASYNC)
                elif op.niov:
                    nsub = 0
                    left = length
                    for k in range(op.niov):
                        if left == 0:
                            break
                        op.sub[k].iov_base = op.iov[k].iov_base
                        op.sub[k].iov_len = op.iov[k].iov_len if op.iov[k].iov_len < left else left
                        left -= <unsigned int>op.sub[k].iov_len
                        nsub += 1
                    if op.opcode == OP_READ:
                        __io_uring_prep_readv(sqe, fd, op.sub, nsub, op.offset)
                    else:
                        __io_uring_prep_writev(sqe, fd, op.sub, nsub, op.offset)
                elif op.opcode == OP_READ:
                    if op.fixed_buf >= 0:
                        __io_uring_prep_read_fixed(sqe, fd, op.addr, length, op.offset, op.fixed_buf)
                    else:
                        __io_uring_prep_read(sqe, fd, op.addr, length, op.offset)
                else:
                    if op.fixed_buf >= 0:
                        __io_uring_prep_write_fixed(sqe, fd, op.addr, length, op.offset, op.fixed_buf)
                    else:
                        __io_uring_prep_write(sqe, fd, op.addr, length, op.offset)
                if op.fixed_file >= 0:
                    __io_uring_sqe_set_flags(sqe, __IOSQE_FIXED_FILE)
                __io_uring_sqe_set_data64(sqe, <uint64_t><uintptr_t>op)
                b.inflight += 1
                self._inflight += 1
                filled += 1
        return filled

    cdef Py_ssize_t _reap(self) noexcept nogil:
        """Consume every ready CQE (of any active batch: each carries its op's address);
        requeue short transfers and transient errors."""
        cdef __io_uring *r = &self._ring.ptr
        cdef unsigned int ready = __io_uring_cq_ready(r)
        cdef unsigned int head = r.cq.khead[0]
        cdef unsigned int mask = r.cq.ring_mask
        cdef unsigned int k
        cdef __io_uring_cqe *cqe
        cdef Op *op
        cdef Batch *b
        cdef Py_ssize_t i
        cdef int res
        for k in range(ready):
            cqe = &r.cq.cqes[(head + k) & mask]
            op = <Op *><uintptr_t>cqe.user_data
            b = <Batch *>op.batch
            i = op - b.ops
            res = cqe.res
            b.inflight -= 1
            self._inflight -= 1
            if res == -EAGAIN or res == -EINTR:
                self._requeue(b, i)
            elif res < 0:
                op.result = res
                self._finish(b, op)
            elif op.opcode == OP_FSYNC or <unsigned int>res >= op.remaining:
                op.done += res
                op.result = op.done
                self._finish(b, op)
            elif res == 0:
                # No progress: end of file on a read, or the device refusing a write.
                op.result = -(ENODATA if op.opcode == OP_READ else EIO)
                self._finish(b, op)
            else:
                op.done += res
                op.addr += res
                op.offset += <unsigned int>res
                op.remaining -= <unsigned int>res
                if op.niov:
                    _advance_iov(op, <size_t>res)
                self._requeue(b, i)
        if ready:
            __io_uring_cq_advance(r, ready)
        return ready

    cdef void _finish(self, Batch *b, Op *op) noexcept nogil:
        """An op has its final result: count it, and when it was the last op of a slot,
        settle the slot (its error or bytes) and check a read right away, while the rest
        of the batch is still in flight."""
        cdef SlotWork *w = op.work
        op.finished = 1
        b.completed += 1
        if w == NULL:
            return
        if op.result < 0:
            if w.error == 0:
                w.error = op.result
        else:
            w.moved += op.result
        w.parts_left -= 1
        if w.parts_left == 0 and w.error == 0 and op.opcode == OP_READ and w.verify:
            if b.checks != NULL:    # checked by the pump once the queue is topped up again
                b.checks[b.nchecks] = w
                b.nchecks += 1
            else:
                _check(w)

    @cython.cdivision(True)
    cdef void _requeue(self, Batch *b, Py_ssize_t i) noexcept nogil:
        b.queue[(b.qhead + b.qlen) % b.n] = i
        b.qlen += 1

    cdef void _run_checks(self) noexcept nogil:
        cdef int a
        cdef Batch *b
        for a in range(self._nactive):
            b = self._active[a]
            while b.nchecks > 0:
                b.nchecks -= 1
                _check(b.checks[b.nchecks])

    cdef int _pump_nogil(self, Batch *target, bint wakeable) except -1 nogil:
        """The whole submit/reap loop, without the GIL and never taking it: returns 0
        when `target` is done, PUMP_WOKEN when `wakeable`, another thread called `wake()`
        and the target has no op left to queue, or the (positive) errno of an io_uring_enter failure it does not
        resume from (see `_resume`; the caller raises it). Every active batch's ops are
        filled and reaped meanwhile (the target's first). Read slots that completed are
        checked only after the queue has been topped up and handed to the kernel, so the
        device does not wait on the checksums."""
        cdef __io_uring *r = &self._ring.ptr
        cdef int filled, ret, err, a
        cdef Py_ssize_t nchecks
        cdef uint64_t heavy
        cdef Batch *b
        while target.completed < target.n or target.nchecks > 0:
            # Woken only once the target's tail has begun (nothing of it left to queue):
            # earlier, the ring has the target's own ops to refill from, and returning
            # would cost the caller a GIL take mid-batch for nothing.
            if wakeable and target.qlen == 0 and kvs_flag_take(&self._wake):
                kvs_submit_and_wait(r, 0)   # hand over what is prepared; errors: next pump
                return PUMP_WOKEN
            filled = self._fill()
            nchecks = 0
            heavy = 0
            for a in range(self._nactive):
                b = self._active[a]
                if b.nchecks > 0:
                    nchecks += b.nchecks
                    if b.checks[0].verify == 2:
                        heavy += <uint64_t>b.nchecks * b.checks[0].payload_len
            if nchecks > 0:
                # Checksums worth more than a syscall (>= 1 MiB pending): hand the refills
                # to the kernel first, so the device is not short of work meanwhile (one
                # submit per batch of checks, never per slot). A refused submit is left
                # to the next submit-and-wait, which hands over the same SQEs.
                if filled and heavy >= EARLY_SUBMIT_BYTES:
                    ret = kvs_submit_and_wait(r, 0)
                    if ret < 0 and ret != -EINTR and ret != -EAGAIN and ret != -EBUSY:
                        return -ret
                self._run_checks()
            else:
                ret = kvs_submit_and_wait(r, 1)
                if ret < 0:
                    err = _resume(self, -ret)
                    if err:
                        return err
            self._reap()
        return 0

    cdef int _pump(self, Batch *b, bint wakeable=False) except -1:
        """Drive the batch to completion in one GIL-free section (EINTR/EAGAIN/EBUSY from
        io_uring_enter are resumed inside it); any other kernel error raises OSError.
        Returns 1 when woken (`wakeable` only) before the batch was done, else 0."""
        cdef int err
        with nogil:
            err = self._pump_nogil(b, wakeable)
        if err == PUMP_WOKEN:
            return 1
        if err:
            raise OSError(err, f"io_uring_enter failed: {os.strerror(err)}")
        return 0

    cdef int _activate(self, Batch *b) except -1:
        if self._nactive >= MAX_ACTIVE:
            raise KVStoreError(f"a ring keeps at most {MAX_ACTIVE} batches in flight; finish "
                               "a started one (slot_io_finish) before starting another")
        self._active[self._nactive] = b
        self._nactive += 1
        b.active = True
        return 0

    cdef void _deactivate(self, Batch *b) noexcept:
        cdef int a, j
        for a in range(self._nactive):
            if self._active[a] == b:
                for j in range(a, self._nactive - 1):
                    self._active[j] = self._active[j + 1]
                self._nactive -= 1
                break
        b.active = False

    cdef void _drain(self) noexcept:
        """Submit nothing more and wait (bounded) until the kernel is done with every
        active batch's requests (queue_exit alone would return before in-flight block I/O
        ends, and their memory may be freed or reused); then no batch is active."""
        cdef int a
        for a in range(self._nactive):
            self._active[a].qlen = 0
        self._wait_idle(NULL)
        while self._nactive > 0:
            self._deactivate(self._active[0])

    cdef void _wait_idle(self, Batch *b) noexcept:
        """Wait (bounded) until the kernel holds no op of `b` (NULL: of any batch)."""
        cdef int tries = 0
        cdef int ret
        cdef __io_uring *r = &self._ring.ptr
        with nogil:
            while (self._inflight if b == NULL else b.inflight) > 0 and tries < 10000:
                tries += 1
                ret = kvs_submit_and_wait(r, 1)   # also hands over SQEs already prepared
                if self._reap() == 0 and ret < 0 and ret != -EINTR:
                    kvs_pause(RETRY_PAUSE_US)    # bounded: 10000 tries of >= 50 us

    cdef int _init_op(self, Op *op, int opcode, int fd, uint64_t offset) except -1:
        cdef int j
        op.opcode = opcode
        op.fd = fd
        op.fixed_file = -1
        op.fixed_buf = -1
        op.offset = offset
        if self._files_registered:
            for j in range(self._nfiles):
                if self._files[j] == fd:
                    op.fixed_file = j
                    break
        return 0

    cdef int _buffer_index(self, uintptr_t addr, uint64_t length) noexcept:
        """Index of the registered buffer holding [addr, addr + length), else -1."""
        cdef int j
        for j in range(self._nbufs):
            if self._buf_start[j] <= addr and addr + length <= self._buf_end[j]:
                return j
        return -1

    cdef bint _in_memory(self, uintptr_t addr, uint64_t length) noexcept:
        """[addr, addr + length) lies inside one buffer given to register_buffers."""
        cdef int j
        for j in range(self._nmem):
            if self._mem_start[j] <= addr and addr + length <= self._mem_end[j]:
                return True
        return False

    cdef int _set_buffer(self, Op *op, uintptr_t addr, uint64_t length) except -1:
        """A one-buffer op: use the registered buffer that holds it, when there is one."""
        cdef int j = self._buffer_index(addr, length)
        if j >= 0 and self._bufs_registered:
            op.fixed_buf = j
        op.addr = <char *>addr
        op.remaining = <unsigned int>length
        return 0

    cdef int _start(self, Batch *b, int opcode, a_fd, a_off, a_len) except -1:
        """Make a prepared batch active: inject test faults, then fill the room the ring
        has and hand it to the kernel (no wait: a pump drives it from here)."""
        cdef Py_ssize_t i
        for i in range(b.n):
            b.queue[i] = i
            b.ops[i].batch = b
        b.qlen = b.n
        if b.max_inflight == 0:
            b.max_inflight = self.depth
        self._activate(b)
        if self.fault_injector is not None:
            try:
                self._inject(b, opcode, a_fd, a_off, a_len)
            except BaseException:
                self._deactivate(b)   # nothing of it was submitted
                raise
        with nogil:
            if self._fill():
                kvs_submit_and_wait(&self._ring.ptr, 0)   # a refusal: the pump resubmits
        return 0

    cdef _run_batch(self, Batch *b, int opcode, a_fd, a_off, a_len):
        """Inject test faults, then drive the prepared batch to its end."""
        self._start(b, opcode, a_fd, a_off, a_len)
        self._pump(b)

    def submit(self, int opcode, fds, offsets, addrs, lengths, *, bint check=True):
        """Run one batch: op `opcode` (0 read, 1 write, 2 fdatasync) on parallel arrays.

        Returns an int64 array: bytes transferred per op, or -errno. Every buffer range is
        checked (inside a registered HostBuffer, 4096-aligned) before anything is submitted.
        """
        self._check_open()
        if opcode not in (OP_READ, OP_WRITE, OP_FSYNC):
            raise ValueError(f"unknown opcode {opcode}")
        cdef cnp.ndarray[int32_t, ndim=1] a_fd = np.ascontiguousarray(fds, dtype=np.int32)
        cdef Py_ssize_t n = a_fd.shape[0]
        cdef cnp.ndarray[uint64_t, ndim=1] a_off = np.ascontiguousarray(
            offsets if offsets is not None else np.zeros(n, np.uint64), dtype=np.uint64)
        cdef cnp.ndarray[uint64_t, ndim=1] a_addr = np.ascontiguousarray(
            addrs if addrs is not None else np.zeros(n, np.uint64), dtype=np.uint64)
        cdef cnp.ndarray[uint32_t, ndim=1] a_len = np.ascontiguousarray(
            lengths if lengths is not None else np.zeros(n, np.uint32), dtype=np.uint32)
        if a_off.shape[0] != n or a_addr.shape[0] != n or a_len.shape[0] != n:
            raise ValueError("fds, offsets, addrs and lengths must have the same length")
        cdef cnp.ndarray[int64_t, ndim=1] out = np.zeros(n, dtype=np.int64)
        if n == 0:
            return out
        cdef Batch b
        _batch_alloc(&b, n, 0)
        cdef Py_ssize_t i
        try:
            for i in range(n):
                self._init_op(&b.ops[i], opcode, a_fd[i], a_off[i])
                if opcode != OP_FSYNC:
                    if check:
                        self._check_op(opcode, a_fd[i], a_off[i], <uintptr_t>a_addr[i], a_len[i])
                    self._set_buffer(&b.ops[i], <uintptr_t>a_addr[i], a_len[i])
            self._run_batch(&b, opcode, a_fd, a_off, a_len)
            for i in range(n):
                out[i] = b.ops[i].result
        finally:
            self._release(&b)
        return out

    cdef _release(self, Batch *b):
        """End of a batch, however it ended: no request may still use its memory."""
        if b.inflight > 0:
            self._abandon(b)
        if b.active:
            self._deactivate(b)
        _batch_free(b)

    cdef _abandon(self, Batch *b):
        """An unexpected failure with requests still in flight: wait (bounded) until the
        kernel is done with every active batch's buffers, then close."""
        self.close()   # close drains first

    def slot_io(self, int opcode, fds, offsets, hdr_addrs, payload_addrs, unsigned int io_len,
                keys, slots, generations, unsigned long long payload_len, *,
                int verify=2, bint check=True, unsigned int payload_align=ALIGN):
        """`slot_io_start` and `slot_io_finish` in one call: see `slot_io_start`."""
        return self.slot_io_finish(self.slot_io_start(
            opcode, fds, offsets, hdr_addrs, payload_addrs, io_len, keys, slots, generations,
            payload_len, verify=verify, check=check, payload_align=payload_align))

    def wake(self):
        """Make the running (or the next) `slot_io_pump` return early. The one Ring method
        another thread may call: it only sets a flag the pump takes."""
        kvs_flag_set(&self._wake)

    def slot_io_pump(self, SlotIOPart part):
        """Drive the ring (every started part, `part` first) until `part` is done (True)
        or another thread called `wake()` and the part's tail has begun (all its ops
        queued in the ring: the moment to start the next part) (False), without the GIL."""
        self._check_part(part)
        try:
            return not self._pump(&part.b, True)
        except BaseException:
            self._release(&part.b)   # nothing of it is left in flight (or the ring closed)
            part.ended = True
            raise

    def slot_io_finish(self, SlotIOPart part):
        """Drive the ring until `part` is done, and end it: returns (results, status) as
        described in `slot_io_start`. Parts may end in any order; the other started parts'
        ops keep the device busy meanwhile."""
        self._check_part(part)
        try:
            self._pump(&part.b)
        except BaseException:
            self._release(&part.b)
            part.ended = True
            raise
        cdef Py_ssize_t i
        cdef cnp.ndarray[int64_t, ndim=1] out = part.out
        cdef cnp.ndarray[int32_t, ndim=1] status = part.status
        for i in range(part.nslots):
            out[i] = part.works[i].error if part.works[i].error < 0 else part.works[i].moved
            status[i] = part.works[i].status
        self._release(&part.b)
        part.ended = True
        return out, status

    cdef _check_part(self, SlotIOPart part):
        if part.ring is not self:
            raise ValueError("this SlotIOPart was started on another ring")
        if part.ended:
            raise ValueError("this SlotIOPart has already ended (slot_io_finish, or a pump "
                             "of it raised)")
        if not part.b.active:
            raise KVStoreError("the ring was closed while this SlotIOPart was in flight; "
                               "its slots did not move")

    cdef void _forget(self, Batch *b) noexcept:
        """A started part dropped without slot_io_finish: queue nothing more of it, and
        wait until the kernel is done with what it has in flight (its memory is freed
        next)."""
        b.qlen = 0
        self._wait_idle(b)
        if b.inflight > 0:
            self.close()
        self._deactivate(b)

    def slot_io_start(self, int opcode, fds, offsets, hdr_addrs, payload_addrs, unsigned int io_len,
                      keys, slots, generations, unsigned long long payload_len, *,
                      int verify=2, bint check=True, unsigned int payload_align=ALIGN):
        """Start moving whole slots (a 4096-byte header + `io_len` payload bytes) in one batch.

        Slot i: header at hdr_addrs[i], key keys[i] (bytes), slot number slots[i],
        generation generations[i]. Writes stamp each header just before their first
        submission; reads are checked on completion (verify: 0 none, 1 header, 2 header +
        payload checksum).
        - payload_addrs None: staging slots, the payload right after its header; each slot
          is one (fixed-buffer) transfer and must lie in a HostBuffer given to
          register_buffers.
        - payload_addrs given: payload i at payload_addrs[i] (caller memory, which the
          caller keeps alive and has validated). Headers must be 4096-aligned, payloads a
          multiple of `payload_align` (4096 for O_DIRECT files; 1 for page-cache files).
          When every header and payload lies in buffers registered with the kernel, each
          slot is two fixed-buffer ops (header, payload; the fault injector sees op 2i and
          2i+1 for slot i); otherwise one readv/writev of two iovecs.

        Returns a SlotIOPart at once: its ops are in the ring, and they move while this
        ring is pumped, for this part or another (`slot_io_pump`, `slot_io_finish`), so a
        caller that starts part k+1 before finishing part k keeps the device's queue full
        across the boundary (at most MAX_ACTIVE started at once). `slot_io_finish(part)`
        returns (results, status): int64 bytes moved or -errno per slot, and int32
        SlotCheck codes (0 = good; reads only, meaningful where results[i] >= 0). The
        memory the slots move from or to must stay untouched until then.
        """
        self._check_open()
        if opcode not in (OP_READ, OP_WRITE):
            raise ValueError(f"slot_io moves reads or writes, not opcode {opcode}")
        if verify not in (0, 1, 2):
            raise ValueError(f"verify must be 0, 1 or 2, got {verify}")
        cdef cnp.ndarray[int32_t, ndim=1] a_fd = np.ascontiguousarray(fds, dtype=np.int32)
        cdef Py_ssize_t n = a_fd.shape[0]
        cdef cnp.ndarray[uint64_t, ndim=1] a_off = np.ascontiguousarray(offsets, dtype=np.uint64)
        cdef cnp.ndarray[uint64_t, ndim=1] a_hdr = np.ascontiguousarray(hdr_addrs, dtype=np.uint64)
        cdef bint staged = payload_addrs is None
        cdef cnp.ndarray[uint64_t, ndim=1] a_pay = np.ascontiguousarray(
            a_hdr + np.uint64(ALIGN) if staged else payload_addrs, dtype=np.uint64)
        keys = tuple(keys)   # the C side borrows pointers into these bytes: hold them here
        cdef cnp.ndarray[uint64_t, ndim=1] a_slot = np.ascontiguousarray(slots, dtype=np.uint64)
        cdef cnp.ndarray[uint64_t, ndim=1] a_gen = np.ascontiguousarray(generations, dtype=np.uint64)
        if not (a_off.shape[0] == a_hdr.shape[0] == a_pay.shape[0] == a_slot.shape[0]
                == a_gen.shape[0] == len(keys) == n):
            raise ValueError("slot_io: every per-slot array must have the same length")
        if io_len == 0 or io_len % ALIGN or payload_len > io_len:
            raise AlignmentError(f"slot_io: payload transfer of {io_len} bytes must be a positive "
                                 f"multiple of {ALIGN} holding the {payload_len}-byte payload")
        cdef SlotIOPart part = SlotIOPart.__new__(SlotIOPart)
        part.ring = self
        part.nslots = n
        part.keys = keys
        part.out = np.zeros(n, dtype=np.int64)
        part.status = np.zeros(n, dtype=np.int32)
        cdef Py_ssize_t i
        # Caller memory that lies in registered buffers (headers too) moves as two
        # fixed-buffer ops per slot, header and payload: no page pinning per I/O, which
        # readv/writev pay (they cannot use registered buffers).
        cdef bint split = not staged and self._bufs_registered
        if split:
            for i in range(n):
                if (not self._in_memory(<uintptr_t>a_hdr[i], ALIGN)
                        or not self._in_memory(<uintptr_t>a_pay[i], io_len)):
                    split = False
                    break
        cdef Py_ssize_t per = 2 if split else 1
        cdef Py_ssize_t nops = n * per
        a_fd_ops = a_off_ops = a_len_ops = None
        if self.fault_injector is not None:   # the test seam sees the per-op arrays
            if split:
                a_fd_ops = np.repeat(a_fd, 2)
                a_off_ops = np.repeat(a_off, 2)
                a_off_ops[1::2] += np.uint64(ALIGN)
                a_len_ops = np.tile(np.array([ALIGN, io_len], dtype=np.uint32), n)
            else:
                a_fd_ops, a_off_ops = a_fd, a_off
                a_len_ops = np.full(n, ALIGN + io_len, dtype=np.uint32)
        if n == 0:
            _batch_alloc(&part.b, 0, 0)
            self._activate(&part.b)   # done at once: finish returns the empty arrays
            return part
        _batch_alloc(&part.b, nops, n)
        cdef SlotWork *works = <SlotWork *>PyMem_Malloc(sizeof(SlotWork) * n)
        if works == NULL:
            raise MemoryError()
        part.works = works
        cdef Batch *b = &part.b
        cdef Op *op
        cdef bytes key
        cdef uintptr_t hdr, pay
        if True:   # (the part frees its batch and works however this ends)
            memset(works, 0, sizeof(SlotWork) * n)
            # The queue depth counts slots: a split slot's 4 KiB header op rides along with
            # its payload op (the completion queue holds 2x depth entries, so it cannot
            # overflow).
            b.max_inflight = self.depth * per
            for i in range(n):
                key = keys[i]
                if len(key) > 128:
                    raise ValueError(f"key of {len(key)} bytes exceeds the 128-byte header field")
                op = &b.ops[i * per]
                self._init_op(op, opcode, a_fd[i], a_off[i])
                hdr = <uintptr_t>a_hdr[i]
                pay = <uintptr_t>a_pay[i]
                if not staged and check and (hdr % ALIGN or a_off[i] % ALIGN
                                             or (payload_align > 1 and pay % payload_align)):
                    from kvstore._hostbuf import check_io_alignment
                    bad_hdr = hdr % ALIGN or a_off[i] % ALIGN
                    check_io_alignment(hdr if bad_hdr else pay, ALIGN if bad_hdr else io_len,
                                       a_off[i] if bad_hdr else a_off[i] + ALIGN, ALIGN,
                                       f"{OPNAMES[opcode]} of a slot "
                                       f"{'header' if bad_hdr else 'payload'}")
                if staged:   # a staging slot: one buffer, registered when the kernel allowed
                    if check:
                        self._check_op(opcode, a_fd[i], a_off[i], hdr, ALIGN + io_len)
                    self._set_buffer(op, hdr, ALIGN + io_len)
                elif split:  # header op, then payload op, both on registered buffers
                    self._set_buffer(op, hdr, ALIGN)
                    op.work = &works[i]
                    op = &b.ops[i * 2 + 1]
                    self._init_op(op, opcode, a_fd[i], a_off[i] + ALIGN)
                    self._set_buffer(op, pay, io_len)
                else:        # one readv/writev of header + payload
                    op.niov = 2
                    op.iov[0].iov_base = <void *>hdr
                    op.iov[0].iov_len = ALIGN
                    op.iov[1].iov_base = <void *>pay
                    op.iov[1].iov_len = io_len
                    op.addr = <char *>hdr   # unused by vectored ops; kept for symmetry
                    op.remaining = ALIGN + io_len
                works[i].key = key
                works[i].key_len = <uint32_t>len(key)
                works[i].slot = a_slot[i]
                works[i].generation = a_gen[i]
                works[i].payload_len = payload_len
                works[i].hdr = <char *>hdr
                works[i].payload = <char *>pay
                works[i].verify = verify
                works[i].parts_left = <int>per
                op.work = &works[i]
            self._start(b, opcode, a_fd_ops, a_off_ops, a_len_ops)
        return part

    cdef _check_op(self, int opcode, int fd, uint64_t offset, uintptr_t addr, uint64_t length):
        what = f"{OPNAMES[opcode]} of {self._fd_names.get(fd, f'fd {fd}')}"
        if length == 0 or length % ALIGN or offset % ALIGN or addr % ALIGN:
            from kvstore._hostbuf import check_io_alignment
            check_io_alignment(addr, length, offset, ALIGN, what)
        if length > 0x7ffff000:
            raise AlignmentError(f"{what} refused: length {length} exceeds one I/O's limit")
        if self._in_memory(addr, length):
            return
        raise AlignmentError(
            f"{what} refused before submission: buffer range [0x{addr:x}, +{length}) at "
            f"file offset {offset} is not inside any staging HostBuffer registered with "
            "this ring (call Ring.register_buffers with the HostBuffer first)")

    cdef _inject(self, Batch *b, int opcode, fds, offsets, lengths):
        """Test seam: let `fault_injector` fail or shorten chosen ops before submission."""
        faults = self.fault_injector(OPNAMES[opcode], fds, offsets, lengths)
        cdef Py_ssize_t i, w, keep
        cdef Py_ssize_t n = b.n
        if not faults:
            return
        dropped = set()
        for i, kind, value in faults:
            if not 0 <= i < n:
                raise IndexError(f"fault_injector named op {i} of a {OPNAMES[opcode]} batch of {n}")
            if i in dropped:
                raise ValueError(f"fault_injector failed op {i} twice")
            if kind == "error" and int(value) == 0:
                raise ValueError("fault_injector error values must be a non-zero errno")
            if kind == "short" and not 0 < int(value) < b.ops[i].remaining:
                raise ValueError(f"fault_injector short of {value} bytes for op {i} of "
                                 f"{b.ops[i].remaining}: it must cut the transfer")
            if kind == "error":
                b.ops[i].result = -abs(int(value))
                self._finish(b, &b.ops[i])
                dropped.add(i)
            elif kind == "short":
                b.ops[i].forced_short = int(value)
            else:
                raise ValueError(f"unknown fault kind {kind!r}")
        if dropped:
            w = 0
            for i in range(n):
                if i not in dropped:
                    b.queue[w] = i
                    w += 1
            b.qlen = w

    def raise_for_results(self, int opcode, results, fds, offsets, lengths=None):
        """Raise OSError for the first failed op, naming the operation, file and offset."""
        res = np.asarray(results)
        bad = np.flatnonzero(res < 0)
        if bad.size == 0:
            return
        i = int(bad[0])
        err = int(-res[i])
        fd = int(np.asarray(fds)[i])
        name = self._fd_names.get(fd, f"fd {fd}")
        off = int(np.asarray(offsets)[i]) if offsets is not None else 0
        extra = f" ({bad.size} of {res.size} ops failed)" if bad.size > 1 else ""
        raise OSError(err, f"io_uring {OPNAMES[opcode]} at offset {off} failed: "
                      f"{os.strerror(err)}{extra}", name)

    def read(self, ops):
        """Read a list of (fd, offset, address, length) and raise OSError on any failure."""
        return self._simple(OP_READ, ops)

    def write(self, ops):
        """Write a list of (fd, offset, address, length) and raise OSError on any failure."""
        return self._simple(OP_WRITE, ops)

    def fdatasync(self, fds):
        """fdatasync every fd through the ring, in one batch."""
        fds = list(fds)
        res = self.submit(OP_FSYNC, fds, None, None, None)
        self.raise_for_results(OP_FSYNC, res, fds, None)

    def _simple(self, int opcode, ops):
        ops = list(ops)
        fds = [o[0] for o in ops]
        offs = [o[1] for o in ops]
        res = self.submit(opcode, fds, offs, [o[2] for o in ops], [o[3] for o in ops])
        self.raise_for_results(opcode, res, fds, offs)
        return res

    def __repr__(self):
        if not self._open:
            return "Ring(closed)"
        return (f"Ring(queue_depth={self.depth}, buffers={self._nbufs}"
                f"{' registered' if self._bufs_registered else ''}, files={self._nfiles}"
                f"{' registered' if self._files_registered else ''})")


@cython.no_gc_clear   # __dealloc__ needs `ring` and `keys` (cleared first, a cycle's part freed
                      # its Batch under the kernel's in-flight ops)
cdef class SlotIOPart:
    """A slot_io batch started on a Ring (`Ring.slot_io_start`) and not yet ended: the
    ring owns its progress, `Ring.slot_io_finish` its results. Dropped unfinished, it
    waits for its ops in flight before its memory goes (never a request into freed
    memory)."""

    def __cinit__(self):
        memset(&self.b, 0, sizeof(Batch))
        self.works = NULL

    def __dealloc__(self):
        if self.b.active and self.ring is not None:
            self.ring._forget(&self.b)
        _batch_free(&self.b)
        PyMem_Free(self.works)
        self.works = NULL

    @property
    def done(self) -> bool:
        """Every op has its result and every read its check (the ring needs no more pumping)."""
        return self.ended or (self.b.completed >= self.b.n and self.b.nchecks == 0)

    @property
    def completed(self) -> int:
        """Ops of this part that have their final result."""
        return self.b.completed

    @property
    def in_flight(self) -> int:
        """Ops of this part in the kernel's hands now."""
        return self.b.inflight

    def __len__(self):
        return self.nslots
