"""Batches: one batch of I/O ops over one rank's devices, and the double buffer of the
batch loops.

A batch names its slots; `RankFiles.place` splits it by device, each device's part runs
on its own ring (on the device's thread with several devices, so every ring has its ops
in flight at once; Ring calls release the GIL for their whole submit/reap loop), and the
per-op results come back in batch order. A failed device's part is never submitted: its
ops fail with EIO at once. Every part's bytes are counted (`io_bytes`, the iostats
counters) and its device errnos handed to `DeviceHealth.note_errors`. `RankIO` owns one.
"""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

import numpy as np

from kvstore import _slotfile
from kvstore.errors import CorruptSlot
from kvstore.format.layout import HEADER_SIZE
from kvstore.io.files import RankFiles, SlotPlaces
from kvstore.io.health import DeviceHealth
from kvstore.io.iostats import OP_READ, OP_WRITE
from kvstore.io.records import ref_parts
from kvstore.io.rings import DeviceRings

# The rank's logger: everything a RankIO logs, whichever of its parts logs it.
log = logging.getLogger("kvstore.io.rank")

OP_FDATASYNC = 2    # Ring.submit's opcode for fdatasync (no offsets, addresses or lengths)


def _settle(fut) -> None:
    """Wait for a ring future whatever its outcome (its error is the caller's to report)."""
    try:
        fut.result()
    except BaseException:
        pass


@dataclass(slots=True)
class SlotBatch:
    """The outcome of a batch of whole-slot ops (`Batches.slot_io`), per op in batch order."""
    res: np.ndarray       # int64: bytes moved (the whole slot), or -errno
    status: np.ndarray    # int32: the ring's slot check of a read (0: passed, or not checked)
    fds: np.ndarray       # the slot file of each op
    offsets: np.ndarray   # its byte offset in that file


class Spread:
    """One batch's device parts in flight (`Batches.spread`): `result()` waits for every
    part (the first error is raised once all of them have ended) and returns the per-op
    results (an array, or a tuple of arrays) in batch order, passed through `then`."""

    __slots__ = ("n", "dead", "futs", "_then")

    def __init__(self, n: int, dead: list, futs: list, then=None):
        self.n = n
        self.dead = dead     # (positions, result) of parts that never reached a ring
        self.futs = futs     # (positions, Future), positions None: the whole batch
        self._then = then

    def then(self, fn) -> "Spread":
        self._then = fn
        return self

    def result(self):
        parts, exc = list(self.dead), None
        for idx, fut in self.futs:
            try:
                parts.append((idx, fut.result()))
            except BaseException as e:   # the other devices' parts still finish first
                exc = exc or e
        if exc is not None:
            raise exc
        if len(parts) == 1 and parts[0][0] is None:
            value = parts[0][1]
        else:
            single = not isinstance(parts[0][1], tuple)
            outs = [np.empty(self.n, dtype=a.dtype) for a in ((parts[0][1],) if single else parts[0][1])]
            for idx, r in parts:
                for o, a in zip(outs, (r,) if single else r):
                    o[idx] = a
            value = outs[0] if single else tuple(outs)
        return value if self._then is None else self._then(value)


def _dead(call, n: int):
    """The result of n ops on a failed device: -EIO each (and status 0 for slot_io)."""
    res = np.full(n, -errno.EIO, dtype=np.int64)
    return (res, np.zeros(n, dtype=np.int32)) if getattr(call, "slot_io", False) else res


def _op_name(opcode: int) -> str:
    return "write" if opcode == OP_WRITE else "read"


class Batches:
    """Batches of ops over one rank's devices (see the module docstring)."""

    def __init__(self, files: RankFiles, rings: DeviceRings, health: DeviceHealth, *,
                 payload_len: int, direct: bool, rank: int):
        self._files = files
        self._rings = rings
        self._health = health
        self.ndev = files.ndev
        self.rank = rank
        self.slot_size = files.slot_size
        self.payload_len = payload_len
        self.direct = direct
        # bytes this opener moved, per device: [read, written]
        self.io_bytes = np.zeros((self.ndev, 2), dtype=np.int64)

    # -- one batch over the devices ------------------------------------------------
    def fan(self, devs: np.ndarray, call):
        """Run one batch over the devices: `call(d, idx)` moves the ops at positions `idx`
        (all of them when idx is None) on device d's ring. With several devices every
        device's part runs on its own thread, so all rings have their ops in flight at
        once, and each ring's queue depth bounds the ops (and so the bytes) in flight on
        its device. Results (an array, or a tuple of arrays, per op) come back in batch
        order; every part has ended before this returns or raises."""
        if self.ndev == 1 or len(devs) == 0:
            return call(0, None)
        return self.spread(devs, call, lambda s, d, idx: s.call(lambda: call(d, idx))).result()

    def spread(self, devs: np.ndarray, call, post) -> Spread:
        """Hand device d's part of a batch (positions idx) to its stream with `post(stream,
        d, idx)` (a Future); a failed device's part fails at once, unsubmitted (`call` says
        what its dead result looks like)."""
        groups = [(d, np.flatnonzero(devs == d)) for d in range(self.ndev)] if self.ndev > 1 else [(0, None)]
        groups = [(d, i) for d, i in groups if i is None or i.size]
        # one snapshot: another device thread may fail a device meanwhile, and every
        # group must land in exactly one of `dead` and `futs`
        failed = set(self._health.failed)
        streams = self._rings.streams()
        # A failed device's ops are never submitted: they fail with EIO at once, so no
        # request waits on a dead disk.
        dead = [(idx, _dead(call, len(devs) if idx is None else len(idx)))
                for d, idx in groups if d in failed]
        futs = []
        try:
            for d, idx in groups:
                if d not in failed:
                    futs.append((idx, post(streams[d], d, idx)))
        except BaseException:
            for _, fut in futs:     # let the posted parts end first; this error is the one
                _settle(fut)
            raise
        return Spread(len(devs), dead, futs)

    def account(self, d: int, opcode: int, res) -> None:
        """Count the bytes device d's part moved (this opener's and the iostats')."""
        if opcode not in (OP_READ, OP_WRITE):
            return
        n = int(res[res > 0].sum())
        if not n:
            return
        self.io_bytes[d, opcode] += n
        if (c := self._files.counter(d)) is not None:
            c.add(opcode, n)

    def submit(self, opcode: int, places: SlotPlaces, addrs, lens):
        """Ring.submit of a plain batch (reads of headers or whole images), over the devices."""
        fds, offs = places.fds, places.offsets
        op = "write" if opcode == OP_WRITE else "read"

        def call(d, idx):
            if idx is None:
                res = self._rings.rings[d].submit(opcode, fds, offs, addrs, lens)
            else:
                res = self._rings.rings[d].submit(opcode, fds[idx], offs[idx], addrs[idx], lens[idx])
            self.account(d, opcode, res)
            self._health.note_errors(d, op, res)
            return res
        return self.fan(places.devices, call)

    def slot_io(self, opcode, refs, hdr_addrs, payload_addrs, verify: int, *, stream: bool = False):
        """Move whole slots (Ring.slot_io on each device's part): a write's header is
        stamped and a read checked (`verify`: 0 none, 1 header, 2 checksum) by the ring.
        Returns a SlotBatch; with `stream`, a Spread whose `result()` returns it: the
        parts are started on the device streams at once and move while the caller goes
        on (the caller must call result(), and keep the memory untouched until then)."""
        keys, slots, gens = ref_parts(refs)
        places = self._files.place(slots)
        fds, offs, devs = places.fds, places.offsets, places.devices
        io_len = self.slot_size - HEADER_SIZE
        align = HEADER_SIZE if self.direct else 1
        hdr_addrs = np.asarray(hdr_addrs, dtype=np.uint64)
        op = "write" if opcode == OP_WRITE else "read"

        def args(idx):
            if idx is None:
                return (opcode, fds, offs, hdr_addrs, payload_addrs, io_len, keys, slots, gens,
                        self.payload_len)
            sel = idx.tolist()
            return (opcode, fds[idx], offs[idx], hdr_addrs[idx],
                    None if payload_addrs is None else np.asarray(payload_addrs)[idx], io_len,
                    [keys[i] for i in sel], [slots[i] for i in sel], [gens[i] for i in sel],
                    self.payload_len)

        def account(d, out):
            self.account(d, opcode, out[0])
            self._health.note_errors(d, op, out[0])
            return out

        def call(d, idx):
            ring = self._rings.rings[d]
            return account(d, ring.slot_io(*args(idx), verify=verify, payload_align=align))
        call.slot_io = True

        def post(stream, d, idx):
            return stream.start(
                lambda: self._rings.rings[d].slot_io_start(*args(idx), verify=verify, payload_align=align),
                lambda out: account(d, out))

        def finish(out):
            res, status = out
            short = (res >= 0) & (res != self.slot_size)
            if short.any():
                # The ring completes every transfer or fails it; a partial count here would
                # commit a half-written slot (writes cannot be verified), so never trust one.
                log.warning("rank %d: %d %s(s) returned a short count (%s of %d bytes); treated as "
                            "I/O errors", self.rank, int(short.sum()), op,
                            int(res[short][0]), self.slot_size)
                res = res.copy()
                res[short] = -errno.EIO
            return SlotBatch(res, status, fds, offs)
        if stream and refs:
            return self.spread(devs, call, post).then(finish)
        if stream:
            empty = finish((np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)))
            return Spread(0, [(None, empty)], [])
        return finish(self.fan(devs, call))

    # -- per-op outcomes ---------------------------------------------------------------
    def error(self, opcode, res, fd, off, ref) -> OSError:
        """The OSError of a failed op on ref's slot."""
        return OSError(-int(res), f"{_op_name(opcode)} of slot {ref.slot} (offset {int(off)}) "
                       f"failed: {os.strerror(-int(res))}", self._files.name_of(fd))

    def write_errors(self, refs, batch: SlotBatch, durable: bool) -> list[Exception | None]:
        """Per-ref write outcome; with `durable`, one fdatasync per file written."""
        errors: list[Exception | None] = [None] * len(refs)
        res, fds, offs = batch.res, batch.fds, batch.offsets
        for i in np.flatnonzero(res < 0):
            errors[i] = self.error(OP_WRITE, res[i], fds[i], offs[i], refs[i])
        if durable:
            self.fdatasync(refs, fds, errors)
        return errors

    def fdatasync(self, refs, fds, errors: list) -> None:
        """fdatasync every file that a successful write of `refs` touched (one op per
        file, as one ring batch); a failed sync fails every write to its file
        (`errors` is updated in place: fds[i] is the file of refs[i])."""
        touched = sorted({int(fds[i]) for i in range(len(refs)) if errors[i] is None})
        if not touched:
            return
        device_of = self._files.fd_device.get     # (0: a file this rank did not open)
        tdev = np.array([device_of(fd, 0) for fd in touched], dtype=np.int64)

        def call(d, idx):   # each device syncs its own files, all devices at once
            res = self._rings.rings[d].submit(OP_FDATASYNC, touched if idx is None
                                             else [touched[i] for i in idx], None, None, None)
            self._health.note_errors(d, "fdatasync", res)
            return res
        sres = self.fan(tdev, call)
        bad = {touched[i]: -int(sres[i]) for i in np.flatnonzero(sres < 0)}
        if not bad:
            return
        for i in range(len(refs)):
            if errors[i] is None and int(fds[i]) in bad:
                err = bad[int(fds[i])]
                errors[i] = OSError(err, f"fdatasync after writing slot {refs[i].slot} failed: "
                                    f"{os.strerror(err)}")

    def read_errors(self, refs, batch: SlotBatch, parts, check_payload) -> list[Exception | None]:
        """Per-slot errors of a read batch: None, the OSError of a failed read, or, for a
        slot the ring's C checker refused (SlotCheck code in `status`), the CorruptSlot
        that decoding the same bytes in Python raises (`parts(i)`: header, payload views)."""
        res, status = batch.res, batch.status
        out: list[Exception | None] = [None] * len(refs)
        for i in np.flatnonzero((res < 0) | (status != 0)):
            ref = refs[i]
            if res[i] < 0:
                out[i] = self.error(OP_READ, res[i], batch.fds[i], batch.offsets[i], ref)
                continue
            header, payload = parts(i)
            try:
                _slotfile.verify_parts(header, payload, ref.key, ref.slot, ref.generation,
                                       self.payload_len, check_payload)
                out[i] = CorruptSlot(f"slot {ref.slot}: refused by the slot checker "
                                     f"(code {int(status[i])})", key=ref.key, slot=ref.slot)
            except CorruptSlot as exc:
                out[i] = exc
        return out

    # -- the double buffer of the batch loops ----------------------------------------
    def pipeline(self, nchunks: int, ring_op, after, before=None, *, overlap: bool,
                 streamed: bool = False) -> None:
        """The double buffer of every batch loop (writes, reads, scans).

        Chunk k is prepared by `before(k)` (this thread; writes fill its staging), moved
        by `ring_op(k)` and finished by `after(k, result)` (this thread; reads verify
        and drain it). With `overlap` (two staging areas, chunk k in area k % 2) the ring
        op runs on the ring thread while this thread finishes chunk k-1 and prepares
        chunk k+1; an area is reused two chunks later, after its `after` returned.
        Without it (one area, or one chunk: nothing to overlap) everything runs here, in
        order. The ring is used by one thread at a time, and no ring op is still running
        when this returns or raises.

        `streamed`: ring_op(k) starts chunk k on the device streams and returns at once
        (`slot_io(stream=True)`), so chunk k+1's ops are in each device's ring before
        chunk k's tail drains, and no submitter thread is needed.
        """
        if not overlap or nchunks < 2:
            for k in range(nchunks):
                if before is not None:
                    before(k)
                res = ring_op(k)
                after(k, res.result() if streamed else res)
            return
        pool = None if streamed else self._rings.submitter()
        inflight: list = []   # (k, future), oldest first, at most two
        try:
            for k in range(nchunks):
                if before is not None:
                    before(k)
                inflight.append((k, ring_op(k) if streamed else pool.submit(ring_op, k)))
                if len(inflight) == 2:
                    j, fut = inflight.pop(0)
                    after(j, fut.result())
            while inflight:
                j, fut = inflight.pop(0)
                after(j, fut.result())
        finally:
            for _, fut in inflight:   # before/after raised: let the ring thread finish first
                _settle(fut)
