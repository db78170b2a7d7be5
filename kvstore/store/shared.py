"""Several engines on one store: the store lock, engine leases and the shared slot state.

Every engine process of a node (vLLM data-parallel ranks, replicas, `kvstore warmup`)
opens a store *together* with the others: one LMDB index (LMDB serializes writers across
processes), one set of slot files, and these files in the store directory:

- ``LOCK``: flock *shared* by every attached engine, *exclusive* by an offline repair
  (`kvstore fsck --repair` / `--rebuild-index`): a repair never runs next to an engine, and
  no engine starts while one runs.
- ``engines/ATTACH``: flock exclusive around the short attach and reclaim sections.
- ``engines/slots``: the store's slot generations (`kvstore._sharedmap.SharedMap`): header
  words (see ``W_*``), then a u64 per slot: the generation of the committed entry the slot
  holds, 0 when it holds none. Every engine's lookups check their hits against it (an
  engine's in-memory table does not hear of another engine's evictions), and evictions
  clear it before they look at the other engines' pins (see `_sharedmap`).
- ``engines/<pid>-<start>.lease``: one per attached process, flock *exclusive* by it for
  its whole life, so a lease whose lock can be taken belongs to a dead process (this holds
  across PID namespaces too: no pid is trusted). Its header names the process; after the
  header, its pin counts (a u32 per slot), which the other engines' evictions read.

An engine's reservations are rows of the index's ``owned`` db (owner id + slot), so the
survivors give a dead engine's reservations back (`Index.reclaim_owner`) as soon as its
lease lock is free, and never while it lives. The first engine to attach (no other live
lease) also reclaims every reservation left without a live owner (a crash of the last
engine, or a store written before leases existed) and rebuilds ``slots`` from LMDB.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import time
import weakref
from dataclasses import dataclass

from kvstore._sharedmap import SharedMap
from kvstore.errors import CorruptStore, DataDirError, KVStoreError, StoreLocked

log = logging.getLogger("kvstore.store.shared")

ENGINES_DIR = "engines"
HDR = 4096
MAGIC_SLOTS = 0x6B76736C6F747331      # "kvslots1"
MAGIC_LEASE = 0x6B766C6561736531      # "kvlease1"
# slots header words
W_MAGIC, W_CAPACITY, W_EPOCH, W_VALID, W_EVICTIONS, W_ATTACHED = range(6)
# lease header words
L_MAGIC, L_PID, L_START, L_STARTED_US, L_KIND, L_CAPACITY = range(6)
KINDS = {1: "engine", 2: "warmup", 3: "tool", 4: "fleet"}
_KIND_CODE = {v: k for k, v in KINDS.items()}
_OWNER = struct.Struct(">IQ")          # owner id: pid, start ticks (12 bytes)


# A lease's (and the store lock's) flock belongs to its open file description, which a
# forked child shares: a child forked after the attach (a worker started with fork,
# multiprocessing's fork start method) would keep a dead engine's lease locked, so its
# reservations would never be reclaimed, and keep an offline repair out (O_CLOEXEC covers
# exec only). At fork the child closes its copies and detaches its copy of the lease's
# pin map (a MAP_SHARED mapping holds the open file description too); closing a copy
# never releases the lock while the parent's stays open (flock(LOCK_UN) would). Its Lease
# reads as left: its close() neither deletes the parent's lease nor counts it gone.
_HELD: "weakref.WeakSet" = weakref.WeakSet()


def _drop_after_fork() -> None:
    for obj in list(_HELD):
        obj._forked()


os.register_at_fork(after_in_child=_drop_after_fork)


def _open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataDirError(f"refusing {path}: it is a symlink (kvstore never follows "
                               "symlinks inside a store; remove it)") from None
        raise


def _close_quietly(fd: int | None) -> None:
    """Close fd if it is open (a forked child's copy); returns None for the attribute."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    return None


def process_start_ticks(pid: int | str = "self") -> int:
    """Field 22 of /proc/<pid>/stat: the process's start time in clock ticks since boot
    (with the pid, it names one process instance: pids are reused, this is not)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return int(raw[raw.rindex(b")") + 2:].split()[19])


def owner_id(pid: int, start: int) -> bytes:
    return _OWNER.pack(pid, start)


def parse_owner(owner: bytes) -> tuple[int, int]:
    return _OWNER.unpack(owner)


@dataclass
class EngineInfo:
    """An attached engine, as its lease file tells (for `kvstore info`)."""
    pid: int
    start_ticks: int
    started: float          # unix time
    kind: str
    path: str
    alive: bool
    pinned_slots: int = 0

    @property
    def owner(self) -> bytes:
        return owner_id(self.pid, self.start_ticks)


def _lease_name(pid: int, start: int) -> str:
    return f"{pid}-{start}.lease"


def _lease_files(store_dir: str) -> list[str]:
    d = os.path.join(store_dir, ENGINES_DIR)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(d, n) for n in names if n.endswith(".lease"))


def _probe(path: str) -> tuple[int | None, bool]:
    """(fd holding an exclusive lock, False) when the lease's owner is dead, or (None,
    True) when it lives (or the file vanished: (None, False))."""
    try:
        fd = _open_nofollow(path, os.O_RDWR)
    except FileNotFoundError:
        return None, False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, True
    if not os.path.exists(path):        # reclaimed and unlinked while we opened it
        os.close(fd)
        return None, False
    return fd, False


class _AttachShared:
    """engines/ATTACH held shared while a liveness probe takes a lease's lock: the attach
    and reap sections hold it exclusive, so a probe by a tool never makes an attaching
    engine's own probe fail (it would count a dead engine as alive)."""

    def __init__(self, lease_path: str):
        self.fd = None
        try:
            self.fd = os.open(os.path.join(os.path.dirname(lease_path), "ATTACH"),
                              os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            pass

    def __enter__(self):
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)       # drops the lock


def _alive(fd: int, path: str) -> bool:
    """Whether the lease open at fd has a live owner (its exclusive lock is held)."""
    with _AttachShared(path):
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False


def read_lease(path: str, *, pins: bool = False, probe: bool = True) -> EngineInfo | None:
    """What a lease file says, and (with `probe`) whether its owner lives; None if it is
    not a lease. Without `probe` (inside the attach section) `alive` is left True."""
    try:
        fd = _open_nofollow(path, os.O_RDONLY)
    except (FileNotFoundError, KVStoreError):
        return None
    try:
        raw = os.pread(fd, 48, 0)
        if len(raw) < 48:
            return None
        w = struct.unpack("<6Q", raw)
        if w[L_MAGIC] != MAGIC_LEASE:
            return None
        alive = _alive(fd, path) if probe else True
        info = EngineInfo(pid=w[L_PID], start_ticks=w[L_START], started=w[L_STARTED_US] / 1e6,
                          kind=KINDS.get(w[L_KIND], "engine"), path=path, alive=alive)
        if pins:
            size = os.fstat(fd).st_size
            if size > HDR:
                info.pinned_slots = SharedMap(fd, size, False).count_nonzero32()
        return info
    finally:
        os.close(fd)


def engines(store_dir: str, *, pins: bool = False) -> list[EngineInfo]:
    """Every lease in the store (alive or left by a dead process not reclaimed yet)."""
    out = []
    for p in _lease_files(store_dir):
        info = read_lease(p, pins=pins)
        if info is not None:
            out.append(info)
    return out


def live_pids(store_dir: str) -> list[int]:
    return [e.pid for e in engines(store_dir) if e.alive]


class StoreLock:
    """flock on STORE/LOCK: shared by engines, exclusive for an offline repair."""

    def __init__(self, store_dir: str, *, exclusive: bool = False):
        self.path = os.path.join(store_dir, "LOCK")
        self.exclusive = exclusive
        try:
            fd = _open_nofollow(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise DataDirError(
                f"cannot open store {store_dir} for writing ({os.strerror(exc.errno)}): an engine "
                "or repair writes to the store; make it writable (remount read-write, or run as "
                "its owner), or open it read-only (kvstore info, kvstore fsck without --repair)"
            ) from None
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pids = live_pids(store_dir)
            pid = pids[0] if pids else None
            if exclusive:
                who = (f"{len(pids)} engine(s) (pid {', '.join(map(str, pids))})" if pids
                       else "another process")
                raise StoreLocked(
                    f"store {store_dir} is in use by {who}; stop them first (an offline repair "
                    "needs the store to itself), or run without --repair for a read-only check",
                    pid=pid) from None
            raise StoreLocked(
                f"store {store_dir} is being repaired offline (an exclusive lock is held); wait "
                "for `kvstore fsck --repair` to finish, then start again", pid=pid) from None
        self.fd = fd
        _HELD.add(self)

    def _forked(self) -> None:
        """In a forked child: drop this copy of the lock (the parent keeps it)."""
        self.fd = _close_quietly(self.fd)

    @staticmethod
    def holders(store_dir: str) -> list[int]:
        """pids of the live engines attached to the store (empty when none)."""
        return live_pids(store_dir)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)       # closing drops the flock
            self.fd = None


class _AttachLock:
    def __init__(self, d: str):
        self.fd = _open_nofollow(os.path.join(d, "ATTACH"), os.O_RDWR | os.O_CREAT)

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


class Lease:
    """This process's attachment to a store: its lease file (lock, identity, pin counts)
    and the store's shared slot generations. `reclaim(owner)` is called (inside the attach
    section) for every dead engine found, and once with None when this engine is the
    only one alive (every reservation without a live owner goes back)."""

    def __init__(self, store_dir: str, capacity: int, reclaim, *, kind: str = "engine"):
        self.store_dir = store_dir
        self.capacity = capacity
        self.dir = os.path.join(store_dir, ENGINES_DIR)
        self.pid = os.getpid()
        self.start = process_start_ticks()
        self.owner = owner_id(self.pid, self.start)
        self.path = os.path.join(self.dir, _lease_name(self.pid, self.start))
        self.fd = None
        self.pins: SharedMap | None = None
        self.slots: SharedMap | None = None
        self._peer_maps: dict[str, SharedMap] = {}
        self.first = False
        self.reclaimed_owners: list[bytes] = []
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            if os.path.islink(self.dir) or not os.path.isdir(self.dir):
                raise DataDirError(f"refusing {self.dir}: not a directory (kvstore never follows "
                                   "symlinks inside a store; remove it)") from None
        with _AttachLock(self.dir):
            if os.path.lexists(self.path):      # a lease of ours? only if we exec'd: stale
                os.unlink(self.path)
            alive = self._reap(reclaim)
            self.first = not alive
            self._open_slots(fresh=self.first)
            self.slots.store(W_ATTACHED, alive)
            if self.first:
                reclaim(None)
            fd = _open_nofollow(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.ftruncate(fd, HDR + 4 * capacity)
                os.pwrite(fd, struct.pack("<6Q", MAGIC_LEASE, self.pid, self.start,
                                          int(time.time() * 1e6), _KIND_CODE.get(kind, 1),
                                          capacity), 0)
                self.pins = SharedMap(fd, HDR + 4 * capacity, True)
            except BaseException:
                os.close(fd)
                os.unlink(self.path)
                raise
            self.fd = fd
            _HELD.add(self)
            self.slots.add(W_ATTACHED, 1)
            self.slots.add(W_EPOCH, 1)

    def _forked(self) -> None:
        """In a forked child: the lease is the parent's. This copy of its lock goes (so the
        parent's death is seen), and close() leaves the lease file and counts alone. Its
        pin map goes too: a mapping holds the open file description (and the lock) alive."""
        if self.pins is not None:
            try:
                self.pins.detach()
            except OSError:
                pass
        self.fd = _close_quietly(self.fd)
        self._peer_maps.clear()

    def _open_slots(self, fresh: bool) -> None:
        path = os.path.join(self.dir, "slots")
        size = HDR + 8 * self.capacity
        fd = _open_nofollow(path, os.O_RDWR | os.O_CREAT)
        try:
            st = os.fstat(fd)
            if fresh or st.st_size != size:
                if not fresh:
                    raise CorruptStore(
                        f"{path} has {st.st_size} bytes, not {size}, while other engines are "
                        "attached; stop them and start again")
                # nobody else is attached: start from zeros (rebuilt from LMDB by the
                # first engine's table build, `ServingIndex`)
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
            m = SharedMap(fd, size, True)
        finally:
            os.close(fd)        # the mapping stays
        if fresh:
            m.store(W_MAGIC, MAGIC_SLOTS)
            m.store(W_CAPACITY, self.capacity)
            m.store(W_VALID, 0)
            m.store(W_ATTACHED, 0)
        elif m.load(W_MAGIC) != MAGIC_SLOTS or m.load(W_CAPACITY) != self.capacity:
            raise CorruptStore(f"{path} is not this store's slot state; stop every engine of "
                               "the store and start again (the first one rebuilds it)")
        self.slots = m

    def _reap(self, reclaim) -> int:
        """Reclaim every dead lease (under the attach lock); returns how many live."""
        alive = 0
        for p in _lease_files(self.store_dir):
            if p == self.path:
                continue
            info = read_lease(p, probe=False)     # we hold ATTACH: probe below
            fd, live = _probe(p)
            if live:
                alive += 1
                continue
            if fd is None:
                continue
            try:
                if info is not None:
                    reclaim(info.owner)
                    self.reclaimed_owners.append(info.owner)
                    log.warning("kvstore: engine pid %d (started %s) is gone; its reservations "
                                "were reclaimed", info.pid, time.strftime(
                                    "%Y-%m-%d %H:%M:%S", time.localtime(info.started)))
                os.unlink(p)
                if self.slots is not None:      # while serving (at attach it is recounted)
                    self.slots.add(W_ATTACHED, -1 & 0xFFFFFFFFFFFFFFFF)
                    self.slots.add(W_EPOCH, 1)
            finally:
                os.close(fd)
        return alive

    def reap(self, reclaim) -> list[bytes]:
        """While serving: reclaim the leases of engines that died since; their owners."""
        before = len(self.reclaimed_owners)
        with _AttachLock(self.dir):
            self._reap(reclaim)
        return self.reclaimed_owners[before:]

    @property
    def epoch(self) -> int:
        return self.slots.load(W_EPOCH) if self.slots is not None else 0

    def peers(self, probe: bool = True) -> list[SharedMap]:
        """The other live engines' pin maps (mapped once per lease file). Without `probe`
        a lease not mapped yet is taken without asking whether its owner lives (no
        engines/ATTACH lock: for an eviction claim inside an LMDB write transaction,
        where waiting for ATTACH could deadlock with an attach section reclaiming a
        dead engine's reservations; a dead engine's pins only keep its slots a while)."""
        out = []
        seen = set()
        for p in _lease_files(self.store_dir):
            if p == self.path:
                continue
            seen.add(p)
            m = self._peer_maps.get(p)
            if m is None:
                try:
                    fd = _open_nofollow(p, os.O_RDONLY)
                except (FileNotFoundError, KVStoreError):
                    continue
                try:
                    if os.fstat(fd).st_size < HDR + 4 * self.capacity:
                        continue        # still being created
                    if probe and not _alive(fd, p):
                        continue        # a dead engine's pins protect nothing
                    m = SharedMap(fd, HDR + 4 * self.capacity, False)
                finally:
                    os.close(fd)
                self._peer_maps[p] = m
            out.append(m)
        for p in list(self._peer_maps):
            if p not in seen:
                del self._peer_maps[p]
        return out

    def close(self) -> None:
        """Leave: the lease file goes (pins with it). Reservations must be given back by
        the caller first; whatever is left is reclaimed by the next engine to attach."""
        if self.fd is None:
            return
        try:
            if self.slots is not None:
                self.slots.add(W_ATTACHED, -1 & 0xFFFFFFFFFFFFFFFF)
                self.slots.add(W_EPOCH, 1)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        finally:
            os.close(self.fd)
            self.fd = None
            self._peer_maps.clear()
