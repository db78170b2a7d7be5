"""RankFiles: one rank's slot files over its devices, and where each slot lives in them.

One device per data directory (the store directory itself for a single-directory store);
global slot s is local slot s // ndev of device s % ndev, and each device has its own
slot files, its own iostats counters (`iostats.IOCounters`) and, for a store over several
data directories, its directory's marker, watched while serving (`DeviceHealth`).
"""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvstore._slotfile import SlotFile
from kvstore.errors import KVStoreError
from kvstore.format.layout import StoreGeometry
from kvstore.io.datadirs import check_dir
from kvstore.io.iostats import IOCounters
from kvstore.io.paths import rank_dir, slot_file_path

# The rank's logger: everything a RankIO logs, whichever of its parts logs it.
log = logging.getLogger("kvstore.io.rank")


def marker_id(ddir: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a data directory's `kvstore-data.json` (None: not there)."""
    try:
        st = os.stat(os.path.join(ddir, "kvstore-data.json"))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def open_counters(ddir: str, rank: int) -> IOCounters | None:
    """A device's iostats counters; None (and a warning) when they cannot be opened."""
    try:
        return IOCounters(ddir, rank)
    except OSError as exc:
        log.warning("rank %d: cannot open the byte counters of %s (%s); bytes moved on this "
                    "device are not recorded", rank, ddir, exc)
        return None


@dataclass(slots=True)
class SlotPlaces:
    """Where a batch of global slots lives, one entry per slot."""
    fds: np.ndarray        # int32: the slot file's descriptor (-1: not open)
    offsets: np.ndarray    # uint64: the slot's byte offset in that file
    devices: np.ndarray    # int64: its device


class RankFiles:
    """The slot files of one rank on each of its devices, opened once.

    A writable opener of a store over several data directories tolerates a device whose
    directory or files cannot be opened (missing, read-only): `fail(d, reason, detail)`
    (`DeviceHealth.fail`) marks it failed, and none of its files stays open. A read-only
    opener with `missing_ok` (fsck) lists the files it cannot open in `bad_files` (file
    number -> reason) instead; every I/O on their slots fails EBADF. Anything else that
    cannot be opened raises (and what was opened is closed).
    """

    def __init__(self, store_dir: str, rank: int, geometry: StoreGeometry, dirs: list[str], *,
                 direct: bool, readonly: bool, missing_ok: bool,
                 fail: Callable[[int, str, str], bool]):
        self.rank = rank
        self.geometry = geometry
        self.dirs = dirs
        self.ndev = len(dirs)
        self.slot_size = geometry.slot_size
        self.files: list[SlotFile] = []
        self.by_device: list[list[SlotFile]] = []   # each device's open files, in file order
        self.bad_files: dict[int, str] = {}
        self.counters: list[IOCounters | None] = []
        self.markers: dict[int, tuple[int, int]] = {}   # watched while serving (DeviceHealth)
        self.fd_table = np.full((self.ndev, geometry.num_files), -1, dtype=np.int32)
        self.fd_device: dict[int, int] = {}   # open slot file descriptor -> its device
        try:
            self._open(store_dir, direct, readonly, missing_ok, fail)
        except BaseException:
            self.close()
            raise

    def _open(self, store_dir, direct, readonly, missing_ok, fail) -> None:
        geo, rank, nf0 = self.geometry, self.rank, self.geometry.num_files
        tolerate = not readonly and self.ndev > 1
        for d, ddir in enumerate(self.dirs):
            try:
                check_dir(rank_dir(ddir, rank))
                dir_error = None
            except KVStoreError as exc:
                if tolerate:
                    fail(d, "missing", str(exc))
                    self.by_device.append([])
                    self.counters.append(None)
                    continue
                if not missing_ok:
                    raise
                dir_error = str(exc)
            if tolerate and (mark := marker_id(ddir)) is not None:
                self.markers[d] = mark
            mine, failed = [], False
            for i in range(geo.device_files(d)):
                if dir_error is not None:
                    self.bad_files[d * nf0 + i] = dir_error
                    continue
                try:
                    f = SlotFile(slot_file_path(ddir, rank, i), geo.slot_size,
                                 geo.device_file_slots(d, i), direct=direct, readonly=readonly)
                except (KVStoreError, OSError) as exc:
                    if tolerate:
                        err = getattr(exc, "errno", None)
                        fail(d, "readonly" if err == errno.EROFS else "missing", str(exc))
                        failed = True
                        break
                    if not missing_ok:
                        raise
                    self.bad_files[d * nf0 + i] = str(exc)
                    continue
                self.files.append(f)
                mine.append(f)
                self.fd_table[d, i] = f.fd
                self.fd_device[f.fd] = d
            if failed:
                for f in mine:
                    self.files.remove(f)
                    self.fd_device.pop(f.fd, None)
                    f.close()
                self.fd_table[d, :] = -1
                mine = []
            self.by_device.append(mine)
            self.counters.append(None if readonly or dir_error is not None or failed
                                 else open_counters(ddir, rank))

    def place(self, slots: Sequence[int]) -> SlotPlaces:
        """Where global slots live: slot s is local slot s // ndev of device s % ndev (the
        slot itself on device 0 for a single-directory store)."""
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
        return SlotPlaces(self.fd_table[devs, fidx], offs.astype(np.uint64), devs)

    def name_of(self, fd) -> str:
        """The path of an open slot file's descriptor, for error messages."""
        return {int(f.fd): f.path for f in self.files}.get(int(fd), f"fd {fd}")

    def counter(self, d: int) -> IOCounters | None:
        """Device d's iostats counters (None: read-only opener, or not available)."""
        return self.counters[d] if d < len(self.counters) else None

    def close(self) -> None:
        """Close the counters, then the slot files (idempotent)."""
        for c in self.counters:
            if c is not None:
                c.close()
        self.counters = []
        for f in self.files:
            f.close()
        self.files = []
        self.bad_files = {}
