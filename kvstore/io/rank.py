"""RankIO: one rank's slot files, io_uring ring and staging memory.

Owns the data path of one TP rank between its staging memory (`kvstore.io.staging.Staging`)
and its fixed-slot files: batches of slot images written (stamped by the ring, then made
durable by one fdatasync per file) and read (checked by the ring as each completes),
double-buffered so that the ring works on one chunk while the caller fills or drains
the other. vLLM workers use only this (they never open LMDB); `DiskStore` opens one per
rank for tools and tests. Never touches the index and never imports vLLM or torch.
"""
from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import threading
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np

from kvstore import _slotfile
from kvstore._hostbuf import HostBuffer
from kvstore._ring import Ring
from kvstore._slotfile import SlotFile
from kvstore.io.datadirs import check_dir, probe_data_dir
from kvstore.io.device_stream import DeviceStream
from kvstore.errors import AlignmentError, ConfigError, CorruptSlot, KVStoreError, StoreClosed
from kvstore.format.layout import HEADER_SIZE, Layout, check_layout, device_dirs, read_fingerprint
from kvstore.io.staging import Staging
from kvstore.io.iostats import OP_READ, OP_WRITE, IOCounters
from kvstore.io.paths import rank_dir, slot_file_path
from kvstore.io.records import SlotRef, ref_parts, ref_slots
from kvstore.io.threads import make_thread

log = logging.getLogger("kvstore.io.rank")


IO_MODES = ("direct", "page_cache")
VERIFY_MODES = ("checksum", "header")
_VERIFY_CODE = {"header": 1, "checksum": 2}   # Ring.slot_io's verify levels
# Errors that mean "this device may have failed" (a store over several data directories
# fences the device: a device gone or a read-only remount at once, EIO from the media or
# the controller past EIO_LIMIT or a failed probe, below); anything else (ENOSPC, EINVAL,
# a bad checksum...) fails only the block it hit.
DEVICE_ERRNOS = frozenset({errno.EIO, errno.ENODEV, errno.ENXIO, errno.EROFS, errno.ESHUTDOWN})
# A device fails on its first ENODEV/ENXIO/EROFS/ESHUTDOWN (gone, or remounted read-only),
# and on EIO once EIO_LIMIT ops failed with it within EIO_WINDOW_S (the rule ZFS's fault
# agent applies to a vdev: 10 I/O errors in 10 minutes). Below that, an EIO costs only its
# block: a load recomputes it (and drops the entry), a store does not commit it.
EIO_LIMIT = 10
EIO_WINDOW_S = 600.0
# An EIO below the limit probes its device (`datadirs.probe_data_dir`: the data directory
# and its marker, a file created, written with O_DIRECT, fdatasynced and read back), at
# most once per PROBE_EVERY_S per device: a device that fails the probe (a file system
# shut down after a media error, a drive gone) is fenced at once, not after ten errors.
# The probe runs on a thread of its own (a sick device may hang on it: no batch waits).
PROBE_EVERY_S = 1.0


def device_fault_reason(err: int) -> str:
    """The fence reason of a device errno ("readonly" for EROFS, else "io_error")."""
    return "readonly" if err == errno.EROFS else "io_error"


FENCE_REASONS = ("io_error", "missing", "readonly", "foreign")


def fence_reason_of(failure: str) -> str:
    """The fence reason of a `RankIO.failed` text ("REASON: detail", as the worker also
    reports it to the scheduler): one of FENCE_REASONS, "io_error" for anything else."""
    reason = str(failure).split(":", 1)[0]
    return reason if reason in FENCE_REASONS else "io_error"


def _host_array(x):
    """A CPU torch tensor as the numpy array sharing its memory; anything else unchanged.
    Device memory is refused: the ring can only move host memory."""
    if type(x).__module__.startswith("torch") and hasattr(x, "data_ptr"):
        if x.device.type != "cpu":
            raise TypeError(f"payloads must be host memory, not a {x.device.type} tensor: copy "
                            "through pinned host memory (the connector uses staging for this)")
        return x.detach().numpy()
    return x


def _settle(fut) -> None:
    """Wait for a ring future whatever its outcome (its error is the caller's to report)."""
    try:
        fut.result()
    except BaseException:
        pass


class _Spread:
    """One batch's device parts in flight (`RankIO._spread`): `result()` waits for every
    part (the first error is raised once all of them have ended) and returns the per-op
    results (an array, or a tuple of arrays) in batch order, passed through `then`."""

    def __init__(self, n: int, dead: list, futs: list, then=None):
        self.n = n
        self.dead = dead     # (positions, result) of parts that never reached a ring
        self.futs = futs     # (positions, Future), positions None: the whole batch
        self._then = then

    def then(self, fn) -> "_Spread":
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


def _view_at(addr: int, nbytes: int) -> np.ndarray:
    """A uint8 view of nbytes at a raw address (caller memory that is alive for the call)."""
    import ctypes
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def check_choice(name, value, choices):
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {', '.join(choices)}")


class RankIO:
    """One rank's slot files, io_uring ring and staging memory.

    Moves slot images (header + payload) between staging memory and disk in batches of
    at most `staging_slots` slots. Writes are made durable with one batched fdatasync
    through the ring before `write_blocks` returns success, so the caller may commit.
    Reads verify each slot against (key, slot, generation) and, with verify='checksum',
    the payload checksum; a bad slot is reported per block, never handed to the caller.
    """

    def __init__(self, store_dir: str, rank: int = 0, *, layout: Layout | None = None,
                 io_mode: str = "direct", queue_depth: int = 32, staging_bytes: int = 64 << 20,
                 readonly: bool = False, staging: Staging | None = None,
                 missing_ok: bool = False, eio_limit: int = EIO_LIMIT,
                 eio_window_s: float = EIO_WINDOW_S, thread_cpus: frozenset[int] | None = None,
                 thread_nice: int = 0):
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
        self.queue_depth = queue_depth
        self.files: list[SlotFile] = []
        # missing_ok (fsck): slot files that cannot be opened (missing, wrong size, symlink)
        # are listed here, file number (`StoreGeometry.file_number`) -> reason, and every
        # I/O on their slots fails EBADF.
        self.bad_files: dict[int, str] = {}
        self.rings: list = []
        # What every ring has registered as its buffers (`Ring.register_buffers`): staging,
        # and with `register_memory` kvstore's header memory and the caller's memory. A
        # ring rebuilt after it closed itself registers the same (`_ring_for_use`).
        self._ring_buffers: list = []
        self._own_staging = staging is None
        self.staging = None
        self._headers = None   # header memory of caller-memory transfers (read_into/write_from)
        self._pool = None
        self._streams: list[DeviceStream] | None = None
        self._streams_lock = threading.Lock()   # built once, whichever thread asks first
        self._counters: list[IOCounters | None] = []
        # bytes this opener moved, per device: [read, written]
        self.io_bytes = np.zeros((self.ndev, 2), dtype=np.int64)
        nf0 = geo.num_files
        self._fd_table = np.full((self.ndev, nf0), -1, dtype=np.int32)
        self._fd_dev: dict[int, int] = {}
        # Failed devices (several data directories only): device -> "reason: detail".
        # No op is submitted to a failed device any more: its ops fail with EIO at once.
        # A writable opener (a serving worker) opens a store whose device is missing or
        # read-only with that device failed instead of refusing to start.
        self.failed: dict[int, str] = {}
        self._lock_failed = threading.Lock()
        if eio_limit < 1 or not (math.isfinite(eio_window_s) and eio_window_s > 0):
            raise ConfigError(f"RankIO: eio_limit must be >= 1 and eio_window_s > 0, got "
                              f"{eio_limit} and {eio_window_s}")
        self.eio_limit = eio_limit
        self.eio_window_s = eio_window_s
        self._eio_times = [deque() for _ in self.dirs]     # recent EIOs per device
        self._probed_at = [float("-inf")] * len(self.dirs)   # last probe after an EIO
        self._probes: dict[int, threading.Thread] = {}       # probes running, per device
        self._readonly = readonly
        self.io_errors = np.zeros(self.ndev, dtype=np.int64)   # failed ops per device, ever
        self._markers: dict[int, tuple[int, int]] = {}
        self._patrols: dict[int, threading.Thread] = {}   # patrol reads running, per device
        self._patrol_bufs: dict[int, mmap.mmap] = {}
        self._patrol_lock = threading.Lock()
        self._patrol_failing: set[int] = set()            # devices whose last patrol failed
        tolerate = not readonly and self.ndev > 1
        try:
            dev_files: list[list[SlotFile]] = []
            for d, ddir in enumerate(self.dirs):
                try:
                    check_dir(rank_dir(ddir, rank))
                    dir_error = None
                except KVStoreError as exc:
                    if tolerate:
                        self._fail_device(d, "missing", str(exc))
                        dev_files.append([])
                        self._counters.append(None)
                        continue
                    if not missing_ok:
                        raise
                    dir_error = str(exc)
                if tolerate and (mark := self._marker_id(ddir)) is not None:
                    self._markers[d] = mark     # watched while serving (check_devices)
                mine = []
                for i in range(geo.device_files(d)):
                    if dir_error is not None:
                        self.bad_files[d * nf0 + i] = dir_error
                        continue
                    try:
                        f = SlotFile(slot_file_path(ddir, rank, i), geo.slot_size,
                                     geo.device_file_slots(d, i), direct=(io_mode == "direct"),
                                     readonly=readonly)
                    except (KVStoreError, OSError) as exc:
                        if tolerate:
                            err = getattr(exc, "errno", None)
                            self._fail_device(d, "readonly" if err == errno.EROFS else "missing",
                                              str(exc))
                            break
                        if not missing_ok:
                            raise
                        self.bad_files[d * nf0 + i] = str(exc)
                        continue
                    self.files.append(f)
                    mine.append(f)
                    self._fd_table[d, i] = f.fd
                    self._fd_dev[f.fd] = d
                if d in self.failed:
                    for f in mine:
                        self.files.remove(f)
                        self._fd_dev.pop(f.fd, None)
                        f.close()
                    self._fd_table[d, :] = -1
                    mine = []
                dev_files.append(mine)
                self._counters.append(None if readonly or dir_error is not None or d in self.failed
                                      else self._open_counters(ddir, rank))
            if staging is None:
                staging = Staging.for_bytes(staging_bytes, geo.slot_size, self.payload_len)
            elif staging.slot_size != geo.slot_size or staging.payload_len != self.payload_len:
                raise ConfigError(f"staging slots of {staging.slot_size} bytes ({staging.payload_len}-byte "
                                  f"payloads) do not fit this store's {geo.slot_size}-byte slots")
            self.staging = staging
            self.staging_slots = staging.num_slots
            self._ring_buffers = [staging.buffer]
            for d in range(self.ndev):
                ring = Ring(queue_depth)
                self.rings.append(ring)
                ring.register_buffers([staging.buffer])
                if dev_files[d]:
                    ring.register_files([f.fd for f in dev_files[d]], [f.path for f in dev_files[d]])
        except BaseException:
            self.close()
            raise
        self._fds = self._fd_table[0]

    @staticmethod
    def _open_counters(ddir: str, rank: int):
        try:
            return IOCounters(ddir, rank)
        except OSError as exc:
            log.warning("rank %d: cannot open the byte counters of %s (%s); bytes moved on this "
                        "device are not recorded", rank, ddir, exc)
            return None

    # -- failed devices (a store over several data directories) ----------------------
    @staticmethod
    def _marker_id(ddir: str):
        try:
            st = os.stat(os.path.join(ddir, "kvstore-data.json"))
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _fail_device(self, d: int, reason: str, detail: str) -> bool:
        """Mark device d failed (first reason kept). True when it was not failed before."""
        with self._lock_failed:
            if d in self.failed:
                return False
            self.failed[d] = f"{reason}: {detail}"
        log.error("kvstore rank %d: device %d (%s) failed (%s: %s); its blocks fail at once "
                  "from now on", self.rank, d, self.dirs[d], reason, detail)
        return True

    def _note_errors(self, d: int, op: str, res) -> None:
        """Device errnos in a batch's results (several devices only): ENODEV, ENXIO, EROFS
        or ESHUTDOWN fail the device at once; EIO once `eio_limit` ops failed with it
        within `eio_window_s` (see EIO_LIMIT)."""
        if self.ndev < 2 or d in self.failed:
            return
        bad = res[res < 0]
        if not bad.size:
            return
        self.io_errors[d] += bad.size
        if (c := self._counter(d)) is not None:
            c.add_errors(int(bad.size))
        for e in np.unique(-bad):
            e = int(e)
            if e in DEVICE_ERRNOS and e != errno.EIO:
                self._fail_device(d, device_fault_reason(e),
                                  f"{op} failed with {errno.errorcode.get(e, e)} ({os.strerror(e)})")
                return
        n = int((bad == -errno.EIO).sum())
        if not n:
            return
        now = time.monotonic()
        with self._lock_failed:
            q = self._eio_times[d]
            q.extend([now] * min(n, self.eio_limit))
            while q and now - q[0] > self.eio_window_s:
                q.popleft()
            recent = len(q)
        if recent >= self.eio_limit:
            self._fail_device(d, "io_error", f"{op} failed with EIO ({os.strerror(errno.EIO)}): "
                              f"{recent} errors within {self.eio_window_s:g} s")
        else:
            self._probe_soon(d, op)
            log.warning("kvstore rank %d: device %d (%s): %d %s(s) failed with EIO (%d of the %d "
                        "within %g s that fail the device); those blocks are recomputed",
                        self.rank, d, self.dirs[d], n, op, recent, self.eio_limit, self.eio_window_s)

    def _probe_soon(self, d: int, op: str) -> None:
        """After an EIO below the limit: probe device d on a thread of its own (unless a
        probe of it runs, or ran less than PROBE_EVERY_S ago, or this opener is read-only:
        fsck only counts); a failed probe fences it as `io_error`, the probe's verdict in
        the detail (never a reason the next start would re-admit by itself)."""
        if self._readonly:
            return
        now = time.monotonic()
        with self._lock_failed:
            running = self._probes.get(d)
            if (running is not None and running.is_alive()) or now - self._probed_at[d] < PROBE_EVERY_S:
                return
            self._probed_at[d] = now
            t = make_thread(self._probe, f"kvstore-probe-dev{d}-r{self.rank}",
                            self.thread_cpus, (d, op), self.thread_nice)
            self._probes[d] = t
        t.start()

    def _probe(self, d: int, op: str) -> None:
        try:
            why = probe_data_dir(self.dirs[d], self.store_dir, d, self._direct,
                                 tag=f"-r{self.rank}-{threading.get_ident()}")
        except Exception as exc:     # the probe itself broke: not the device's verdict
            log.warning("kvstore rank %d: probing device %d (%s) failed: %s", self.rank, d,
                        self.dirs[d], exc)
            return
        if why is not None:
            self._fail_device(d, "io_error", f"{op} failed with EIO, then the device's probe "
                              f"failed ({why[0]}: {why[1]})")

    def wait_probes(self, timeout: float = 10.0) -> None:
        """Wait for the device probes running now (tests)."""
        with self._lock_failed:
            probes = list(self._probes.values())
        for t in probes:
            t.join(timeout)

    def check_devices(self) -> list[int]:
        """Look for devices that failed while serving, traffic or not: a data directory
        that went away (an unmounted or replaced device: its `kvstore-data.json` is gone
        or is another file) fails at once; and every healthy device gets a patrol read
        (`_patrol`: one 4 KiB O_DIRECT read of its first slot header, on a thread of its
        own, so a hung device never blocks the caller): a device errno fences at once, an
        EIO asks for a probe, which fences the device if it fails. Without it a
        device that died while no block of it was asked for stayed "ok" in the metrics
        until a request happened to touch it. Returns the devices found missing now.
        Cheap (one stat and one small read per device); the worker's I/O thread calls it
        every few seconds."""
        out = []
        for d, ident in list(self._markers.items()):
            if d in self.failed:
                continue
            now = self._marker_id(self.dirs[d])
            if now != ident:
                what = "is gone" if now is None else "was replaced"
                if self._fail_device(d, "missing", f"{self.dirs[d]}/kvstore-data.json {what} "
                                     "(device unmounted?)"):
                    out.append(d)
        if self.ndev > 1 and not self._readonly and self.rings:
            for d in range(self.ndev):
                if d in self.failed or int(self._fd_table[d, 0]) < 0:
                    continue
                with self._lock_failed:
                    running = self._patrols.get(d)
                    if running is not None and running.is_alive():
                        continue    # the last patrol has not returned (a slow or hung device)
                    t = make_thread(self._patrol, f"kvstore-patrol-dev{d}-r{self.rank}",
                                    self.thread_cpus, (d,), self.thread_nice)
                    self._patrols[d] = t
                t.start()
        return out

    def _patrol(self, d: int) -> None:
        """Read device d's first slot header (4 KiB, straight from the device with
        O_DIRECT; in page-cache mode the cache may answer) into memory of its own.

        A device errno other than EIO (ENODEV, ENXIO, EROFS, ESHUTDOWN) fails the device
        at once, as a ring op's would. An EIO only asks for a probe (at most one a
        second), which decides: the patrol rereads the same sector every check, so one
        bad sector there must not add up to the EIO limit and fence a device whose other
        blocks serve. Errors are logged and counted once per run of failing patrols."""
        try:
            buf = self._patrol_bufs.get(d)
            if buf is None:
                buf = self._patrol_bufs[d] = mmap.mmap(-1, HEADER_SIZE)   # page-aligned
            with self._patrol_lock:     # a duplicate of the fd: close() may run meanwhile
                fd = int(self._fd_table[d, 0]) if self.rings else -1
                if fd < 0:
                    return
                fd = os.dup(fd)
            try:
                n = os.preadv(fd, [buf], 0)
                err = errno.EIO if n == 0 else 0    # a preallocated slot file has no EOF here
            except OSError as exc:
                err = exc.errno or errno.EIO
            finally:
                os.close(fd)
            with self._patrol_lock:     # close() closes the counters under it
                if not self.rings:
                    return
                failing = d in self._patrol_failing
                if not err:
                    if failing:
                        self._patrol_failing.discard(d)
                        log.info("kvstore rank %d: device %d (%s): the patrol read succeeds again",
                                 self.rank, d, self.dirs[d])
                    return
                if not failing:
                    self._patrol_failing.add(d)
                    log.warning("kvstore rank %d: device %d (%s): the patrol read of its first slot "
                                "failed: %s", self.rank, d, self.dirs[d], os.strerror(err))
                    self.io_errors[d] += 1
                    if (c := self._counter(d)) is not None:
                        c.add_errors(1)
            if err in DEVICE_ERRNOS and err != errno.EIO:
                self._fail_device(d, device_fault_reason(err), f"patrol read failed with "
                                  f"{errno.errorcode.get(err, err)} ({os.strerror(err)})")
            elif err == errno.EIO:
                self._probe_soon(d, "patrol read")
        except Exception as exc:    # never a traceback every few seconds from a helper thread
            log.warning("kvstore rank %d: patrol of device %d failed: %s", self.rank, d, exc)

    @property
    def ring(self):
        """The ring of device 0 (the only one of a single-directory store)."""
        return self.rings[0] if self.rings else None

    @ring.setter
    def ring(self, value):   # a test seam: replace device 0's ring
        self.rings[0] = value

    def device_ring(self, device: int):
        return self.rings[device]

    def close(self):
        """Close ring, files and owned staging memory (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._streams is not None:
            for stream in self._streams:
                stream.close()
            self._streams = None
        with self._patrol_lock:   # no patrol dups a file's fd or counts an error meanwhile
            for ring in self.rings:
                ring.close()
            self.rings = []
            self._ring_buffers = []     # (the caller's memory is no longer referenced)
            for c in self._counters:
                if c is not None:
                    c.close()
            self._counters = []
        for f in self.files:
            f.close()
        self.files = []
        self.bad_files = {}
        if self._headers is not None:
            self._headers.close()
            self._headers = None
        if self.staging is not None:
            if self._own_staging:
                self.staging.close()
            self.staging = None

    @property
    def closed(self) -> bool:
        return not self.rings

    def _check_open(self):
        """Refuse a closed RankIO; every operation starts here, and takes its rings open
        (`_ring_for_use`)."""
        if not self.rings:
            raise StoreClosed(f"RankIO for rank {self.rank} of {self.store_dir} is closed")
        for d in range(len(self.rings)):
            self._ring_for_use(d)

    def _ring_for_use(self, d: int):
        """Device d's ring, open. A ring closes itself when io_uring_enter fails with
        requests in flight (`Ring._abandon`: the call that hit it raises); the next
        operation replaces it here with a new ring of the same queue depth, the same
        buffers and the device's slot files registered, and logs a warning. The device
        threads (`DeviceStream`), which hold the old ring, are stopped and made again on
        demand. Called between operations only (no part of this RankIO in flight). When
        the rebuild fails this raises KVStoreError (the operation fails, nothing moved)
        and the next operation tries again."""
        ring = self.rings[d]
        if not ring.closed:
            return ring
        new = None
        try:
            new = Ring(self.queue_depth)
            new.register_buffers(self._ring_buffers)
            files = [f for f in self.files if self._fd_dev.get(f.fd) == d]
            if files:
                new.register_files([f.fd for f in files], [f.path for f in files])
        except Exception as exc:
            if new is not None:
                new.close()
            raise KVStoreError(f"rank {self.rank}: the io_uring ring of device {d} "
                               f"({self.dirs[d]}) closed after an error and could not be "
                               f"rebuilt: {exc}") from exc
        with self._streams_lock:
            streams, self._streams = self._streams, None
        for stream in streams or ():
            stream.close()
        self.rings[d] = new
        log.warning("kvstore rank %d: the io_uring ring of device %d (%s) had closed after an "
                    "error; rebuilt (queue depth %d)", self.rank, d, self.dirs[d],
                    self.queue_depth)
        return new

    def payload_view(self, i: int) -> np.ndarray:
        """Staging payload area of staging slot i (uint8, block_bytes long)."""
        return self.staging.payload_view(i)

    def slot_view(self, i: int) -> np.ndarray:
        return self.staging.slot_view(i)

    def locate(self, slots: Sequence[int]):
        """(fds, offsets, devices) of global slots: slot s is local slot s // ndev of
        device s % ndev (the slot itself on device 0 for a single-directory store)."""
        s = np.asarray(slots, dtype=np.int64)
        if s.size and (s.min() < 0 or s.max() >= self.geometry.num_slots):
            raise KVStoreError(f"slot out of range 0..{self.geometry.num_slots - 1}: {s.min()}..{s.max()}")
        if self.ndev == 1:
            devs = np.zeros(s.shape, dtype=np.int64)
            local = s
        else:
            devs, local = s % self.ndev, s // self.ndev
        fidx = local // self.geometry.slots_per_file
        offs = (local % self.geometry.slots_per_file) * self.slot_size
        return self._fd_table[devs, fidx], offs.astype(np.uint64), devs

    def _device_streams(self) -> list[DeviceStream]:
        """One thread per device (`DeviceStream`): device d's ring is only ever used by
        its own thread (or, with one device, by the caller between the stream's parts),
        and the parts of consecutive chunks are started on it before the one ahead of
        them has drained, so its queue stays full across chunk boundaries."""
        streams = self._streams
        if streams is None:
            with self._streams_lock:
                # Two threads asking at once (a scan's two ring-op threads) must not build
                # two sets: two threads would drive one ring.
                if self._streams is None:
                    self._streams = [DeviceStream(self.rings[d], f"kvstore-dev{d}-r{self.rank}",
                                                 self.thread_cpus, self.thread_nice)
                                     for d in range(self.ndev)]
                streams = self._streams
        return streams

    def _fan(self, devs: np.ndarray, call):
        """Run one batch over the devices: `call(d, idx)` moves the ops at positions `idx`
        (all of them when idx is None) on device d's ring. With several devices every
        device's part runs on its own thread, so all rings have their ops in flight at
        once (Ring calls release the GIL for their whole submit/reap loop), and each
        ring's queue depth bounds the ops (and so the bytes) in flight on its device.
        Results (an array, or a tuple of arrays, per op) come back in batch order; every
        part has ended before this returns or raises."""
        if self.ndev == 1 or len(devs) == 0:
            return call(0, None)
        return self._spread(devs, call, lambda s, d, idx: s.call(lambda: call(d, idx))).result()

    def _spread(self, devs: np.ndarray, call, post) -> "_Spread":
        """Hand device d's part of a batch (positions idx) to its stream with `post(stream,
        d, idx)` (a Future); a failed device's part fails at once, unsubmitted (`call` says
        what its dead result looks like)."""
        groups = [(d, np.flatnonzero(devs == d)) for d in range(self.ndev)] if self.ndev > 1 else [(0, None)]
        groups = [(d, i) for d, i in groups if i is None or i.size]
        # one snapshot: another device thread may fail a device meanwhile, and every
        # group must land in exactly one of `dead` and `futs`
        failed = set(self.failed)
        streams = self._device_streams()
        # A failed device's ops are never submitted: they fail with EIO at once, so no
        # request waits on a dead disk.
        dead = [(idx, self._dead(call, len(devs) if idx is None else len(idx)))
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
        return _Spread(len(devs), dead, futs)

    @staticmethod
    def _dead(call, n: int):
        """The result of n ops on a failed device: -EIO each (and status 0 for slot_io)."""
        res = np.full(n, -errno.EIO, dtype=np.int64)
        return (res, np.zeros(n, dtype=np.int32)) if getattr(call, "slot_io", False) else res

    def _account(self, d: int, opcode: int, res) -> None:
        if opcode not in (OP_READ, OP_WRITE):
            return
        n = int(res[res > 0].sum())
        if not n:
            return
        self.io_bytes[d, opcode] += n
        if (c := self._counter(d)) is not None:
            c.add(opcode, n)

    def _counter(self, d: int):
        """Device d's iostats counters (None: read-only opener, or not available)."""
        return self._counters[d] if d < len(self._counters) else None

    def _ring_submit(self, opcode, fds, offs, addrs, lens, devs):
        """Ring.submit of a plain batch (reads of headers or whole images), over the devices."""
        def call(d, idx):
            if idx is None:
                res = self.rings[d].submit(opcode, fds, offs, addrs, lens)
            else:
                res = self.rings[d].submit(opcode, fds[idx], offs[idx], addrs[idx], lens[idx])
            self._account(d, opcode, res)
            self._note_errors(d, "write" if opcode == OP_WRITE else "read", res)
            return res
        return self._fan(devs, call)

    def _submit(self, opcode, refs, stage_slots, verify: int = 0, *, stream: bool = False):
        """Move refs[i] between disk and staging slot stage_slots[i] (header + payload).

        Writes are stamped and reads checked by the ring, inside its GIL-free loop.
        Returns (results, status, fds, offsets) as `_slot_io` (with `stream`, started).
        """
        stage = np.asarray(stage_slots, dtype=np.uint64)
        hdrs = np.uint64(self.staging.address) + stage * np.uint64(self.slot_size)
        return self._slot_io(opcode, refs, hdrs, None, verify, stream=stream)

    def _slot_io(self, opcode, refs, hdr_addrs, payload_addrs, verify: int, *, stream: bool = False):
        """Move whole slots (Ring.slot_io on each device's part). Returns (results, status,
        fds, offsets); with `stream`, an object whose `result()` returns them: the parts
        are started on the device streams at once and move while the caller goes on (the
        caller must call result(), and keep the memory untouched until then)."""
        keys, slots, gens = ref_parts(refs)
        fds, offs, devs = self.locate(slots)
        io_len = self.slot_size - HEADER_SIZE
        align = HEADER_SIZE if self._direct else 1
        hdr_addrs = np.asarray(hdr_addrs, dtype=np.uint64)

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
            self._account(d, opcode, out[0])
            self._note_errors(d, "write" if opcode == OP_WRITE else "read", out[0])
            return out

        def call(d, idx):
            return account(d, self.rings[d].slot_io(*args(idx), verify=verify, payload_align=align))
        call.slot_io = True

        def post(stream, d, idx):
            return stream.start(lambda: self.rings[d].slot_io_start(*args(idx), verify=verify,
                                                                    payload_align=align),
                                lambda out: account(d, out))

        def finish(out):
            res, status = out
            short = (res >= 0) & (res != self.slot_size)
            if short.any():
                # The ring completes every transfer or fails it; a partial count here would
                # commit a half-written slot (writes cannot be verified), so never trust one.
                log.warning("rank %d: %d %s(s) returned a short count (%s of %d bytes); treated as "
                            "I/O errors", self.rank, int(short.sum()), "write" if opcode == OP_WRITE
                            else "read", int(res[short][0]), self.slot_size)
                res = res.copy()
                res[short] = -errno.EIO
            return res, status, fds, offs
        if stream and refs:
            return self._spread(devs, call, post).then(finish)
        if stream:
            empty = finish((np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)))
            return _Spread(0, [(None, empty)], [])
        return finish(self._fan(devs, call))

    def _error(self, opcode, res, fd, off, ref):
        name = {int(f.fd): f.path for f in self.files}.get(int(fd), f"fd {fd}")
        op = "write" if opcode == OP_WRITE else "read"
        return OSError(-int(res), f"{op} of slot {ref.slot} (offset {int(off)}) failed: "
                       f"{os.strerror(-int(res))}", name)

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
        res, _, fds, offs = self._submit(OP_WRITE, refs, stage_slots)
        return self._write_errors(refs, res, fds, offs, durable)

    def _write_errors(self, refs, res, fds, offs, durable: bool) -> list[Exception | None]:
        """Per-ref write outcome; with `durable`, one fdatasync per file written."""
        errors: list[Exception | None] = [None] * len(refs)
        for i in np.flatnonzero(res < 0):
            errors[i] = self._error(OP_WRITE, res[i], fds[i], offs[i], refs[i])
        if durable:
            self._fdatasync(refs, fds, errors)
        return errors

    def _fdatasync(self, refs, fds, errors: list) -> None:
        """fdatasync every file that a successful write of `refs` touched (one op per
        file, as one ring batch); a failed sync fails every write to its file
        (`errors` is updated in place: fds[i] is the file of refs[i])."""
        touched = sorted({int(fds[i]) for i in range(len(refs)) if errors[i] is None})
        if not touched:
            return
        tdev = np.array([self._fd_dev.get(fd, 0) for fd in touched], dtype=np.int64)

        def call(d, idx):   # each device syncs its own files, all devices at once
            res = self.rings[d].submit(2, touched if idx is None else [touched[i] for i in idx],
                                       None, None, None)
            self._note_errors(d, "fdatasync", res)
            return res
        sres = self._fan(tdev, call)
        bad = {touched[i]: -int(sres[i]) for i in np.flatnonzero(sres < 0)}
        if not bad:
            return
        for i in range(len(refs)):
            if errors[i] is None and int(fds[i]) in bad:
                err = bad[int(fds[i])]
                errors[i] = OSError(err, f"fdatasync after writing slot {refs[i].slot} failed: "
                                    f"{os.strerror(err)}")

    def read_staged(self, refs: Sequence[SlotRef], stage_slots: Sequence[int], *,
                    verify: str = "checksum") -> list[Exception | None]:
        """Read refs[i] into staging slot stage_slots[i] and verify it.

        None per verified slot; an OSError or CorruptSlot otherwise (never both data and
        an error: a failed slot's staging bytes must not be used).
        """
        self._check_open()
        check_choice("verify", verify, VERIFY_MODES)
        check_payload = verify == "checksum"
        errors: list[Exception | None] = [None] * len(refs)
        if not refs:
            return errors
        res, status, fds, offs = self._submit(OP_READ, refs, stage_slots, _VERIFY_CODE[verify])
        return self._verify(refs, stage_slots, res, status, fds, offs, check_payload)

    def _submitter(self):
        # One background thread drives the ring while this thread prepares or verifies
        # the other half of staging: Ring.submit runs its whole submit/reap loop without
        # the GIL, so disk and CPU work overlap (one submit in flight at a time, so the
        # ring is never used by two threads at once).
        # With several devices, two: chunk k+1's parts are queued on every device's own
        # thread while chunk k's are still running, so a device that finished its part
        # of chunk k goes on with chunk k+1 instead of waiting for the slowest device
        # (each ring is still used by one thread only: its device's, see _fan).
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1 if self.ndev == 1 else 2,
                                            thread_name_prefix=f"kvstore-ring-r{self.rank}")
        return self._pool

    def _pipeline(self, nchunks: int, ring_op, after, before=None, *, overlap: bool,
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
        (`_slot_io(stream=True)`), so chunk k+1's ops are in each device's ring before
        chunk k's tail drains, and no submitter thread is needed.
        """
        if not overlap or nchunks < 2:
            for k in range(nchunks):
                if before is not None:
                    before(k)
                res = ring_op(k)
                after(k, res.result() if streamed else res)
            return
        pool = None if streamed else self._submitter()
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

    def _halves(self, n: int):
        """Chunks of refs and the staging half each one uses (double buffering)."""
        half = max(1, self.staging_slots // 2)
        for k, start in enumerate(range(0, n, half)):
            base = (k % 2) * half if self.staging_slots >= 2 else 0
            yield start, min(n, start + half), base

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
        chunks = list(self._halves(len(refs)))

        def before(k):
            start, stop, base = chunks[k]
            fill(start, stop, [self.payload_view(i) for i in range(base, base + stop - start)])

        def ring_op(k):
            start, stop, base = chunks[k]
            return self._submit(OP_WRITE, refs[start:stop], range(base, base + stop - start),
                                stream=True)

        def after(k, result):
            start, stop, _ = chunks[k]
            res, _, fds, offs = result
            fds_all[start:stop] = fds
            for i in np.flatnonzero(res < 0):
                errors[start + i] = self._error(OP_WRITE, res[i], fds[i], offs[i], refs[start + i])

        self._pipeline(len(chunks), ring_op, after, before, overlap=self.staging_slots >= 2,
                       streamed=True)
        if durable:
            self._fdatasync(refs, fds_all, errors)
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
        on the ring thread while `consume(start, stop, stage_slots, errors)` handles chunk
        k here. The ring is used by one thread at a time: every future is resolved before
        this returns.
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
            return self._submit(OP_READ, refs[start:stop], slots[:stop - start], vcode,
                                stream=True)

        def after(k, result):
            start, stop, slots = plan[k]
            res, status, fds, offs = result
            chunk = refs[start:stop]
            used = slots[:len(chunk)]
            chunk_errors = self._verify(chunk, used, res, status, fds, offs, verify == "checksum")
            consume(start, stop, used, chunk_errors)
            errors.extend(chunk_errors)

        self._pipeline(len(plan), ring_op, after, overlap=len(areas) > 1, streamed=True)
        return errors

    def _verify(self, refs, stage_slots, res, status, fds, offs, check_payload) -> list[Exception | None]:
        """Errors of a checked read batch into staging slots."""
        def parts(i):
            img = self.slot_view(stage_slots[i])
            return img[:HEADER_SIZE], img[HEADER_SIZE:]
        return self._read_errors(refs, res, status, fds, offs, parts, check_payload)

    def _read_errors(self, refs, res, status, fds, offs, parts, check_payload) -> list[Exception | None]:
        """Per-slot errors of a read batch: None, the OSError of a failed read, or, for a
        slot the ring's C checker refused (SlotCheck code in `status`), the CorruptSlot
        that decoding the same bytes in Python raises (`parts(i)`: header, payload views)."""
        out: list[Exception | None] = [None] * len(refs)
        for i in np.flatnonzero((res < 0) | (status != 0)):
            ref = refs[i]
            if res[i] < 0:
                out[i] = self._error(OP_READ, res[i], fds[i], offs[i], ref)
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

    # -- slots whose payload lives in caller memory (no staging copy) ----------------
    def _header_pool(self) -> HostBuffer:
        """Header memory of caller-memory transfers: HEADER_BATCH headers, allocated once
        (so it can stay registered with the ring)."""
        if self._headers is None:
            self._headers = HostBuffer(max(1, self.HEADER_BATCH) * HEADER_SIZE)
        return self._headers

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
        buffers = [_host_array(b) for b in buffers]
        for b in buffers:
            try:
                readonly = memoryview(b).readonly
            except TypeError:
                raise TypeError(f"register_memory takes host memory (numpy arrays, mmap, CPU "
                                f"tensors), not {type(b).__name__}") from None
            if readonly:
                raise TypeError("register_memory needs writable memory (the kernel pins it "
                                "for both directions); pass read-only sources to write_from "
                                "unregistered")
        bufs = [self.staging.buffer, self._header_pool(), *buffers]
        ok = all([ring.register_buffers(bufs) for ring in self.rings])
        if not ok:
            bufs = [self.staging.buffer]
            for ring in self.rings:
                ring.register_buffers(bufs)
        self._ring_buffers = bufs
        return ok

    def unregister_memory(self) -> None:
        """Drop caller memory registered with `register_memory` (staging stays)."""
        self._check_open()
        for ring in self.rings:
            ring.register_buffers([self.staging.buffer])
        self._ring_buffers = [self.staging.buffer]

    def _payload_addrs(self, payloads, n: int, writable: bool):
        """Addresses of n caller payload buffers, each checked: C-contiguous, holding the
        payload's transfer length (rounded up to 4096) and, for O_DIRECT, 4096-aligned.
        `payloads` is a 2-D array (one row per block) or a sequence of buffers."""
        io_len = self.slot_size - HEADER_SIZE
        direct = self._direct
        payloads = _host_array(payloads)
        if isinstance(payloads, np.ndarray) and payloads.ndim != 2:
            raise ValueError(f"payloads must be a 2-D array with one row per block, or a sequence "
                             f"of per-block buffers; got a {payloads.ndim}-D array of shape "
                             f"{payloads.shape}")
        if isinstance(payloads, np.ndarray):
            arr = payloads
            if arr.shape[0] != n:
                raise ValueError(f"{arr.shape[0]} payload rows for {n} blocks")
            if arr.dtype.hasobject:
                raise TypeError("payload memory must hold plain numbers, not Python objects")
            row = arr.shape[1] * arr.itemsize
            if arr.strides[1] != arr.itemsize or row < io_len:
                raise AlignmentError(
                    f"payload rows must be contiguous and hold {io_len} bytes (the {self.payload_len}"
                    f"-byte payload rounded up to 4096); got rows of {row} bytes")
            if n > 1 and arr.strides[0] < max(row, io_len):
                raise AlignmentError(f"payload rows overlap or run backwards (row stride "
                                     f"{arr.strides[0]} for {io_len}-byte transfers)")
            if writable and not arr.flags.writeable:
                raise ValueError("payload array is read-only; reads need writable memory")
            base = arr.__array_interface__["data"][0]
            addrs = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(arr.strides[0])
            if direct and (base % HEADER_SIZE or arr.strides[0] % HEADER_SIZE):
                raise AlignmentError(
                    f"payload rows at 0x{base:x} with stride {arr.strides[0]} are not 4096-aligned, "
                    "which O_DIRECT needs: allocate them with kvstore.HostBuffer (or mmap), or "
                    "open the store with io_mode='page_cache'")
            return addrs, arr
        if payloads is None or isinstance(payloads, (bytes, bytearray, memoryview)):
            raise ValueError("payloads must be a 2-D array with one row per block, or a sequence "
                             f"of per-block buffers; got {type(payloads).__name__}")
        bufs = [_host_array(b) for b in payloads]
        if len(bufs) != n:
            raise ValueError(f"{len(bufs)} payload buffers for {n} blocks")
        views = []
        addrs = np.empty(n, dtype=np.uint64)
        for i, b in enumerate(bufs):
            mv = memoryview(b)
            if "O" in mv.format:
                raise TypeError(f"payload buffer {i} holds Python objects; pass plain memory")
            if writable and mv.readonly:
                raise ValueError(f"payload buffer {i} is read-only; reads need writable memory")
            if not mv.c_contiguous or mv.nbytes < io_len:
                raise AlignmentError(
                    f"payload buffer {i} must be contiguous and hold {io_len} bytes (the "
                    f"{self.payload_len}-byte payload rounded up to 4096); got {mv.nbytes}")
            a = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
            addr = a.__array_interface__["data"][0]
            if direct and addr % HEADER_SIZE:
                raise AlignmentError(
                    f"payload buffer {i} at 0x{addr:x} is not 4096-aligned, which O_DIRECT "
                    "needs: allocate it with kvstore.HostBuffer (or mmap), or open the store "
                    "with io_mode='page_cache'")
            addrs[i] = addr
            views.append(a)
        return addrs, views

    def _caller_chunks(self, refs, payloads, writable):
        addrs, keep = self._payload_addrs(payloads, len(refs), writable)
        yield from self._addr_chunks(refs, addrs)
        del keep  # the caller's buffers stay referenced until every chunk has moved

    def _addr_chunks(self, refs, addrs):
        hdrs = self._header_pool()
        step = max(1, min(self.HEADER_BATCH, hdrs.nbytes // HEADER_SIZE))
        hbase = np.uint64(hdrs.address) + np.arange(min(len(refs), step), dtype=np.uint64) * np.uint64(HEADER_SIZE)
        for start in range(0, len(refs), step):
            stop = min(len(refs), start + step)
            yield start, stop, hbase[:stop - start], addrs[start:stop]

    HEADER_BATCH = 1024   # slots per ring batch for caller-memory transfers (4 MiB of headers)

    def write_from(self, refs: Sequence[SlotRef], payloads, *, durable: bool = True) -> list[Exception | None]:
        """Write blocks straight from caller memory (no staging copy).

        `payloads`: a 2-D array with one row per ref, or a sequence of buffers, each
        holding the payload rounded up to 4096 bytes (4096-aligned for O_DIRECT). The ring
        stamps each header and writes header + payload as one writev. Returns None per
        written (durable) ref, else the error.
        """
        self._check_open()
        errors: list[Exception | None] = [None] * len(refs)
        for start, stop, hdrs, pays in self._caller_chunks(refs, payloads, writable=False):
            chunk = refs[start:stop]
            res, _, fds, offs = self._slot_io(OP_WRITE, chunk, hdrs, pays, 0)
            errors[start:stop] = self._write_errors(chunk, res, fds, offs, durable)
        return errors

    def read_into(self, refs: Sequence[SlotRef], payloads, *, verify: str = "checksum") -> list[Exception | None]:
        """Read and verify blocks straight into caller memory (no staging copy).

        `payloads` as for `write_from` (writable). Each slot is one readv (header into
        kvstore's header memory, payload into the caller's buffer), checked by the ring as
        it completes. Returns None per verified block, else its OSError or CorruptSlot: the
        caller's bytes for a failed block are undefined and must not be used.
        """
        self._check_open()
        check_choice("verify", verify, VERIFY_MODES)
        check_payload = verify == "checksum"
        errors: list[Exception | None] = [None] * len(refs)
        for start, stop, hdrs, pays in self._caller_chunks(refs, payloads, writable=True):
            chunk = refs[start:stop]
            res, status, fds, offs = self._slot_io(OP_READ, chunk, hdrs, pays, _VERIFY_CODE[verify])

            def parts(i, pays=pays):
                return (self._headers.numpy()[i * HEADER_SIZE:(i + 1) * HEADER_SIZE],
                        _view_at(int(pays[i]), self.payload_len))
            errors[start:stop] = self._read_errors(chunk, res, status, fds, offs, parts, check_payload)
        return errors

    def _check_addrs(self, addrs, n: int) -> np.ndarray:
        addrs = np.ascontiguousarray(addrs, dtype=np.uint64)
        if addrs.ndim != 1 or len(addrs) != n:
            raise ValueError(f"{addrs.size} payload addresses for {n} blocks")
        if self._direct and n and (addrs % np.uint64(HEADER_SIZE)).any():
            bad = int(addrs[np.flatnonzero(addrs % np.uint64(HEADER_SIZE))[0]])
            raise AlignmentError(
                f"payload address 0x{bad:x} is not 4096-aligned, which O_DIRECT needs: move "
                "the payloads through staging, or open the store with io_mode='page_cache'")
        return addrs

    def write_at(self, refs: Sequence[SlotRef], addrs, *, durable: bool = True) -> list[Exception | None]:
        """`write_from` of payloads given by address: addrs[i] (uint64) is where refs[i]'s
        payload starts, in memory the caller keeps alive and unchanged until this returns,
        each holding the payload rounded up to 4096 bytes (4096-aligned for O_DIRECT). For
        payloads that are not the rows of one strided array (a secondary tier's primary
        chunks, in the order a job names them): no Python object per block."""
        self._check_open()
        addrs = self._check_addrs(addrs, len(refs))
        errors: list[Exception | None] = [None] * len(refs)
        for start, stop, hdrs, pays in self._addr_chunks(refs, addrs):
            chunk = refs[start:stop]
            res, _, fds, offs = self._slot_io(OP_WRITE, chunk, hdrs, pays, 0)
            errors[start:stop] = self._write_errors(chunk, res, fds, offs, durable)
        return errors

    def read_at(self, refs: Sequence[SlotRef], addrs, *, verify: str = "checksum") -> list[Exception | None]:
        """`read_into` of payloads given by address (as `write_at`; the memory must be
        writable). None per verified block, else its OSError or CorruptSlot: the bytes at
        a failed block's address are undefined and must not be used."""
        self._check_open()
        check_choice("verify", verify, VERIFY_MODES)
        addrs = self._check_addrs(addrs, len(refs))
        check_payload = verify == "checksum"
        errors: list[Exception | None] = [None] * len(refs)
        for start, stop, hdrs, pays in self._addr_chunks(refs, addrs):
            chunk = refs[start:stop]
            res, status, fds, offs = self._slot_io(OP_READ, chunk, hdrs, pays, _VERIFY_CODE[verify])

            def parts(i, pays=pays):
                return (self._headers.numpy()[i * HEADER_SIZE:(i + 1) * HEADER_SIZE],
                        _view_at(int(pays[i]), self.payload_len))
            errors[start:stop] = self._read_errors(chunk, res, status, fds, offs, parts, check_payload)
        return errors

    def read_headers(self, slots: Sequence[int]) -> list:
        """Read slot headers only (for fsck): SlotHeader, or the exception, per slot."""
        self._check_open()
        out = []
        # A header is the first 4096 bytes; read whole slots only when needed (fsck --deep).
        step = self.staging.nbytes // HEADER_SIZE
        stage_np = self.staging.numpy()
        for start in range(0, len(slots), step):
            chunk = list(slots[start:start + step])
            fds, offs, devs = self.locate(chunk)
            n = len(chunk)
            addrs = self.staging.address + np.arange(n, dtype=np.uint64) * np.uint64(HEADER_SIZE)
            res = self._ring_submit(OP_READ, fds, offs, addrs, np.full(n, HEADER_SIZE, np.uint32), devs)
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
            fds, offs, devs = self.locate(chunk)
            addrs = self.staging.address + (np.arange(base(k), base(k) + len(chunk), dtype=np.uint64)
                                            * np.uint64(self.slot_size))
            return self._ring_submit(OP_READ, fds, offs, addrs, lens[:len(chunk)], devs)

        def after(k, res):
            start, stop = k * per, min(n, (k + 1) * per)
            consume(start, stop, [self.slot_view(base(k) + j) for j in range(stop - start)], res)

        self._pipeline(-(-n // per), ring_op, after, overlap=two)
