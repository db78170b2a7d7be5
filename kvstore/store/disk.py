"""DiskStore: the public Python API of a kvstore store.

Owns the store directory (fingerprint, writer lock, index, per-rank slot files) and the
protocols that keep them consistent: data is written and made durable (fdatasync through
the ring) before the index commits a key; every read verifies key, generation and
checksums before bytes are handed out; reservations that never committed are reclaimed
on the next writer open. The vLLM connector, the CLI tools and the tests all go through
this module. It never imports vLLM.

`DiskStore` is the index side (longest prefix, pins, reservations, commits, LRU, stats)
plus, for tools and tests, a convenience data path over every rank through
`kvstore.io.rank.RankIO` (one rank's slot files, ring and staging; re-exported here with
`SlotRef`, `rank_dir` and `slot_file_path`). vLLM workers use only RankIO (they never
open LMDB).
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
from collections import Counter
from typing import Callable, Iterable, Sequence

import numpy as np

from kvstore._slotfile import SlotFile
from kvstore.errors import (
    ConfigError, KVStoreError, LayoutMismatch, StoreClosed, StoreLocked, StoreNotFound,
)
from kvstore.format.identity import describe_differences
from kvstore.index.core import Entry, Index
from kvstore.store.shared import W_VALID, Lease, StoreLock
from kvstore.format.layout import (
    Layout, StoreGeometry, check_data_dirs, check_layout, device_dirs,
    normalize_data_dirs, parse_size, read_fingerprint, stored_identity, write_fingerprint,
)

from kvstore.io.iostats import create_iostats
from kvstore.io.paths import rank_dir, slot_file_path  # noqa: F401  (public here too)
from kvstore.io.rank import IO_MODES, RankIO, check_choice
from kvstore.io.rings import INFLIGHT_BYTES
from kvstore.io.records import SlotRef  # noqa: F401  (public here too)
from kvstore.io.datadirs import (  # noqa: F401  (probe_data_dir and DATA_MARKER are public here too)
    DATA_MARKER, check_data_dir, check_dir, check_distinct_dirs, check_free_space, claim_data_dir,
    write_marker, probe_data_dir,
)

log = logging.getLogger("kvstore.store.disk")


def _safe_mkdir(path: str) -> None:
    """mkdir 0700, refusing a path that exists as a symlink or a non-directory."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        check_dir(path)


def _remove_unfinished_store(path: str) -> None:
    """Delete what an interrupted creation left in `path` (which has no kvstore.json):
    rank*/slots-NNNN.kvs files and index/{data,lock}.mdb, by their exact names only, never
    through a symlink. The caller holds the writer lock."""
    import re
    for name in os.listdir(path):
        if not re.fullmatch(r"rank\d+", name):
            continue
        d = os.path.join(path, name)
        check_dir(d)
        for f in os.listdir(d):
            if re.fullmatch(r"slots-\d{4}\.kvs", f):
                os.unlink(os.path.join(d, f))
    idx = os.path.join(path, "index")
    if os.path.lexists(idx):
        check_dir(idx)
        for f in ("data.mdb", "lock.mdb"):
            if os.path.lexists(os.path.join(idx, f)):
                os.unlink(os.path.join(idx, f))
        try:
            os.rmdir(idx)
        except OSError:
            pass



class WriterLock:
    """The exclusive store lock of an offline repair (`kvstore fsck --repair`): refused
    while any engine is attached (StoreLocked naming one), and no engine attaches while it
    is held. `holder()` names an attached engine's pid, or None."""

    def __init__(self, store_dir: str):
        self._lock = StoreLock(store_dir, exclusive=True)

    @staticmethod
    def holder(store_dir: str) -> int | None:
        pids = StoreLock.holders(store_dir)
        return pids[0] if pids else None

    def release(self):
        self._lock.release()


class _SharedClaim:
    """`Index.reserve`'s pinned set for a store shared with other engines: a slot is
    refused when this process pins it, or when clearing its shared generation finds
    another engine pinning it (`SharedMap.try_clear`), or an engine attached since the
    peers were listed (its pins are not among them)."""

    def __init__(self, own, lease):
        self.own, self.slots, self.lease = own, lease.slots, lease
        self.epoch = lease.epoch        # before the list: an engine attaching later moves it
        self.peers = lease.peers()

    def __contains__(self, s) -> bool:
        if s in self.own:
            return True
        for _ in range(3):
            if self.lease.epoch == self.epoch:
                break
            # an engine came or went: list them again (inside the reservation's LMDB
            # transaction, so without the ATTACH lock)
            self.epoch = self.lease.epoch
            self.peers = self.lease.peers(probe=False)
        return not self.slots.try_clear(s, self.peers, self.epoch)

    def __len__(self) -> int:
        return len(self.own)


class DiskStore:
    """A kvstore store: directory, index and (optionally) every rank's data path.

    `DiskStore.create(path, layout, capacity)` makes a new store; `DiskStore(path, layout)`
    opens one and refuses it with LayoutMismatch naming the differing field. Exactly one
    writer per process; any number of engine processes attach to one store together
    (`kvstore.store.shared`: a shared flock on LOCK and a lease each; `exclusive=True` is an
    offline repair's open, refused while any engine is attached) and any number of
    `readonly=True` openers. With `io=True` the store also opens a RankIO per rank so
    that `put`/`get` work (tools, tests, benchmarks), each ring `queue_depth` slots deep,
    deeper for small slots until `inflight_bytes` are in flight (`kvstore.io.rings`); the
    vLLM scheduler uses io=False and its workers use RankIO directly.

    Pins are in memory (a Counter of slot -> pin count): eviction never takes a pinned
    slot, and pins die with the process, as they must.
    """

    def __init__(self, path: str, layout: Layout | None = None, *, readonly: bool = False,
                 io: bool = False, io_mode: str = "direct", queue_depth: int = 32,
                 staging_bytes: int = 64 << 20, sync: bool = True, data_dirs=None,
                 exclusive: bool = False, kind: str = "engine",
                 inflight_bytes: int = INFLIGHT_BYTES):
        check_choice("io_mode", io_mode, IO_MODES)
        self.path = os.path.abspath(path)
        self.readonly = readonly
        self._pid = os.getpid()
        self._lock = None
        self.lease: Lease | None = None
        self.index = None
        self.ranks: list[RankIO] = []
        self._pins: Counter = Counter()
        check_dir(self.path)
        self.layout, self.geometry, self.fingerprint = read_fingerprint(self.path)
        if layout is not None:
            check_layout(self.path, self.layout, layout)
        check_data_dirs(self.path, self.fingerprint, data_dirs)
        self.data_dirs = device_dirs(self.path, self.fingerprint)
        try:
            if not readonly:
                self._lock = StoreLock(self.path, exclusive=exclusive)
            idx = os.path.join(self.path, "index")
            if not os.path.isdir(idx):
                from kvstore.errors import CorruptIndex
                raise CorruptIndex(f"store {self.path} has no index/ directory; rebuild it from the "
                                   "slot headers with `kvstore fsck --rebuild-index`")
            self.index = Index(idx, self.geometry.num_slots, readonly=readonly, sync=sync)
            if not readonly and exclusive:
                self._reclaim(None)
            elif not readonly:
                self.lease = Lease(self.path, self.geometry.num_slots, self._reclaim, kind=kind)
                self.index.owner = self.lease.owner
                self.index.shared_slots = self.lease.slots
                if self.lease.slots.load(W_VALID) != 1:
                    # The first engine of a run (or one after a first that died before it
                    # finished): the generations from LMDB, under its writer lock, so no
                    # other engine's commit or eviction interleaves. Every writer open
                    # returns with them complete: hits are checked from the first lookup.
                    self.index.rebuild_generations(self.lease.slots, W_VALID)
                # fenced (failed) devices: no reservation or commit of this writer uses them
                self.index.set_devices(self.geometry.num_devices)
            if io:
                for r in range(self.layout.tp_size):
                    self.ranks.append(RankIO(self.path, r, io_mode=io_mode, queue_depth=queue_depth,
                                             staging_bytes=staging_bytes, readonly=readonly,
                                             inflight_bytes=inflight_bytes))
        except BaseException:
            self.close()
            raise

    def _reclaim(self, owner: bytes | None) -> None:
        """Reservations nobody will commit: a dead engine's (owner), or with None every
        one (this process is the only one attached: a previous run's crash)."""
        if owner is None:
            n = self.index.reclaim_reserved()
            if n:
                log.info("reclaimed %d slots reserved by a previous run that never committed", n)
        else:
            self.index.reclaim_owner(owner)

    @property
    def shared_slots(self):
        """The store's shared slot generations (`kvstore.store.shared`), or None (read-only,
        exclusive)."""
        return self.lease.slots if self.lease is not None else None

    @classmethod
    def create(cls, path: str, layout: Layout, capacity, *, exist_ok: bool = False,
               data_dirs=None, identity=None, **kw) -> "DiskStore":
        """Create a store of `capacity` bytes (int or '500G') for `layout`, then open it.

        `data_dirs` (one directory per device) spreads the slots over several devices:
        slot s on data_dirs[s % len(data_dirs)]; the index, fingerprint and lock stay in
        `path`. Each data directory must exist and have room for its share. `identity`
        (a `ModelIdentity`) is recorded in the fingerprint."""
        capacity_bytes = parse_size(capacity)
        dirs = normalize_data_dirs(data_dirs)
        geo = StoreGeometry.for_capacity(capacity_bytes, layout, len(dirs) if dirs else 1)
        path = os.path.abspath(path)
        if os.path.lexists(os.path.join(path, "kvstore.json")):
            if not exist_ok:
                raise KVStoreError(f"a store already exists at {path}; open it instead")
            return cls(path, layout, data_dirs=data_dirs, **kw)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise StoreNotFound(f"parent directory {parent} does not exist")
        direct = kw.get("io_mode", "direct") == "direct"
        if dirs:
            for d in dirs:
                check_data_dir(d, direct)
            check_distinct_dirs(dirs)
        _safe_mkdir(path)
        lock = WriterLock(path)
        devices = dirs or [path]
        try:
            if os.path.lexists(os.path.join(path, "kvstore.json")):
                # Another process finished creating it while we waited for the lock.
                lock.release()
                if not exist_ok:
                    raise KVStoreError(f"a store already exists at {path}; open it instead")
                return cls(path, layout, data_dirs=data_dirs, **kw)
            # A creation that was killed before it wrote the fingerprint left slot files
            # and an index behind; they belong to no store (nothing opens a directory
            # without kvstore.json) and would make every later creation fail.
            _remove_unfinished_store(path)
            check_free_space(path, devices, geo, layout.tp_size)
            if dirs:
                for d, ddir in enumerate(dirs):
                    if ddir != path:
                        claim_data_dir(ddir, path, d)
        except BaseException:
            lock.release()
            raise
        created = []
        try:
            for d, ddir in enumerate(devices):
                for r in range(layout.tp_size):
                    _safe_mkdir(rank_dir(ddir, r))
                    for i in range(geo.device_files(d)):
                        p = slot_file_path(ddir, r, i)
                        SlotFile(p, geo.slot_size, geo.device_file_slots(d, i),
                                 direct=direct, create=True).close()
                        created.append(p)
                    create_iostats(ddir, r)
            Index(os.path.join(path, "index"), geo.num_slots, create=True).close()
            # The fingerprint is written last: a store without it is not a store, so a
            # crash during creation leaves nothing that could be opened half-made.
            write_fingerprint(path, layout, geo, capacity_bytes, dirs, identity)
            for d, ddir in enumerate(dirs or []):
                if ddir != path:
                    write_marker(ddir, path, d, complete=True)
        except BaseException:
            for p in created:
                try:
                    os.unlink(p)
                except OSError:
                    pass
            lock.release()
            raise
        lock.release()
        return cls(path, layout, data_dirs=data_dirs, **kw)

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Close ranks, index and lock (idempotent). Pins are dropped. In a child forked
        from the process that opened it, nothing is given back or closed: the store, its
        lease and its reservations are the parent's (`kvstore.store.shared` drops the child's
        copies of the lock files at fork, `kvstore.index.core` its LMDB environments)."""
        if self._pid != os.getpid():
            self.ranks, self.index, self.lease, self._lock = [], None, None, None
            self._pins.clear()
            return
        try:
            for r in self.ranks:
                r.close()
            self.ranks = []
            if self.index is not None:
                index, self.index = self.index, None
                if self.lease is not None:
                    # What this engine still holds (a store cut short by the shutdown)
                    # goes back now: with other engines attached, nobody else would.
                    try:
                        index.reclaim_owner(self.lease.owner)
                    except KVStoreError as exc:
                        log.warning("kvstore: could not give back this engine's reservations "
                                    "(%s); the next engine to start alone reclaims them", exc)
                index.close()
        finally:
            if self.lease is not None:
                self.lease.close()
                self.lease = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            self._pins.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self) -> bool:
        return self.index is None

    def _idx(self) -> Index:
        if self.index is None:
            raise StoreClosed(f"store {self.path} is closed")
        return self.index

    def writable_index(self) -> Index:
        """The store's LMDB index for writing (KVStoreError if the store is read-only):
        the serving index's thread writes through it."""
        idx = self._idx()
        if self.readonly:
            raise KVStoreError(f"store {self.path} is open read-only")
        return idx

    # -- index side (no I/O) ---------------------------------------------------------
    def longest_prefix(self, keys: Sequence[bytes]) -> list[Entry]:
        """Entries of the longest run of `keys` (from the first) that is cached."""
        return self._idx().longest_prefix(keys)

    def lookup(self, key: bytes) -> Entry | None:
        return self._idx().lookup(key)

    def present(self, keys: Sequence[bytes]) -> dict[bytes, int]:
        """{key: slot} for each of `keys` the index holds: one read transaction (a lookup
        per key costs a transaction each, tens of microseconds)."""
        return {k: s for k, s, _ in self._idx().get_many(keys)}

    def pin(self, slots: Iterable[int]) -> None:
        """Protect slots from eviction until unpinned (counted: pin twice, unpin twice).
        Attached to a shared store, the pins are in this engine's lease too, where the
        other engines' evictions see them."""
        slots = list(slots)
        self._pins.update(slots)
        if self.lease is not None and slots:
            self.lease.pins.add32(slots, 1)

    def unpin(self, slots: Iterable[int]) -> None:
        gone = []
        for s in slots:
            c = self._pins.get(s, 0)
            if c == 0:
                continue
            gone.append(s)
            if c <= 1:
                self._pins.pop(s, None)
            else:
                self._pins[s] = c - 1
        if self.lease is not None and gone:
            self.lease.pins.add32(gone, -1)

    def _still_standing(self, entries: list) -> list:
        """After pinning them: the longest prefix of entries whose slots still hold their
        generations (another engine may have evicted one just before the pin)."""
        sm = self.shared_slots
        if sm is None or sm.load(W_VALID) != 1:     # not shared, or the array is being built
            return entries
        for i, e in enumerate(entries):
            if sm.generation(e.slot) != e.generation:
                return entries[:i]
        return entries

    @property
    def pinned_slots(self) -> int:
        return len(self._pins)

    def reserve(self, keys: Sequence[bytes]) -> tuple[list[SlotRef], list[Entry]]:
        """Reserve one slot per new key, evicting LRU unpinned entries; StoreFull if impossible."""
        if self.lease is None:
            items, evicted = self.writable_index().reserve(list(keys), self._pins.keys())
            return [SlotRef(k, s, g) for k, s, g in items], evicted
        self.lease.reap(self._reclaim)  # a dead engine's pins and reservations go first
        claim = _SharedClaim(self._pins.keys(), self.lease)
        items, evicted = self.writable_index().reserve(list(keys), claim)
        return [SlotRef(k, s, g) for k, s, g in items], evicted

    def commit(self, refs: Sequence[SlotRef]) -> None:
        """Point keys at their (durably written) slots, in one transaction."""
        items = [(r.key, r.slot, r.generation) for r in refs]
        # (the index publishes the new entries' generations to the other engines inside
        # the commit's transaction)
        self.writable_index().commit(items)

    def abort(self, refs: Sequence[SlotRef]) -> None:
        """Give reserved slots back (the write failed or was cancelled)."""
        self.writable_index().abort([(r.key, r.slot, r.generation) for r in refs])

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark a hit prefix most recently used."""
        if keys:
            self.writable_index().touch(list(keys))

    def drop(self, keys: Sequence[bytes]) -> list[Entry]:
        """Remove entries (e.g. a slot that failed verification); their slots become free."""
        return self.writable_index().drop(list(keys))    # retracted in its transaction

    def count_hits(self, hits: int, misses: int) -> None:
        if not self.readonly:
            self._idx().count_hits(hits, misses)

    def stats(self) -> dict:
        s = dict(self._idx().stats())
        s["pinned_slots"] = len(self._pins)
        s["slot_size"] = self.geometry.slot_size
        s["tp_size"] = self.layout.tp_size
        return s

    # -- data path over every rank (tools, tests, benchmarks) -------------------------
    def _rank_io(self) -> list[RankIO]:
        if not self.ranks:
            raise KVStoreError("this DiskStore was opened without io=True; no data path")
        return self.ranks

    def put(self, keys: Sequence[bytes],
            payloads: Callable[[int, int], np.ndarray | bytes] | None = None, *,
            rows: Sequence[np.ndarray] | None = None) -> list[bytes]:
        """Store blocks; returns the keys stored. Their bytes come from `payloads(i, rank)`
        (key i's bytes for that rank, copied into staging), or from `rows` without a copy:
        one 2-D array per rank, `rows[rank][i]` holding key i's payload, rows 4096-aligned
        (O_DIRECT) and a multiple of 4096 bytes wide (`row_buffers` makes such arrays).

        Keys already present are skipped. Reserve -> write every rank -> fdatasync -> commit;
        a block whose write failed on any rank is aborted, never committed.
        """
        if (payloads is None) == (rows is None):
            raise TypeError("DiskStore.put: give payloads or rows")
        if rows is not None:
            _check_rows(rows, self.layout, len(keys), writable=False)
        idx = self.writable_index()
        uniq = list(dict.fromkeys(keys))
        have = {k for k, _, _ in idx.get_many(uniq)}
        new = [k for k in uniq if k not in have]
        if not new:
            return []
        refs, _ = self.reserve(new)
        failed: set[int] = set()
        pos = {k: i for i, k in enumerate(keys)}
        try:
            for rio in self._rank_io():
                if rows is not None:
                    errs = rio.write_at(refs, _row_addrs(rows[rio.rank],
                                                         [pos[r.key] for r in refs]))
                else:
                    def fill(start, stop, views, rank=rio.rank):
                        for j, v in enumerate(views):
                            v[:] = np.frombuffer(payloads(pos[refs[start + j].key], rank),
                                                 dtype=np.uint8)
                    errs = rio.write_blocks(refs, fill)
                failed.update(i for i, e in enumerate(errs) if e is not None)
        except BaseException:
            self.abort(refs)
            raise
        good = [r for i, r in enumerate(refs) if i not in failed]
        bad = [r for i, r in enumerate(refs) if i in failed]
        if bad:
            self.abort(bad)
        self.commit(good)
        return [r.key for r in good]

    def get(self, keys: Sequence[bytes], *, verify: str = "checksum", rank: int | None = None,
            touch: bool = True, count: bool = True) -> dict:
        """Read the longest cached prefix of `keys`: {key: [bytes per rank]} for verified blocks.

        A block that fails verification is dropped from the index and left out (with every
        block after it, since a prefix stops at its first hole). `count=False`: the read
        is not a hit or miss in the store's counters (the fleet agent's publishing).
        """
        out: dict[bytes, list] = {}

        def read(rio, refs):
            for r in refs:
                out.setdefault(r.key, [])

            def drain(start, stop, views, errors):
                for j, v in enumerate(views):
                    if errors[j] is None:
                        out[refs[start + j].key].append(bytes(v))
            return rio.read_blocks(refs, drain, verify=verify)
        got = self._read_prefix(keys, read, rank, touch, count)
        return {k: out.get(k, []) for k in got}

    def get_into(self, keys: Sequence[bytes], rows: Sequence[np.ndarray], *,
                 verify: str = "checksum", touch: bool = True, count: bool = True) -> list[bytes]:
        """`get` without a copy: the longest cached prefix of `keys` read straight into
        `rows` (as for `put`: `rows[rank][i]` receives keys[i]'s payload); returns the keys
        of that prefix whose rows hold verified bytes (every rank's)."""
        _check_rows(rows, self.layout, len(keys), writable=True)

        def read(rio, refs):
            return rio.read_at(refs, _row_addrs(rows[rio.rank], range(len(refs))), verify=verify)
        return self._read_prefix(keys, read, None, touch, count)

    def _read_prefix(self, keys, read, rank, touch, count) -> list[bytes]:
        """The reads of `get` and `get_into`: the prefix of `keys` the index holds, pinned
        while `read(rio, refs)` reads it on every rank (or `rank`); the keys before the first
        block that failed on any rank. A failed block leaves the index."""
        entries = self.longest_prefix(keys)
        if entries:
            self.pin(e.slot for e in entries)
            kept = self._still_standing(entries)
            if len(kept) < len(entries):
                self.unpin(e.slot for e in entries[len(kept):])
                entries = kept
        if not entries:
            if count:
                self.count_hits(0, 1)
            return []
        refs = [SlotRef(e.key, e.slot, e.generation) for e in entries]
        bad: set[int] = set()
        try:
            for rio in self._rank_io():
                if rank is None or rio.rank == rank:
                    errs = read(rio, refs)
                    bad.update(i for i, e in enumerate(errs) if e is not None)
        finally:
            self.unpin(r.slot for r in refs)
        good = [r.key for r in refs[:min(bad) if bad else len(refs)]]
        if bad and not self.readonly:
            self.drop([refs[i].key for i in sorted(bad)])
        if touch and good and not self.readonly:
            self.touch(good)
        if count:
            self.count_hits(len(good), 0 if len(good) == len(keys) else 1)
        return good


def row_buffers(layout: Layout, n: int) -> list[np.ndarray]:
    """One array per rank of `n` rows, each row one block's payload (rounded up to 4096
    bytes), page-aligned: what `DiskStore.put(rows=)` and `get_into` move blocks to and
    from without a copy, and what `RankIO.register_memory` can register."""
    width = -(-layout.block_bytes // 4096) * 4096
    return [np.frombuffer(mmap.mmap(-1, n * width), dtype=np.uint8).reshape(n, width)
            for _ in range(layout.tp_size)]


def _check_rows(rows, layout: Layout, n: int, *, writable: bool) -> None:
    """Refuse `rows` that cannot take `n` blocks of every rank (the ring writes a whole
    row at each address it is given, so a short array would be overrun)."""
    width = -(-layout.block_bytes // 4096) * 4096
    if len(rows) != layout.tp_size:
        raise ValueError(f"rows: one array per rank ({layout.tp_size}), got {len(rows)}")
    for r, a in enumerate(rows):
        if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype != np.uint8 \
                or a.strides[1] != 1 or a.shape[1] < width or a.shape[0] < n:
            raise ValueError(f"rows[{r}]: need a 2-D uint8 array of at least {n} rows of "
                             f"{width} contiguous bytes (kvstore.store.disk.row_buffers makes "
                             f"one), got {getattr(a, 'shape', type(a).__name__)}")
        if writable and not a.flags.writeable:
            raise ValueError(f"rows[{r}] is read-only; reads need writable memory")


def _row_addrs(arr: np.ndarray, idx) -> np.ndarray:
    """Addresses of rows `idx` of the 2-D array `arr`."""
    base = arr.__array_interface__["data"][0]
    return np.uint64(base) + np.asarray(list(idx), dtype=np.uint64) * np.uint64(arr.strides[0])


ON_MODEL_CHANGE = ("reset", "refuse")


def ensure_store(path: str, layout: Layout, capacity=None, *, io_mode: str = "direct",
                 create: bool = True, data_dirs=None, identity=None,
                 on_model_change: str = "reset") -> str:
    """Make sure a store for `layout` exists at `path`; create it once, race-free.

    Every process of a serving engine (scheduler and each TP worker) calls this at start;
    the first one creates the store under a blocking flock, the others wait for it and
    then read the same geometry from kvstore.json, so all ranks agree on the slot count
    without talking to each other. Refuses a store of another layout (LayoutMismatch),
    or, when `data_dirs` is given, a store over other data directories (LayoutMismatch
    naming `data_dirs`; None accepts the store's own).

    With `identity` (the engine's `ModelIdentity`), a store whose recorded identity
    differs (or that records none) never serves this engine: `on_model_change="reset"`
    re-initialises it (`reset_store`, logged with what changed and the blocks dropped),
    "refuse" raises LayoutMismatch naming the field. A store other engines are attached
    to is never reset (two models on one path are refused).
    """
    path = os.path.abspath(path)
    fp = os.path.join(path, "kvstore.json")
    if on_model_change not in ON_MODEL_CHANGE:
        raise ConfigError(f"on_model_change={on_model_change!r} is not valid; choose one of "
                          f"{', '.join(ON_MODEL_CHANGE)}")
    if not os.path.lexists(fp) and os.path.isdir(path) and not os.path.islink(path):
        with _CreateLock(path):     # a creation or re-initialisation under way ends first
            pass
    if not os.path.lexists(fp):
        if not create:
            raise StoreNotFound(f"no kvstore store at {path} and create is false")
        if capacity is None:
            raise ConfigError(f"no kvstore store at {path} yet: give a capacity (e.g. \"500G\") "
                              "to create one")
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise StoreNotFound(f"cannot create store {path}: parent directory {parent} does not exist")
        _safe_mkdir(path)
        with _CreateLock(path):
            if not os.path.lexists(fp):
                DiskStore.create(path, layout, capacity, io_mode=io_mode, data_dirs=data_dirs,
                                 identity=identity).close()
    check_dir(path)
    try:
        stored, _, doc = read_fingerprint(path)
    except StoreNotFound:
        with _CreateLock(path):     # another process of the engine is re-initialising it
            pass
        stored, _, doc = read_fingerprint(path)
    check_layout(path, stored, layout)
    check_data_dirs(path, doc, data_dirs)
    if identity is not None and _identity_changes(doc, identity):
        with _CreateLock(path):     # one process of the engine resets, the others wait
            stored, _, doc = read_fingerprint(path)
            check_layout(path, stored, layout)
            diffs = _identity_changes(doc, identity)
            if diffs:
                if on_model_change == "refuse":
                    raise LayoutMismatch(
                        f"store {path} holds KV of another model: {describe_differences(diffs)}; "
                        f"refusing to serve it (on_model_change=\"refuse\"). Give this model "
                        "another store path, delete the store, or set on_model_change to "
                        "\"reset\" to re-initialise it.", field=f"model_identity.{diffs[0][0]}")
                reset_store(path, layout, doc, identity, diffs, io_mode=io_mode)
    return path


class _CreateLock:
    """flock on STORE/.create.lock: serialises creating and re-initialising a store
    among the processes of the engines starting on it."""

    def __init__(self, path: str):
        self.fd = os.open(os.path.join(path, ".create.lock"),
                          os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _identity_changes(doc: dict, identity) -> list[tuple[str, str, str]]:
    """How the store's recorded identity differs from `identity`: (field, stored, now)."""
    stored = stored_identity(doc)
    if stored is None:
        return [("model_identity", "unrecorded", identity.weights)]
    return stored.differences(identity)


def reset_store(path: str, layout: Layout, doc: dict, identity, diffs, *,
                io_mode: str = "direct") -> int:
    """Re-initialise the store at `path` for the model `identity`: every block is dropped
    and the store is made anew with the same capacity and data directories, so nothing of
    the old KV can be served or re-indexed (its slot files are deleted, not just
    unindexed). Refused (StoreLocked) while any engine is attached: it serves the old
    model. Returns the blocks dropped. The caller holds the creation lock.

    Crash-safe through the creation protocol: the data directories' markers go back to
    incomplete and kvstore.json is removed first, so a crash part way leaves a directory
    that the next start creates anew (a store without kvstore.json is not a store)."""
    try:
        lock = WriterLock(path)
    except StoreLocked as exc:
        raise StoreLocked(
            f"store {path} holds KV of another model ({describe_differences(diffs)}) and "
            f"engine(s) serving that model are attached ({exc}); two models on one path are "
            "refused: give this model another store path, or stop them first.",
            pid=exc.pid) from None
    try:
        try:
            with Index(os.path.join(path, "index"), int(doc["num_slots"]), readonly=True) as idx:
                dropped = int(idx.stats()["used_slots"])
        except Exception:       # noqa: BLE001 - an unreadable index loses nothing more
            dropped = -1
        dirs = doc.get("data_dirs")
        for d, ddir in enumerate(dirs or []):
            if ddir != path:
                write_marker(ddir, path, d, complete=False)
        os.unlink(os.path.join(path, "kvstore.json"))
        _fsync_dir(path)
        _remove_unfinished_store(path)
    finally:
        lock.release()
    DiskStore.create(path, layout, int(doc["capacity_bytes"]), io_mode=io_mode,
                     data_dirs=dirs, identity=identity).close()
    log.warning("kvstore: store %s was written by another model (%s); re-initialised it for "
                "this one: %s block(s) dropped (on_model_change=\"reset\"; set \"refuse\" to "
                "be refused instead)", path, describe_differences(diffs),
                "?" if dropped < 0 else dropped)
    return dropped


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
