"""DeviceHealth: which devices of one rank failed, and the evidence that fails them.

A store over several data directories keeps serving when one device dies: the device is
fenced (`DeviceHealth.failed`), its ops fail with EIO without being submitted, and the
worker reports it to the scheduler, which drops its entries. The evidence: device errnos
in a batch's results (`note_errors`), a data directory that went away or was replaced
and a patrol read of each device (`check_devices`, every few seconds while serving), and
a probe of the device after an EIO (`datadirs.probe_data_dir`). A single-directory store
never fences its only device (every error fails its block only). `RankIO` owns one.
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

import numpy as np

from kvstore.errors import ConfigError
from kvstore.format.layout import HEADER_SIZE
from kvstore.io.datadirs import probe_data_dir
from kvstore.io.files import RankFiles, marker_id
from kvstore.io.threads import make_thread

# The rank's logger: everything a RankIO logs, whichever of its parts logs it.
log = logging.getLogger("kvstore.io.rank")

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

FENCE_REASONS = ("io_error", "missing", "readonly", "foreign")


def device_fault_reason(err: int) -> str:
    """The fence reason of a device errno ("readonly" for EROFS, else "io_error")."""
    return "readonly" if err == errno.EROFS else "io_error"


def fence_reason_of(failure: str) -> str:
    """The fence reason of a `RankIO.failed` text ("REASON: detail", as the worker also
    reports it to the scheduler): one of FENCE_REASONS, "io_error" for anything else."""
    reason = str(failure).split(":", 1)[0]
    return reason if reason in FENCE_REASONS else "io_error"


class DeviceHealth:
    """The failed devices of one rank (device -> "reason: detail", first reason kept)
    and the EIO counts, probes and patrol reads that decide them.

    Made before the rank's files are opened (a device that cannot be opened is failed
    then: `fail`); `watch(files)` hands it the open files for the patrol reads and the
    marker checks, `stop()` (under the lock every patrol takes) ends both before the
    files and counters close.
    """

    def __init__(self, rank: int, store_dir: str, dirs: list[str], *, direct: bool,
                 readonly: bool, eio_limit: int = EIO_LIMIT, eio_window_s: float = EIO_WINDOW_S,
                 thread_cpus: frozenset[int] | None = None, thread_nice: int = 0):
        if eio_limit < 1 or not (math.isfinite(eio_window_s) and eio_window_s > 0):
            raise ConfigError(f"RankIO: eio_limit must be >= 1 and eio_window_s > 0, got "
                              f"{eio_limit} and {eio_window_s}")
        self.rank = rank
        self.store_dir = store_dir
        self.dirs = dirs
        self.ndev = len(dirs)
        self.direct = direct
        self.readonly = readonly
        self.eio_limit = eio_limit
        self.eio_window_s = eio_window_s
        self.thread_cpus = thread_cpus
        self.thread_nice = thread_nice
        # No op is submitted to a failed device any more: its ops fail with EIO at once.
        # A writable opener (a serving worker) opens a store whose device is missing or
        # read-only with that device failed instead of refusing to start.
        self.failed: dict[int, str] = {}
        self.io_errors = np.zeros(self.ndev, dtype=np.int64)   # failed ops per device, ever
        self._lock = threading.Lock()                    # failed, EIO times, probes, patrols
        self._eio_times = [deque() for _ in dirs]        # recent EIOs per device
        self._probed_at = [float("-inf")] * self.ndev    # last probe after an EIO
        self.probes: dict[int, threading.Thread] = {}    # probes running, per device
        self.patrols: dict[int, threading.Thread] = {}   # patrol reads running, per device
        self.patrol_failing: set[int] = set()            # devices whose last patrol failed
        self._patrol_bufs: dict[int, mmap.mmap] = {}
        self._patrol_lock = threading.Lock()
        self._files: RankFiles | None = None   # the rank's files (their counters, markers)
        self._patrolling = False               # watched and not stopped: patrols read them

    def watch(self, files: RankFiles) -> None:
        """Count errors in these (open) files' counters, check their data directories'
        markers and patrol them from now on."""
        with self._patrol_lock:
            self._files = files
            self._patrolling = True

    def stop(self) -> None:
        """No patrol reads a file or counts an error once this returns (before the files
        and their counters close)."""
        with self._patrol_lock:
            self._patrolling = False

    def _counter(self, d: int):
        """Device d's iostats counters (None: not kept, or not watching yet)."""
        return self._files.counter(d) if self._files is not None else None

    def fail(self, d: int, reason: str, detail: str) -> bool:
        """Mark device d failed (first reason kept). True when it was not failed before."""
        with self._lock:
            if d in self.failed:
                return False
            self.failed[d] = f"{reason}: {detail}"
        log.error("kvstore rank %d: device %d (%s) failed (%s: %s); its blocks fail at once "
                  "from now on", self.rank, d, self.dirs[d], reason, detail)
        return True

    def note_errors(self, d: int, op: str, res) -> None:
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
                self.fail(d, device_fault_reason(e),
                          f"{op} failed with {errno.errorcode.get(e, e)} ({os.strerror(e)})")
                return
        n = int((bad == -errno.EIO).sum())
        if not n:
            return
        now = time.monotonic()
        with self._lock:
            q = self._eio_times[d]
            q.extend([now] * min(n, self.eio_limit))
            while q and now - q[0] > self.eio_window_s:
                q.popleft()
            recent = len(q)
        if recent >= self.eio_limit:
            self.fail(d, "io_error", f"{op} failed with EIO ({os.strerror(errno.EIO)}): "
                      f"{recent} errors within {self.eio_window_s:g} s")
        else:
            self.probe_soon(d, op)
            log.warning("kvstore rank %d: device %d (%s): %d %s(s) failed with EIO (%d of the %d "
                        "within %g s that fail the device); those blocks are recomputed",
                        self.rank, d, self.dirs[d], n, op, recent, self.eio_limit, self.eio_window_s)

    def probe_soon(self, d: int, op: str) -> None:
        """After an EIO below the limit: probe device d on a thread of its own (unless a
        probe of it runs, or ran less than PROBE_EVERY_S ago, or this opener is read-only:
        fsck only counts); a failed probe fences it as `io_error`, the probe's verdict in
        the detail (never a reason the next start would re-admit by itself)."""
        if self.readonly:
            return
        now = time.monotonic()
        with self._lock:
            running = self.probes.get(d)
            if (running is not None and running.is_alive()) or now - self._probed_at[d] < PROBE_EVERY_S:
                return
            self._probed_at[d] = now
            t = make_thread(self._probe, f"kvstore-probe-dev{d}-r{self.rank}",
                            self.thread_cpus, (d, op), self.thread_nice)
            self.probes[d] = t
        t.start()

    def _probe(self, d: int, op: str) -> None:
        try:
            why = probe_data_dir(self.dirs[d], self.store_dir, d, self.direct,
                                 tag=f"-r{self.rank}-{threading.get_ident()}")
        except Exception as exc:     # the probe itself broke: not the device's verdict
            log.warning("kvstore rank %d: probing device %d (%s) failed: %s", self.rank, d,
                        self.dirs[d], exc)
            return
        if why is not None:
            self.fail(d, "io_error", f"{op} failed with EIO, then the device's probe "
                      f"failed ({why[0]}: {why[1]})")

    def wait_probes(self, timeout: float = 10.0) -> None:
        """Wait for the device probes running now (tests)."""
        with self._lock:
            probes = list(self.probes.values())
        for t in probes:
            t.join(timeout)

    def check_devices(self) -> list[int]:
        """Look for devices that failed while serving, traffic or not: a data directory
        that went away (an unmounted or replaced device: its `kvstore-data.json` is gone
        or is another file) fails at once; and every healthy device gets a patrol read
        (`patrol`: one 4 KiB O_DIRECT read of its first slot header, on a thread of its
        own, so a hung device never blocks the caller): a device errno fences at once, an
        EIO asks for a probe, which fences the device if it fails. Without it a
        device that died while no block of it was asked for stayed "ok" in the metrics
        until a request happened to touch it. Returns the devices found missing now.
        Cheap (one stat and one small read per device); the worker's I/O thread calls it
        every few seconds."""
        out = []
        files = self._files
        for d, ident in list(files.markers.items() if files is not None else ()):
            if d in self.failed:
                continue
            now = marker_id(self.dirs[d])
            if now != ident:
                what = "is gone" if now is None else "was replaced"
                if self.fail(d, "missing", f"{self.dirs[d]}/kvstore-data.json {what} "
                             "(device unmounted?)"):
                    out.append(d)
        if self.ndev > 1 and not self.readonly and self._patrolling:
            for d in range(self.ndev):
                if d in self.failed or int(files.fd_table[d, 0]) < 0:
                    continue
                with self._lock:
                    running = self.patrols.get(d)
                    if running is not None and running.is_alive():
                        continue    # the last patrol has not returned (a slow or hung device)
                    t = make_thread(self.patrol, f"kvstore-patrol-dev{d}-r{self.rank}",
                                    self.thread_cpus, (d,), self.thread_nice)
                    self.patrols[d] = t
                t.start()
        return out

    def patrol(self, d: int) -> None:
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
            with self._patrol_lock:     # a duplicate of the fd: stop() may run meanwhile
                fd = int(self._files.fd_table[d, 0]) if self._patrolling else -1
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
            with self._patrol_lock:     # the counters close after stop()
                if not self._patrolling:
                    return
                failing = d in self.patrol_failing
                if not err:
                    if failing:
                        self.patrol_failing.discard(d)
                        log.info("kvstore rank %d: device %d (%s): the patrol read succeeds again",
                                 self.rank, d, self.dirs[d])
                    return
                if not failing:
                    self.patrol_failing.add(d)
                    log.warning("kvstore rank %d: device %d (%s): the patrol read of its first slot "
                                "failed: %s", self.rank, d, self.dirs[d], os.strerror(err))
                    self.io_errors[d] += 1
                    if (c := self._counter(d)) is not None:
                        c.add_errors(1)
            if err in DEVICE_ERRNOS and err != errno.EIO:
                self.fail(d, device_fault_reason(err), f"patrol read failed with "
                          f"{errno.errorcode.get(err, err)} ({os.strerror(err)})")
            elif err == errno.EIO:
                self.probe_soon(d, "patrol read")
        except Exception as exc:    # never a traceback every few seconds from a helper thread
            log.warning("kvstore rank %d: patrol of device %d failed: %s", self.rank, d, exc)
