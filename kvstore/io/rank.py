"""RankIO: one rank's data path between host memory and its fixed-slot files.

Batches of slot images are written (stamped by the ring, then made durable by one
fdatasync per file) and read (checked by the ring as each completes), through the rank's
staging memory (`kvstore.io.staging.Staging`) or straight from and into the caller's
memory; batch loops are double-buffered, so that the ring works on one chunk while the
caller fills or drains the other. vLLM workers use only this (they never open LMDB);
`DiskStore` opens one per rank for tools and tests. Never touches the index and never
imports vLLM or torch.

RankIO is the entry points; its parts: `RankFiles` (files.py: the slot files on each
device, where a slot lives), `DeviceHealth` (health.py: failed devices, EIO accounting,
probes, patrol reads), `DeviceRings` (rings.py: one ring per device, rebuilt when it
closed itself, the device threads), `Batches` (batches.py: one batch over the devices,
its per-op errors, the double buffer) and `CallerMemory` (callermem.py: slots moved
straight from and into the caller's memory).
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

from kvstore import _slotfile
from kvstore.errors import ConfigError, CorruptSlot, StoreClosed
from kvstore.format.layout import HEADER_SIZE, Layout, check_layout, device_dirs, read_fingerprint
from kvstore.io.batches import Batches, SlotBatch
from kvstore.io.callermem import CallerMemory, check_addrs, check_registrable, payload_addrs
from kvstore.io.files import RankFiles
from kvstore.io.health import EIO_LIMIT, EIO_WINDOW_S, DeviceHealth, fence_reason_of
from kvstore.io.iostats import OP_READ, OP_WRITE
from kvstore.io.records import SlotRef, ref_slots
from kvstore.io.rings import DeviceRings, ring_depth
from kvstore.io.staging import Staging

__all__ = ["IO_MODES", "VERIFY_MODES", "RankIO", "check_choice", "fence_reason_of"]

IO_MODES = ("direct", "page_cache")
VERIFY_MODES = ("checksum", "header")
_VERIFY_CODE = {"header": 1, "checksum": 2}   # Ring.slot_io's verify levels


def check_choice(name, value, choices):
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {', '.join(choices)}")


class RankIO:
    """One rank's slot files, io_uring rings (one per device) and staging memory.

    Moves slot images (header + payload) between host memory and disk in batches.
    Writes are made durable with one batched fdatasync through the ring before they
    return success, so the caller may commit. Reads verify each slot against (key, slot,
    generation) and, with verify='checksum', the payload checksum; a bad slot is
    reported per block, never handed to the caller. The write and verified-read entry
    points return one entry per block: None, or that block's error.

    Entry points, by where the payloads are:
    - staging slots the caller manages: `write_staged`, `read_staged` (one batch),
      `read_pipelined` (chunks through one or two staging areas);
    - staging managed here, through callbacks: `write_blocks`, `read_blocks`;
    - caller memory: `write_from`/`read_into` (rows of an array, or buffers),
      `write_at`/`read_at` (addresses);
    - unverified reads for fsck and index rebuilds: `read_headers`, `scan_slots`.
    """

    HEADER_BATCH = 1024   # slots per ring batch for caller-memory transfers (4 MiB of headers)

    def __init__(self, store_dir: str, rank: int = 0, *, layout: Layout | None = None,
                 io_mode: str = "direct", queue_depth: int = 32, staging_bytes: int = 64 << 20,
                 readonly: bool = False, staging: Staging | None = None,
                 missing_ok: bool = False, eio_limit: int = EIO_LIMIT,
                 eio_window_s: float = EIO_WINDOW_S, thread_cpus: frozenset[int] | None = None,
                 thread_nice: int = 0, inflight_bytes: int = 0):
        check_choice("io_mode", io_mode, IO_MODES)
        if missing_ok and not readonly:
            raise ConfigError("RankIO: missing_ok=True is only for readonly openers (fsck)")
        stored, geo, doc = read_fingerprint(store_dir)
        if layout is not None:
            check_layout(store_dir, stored, layout)
        if not 0 <= rank < stored.tp_size:
            raise ConfigError(f"rank {rank} out of range: store has tp_size={stored.tp_size}")
        self.store_dir = store_dir
        self.rank = rank
        self.thread_cpus = thread_cpus   # where this rank's threads run (None: anywhere)
        self.thread_nice = thread_nice   # and how much below the process's priority
        self._direct = io_mode == "direct"
        self.layout = stored
        self.geometry = geo
        self.payload_len = stored.block_bytes
        self.slot_size = geo.slot_size
        # One device per data directory (the store directory itself for a single-directory
        # store); slot s lives on device s % ndev. Each device has its own files and ring.
        self.dirs = device_dirs(store_dir, doc)
        self.ndev = len(self.dirs)
        # slots in flight per ring: the queue depth, raised to hold `inflight_bytes`
        self.queue_depth = ring_depth(geo.slot_size, queue_depth, inflight_bytes)
        self._own_staging = staging is None
        self.staging = None
        self._files = self._rings = self._batches = self._caller = None
        self._health = DeviceHealth(rank, store_dir, self.dirs, direct=self._direct,
                                    readonly=readonly, eio_limit=eio_limit,
                                    eio_window_s=eio_window_s, thread_cpus=thread_cpus,
                                    thread_nice=thread_nice)
        try:
            self._files = RankFiles(store_dir, rank, geo, self.dirs, direct=self._direct,
                                    readonly=readonly, missing_ok=missing_ok,
                                    fail=self._health.fail)
            self._health.watch(self._files)
            if staging is None:
                staging = Staging.for_bytes(staging_bytes, geo.slot_size, self.payload_len)
            elif staging.slot_size != geo.slot_size or staging.payload_len != self.payload_len:
                raise ConfigError(f"staging slots of {staging.slot_size} bytes ({staging.payload_len}-byte "
                                  f"payloads) do not fit this store's {geo.slot_size}-byte slots")
            self.staging = staging
            self.staging_slots = staging.num_slots
            self._rings = DeviceRings(self._files, staging.buffer, self.queue_depth, rank=rank,
                                      thread_cpus=thread_cpus, thread_nice=thread_nice)
            self._batches = Batches(self._files, self._rings, self._health,
                                    payload_len=self.payload_len, direct=self._direct, rank=rank)
            self._caller = CallerMemory(self._batches, self.payload_len)
        except BaseException:
            self.close()
            raise

    # -- state ------------------------------------------------------------------------
    @property
    def files(self) -> list:
        """The open slot files (`SlotFile`), every device's."""
        return self._files.files if self._files is not None else []

    @property
    def bad_files(self) -> dict[int, str]:
        """missing_ok (fsck): slot files that cannot be opened (missing, wrong size,
        symlink), file number (`StoreGeometry.file_number`) -> reason; every I/O on their
        slots fails EBADF."""
        return self._files.bad_files if self._files is not None else {}

    @property
    def rings(self) -> list:
        """The ring of each device ([] once closed)."""
        return self._rings.rings if self._rings is not None else []

    @property
    def ring(self):
        """The ring of device 0 (the only one of a single-directory store)."""
        return self.rings[0] if self.rings else None

    @ring.setter
    def ring(self, value):   # a test seam: replace device 0's ring
        self.rings[0] = value

    def device_ring(self, device: int):
        return self.rings[device]

    @property
    def failed(self) -> dict[int, str]:
        """Failed devices (several data directories only): device -> "reason: detail"."""
        return self._health.failed

    @property
    def io_errors(self) -> np.ndarray:
        """Failed ops per device, ever."""
        return self._health.io_errors

    @property
    def io_bytes(self) -> np.ndarray:
        """Bytes this opener moved, per device: [read, written]."""
        return self._batches.io_bytes

    @property
    def eio_limit(self) -> int:
        return self._health.eio_limit

    @eio_limit.setter
    def eio_limit(self, value: int):
        self._health.eio_limit = value

    @property
    def eio_window_s(self) -> float:
        return self._health.eio_window_s

    @eio_window_s.setter
    def eio_window_s(self, value: float):
        self._health.eio_window_s = value

    def check_devices(self) -> list[int]:
        """Look for devices that failed while serving (`DeviceHealth.check_devices`);
        returns the devices found missing now. The worker's I/O thread calls it every
        few seconds."""
        return self._health.check_devices()

    def wait_probes(self, timeout: float = 10.0) -> None:
        """Wait for the device probes running now (tests)."""
        self._health.wait_probes(timeout)

    def locate(self, slots: Sequence[int]):
        """(fds, offsets, devices) of global slots (`RankFiles.place`)."""
        p = self._files.place(slots)
        return p.fds, p.offsets, p.devices

    # Test seams (tests/io/): the parts' state under the names the tests use.
    @property
    def _fd_table(self):
        return self._files.fd_table

    @property
    def _patrols(self):
        return self._health.patrols

    @property
    def _patrol_failing(self):
        return self._health.patrol_failing

    @property
    def _probes(self):
        return self._health.probes

    def _patrol(self, d: int) -> None:
        self._health.patrol(d)

    def _device_streams(self):
        return self._rings.streams()

    def close(self):
        """Close rings, files and owned staging memory (idempotent)."""
        self._health.stop()     # no patrol reads a file or counts an error from here on
        if self._rings is not None:
            self._rings.close()
        if self._files is not None:
            self._files.close()
        if self._caller is not None:
            self._caller.close()
        if self.staging is not None:
            if self._own_staging:
                self.staging.close()
            self.staging = None

    @property
    def closed(self) -> bool:
        return not self.rings

    def _check_open(self):
        """Refuse a closed RankIO; every operation starts here, and takes its rings open
        (`DeviceRings.ensure_open`)."""
        rings = self._rings
        if not rings.rings:
            raise StoreClosed(f"RankIO for rank {self.rank} of {self.store_dir} is closed")
        rings.ensure_open()

    def payload_view(self, i: int) -> np.ndarray:
        """Staging payload area of staging slot i (uint8, block_bytes long)."""
        return self.staging.payload_view(i)

    def slot_view(self, i: int) -> np.ndarray:
        return self.staging.slot_view(i)

    # -- slots in staging ---------------------------------------------------------------
    def _staged(self, opcode, refs, stage_slots, verify: int = 0, *, stream: bool = False):
        """Move refs[i] between disk and staging slot stage_slots[i] (header + payload
        adjacent: one fixed-buffer op per slot); `Batches.slot_io`."""
        stage = np.asarray(stage_slots, dtype=np.uint64)
        hdrs = np.uint64(self.staging.address) + stage * np.uint64(self.slot_size)
        return self._batches.slot_io(opcode, refs, hdrs, None, verify, stream=stream)

    def _staged_errors(self, refs, stage_slots, batch: SlotBatch, check_payload) -> list[Exception | None]:
        """Errors of a checked read batch into staging slots."""
        def parts(i):
            img = self.slot_view(stage_slots[i])
            return img[:HEADER_SIZE], img[HEADER_SIZE:]
        return self._batches.read_errors(refs, batch, parts, check_payload)

    def write_staged(self, refs: Sequence[SlotRef], stage_slots: Sequence[int], *,
                     durable: bool = True) -> list[Exception | None]:
        """Write refs[i] from staging slot stage_slots[i] (payload already in place).

        Stamps each header (key, slot, generation, payload checksum), submits the whole
        batch, then fdatasyncs every touched file through the ring when `durable`.
        Returns None per written (durable) slot, else the error.
        """
        self._check_open()
        errors: list[Exception | None] = [None] * len(refs)
        if not refs:
            return errors
        batch = self._staged(OP_WRITE, refs, stage_slots)
        return self._batches.write_errors(refs, batch, durable)

    def read_staged(self, refs: Sequence[SlotRef], stage_slots: Sequence[int], *,
                    verify: str = "checksum") -> list[Exception | None]:
        """Read refs[i] into staging slot stage_slots[i] and verify it, as one batch.

        None per verified slot; an OSError or CorruptSlot otherwise (never both data and
        an error: a failed slot's staging bytes must not be used).
        """
        self._check_open()
        check_choice("verify", verify, VERIFY_MODES)
        errors: list[Exception | None] = [None] * len(refs)
        if not refs:
            return errors
        batch = self._staged(OP_READ, refs, stage_slots, _VERIFY_CODE[verify])
        return self._staged_errors(refs, stage_slots, batch, verify == "checksum")

    def write_blocks(self, refs: Sequence[SlotRef], fill: Callable[[int, int, list[np.ndarray]], None],
                     *, durable: bool = True) -> list[Exception | None]:
        """Write blocks: `fill(start, stop, views)` puts payloads of refs[start:stop] into views.

        Returns one entry per ref: None when the slot is written (and durable), else the
        error. Double-buffered: the next chunk is filled while the previous one is stamped
        and written by the ring; one fdatasync per touched file at the end. The refs must
        name distinct slots (consecutive chunks are in flight together, in no order).
        """
        self._check_open()
        if len(set(ref_slots(refs))) != len(refs):
            raise ValueError("write_blocks: a slot appears twice in one batch (its two writes "
                             "would race); write one key per slot")
        errors: list[Exception | None] = [None] * len(refs)
        fds_all = np.full(len(refs), -1, dtype=np.int64)
        # Chunks of refs and the staging half each one uses (double buffering).
        half = max(1, self.staging_slots // 2)
        chunks = [(start, min(len(refs), start + half),
                   (k % 2) * half if self.staging_slots >= 2 else 0)
                  for k, start in enumerate(range(0, len(refs), half))]

        def before(k):
            start, stop, base = chunks[k]
            fill(start, stop, [self.payload_view(i) for i in range(base, base + stop - start)])

        def ring_op(k):
            start, stop, base = chunks[k]
            return self._staged(OP_WRITE, refs[start:stop], range(base, base + stop - start),
                                stream=True)

        def after(k, batch):
            start, stop, _ = chunks[k]
            fds_all[start:stop] = batch.fds
            for i in np.flatnonzero(batch.res < 0):
                errors[start + i] = self._batches.error(OP_WRITE, batch.res[i], batch.fds[i],
                                                        batch.offsets[i], refs[start + i])

        self._batches.pipeline(len(chunks), ring_op, after, before,
                               overlap=self.staging_slots >= 2, streamed=True)
        if durable:
            self._batches.fdatasync(refs, fds_all, errors)
        return errors

    def read_blocks(self, refs: Sequence[SlotRef], drain: Callable[[int, int, list[np.ndarray], list], None],
                    *, verify: str = "checksum") -> list[Exception | None]:
        """Read and verify blocks; `drain(start, stop, views, errors)` consumes the payloads.

        `errors[i]` (for refs[start + i]) is None for a verified block and the error
        otherwise; drain must not use the view of a failed block. Double-buffered: the
        next chunk is read while this one is verified and drained.
        """
        half = max(1, self.staging_slots // 2)
        # Chunks small enough that even one request's prefix is split in a few (so its
        # verification and copy-out overlap the next chunk's read), but never below the
        # ring's queue depth (or the device would idle between chunks).
        n = len(refs)
        # (Every device's queue counts: a chunk spreads over all of them.)
        qd = (self.ring.queue_depth if self.ring else 32) * self.ndev
        chunk = max(1, min(half, max(qd, -(-n // 4))))
        areas = [list(range(chunk))] if self.staging_slots < 2 else [list(range(chunk)), list(range(half, half + chunk))]

        def consume(start, stop, slots, errs):
            drain(start, stop, [self.payload_view(i) for i in slots], errs)
        return self.read_pipelined(refs, areas, consume, verify=verify)

    def read_pipelined(self, refs: Sequence[SlotRef], areas: Sequence[Sequence[int]],
                       consume: Callable[[int, int, Sequence[int], list], None], *,
                       verify: str = "checksum") -> list[Exception | None]:
        """Read refs through one or two staging areas (lists of staging slots), verified.

        Chunk k goes to areas[k % len(areas)]; with two areas the read of chunk k+1 runs
        on the device streams while `consume(start, stop, stage_slots, errors)` handles
        chunk k here. Every chunk has moved before this returns.
        """
        self._check_open()
        check_choice("verify", verify, VERIFY_MODES)
        step = min(len(a) for a in areas)
        plan = [(start, min(len(refs), start + step), areas[k % len(areas)][:step])
                for k, start in enumerate(range(0, len(refs), step))]
        errors: list[Exception | None] = []
        vcode = _VERIFY_CODE[verify]

        def ring_op(k):
            start, stop, slots = plan[k]
            return self._staged(OP_READ, refs[start:stop], slots[:stop - start], vcode,
                                stream=True)

        def after(k, batch):
            start, stop, slots = plan[k]
            chunk = refs[start:stop]
            used = slots[:len(chunk)]
            chunk_errors = self._staged_errors(chunk, used, batch, verify == "checksum")
            consume(start, stop, used, chunk_errors)
            errors.extend(chunk_errors)

        self._batches.pipeline(len(plan), ring_op, after, overlap=len(areas) > 1, streamed=True)
        return errors

    # -- slots whose payload lives in caller memory (no staging copy) ----------------
    def register_memory(self, *buffers) -> bool:
        """Register caller memory that write_from/read_into will move slots from/into
        (writable, C-contiguous; e.g. the rows of a pinned host region), together with
        staging and kvstore's header memory. Slots whose payload lies in it then move as
        two fixed-buffer ops (header, payload) instead of a readv/writev: the kernel pins
        those pages once here instead of on every I/O. Replaces earlier registrations;
        call it while this RankIO has no I/O in flight, and keep the memory alive until
        `unregister_memory()` or close. Returns False (and keeps plain I/O) when the
        kernel refuses the registration."""
        self._check_open()
        buffers = check_registrable(buffers)
        ok = self._rings.register([self.staging.buffer, self._caller.header_pool(self.HEADER_BATCH),
                                   *buffers])
        if not ok:
            self._rings.register([self.staging.buffer])
        return ok

    def unregister_memory(self) -> None:
        """Drop caller memory registered with `register_memory` (staging stays)."""
        self._check_open()
        self._rings.register([self.staging.buffer])

    def write_from(self, refs: Sequence[SlotRef], payloads, *, durable: bool = True) -> list[Exception | None]:
        """Write blocks straight from caller memory (no staging copy).

        `payloads`: a 2-D array with one row per ref, or a sequence of buffers, each
        holding the payload rounded up to 4096 bytes (4096-aligned for O_DIRECT). The ring
        stamps each header and writes header + payload as one writev. Returns None per
        written (durable) ref, else the error.
        """
        self._check_open()
        caller = payload_addrs(payloads, len(refs), self.slot_size - HEADER_SIZE,
                               self.payload_len, self._direct, writable=False)
        return self._caller.write(refs, caller.addrs, durable, self.HEADER_BATCH)

    def read_into(self, refs: Sequence[SlotRef], payloads, *, verify: str = "checksum") -> list[Exception | None]:
        """Read and verify blocks straight into caller memory (no staging copy).

        `payloads` as for `write_from` (writable). Each slot is one readv (header into
        kvstore's header memory, payload into the caller's buffer), checked by the ring as
        it completes. Returns None per verified block, else its OSError or CorruptSlot: the
        caller's bytes for a failed block are undefined and must not be used.
        """
        self._check_open()
        check_choice("verify", verify, VERIFY_MODES)
        caller = payload_addrs(payloads, len(refs), self.slot_size - HEADER_SIZE,
                               self.payload_len, self._direct, writable=True)
        return self._caller.read(refs, caller.addrs, _VERIFY_CODE[verify], verify == "checksum",
                                 self.HEADER_BATCH)

    def write_at(self, refs: Sequence[SlotRef], addrs, *, durable: bool = True) -> list[Exception | None]:
        """`write_from` of payloads given by address: addrs[i] (uint64) is where refs[i]'s
        payload starts, in memory the caller keeps alive and unchanged until this returns,
        each holding the payload rounded up to 4096 bytes (4096-aligned for O_DIRECT). For
        payloads that are not the rows of one strided array (a secondary tier's primary
        chunks, in the order a job names them): no Python object per block."""
        self._check_open()
        return self._caller.write(refs, check_addrs(addrs, len(refs), self._direct), durable,
                                  self.HEADER_BATCH)

    def read_at(self, refs: Sequence[SlotRef], addrs, *, verify: str = "checksum") -> list[Exception | None]:
        """`read_into` of payloads given by address (as `write_at`; the memory must be
        writable). None per verified block, else its OSError or CorruptSlot: the bytes at
        a failed block's address are undefined and must not be used."""
        self._check_open()
        check_choice("verify", verify, VERIFY_MODES)
        addrs = check_addrs(addrs, len(refs), self._direct)
        return self._caller.read(refs, addrs, _VERIFY_CODE[verify], verify == "checksum",
                                 self.HEADER_BATCH)

    # -- unverified reads (fsck, index rebuild) -------------------------------------------
    def read_headers(self, slots: Sequence[int]) -> list:
        """Read slot headers only (for fsck): SlotHeader, or the exception, per slot."""
        self._check_open()
        out = []
        # A header is the first 4096 bytes; read whole slots only when needed (fsck --deep).
        step = self.staging.nbytes // HEADER_SIZE
        stage_np = self.staging.numpy()
        for start in range(0, len(slots), step):
            chunk = list(slots[start:start + step])
            places = self._files.place(chunk)
            n = len(chunk)
            addrs = self.staging.address + np.arange(n, dtype=np.uint64) * np.uint64(HEADER_SIZE)
            res = self._batches.submit(OP_READ, places, addrs, np.full(n, HEADER_SIZE, np.uint32))
            for i, s in enumerate(chunk):
                if res[i] < 0:
                    out.append(OSError(-int(res[i]), os.strerror(-int(res[i]))))
                    continue
                try:
                    out.append(_slotfile.decode_header(stage_np[i * HEADER_SIZE:(i + 1) * HEADER_SIZE], s))
                except CorruptSlot as exc:
                    out.append(exc)
        return out

    def scan_slots(self, slots: Sequence[int], consume: Callable[[int, int, list[np.ndarray], np.ndarray], None],
                   *, overlap: bool = True) -> None:
        """Read whole slot images (header + payload) of `slots`, unverified (fsck --deep,
        index rebuild): `consume(start, stop, images, results)` gets uint8 views of the
        images of slots[start:stop] (valid only during the call) and, per slot, the bytes
        read or -errno. With `overlap`, staging memory is split in two halves and the ring
        reads the next batch on a helper thread while `consume` runs on this one, so a
        checksumming consumer does not leave the device idle. The ring is only ever used
        by one thread at a time.
        """
        self._check_open()
        slots = np.asarray(slots, dtype=np.int64)
        n = len(slots)
        if n == 0:
            return
        per = self.staging_slots // 2 if overlap and self.staging_slots >= 2 else self.staging_slots
        lens = np.full(per, self.slot_size, dtype=np.uint32)

        two = per < self.staging_slots   # two areas of `per` slots: overlap

        def base(k):
            return (k % 2) * per if two else 0

        def ring_op(k):
            chunk = slots[k * per:(k + 1) * per]
            places = self._files.place(chunk)
            addrs = self.staging.address + (np.arange(base(k), base(k) + len(chunk), dtype=np.uint64)
                                            * np.uint64(self.slot_size))
            return self._batches.submit(OP_READ, places, addrs, lens[:len(chunk)])

        def after(k, res):
            start, stop = k * per, min(n, (k + 1) * per)
            consume(start, stop, [self.slot_view(base(k) + j) for j in range(stop - start)], res)

        self._batches.pipeline(-(-n // per), ring_op, after, overlap=two)
