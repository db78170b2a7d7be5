"""The LMDB index of a store: key -> slot, slot -> key, LRU order, free slots, counters.

Owns the `STORE/index/` LMDB environment and nothing else. It never touches slot files,
never checks payloads and knows nothing about vLLM: keys are opaque bytes (block hash + KV
group id), slots are ints in ``[0, capacity_slots)``.

Named databases (every value struct-packed, never pickled):

===========  ==========================  =====================================
db           key                         value
===========  ==========================  =====================================
``keys``     key bytes                   slot u32, generation u64, tick u64 (LE)
``slots``    slot u32 BE                 key bytes
``lru``      tick u64 BE + slot u32 BE   empty (first row = eviction victim)
``free``     slot u32 BE                 empty (only slots given back)
``reserved`` slot u32 BE                 generation u64 LE + key bytes
``meta``     counter name                u64 LE
``owned``    owner id (12 B) + slot BE   empty (the engine holding a reservation)
===========  ==========================  =====================================

Every slot is in exactly one of three states: *used* (a row in keys/slots/lru), *free*
(a row in ``free``, or ``>= meta.high_water``; the latter makes creating a 10M-slot index
O(1)) or *reserved* (a row in ``reserved``: handed to an in-flight store, not yet
committed). ``used + free + reserved == capacity`` always; `Index.check_consistency` verifies it.

Several writers: every engine attached to the store (`kvstore.store.shared`) writes through its
own `Index`; LMDB serializes their write transactions. A reservation made with `owner` set
is also a row of ``owned``, so the survivors give a dead engine's reservations back
(`reclaim_owner`). Any number of readonly openers (tools) may run at the same time.
Pins live in the engines' memory (shared maps) and are passed to `Index.reserve` or checked
by `reserve_pool`'s claim.
"""

from __future__ import annotations

import array
import errno
import logging
import os
import struct
import threading
import weakref
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import lmdb

from kvstore.errors import ConfigError, CorruptIndex, KVStoreError, StoreClosed, StoreFull

__all__ = ["Entry", "Index", "IndexDBs", "FORMAT_VERSION", "SLOT_KEY", "COUNTER", "LRU_KEY",
           "ENTRY_VALUE", "make_entry"]

FORMAT_VERSION = 1

# The row codecs (docs/FORMAT.md), public for the maintenance code (`kvstore.index.maint`).
SLOT_KEY = _U32 = struct.Struct(">I")   # slot keys: big-endian so LMDB order == numeric order
COUNTER = _U64 = struct.Struct("<Q")    # meta counters, reservation generation
LRU_KEY = _LRU = struct.Struct(">QI")   # tick then slot: ordered by age, unique per slot
ENTRY_VALUE = _VAL = struct.Struct("<IQQ")   # keys-db value: slot, generation, tick

_DB_NAMES = (b"keys", b"slots", b"lru", b"free", b"reserved", b"meta", b"owned")
_COUNTERS = (b"capacity", b"high_water", b"tick", b"generation", b"hits", b"misses",
             b"evictions", b"duplicates", b"stale_commits", b"format")

_MAX_SLOTS = 1 << 32
# A fenced (failed) device of a store over several data directories: meta row
# b"fenced.<d>" = u32 LE reason code, u32 LE unix time (8 bytes, like every meta row).
FENCE_PREFIX = b"fenced."
_FENCE = struct.Struct("<II")
FENCE_REASONS = {1: "io_error", 2: "missing", 3: "readonly", 4: "foreign"}
_FENCE_CODE = {v: k for k, v in FENCE_REASONS.items()}
_MIN_MAP = 1 << 24
_REBUILD_HINT = "run `kvstore fsck --rebuild-index` to rebuild it from the slot files"
_ITER_CHUNK = 4096
_PAUSE_EVERY = 64


@dataclass(frozen=True, slots=True)
class Entry:
    key: bytes
    slot: int
    generation: int
    tick: int


# A frozen dataclass's __init__ goes through object.__setattr__ per field; setting the slot
# descriptors directly is ~2x faster, which matters in longest_prefix (1000s of entries/call).
_new = object.__new__
_set_key = Entry.key.__set__        # type: ignore[attr-defined]
_set_slot = Entry.slot.__set__      # type: ignore[attr-defined]
_set_gen = Entry.generation.__set__  # type: ignore[attr-defined]
_set_tick = Entry.tick.__set__      # type: ignore[attr-defined]


def _entry(key: bytes, slot: int, gen: int, tick: int) -> Entry:
    e = _new(Entry)
    _set_key(e, key)
    _set_slot(e, slot)
    _set_gen(e, gen)
    _set_tick(e, tick)
    return e


make_entry = _entry     # (public name, for the maintenance code)


@dataclass(frozen=True, slots=True)
class IndexDBs:
    """The LMDB database handles of an open index (docs/FORMAT.md, "Index")."""
    keys: object
    slots: object
    lru: object
    free: object
    reserved: object
    meta: object
    owned: object


_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadValsizeError)


def _guard(fn):
    """Turn a damaged record (bad length, garbage bytes) into CorruptIndex, not a crash.

    Every value read from LMDB is struct-unpacked; a record that does not parse means the
    index was damaged on disk. Callers get a KVStoreError naming the repair, never a
    struct.error or an lmdb internal error from deep inside.
    """
    import functools
    import inspect

    def convert(exc):
        return CorruptIndex(f"index record unreadable in {fn.__name__}() ({type(exc).__name__}: {exc}); "
                            f"{_REBUILD_HINT}, or `kvstore fsck --repair` to drop damaged rows")

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(*a, **kw):
            try:
                yield from fn(*a, **kw)
            except (struct.error, UnicodeDecodeError, lmdb.CorruptedError, lmdb.PageNotFoundError,
                    lmdb.BadValsizeError) as exc:
                raise convert(exc) from exc
        return gen

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except (struct.error, UnicodeDecodeError, lmdb.CorruptedError, lmdb.PageNotFoundError,
                lmdb.BadValsizeError) as exc:
            raise convert(exc) from exc
    return wrapper


class _MapGuard:
    """This process's transactions vs. re-mapping its environment (`set_mapsize`: growing
    the map, or adopting a size another process grew it to). LMDB requires that no
    transaction of the process is open while it re-maps, and py-lmdb invalidates every
    open one; with a store shared by several engines the scheduler thread reads LMDB
    (another engine's blocks) while the index thread writes, and every engine meets the
    other engines' growth (MDB_MAP_RESIZED) at its next transaction. Transactions hold
    the guard shared; a re-map waits until none is open, and while it waits or runs no
    new one begins (else a thread that reads in a loop starves it), except in a thread
    that holds one already."""

    __slots__ = ("_cond", "_active", "_resizing", "_pending", "_local")

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._active = 0
        self._resizing = False
        self._pending = 0
        self._local = threading.local()

    def enter(self) -> None:
        depth = getattr(self._local, "depth", 0)
        with self._cond:
            while depth == 0 and (self._resizing or self._pending):
                self._cond.wait()
            self._active += 1
        self._local.depth = depth + 1

    def exit(self) -> None:
        self._local.depth -= 1
        with self._cond:
            self._active -= 1
            if self._active == 0:
                self._cond.notify_all()

    def remap(self, fn, timeout: float | None) -> bool:
        """Run fn() while no transaction of this process is open; False when this thread
        holds one itself, or none could be had within `timeout` seconds."""
        if getattr(self._local, "depth", 0):
            return False
        with self._cond:
            self._pending += 1
            try:
                ok = self._cond.wait_for(lambda: self._active == 0 and not self._resizing,
                                         timeout)
            finally:
                self._pending -= 1
            if not ok:
                self._cond.notify_all()     # the transactions held back may begin
                return False
            self._resizing = True
        try:
            fn()
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()
        return True


class _ReadTxn:
    """A read transaction holding the map guard until it ends (`with`, or `abort()`)."""

    __slots__ = ("_txn", "_guard")

    def __init__(self, txn, guard: _MapGuard):
        self._txn, self._guard = txn, guard

    def __enter__(self):
        return self._txn

    def __exit__(self, *exc):
        self.abort()

    def abort(self) -> None:
        g, self._guard = self._guard, None
        if g is not None:
            try:
                self._txn.abort()
            finally:
                g.exit()

    def __getattr__(self, name):
        return getattr(self._txn, name)


# A step thread that meets MDB_MAP_RESIZED waits this long for the other thread's
# transaction to end before it gives up (a KVStoreError: the lookup is a miss); the index
# thread may be inside a write transaction that waits for the step thread's lock.
_REMAP_WAIT_S = 0.05

# Indexes of this process: a child forked from it must never use (or close) them.
_OPEN: "weakref.WeakSet[Index]" = weakref.WeakSet()
_INHERITED: list = []


def _forget_after_fork() -> None:
    """In a forked child: LMDB environments must not be used across fork, and closing one
    (as py-lmdb does when it is freed) would clear the parent's reader slots (LMDB clears
    those of the pid that opened it). Each inherited environment is kept, unused, until
    the child exits; its Index reads as closed."""
    for ix in list(_OPEN):
        env = ix.__dict__.get("_env")
        if env is not None:
            _INHERITED.append(env)
            ix._env = None


os.register_at_fork(after_in_child=_forget_after_fork)


class Index:
    """The LMDB index of one store. See the module docstring for the layout.

    Not thread-safe: one owner thread per instance (the scheduler); LMDB itself keeps
    readers in other processes consistent.
    """

    def __init__(self, path: str, capacity_slots: int | None = None, *, create: bool = False,
                 readonly: bool = False, sync: bool = True, map_size: int | None = None):
        if create and readonly:
            raise ConfigError("Index: create=True and readonly=True are exclusive")
        self._path = os.fspath(path)
        self._readonly = readonly
        self._sync = sync
        self._env: lmdb.Environment | None = None
        self._pending_hits = 0
        self._pending_misses = 0
        # fsyncs of the index by thread id: benchmarks prove which thread pays for them
        # (`kvstore bench connector` checks that vLLM's scheduler thread never does).
        self.fsyncs_by_thread: Counter = Counter()
        # Called every _PAUSE_EVERY rows inside long write transactions (commit, touch,
        # drop, reserve_pool) when set: the serving index's background thread releases
        # the GIL there, so vLLM's scheduler thread never waits long for it.
        self.pause = None
        # Fenced devices (`set_devices`, `fence_device`): (ndev, frozenset of devices).
        # Their slots are never reserved and never committed; free slots of them stay free.
        self._fence: tuple[int, frozenset] = (1, frozenset())
        # With a fenced device, the free list can hold only fenced slots (a full store):
        # `reserve_pool` then skips scanning it until a write may have freed another slot
        # (`_free_epoch` counts those writes; `_free_dry` is the epoch of the last scan
        # that found the list exhausted).
        self._free_epoch = 0
        self._free_dry = -1
        # The engine (`kvstore.store.shared.Lease.owner`) whose reservations this handle makes:
        # each one is also a row of `owned`, so survivors can give them back if it dies.
        self.owner: bytes | None = None
        # The store's shared slot generations (`kvstore.store.shared`; None when not shared):
        # commits publish, drops and fences retract inside their write transaction, so
        # every change to them is ordered by LMDB's writer lock with the other engines'
        # (an eviction claim clears them inside its transaction too). `_undo` holds what
        # the current write transaction changed, put back if it does not commit.
        self.shared_slots = None
        self._undo: list | None = None
        self._map = _MapGuard()
        data = os.path.join(self._path, "data.mdb")
        for p in (self._path, data, os.path.join(self._path, "lock.mdb")):
            # LMDB opens its files without O_NOFOLLOW: refuse links here, as every other
            # file of a store is refused (a link could point the index anywhere).
            if os.path.islink(p):
                raise CorruptIndex(
                    f"refusing index {p}: it is a symlink (kvstore never follows symlinks "
                    f"inside a store); move the real files into place, or {_REBUILD_HINT}")
        exists = os.path.isfile(data)
        if create and not exists:
            if capacity_slots is None or not 0 < capacity_slots <= _MAX_SLOTS:
                raise ConfigError(
                    f"Index: capacity_slots must be in 1..{_MAX_SLOTS} to create an index "
                    f"(got {capacity_slots!r})")
            os.makedirs(self._path, mode=0o700, exist_ok=True)
        elif not exists:
            raise CorruptIndex(f"index not found at {self._path} (no data.mdb); {_REBUILD_HINT}")
        if map_size is None:
            # Room for ~2x the steady-state footprint (~200 B/entry) so that growth is rare.
            cap = capacity_slots or 0
            map_size = max(_MIN_MAP, cap * 512)
        try:
            env = lmdb.open(self._path, map_size=map_size, subdir=True, readonly=readonly,
                            lock=True, sync=False, metasync=False, create=create, max_dbs=8, mode=0o700,
                            readahead=False, max_spare_txns=4)
        except lmdb.Error as e:
            if "already open in this process" in str(e):
                # LMDB forbids two handles on one env in a process (its locks would break).
                raise KVStoreError(
                    f"index at {self._path} is already open in this process; share that "
                    f"Index instead of opening a second one") from e
            raise CorruptIndex(f"cannot open index at {self._path}: {e}; {_REBUILD_HINT}") from e
        self._env = env  # _open_dbs may write (a lagging tick counter): it needs a live env
        try:
            self._open_dbs(env, create and not exists, capacity_slots)
        except BaseException:
            self._env = None
            env.close()
            raise
        _OPEN.add(self)

    # ------------------------------------------------------------------ open / close

    @_guard
    def _open_dbs(self, env: lmdb.Environment, fresh: bool, capacity: int | None) -> None:
        try:
            if self._readonly:
                dbs = [env.open_db(n, create=False) for n in _DB_NAMES[:6]]
                try:    # made by the first writable open: a read-only opener may not find it
                    dbs.append(env.open_db(b"owned", create=False))
                except lmdb.Error:
                    dbs.append(None)
            else:
                with env.begin(write=True) as txn:
                    dbs = [env.open_db(n, txn=txn, create=True) for n in _DB_NAMES]
                    meta = dbs[5]
                    if fresh:
                        for name in _COUNTERS:
                            txn.put(name, _U64.pack(0), db=meta)
                        txn.put(b"capacity", _U64.pack(capacity), db=meta)
                        txn.put(b"format", _U64.pack(FORMAT_VERSION), db=meta)
        except lmdb.Error as e:
            raise CorruptIndex(
                f"index at {self._path} is missing its databases ({e}); {_REBUILD_HINT}") from e
        self._keys, self._slots, self._lru, self._free, self._reserved, self._meta, self._owned = dbs
        with env.begin() as txn:
            raw_cap = txn.get(b"capacity", db=self._meta)
            raw_fmt = txn.get(b"format", db=self._meta)
            if raw_cap is None or raw_fmt is None:
                raise CorruptIndex(f"index at {self._path} has no meta counters; {_REBUILD_HINT}")
            fmt = _U64.unpack(raw_fmt)[0]
            if fmt != FORMAT_VERSION:
                raise CorruptIndex(
                    f"index at {self._path} has format {fmt}, this kvstore reads "
                    f"{FORMAT_VERSION}; {_REBUILD_HINT}")
            self._capacity = _U64.unpack(raw_cap)[0]
            last_tick = 0
            cur = txn.cursor(db=self._lru)
            if cur.last():
                last_tick = _LRU.unpack(cur.key())[0]
            meta_tick = _U64.unpack(txn.get(b"tick", db=self._meta))[0]
        if capacity is not None and capacity != self._capacity:
            raise ConfigError(
                f"Index: {self._path} was created with capacity_slots={self._capacity}, "
                f"opened with {capacity}; resizing an index is not supported (recreate the store)")
        if not self._readonly and last_tick > meta_tick:
            # lru appends rely on tick being past every row; repair a lagging counter.
            self._write(lambda txn: txn.put(b"tick", _U64.pack(last_tick), db=self._meta))

    def close(self) -> None:
        """Flush batched hit counters, sync (when opened with sync=False) and close. Idempotent."""
        env = self._env
        if env is None:
            return
        try:
            if not self._readonly:
                if self._pending_hits or self._pending_misses:
                    self._write(lambda txn: None)
                env.sync(True)
        except (KVStoreError, lmdb.Error) as exc:
            # Closing must not fail (the store's lock is released after this): what is
            # lost are batched hit/miss counters, and commits were already synced.
            logging.getLogger("kvstore.index.core").warning(
                "index at %s: final flush on close failed: %s", self._path, exc)
        finally:
            self._env = None
            env.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        env = getattr(self, "_env", None)
        if env is not None:
            try:
                env.close()
            except Exception:
                pass

    @property
    def capacity_slots(self) -> int:
        self._live()
        return self._capacity

    @property
    def path(self) -> str:
        return self._path

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def closed(self) -> bool:
        return self._env is None

    # -- the maintenance interface: raw transactions and rows, for `kvstore.index.maint`
    # (fsck, rebuild, bulk load). The serving path never uses it.

    @property
    def dbs(self) -> IndexDBs:
        return IndexDBs(self._keys, self._slots, self._lru, self._free, self._reserved,
                        self._meta, self._owned)

    def env(self) -> lmdb.Environment:
        """The open LMDB environment (StoreClosed once closed)."""
        return self._live()

    def read_txn(self):
        """A read transaction: a context manager giving the lmdb txn."""
        return self._read()

    def write_txn(self, fn, *args):
        """Run fn(txn, *args) in one write transaction (rerun after a map resize)."""
        return self._write(fn, *args)

    def counter(self, txn, name: bytes) -> int:
        """A `meta` counter (docs/FORMAT.md) read in `txn`."""
        return self._get(txn, name)

    def set_counter(self, txn, name: bytes, value: int) -> None:
        self._set(txn, name, value)

    # ------------------------------------------------------------------ txn plumbing

    def _live(self) -> lmdb.Environment:
        env = self._env
        if env is None:
            raise StoreClosed(f"index is closed ({self._path})")
        return env

    def _read(self) -> _ReadTxn:
        """A read transaction (a context manager giving the lmdb txn; or `abort()` it)."""
        env = self._live()
        for _ in range(3):
            self._map.enter()
            try:
                txn = env.begin()
            except lmdb.MapResizedError:
                # Another process grew the map past ours: adopt its size (once no
                # transaction of this process is open), then begin again.
                self._map.exit()
                self._map.remap(lambda: env.set_mapsize(0), _REMAP_WAIT_S)
                continue
            except BaseException:
                self._map.exit()
                raise
            return _ReadTxn(txn, self._map)
        raise KVStoreError(f"index at {self._path}: another process grew the map and this "
                           "process's other transactions kept it from adopting the new size; "
                           "retry")

    def _write(self, fn, *args):
        """Run fn(txn, *args) in one write txn; on MapFullError double the map and rerun
        (and adopt a map another process grew). Shared slot generations fn changed
        (`_shared_set`) are put back when fn fails.

        fn must not change Python-side state: a rerun starts from scratch.
        """
        env = self._live()
        if self._readonly:
            raise KVStoreError(f"index at {self._path} is opened read-only")
        ph, pm = self._pending_hits, self._pending_misses
        while True:
            grow = None
            self._map.enter()
            try:
                with env.begin(write=True) as txn:
                    self._undo = []
                    try:
                        if ph or pm:
                            self._add(txn, b"hits", ph)
                            self._add(txn, b"misses", pm)
                        result = fn(txn, *args)
                    except BaseException:
                        # still holding LMDB's writer lock: no other engine changed
                        # these slots since (after the abort one may)
                        self._rollback_shared()
                        raise
                    finally:
                        self._undo = None
                break
            except lmdb.MapResizedError:
                grow = 0            # another process grew the map: adopt its size
            except lmdb.MapFullError:
                grow = env.info()["map_size"] * 2
            except _DAMAGE:
                raise  # a damaged record: @_guard makes it CorruptIndex
            except lmdb.Error as exc:
                # ENOSPC, EIO, ...: the transaction was not committed and nothing changed.
                raise self._write_failed(exc, "committing a transaction") from exc
            finally:
                self._map.exit()
            try:
                if not self._map.remap(lambda: env.set_mapsize(grow), None):
                    raise KVStoreError(
                        f"index at {self._path}: cannot re-map it while this thread has a "
                        "read transaction open")
            except lmdb.Error as exc:
                raise self._write_failed(exc, f"growing its map to {grow} bytes") from exc
        self._pending_hits -= ph
        self._pending_misses -= pm
        return result

    def _shared_set(self, slots: list[int], gens: list[int], before: list[int]) -> None:
        """Inside a write txn: slots[j] holds generation gens[j] (0: nothing) from now on,
        in the shared slot generations (other engines check their hits there); before[j]
        is what the index said until now (put back if the transaction fails)."""
        sm = self.shared_slots
        if sm is None or not slots:
            return
        if self._undo is not None:
            self._undo.append((slots, before))
        sm.publish(slots, gens)

    def _evicted_shared(self, slots: list[int], gens: list[int]) -> None:
        """Inside a write txn: an eviction claim cleared these slots' generations (they
        held gens); put back if the transaction fails."""
        if self.shared_slots is not None and self._undo is not None and slots:
            self._undo.append((slots, gens))

    def _rollback_shared(self) -> None:
        undo, sm = self._undo, self.shared_slots
        if not undo or sm is None:
            return
        for slots, gens in reversed(undo):
            sm.publish(slots, gens)
        undo.clear()

    def reader_check(self) -> int:
        """Clear LMDB reader slots left by dead processes (an engine killed inside a read
        transaction keeps its snapshot pinned otherwise: no page freed since is reused, so
        the file grows with every write, and the slot is lost to the 126 there are).
        Returns how many were cleared."""
        try:
            return self._live().reader_check()
        except lmdb.Error:
            return 0

    def _write_failed(self, exc: Exception, doing: str) -> KVStoreError:
        msg = f"cannot write the index at {self._path} ({doing}): {exc}"
        if ("No space left" in str(exc) or getattr(exc, "errno", None) == errno.ENOSPC
                or (("Input/output error" in str(exc) or getattr(exc, "errno", None) == errno.EIO)
                    and self._fs_full())):
            # LMDB reports a write the full disk cut short as EIO, not ENOSPC
            # (mdb_page_flush: a short pwrite becomes EIO).
            msg += ("; the filesystem is full. Slot files are preallocated, only the index "
                    "grows: free space on that filesystem (until then stores are dropped and "
                    "loads keep working)")
        return KVStoreError(msg)

    def _fs_full(self) -> bool:
        """The index's filesystem has no room for one more page (so an EIO was ENOSPC)."""
        try:
            st = os.statvfs(self._path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < 64 << 10

    def _get(self, txn: lmdb.Transaction, name: bytes) -> int:
        return _U64.unpack(txn.get(name, db=self._meta))[0]

    def _set(self, txn: lmdb.Transaction, name: bytes, value: int) -> None:
        txn.put(name, _U64.pack(value), db=self._meta)

    def _add(self, txn: lmdb.Transaction, name: bytes, delta: int) -> None:
        raw = txn.get(name, db=self._meta)
        txn.put(name, _U64.pack((_U64.unpack(raw)[0] if raw else 0) + delta), db=self._meta)

    # ------------------------------------------------------------------ reads

    @_guard
    def lookup(self, key: bytes) -> Entry | None:
        with self._read() as txn:
            v = txn.get(key, db=self._keys)
        if v is None:
            return None
        s, g, t = _VAL.unpack(v)
        return _entry(key, s, g, t)

    @_guard
    def get_many(self, keys: Sequence[bytes]) -> list[tuple[bytes, int, int]]:
        """(key, slot, generation) of each of `keys` that is in the index (in key order
        of the answer, absent keys left out); one read txn, the B-tree walks in C."""
        if not keys:
            return []
        with self._read() as txn:
            rows = txn.cursor(db=self._keys).getmulti(list(keys))
        out = []
        for k, v in rows:
            s, g, _ = _VAL.unpack(v)
            out.append((bytes(k), s, g))
        return out

    @_guard
    def longest_prefix(self, keys: Sequence[bytes]) -> list[Entry]:
        """Entries of keys[0..i) where keys[i] is the first key not in the index. One read txn."""
        out: list[Entry] = []
        n = len(keys)
        if n == 0:
            return out
        unpack = _VAL.unpack
        append = out.append
        new, set_k, set_s, set_g, set_t = _new, _set_key, _set_slot, _set_gen, _set_tick
        with self._read() as txn:
            cur = txn.cursor(db=self._keys)
            # getmulti does the B-tree walks in C and skips missing keys, so a short result
            # means a miss, at the first position whose returned key differs from the asked
            # one. Chunks grow so that an early miss does not pay for the whole chain.
            pos, chunk = 0, 64
            while pos < n:
                part = keys[pos:pos + chunk]
                rows = cur.getmulti(part)
                full = len(rows) == len(part)
                if not full:
                    i = 0
                    for (rk, _), k in zip(rows, part):
                        if rk != k:
                            break
                        i += 1
                    rows = rows[:i]
                # Inlined Entry construction: this loop is the serving hot path.
                for k, v in rows:
                    e = new(Entry)
                    set_k(e, k)
                    s, g, t = unpack(v)
                    set_s(e, s)
                    set_g(e, g)
                    set_t(e, t)
                    append(e)
                if not full:
                    return out
                pos += chunk
                chunk *= 4
        return out

    @_guard
    def stats(self) -> dict:
        """Counters and sizes; O(1) (meta rows and LMDB db stats, no scan)."""
        env = self._live()
        with self._read() as txn:
            m = {name.decode(): self._get(txn, name) for name in _COUNTERS
                 if txn.get(name, db=self._meta) is not None}
            used = txn.stat(self._keys)["entries"]
            free_rows = txn.stat(self._free)["entries"]
            reserved = txn.stat(self._reserved)["entries"]
            lru_rows = txn.stat(self._lru)["entries"]
            oldest = self._oldest(txn)
        info = env.info()
        cap = m["capacity"]
        return {
            "capacity_slots": cap,
            "used_slots": used,
            "free_slots": free_rows + cap - m["high_water"],
            "reserved_slots": reserved,
            "high_water": m["high_water"],
            "lru_rows": lru_rows,
            "hits": m["hits"] + self._pending_hits,
            "misses": m["misses"] + self._pending_misses,
            "evictions": m["evictions"],
            "duplicates": m.get("duplicates", 0),
            "stale_commits": m.get("stale_commits", 0),
            "tick": m["tick"],
            "oldest_tick": oldest,
            "generation": m["generation"],
            "format": m["format"],
            "map_size": info["map_size"],
            "data_bytes": (info["last_pgno"] + 1) * env.stat()["psize"],
            "readonly": self._readonly,
        }

    def _oldest(self, txn: lmdb.Transaction) -> int | None:
        cur = txn.cursor(db=self._lru)
        return _LRU.unpack(cur.key())[0] if cur.first() else None

    @_guard
    def oldest_tick(self) -> int | None:
        with self._read() as txn:
            return self._oldest(txn)

    # Iterators read in chunks of short transactions rather than holding one snapshot: a
    # long-lived read txn pins old pages (the map grows) and would block map growth in this
    # process. With the writer lock held (fsck, warmup) nothing moves underneath anyway.

    def _chunks(self, db, reverse: bool = False) -> Iterator[list[tuple[bytes, bytes]]]:
        last: bytes | None = None
        while True:
            with self._read() as txn:
                cur = txn.cursor(db=db)
                rows: list[tuple[bytes, bytes]] = []
                if not reverse:
                    ok = cur.set_range(last) if last is not None else cur.first()
                    if ok and last is not None and cur.key() == last:
                        ok = cur.next()
                    while ok and len(rows) < _ITER_CHUNK:
                        rows.append(cur.item())
                        ok = cur.next()
                else:
                    if last is None:
                        ok = cur.last()
                    else:
                        ok = cur.set_range(last)
                        ok = cur.prev() if ok else cur.last()
                    while ok and len(rows) < _ITER_CHUNK:
                        rows.append(cur.item())
                        ok = cur.prev()
            if not rows:
                return
            yield rows
            if len(rows) < _ITER_CHUNK:
                return
            last = rows[-1][0]

    @_guard
    def iter_entries(self) -> Iterator[Entry]:
        """Every committed entry, in key order."""
        for rows in self._chunks(self._keys):
            for k, v in rows:
                yield _entry(k, *_VAL.unpack(v))

    def iter_key_batches(self) -> Iterator[list[bytes]]:
        """Every committed key, in key order, in batches (one read transaction each)."""
        for rows in self._chunks(self._keys):
            yield [k for k, _ in rows]

    @_guard
    def iter_lru(self, hottest_first: bool = False) -> Iterator[Entry]:
        """Committed entries in eviction order (coldest first unless hottest_first)."""
        for rows in self._chunks(self._lru, reverse=hottest_first):
            out = []
            with self._read() as txn:
                for lk, _ in rows:
                    _tick, slot = _LRU.unpack(lk)
                    key = txn.get(_U32.pack(slot), db=self._slots)
                    v = txn.get(key, db=self._keys) if key is not None else None
                    if v is None:
                        continue  # changed since the chunk was read
                    s, g, t = _VAL.unpack(v)
                    if s == slot:
                        out.append(_entry(key, s, g, t))
            yield from out  # outside the txn: see the note above _chunks

    @_guard
    def iter_reserved(self) -> Iterator[tuple[int, int, bytes]]:
        """(slot, generation, key) of every reservation not yet committed or aborted."""
        for rows in self._chunks(self._reserved):
            for sk, v in rows:
                yield _U32.unpack(sk)[0], _U64.unpack_from(v)[0], bytes(v[8:])

    @_guard
    def iter_free(self) -> Iterator[int]:
        """Every free slot: the given-back ones (ascending), then high_water..capacity."""
        for rows in self._chunks(self._free):
            for sk, _ in rows:
                yield _U32.unpack(sk)[0]
        with self._read() as txn:
            hw = self._get(txn, b"high_water")
        yield from range(hw, self._capacity)

    # ------------------------------------------------------------------ writes

    @_guard
    def reserve(self, keys: Iterable[bytes], pinned: Collection[int] = ()
                ) -> tuple[list[tuple[bytes, int, int]], list[Entry]]:
        """Reserve one slot per key that is not already committed; one write txn.

        Keys already in the index, and repeats within `keys`, are skipped (not returned):
        the caller stores only what is returned. Slots come from the free list, then from
        never-used slots, then by evicting the least recently used entries whose slot is not
        in `pinned` (a pinned slot is never handed out, free or not). Each reservation gets a
        fresh generation. Returns ([(key, slot, generation)], evicted entries).

        Raises StoreFull, changing nothing, if not every key can get a slot.
        """
        if not hasattr(pinned, "__contains__") or not hasattr(pinned, "__len__"):
            pinned = set(pinned)
        elif not isinstance(pinned, (set, frozenset)) and hasattr(pinned, "__iter__") \
                and not hasattr(pinned, "peers"):
            pinned = set(pinned)
        if self._fence[1]:
            pinned = _FencedOrPinned(pinned, *self._fence)
        return self._write(self._reserve_txn, list(keys), pinned)

    def _reserve_txn(self, txn, keys, pinned):
        get, put = txn.get, txn.put
        kdb = self._keys
        todo: list[bytes] = []
        seen: set[bytes] = set()
        for k in keys:
            if not k or len(k) > 511:
                raise KVStoreError(f"Index.reserve: key length {len(k)} not in 1..511 bytes")
            if k in seen:
                continue
            seen.add(k)
            if get(k, db=kdb) is None:
                todo.append(k)
        n = len(todo)
        if n == 0:
            return [], []
        slots: list[int] = []
        cur = txn.cursor(db=self._free)
        ok = cur.first()
        while ok and len(slots) < n:
            s = _U32.unpack(cur.key())[0]
            if s in pinned:
                ok = cur.next()
                continue
            slots.append(s)
            cur.delete()
            ok = cur.key() != b""
        cap = self._capacity
        hw = self._get(txn, b"high_water")
        while hw < cap and len(slots) < n:
            if hw not in pinned:
                slots.append(hw)
            else:
                put(_U32.pack(hw), b"", db=self._free)  # keep the accounting whole
            hw += 1
        evicted: list[Entry] = []
        if len(slots) < n:
            sdb = self._slots
            cur = txn.cursor(db=self._lru)
            ok = cur.first()
            while ok and len(slots) < n:
                t, s = _LRU.unpack(cur.key())
                if s in pinned:
                    ok = cur.next()
                    continue
                sk = _U32.pack(s)
                k = txn.pop(sk, db=sdb)
                v = txn.pop(k, db=kdb) if k is not None else None
                if v is None:
                    raise CorruptIndex(
                        f"lru row (tick {t}, slot {s}) has no key/slot rows; {_REBUILD_HINT}")
                _, g, _ = _VAL.unpack(v)
                self._evicted_shared([s], [g])      # `pinned` cleared its generation
                evicted.append(_entry(k, s, g, t))
                slots.append(s)
                cur.delete()
                ok = cur.key() != b""
            if len(slots) < n:
                reserved = txn.stat(self._reserved)["entries"]
                raise StoreFull(
                    f"cannot reserve {n} slot(s): capacity {cap}, {len(pinned)} pinned by "
                    f"in-flight loads, {reserved} reserved by in-flight stores, only "
                    f"{len(slots)} free or evictable. Store fewer blocks per step, pin fewer "
                    f"blocks at once, or create the store with more capacity_slots")
        gen = self._get(txn, b"generation")
        rdb = self._reserved
        owner = self.owner
        out = []
        for k, s in zip(todo, slots):
            gen += 1
            put(_U32.pack(s), _U64.pack(gen) + k, db=rdb)
            if owner is not None:
                put(owner + _U32.pack(s), b"", db=self._owned)
            out.append((k, s, gen))
        self._set(txn, b"generation", gen)
        self._set(txn, b"high_water", hw)
        if evicted:
            self._add(txn, b"evictions", len(evicted))
        return out, evicted

    @_guard
    def reserve_pool(self, n: int, claim) -> tuple[array.array, array.array, list[bytes]]:
        """Reserve up to n slots for keys not known yet (the scheduler's slot pool); one
        write txn, never an fsync. Slots come from the free list, then never-used slots,
        then by evicting LRU entries. `claim(candidates)` decides which may be taken: it gets
        [(key or None, slot)] (None for a free slot) and returns the set of slots it gives
        up (the serving index drops evicted keys from its lookup table there, and refuses
        pinned slots). Each slot gets a fresh generation; its `reserved` row holds only the
        generation until `commit` names the key. Returns (slots, their generations, the
        evicted entries' keys); fewer than n slots when nothing more can be taken (no
        StoreFull). Slots and generations come as arrays ('I', 'Q'), keys as bytes: this
        runs on the index thread, thousands of slots per call, and objects the garbage
        collector tracks (a tuple per slot, an `Entry` per eviction) would have it trigger
        collections there, holding the GIL that vLLM's step thread waits for."""
        if n <= 0:
            return array.array("I"), array.array("Q"), []
        ndev, fenced = self._fence
        if not fenced:
            return self._write(self._reserve_pool_txn, n, claim)[:3]
        inner = claim

        def claim(cands):   # a fenced device's slots are never taken (they stay free)
            return inner([c for c in cands if c[1] % ndev not in fenced])
        epoch = self._free_epoch
        slots, gens, evicted, exhausted = self._write(self._reserve_pool_txn, n, claim,
                                                      self._free_dry == epoch)
        if exhausted:
            self._free_dry = epoch
        return slots, gens, evicted

    def _reserve_pool_txn(self, txn, n, claim, skip_free=False):
        def batches(db):
            """Rows of db in key order, in batches of at most what is still missing;
            rows deleted between batches (taken ones) are skipped over by set_range."""
            last = None
            while len(slots) < n:
                cur = txn.cursor(db=db)
                ok = cur.set_range(last) if last is not None else cur.first()
                if ok and last is not None and cur.key() == last:
                    ok = cur.next()     # `last` was refused and is still there
                rows = []
                while ok and len(rows) < min(n - len(slots), _PAUSE_EVERY):
                    last = cur.key()
                    rows.append(last)
                    ok = cur.next()
                if not rows:
                    return
                yield rows
                if not ok:
                    return
                if self.pause is not None:
                    self.pause()

        slots: list[int] = []
        for rows in (() if skip_free else batches(self._free)):
            cand = [_U32.unpack(r)[0] for r in rows]
            taken = claim([(None, c) for c in cand])
            for r, c in zip(rows, cand):
                if c in taken:
                    txn.delete(r, db=self._free)
                    slots.append(c)
        exhausted = len(slots) < n
        cap = self._capacity
        hw = self._get(txn, b"high_water")
        # (in rounds: a round whose candidates were refused, e.g. a fenced device's slots,
        # is followed by the next never-used slots before any entry is evicted)
        while hw < cap and len(slots) < n:
            cand = list(range(hw, min(cap, hw + n - len(slots))))
            taken = claim([(None, c) for c in cand])
            for c in cand:
                if c in taken:
                    slots.append(c)
                else:
                    txn.put(_U32.pack(c), b"", db=self._free)  # keep the accounting whole
            hw = cand[-1] + 1
        evicted: list[bytes] = []
        kdb, sdb, ldb = self._keys, self._slots, self._lru
        for rows in batches(ldb):
            # (parallel lists of bytes and ints, not a tuple per candidate: see above)
            cs: list[int] = []
            ck: list[bytes] = []
            for lk in rows:
                s_ = _LRU.unpack(lk)[1]
                k = txn.get(_U32.pack(s_), db=sdb)
                if k is None:
                    raise CorruptIndex(f"lru row (tick {_LRU.unpack(lk)[0]}, slot {s_}) has no "
                                       f"slot row; {_REBUILD_HINT}")
                cs.append(s_)
                ck.append(k)
            taken = claim(list(zip(ck, cs)))
            ev_s: list[int] = []
            ev_g: list[int] = []
            try:
                for lk, s_, k in zip(rows, cs, ck):
                    if s_ not in taken:
                        continue
                    v = txn.pop(k, db=kdb)
                    if v is None:
                        raise CorruptIndex(f"lru row (tick {_LRU.unpack(lk)[0]}, slot {s_}) "
                                           f"has no key row; {_REBUILD_HINT}")
                    txn.delete(_U32.pack(s_), db=sdb)
                    txn.delete(lk, db=ldb)
                    ev_s.append(s_)
                    ev_g.append(_VAL.unpack(v)[1])
                    evicted.append(k)
                    slots.append(s_)
            finally:
                self._evicted_shared(ev_s, ev_g)    # the claim cleared their generations
        gen = self._get(txn, b"generation")
        owner = self.owner
        gens = array.array("Q", range(gen + 1, gen + 1 + len(slots)))
        for s_, g_ in zip(slots, gens):
            txn.put(_U32.pack(s_), _U64.pack(g_), db=self._reserved)
            if owner is not None:
                txn.put(owner + _U32.pack(s_), b"", db=self._owned)
        self._set(txn, b"generation", gen + len(slots))
        self._set(txn, b"high_water", hw)
        if evicted:
            self._add(txn, b"evictions", len(evicted))
        return array.array("I", slots), gens, evicted, exhausted

    @_guard
    def load_keys(self, table) -> int:
        """Fill `table` (a `kvstore._keytable.KeyTable`) with every committed key -> (slot,
        generation), from one read transaction. Returns the count. (The store's shared
        slot generations are rebuilt at open, `rebuild_generations`: an entry evicted
        after this snapshot is cut where a lookup meets it.)"""
        with self._read() as txn:
            return table.load(txn.cursor(db=self._keys).iternext(keys=True, values=True))

    @_guard
    def rebuild_generations(self, slots, valid_word: int) -> bool:
        """The store's shared slot generations from this index, in one write transaction,
        unless header word `valid_word` of `slots` says they are complete already; then
        marked complete. Holding LMDB's writer lock, no other engine commits, evicts or
        drops meanwhile (they change the generations inside their write transactions),
        so the array agrees with the index from here on. True if rebuilt."""
        def txn_fn(txn):
            if slots.load(valid_word) == 1:
                return False
            slots.clear_array()
            slots.load_generations(txn.cursor(db=self._keys).iternext(keys=True, values=True))
            slots.store(valid_word, 1)
            return True
        return self._write(txn_fn)

    @_guard
    def commit(self, items: Sequence[tuple[bytes, int, int]], *, sync: bool = True,
               dups_out: list | None = None) -> list[tuple[bytes, int, int]]:
        """Make reserved (key, slot, generation) items visible to lookups; one write txn.

        items[0] gets the most recent tick (a chain's head outlives its tail). An item whose
        slot is no longer reserved with that generation and key (aborted, reclaimed or
        re-reserved since) is skipped and returned: its slot may hold someone else's data.
        If the key is already committed at another slot (two stores of the same block), the
        existing entry is kept and refreshed (a load may be reading it now) and the new slot
        goes back to free; with `dups_out` (a list) such a key's entry as it stands,
        (key, slot, generation), is appended there (another engine stored it first).
        Returns the skipped items (empty when all went in).
        sync=False leaves the fsync to a later `sync()` (a commit in several transactions).
        """
        if not items:
            return []
        skipped, dups = self._write(self._commit_txn, items, dups_out)
        if dups or skipped:
            self._free_epoch += 1
        if sync and self._sync:
            # Only commits are made durable (fdatasync of data.mdb): LMDB writes
            # transactions in order, so syncing here also persists every earlier
            # reservation and eviction, while touches and reservations alone never pay
            # for an fsync. After a crash the index is the state as of some commit.
            self._fsync("syncing a commit")
        return skipped

    def sync(self) -> None:
        """fsync the index (when opened with sync=True): every transaction so far is durable."""
        if self._sync:
            self._fsync("syncing a commit")

    def _fsync(self, doing: str) -> None:
        self.fsyncs_by_thread[threading.get_ident()] += 1
        try:
            self._live().sync(True)
        except lmdb.Error as exc:
            raise self._write_failed(exc, doing) from exc

    def _commit_txn(self, txn, items, dups_out=None):
        get, put, delete = txn.get, txn.put, txn.delete
        kdb, sdb, ldb, rdb = self._keys, self._slots, self._lru, self._reserved
        owner, odb = self.owner, self._owned
        if dups_out is not None:
            del dups_out[:]     # a retried transaction starts over
        tick = self._get(txn, b"tick")
        skipped = []
        dups = 0
        pub_s: list[int] = []
        pub_g: list[int] = []
        pause = self.pause
        ndev, fenced = self._fence
        for n, item in enumerate(reversed(items)):
            if pause is not None and n and n % _PAUSE_EVERY == 0:
                pause()
            key, slot, gen = item
            sk = _U32.pack(slot)
            r = get(sk, db=rdb)
            if fenced and slot % ndev in fenced:
                # written before its device was fenced: never an entry on a failed device
                if r is not None and _U64.unpack_from(r)[0] == gen:
                    delete(sk, db=rdb)
                    put(sk, b"", db=self._free)
                    if owner is not None:
                        delete(owner + sk, db=odb)
                skipped.append(item)
                continue
            # a pool reservation (`reserve_pool`) has no key yet: only its generation counts
            if r is None or _U64.unpack_from(r)[0] != gen or (len(r) > 8 and r[8:] != key):
                skipped.append(item)
                continue
            delete(sk, db=rdb)
            if owner is not None:
                delete(owner + sk, db=odb)
            tick += 1
            old = get(key, db=kdb)
            if old is None:
                put(key, _VAL.pack(slot, gen, tick), db=kdb)
                put(sk, key, db=sdb)
                put(_LRU.pack(tick, slot), b"", db=ldb, append=True)
                pub_s.append(slot)
                pub_g.append(gen)
            else:
                os_, og, ot = _VAL.unpack(old)
                delete(_LRU.pack(ot, os_), db=ldb)
                put(_LRU.pack(tick, os_), b"", db=ldb, append=True)
                put(key, _VAL.pack(os_, og, tick), db=kdb)
                put(sk, b"", db=self._free)
                dups += 1
                if dups_out is not None:
                    dups_out.append((key, os_, og))
        self._set(txn, b"tick", tick)
        # Published before the transaction commits, under LMDB's writer lock: an engine
        # that evicts one of these entries does it in a later transaction, so its clear
        # comes after (published after the commit, the generation could land on a slot
        # another engine had evicted and reserved meanwhile). No engine holds these
        # (slot, generation) pairs before the commit is visible.
        self._shared_set(pub_s, pub_g, [0] * len(pub_s))
        if dups:
            self._add(txn, b"duplicates", dups)
        if skipped:
            self._add(txn, b"stale_commits", len(skipped))
            skipped.reverse()
        return skipped, dups

    @_guard
    def abort(self, slots_or_items: Iterable[int | tuple[bytes, int, int]]) -> int:
        """Give reservations back to free. Accepts slot ints (released if reserved) or
        (key, slot, generation) items (released only if that reservation still stands).
        Returns how many were released."""
        self._free_epoch += 1
        return self._write(self._abort_txn, list(slots_or_items))

    def _abort_txn(self, txn, things):
        rdb, fdb = self._reserved, self._free
        n = 0
        for x in things:
            if isinstance(x, int):
                sk = _U32.pack(x)
                if txn.pop(sk, db=rdb) is None:
                    continue
            else:
                key, slot, gen = x
                sk = _U32.pack(slot)
                r = txn.get(sk, db=rdb)
                if r is None or _U64.unpack_from(r)[0] != gen or (len(r) > 8 and r[8:] != key):
                    continue
                txn.delete(sk, db=rdb)
            txn.put(sk, b"", db=fdb)
            if self.owner is not None:
                txn.delete(self.owner + sk, db=self._owned)
            n += 1
        return n

    @_guard
    def reclaim_reserved(self) -> int:
        """Crash recovery, for the writer at open: every reserved slot goes back to free.
        A reserved slot may hold a half-written block; nothing points at it. Returns count."""
        self._free_epoch += 1
        n = self._write(self._reclaim_txn)
        self.reader_check()
        return n

    def _reclaim_txn(self, txn):
        slots = list(txn.cursor(db=self._reserved).iternext(keys=True, values=False))
        if slots:
            txn.cursor(db=self._free).putmulti(((sk, b"") for sk in slots))
            txn.drop(self._reserved, delete=False)
        if self._owned is not None:
            txn.drop(self._owned, delete=False)
        return len(slots)

    @_guard
    def reclaim_owner(self, owner: bytes) -> int:
        """A dead engine's reservations go back to free (its `owned` rows, and the
        reservations they name when still standing), and LMDB reader slots it left (it
        may have died inside a read transaction) are cleared. Returns how many
        reservations were released."""
        self._free_epoch += 1
        n = self._write(self._reclaim_owner_txn, owner)
        self.reader_check()
        return n

    def _reclaim_owner_txn(self, txn, owner):
        odb, rdb, fdb = self._owned, self._reserved, self._free
        cur = txn.cursor(db=odb)
        rows = []
        ok = cur.set_range(owner)
        while ok and cur.key()[:len(owner)] == owner:
            rows.append(bytes(cur.key()))
            ok = cur.next()
        n = 0
        for row in rows:
            sk = row[len(owner):]
            txn.delete(row, db=odb)
            if txn.pop(sk, db=rdb) is not None:
                txn.put(sk, b"", db=fdb)
                n += 1
        return n

    @_guard
    def owned_counts(self) -> dict[bytes, int]:
        """{owner id: reservations it holds} (for `kvstore info`)."""
        out: Counter = Counter()
        if self._owned is None:
            return {}
        with self._read() as txn:
            for k in txn.cursor(db=self._owned).iternext(keys=True, values=False):
                out[bytes(k[:12])] += 1
        return dict(out)

    @_guard
    def touch(self, keys: Sequence[bytes]) -> None:
        """LRU update for a prefix hit, one write txn: keys[0] becomes the most recent,
        keys[-1] the least recent of the chain, so a chain is evicted tail first.
        Keys not in the index are ignored."""
        if keys:
            self._write(self._touch_txn, keys)

    def _touch_txn(self, txn, keys):
        get, put, delete = txn.get, txn.put, txn.delete
        kdb, ldb = self._keys, self._lru
        tick = self._get(txn, b"tick")
        unpack, pack, lru = _VAL.unpack, _VAL.pack, _LRU.pack
        pause = self.pause
        for n, k in enumerate(reversed(keys)):
            if pause is not None and n and n % _PAUSE_EVERY == 0:
                pause()
            v = get(k, db=kdb)
            if v is None:
                continue
            s, g, t = unpack(v)
            tick += 1
            delete(lru(t, s), db=ldb)
            put(lru(tick, s), b"", db=ldb, append=True)
            put(k, pack(s, g, tick), db=kdb)
        self._set(txn, b"tick", tick)

    @_guard
    def drop(self, keys: Iterable[bytes]) -> list[Entry]:
        """Remove entries (e.g. a slot failed verification); their slots go back to free.
        Returns the removed entries; absent keys are ignored."""
        self._free_epoch += 1
        return self._write(self._drop_txn, list(keys))

    def _drop_txn(self, txn, keys):
        out = []
        pause = self.pause
        for n, k in enumerate(keys):
            if pause is not None and n and n % _PAUSE_EVERY == 0:
                pause()
            v = txn.pop(k, db=self._keys)
            if v is None:
                continue
            s, g, t = _VAL.unpack(v)
            sk = _U32.pack(s)
            txn.delete(sk, db=self._slots)
            txn.delete(_LRU.pack(t, s), db=self._lru)
            txn.put(sk, b"", db=self._free)
            out.append(_entry(k, s, g, t))
        # retracted inside the transaction: once it commits the slot is free, and an
        # engine that reserves it and publishes a new entry must come after
        self._shared_set([e.slot for e in out], [0] * len(out), [e.generation for e in out])
        return out

    # ------------------------------------------------------------------ failed devices

    @_guard
    def fenced_devices(self) -> dict[int, tuple[str, int]]:
        """{device: (reason, unix time)} of every fenced device (meta rows `fenced.<d>`)."""
        out = {}
        with self._read() as txn:
            cur = txn.cursor(db=self._meta)
            ok = cur.set_range(FENCE_PREFIX)
            while ok and cur.key().startswith(FENCE_PREFIX):
                code, t = _FENCE.unpack(cur.value())
                out[int(cur.key()[len(FENCE_PREFIX):])] = (FENCE_REASONS.get(code, f"code {code}"), t)
                ok = cur.next()
        return out

    @_guard
    def fence_rows(self) -> dict[str, int]:
        """The raw `fenced.<d>` meta rows (name -> u64), for an index rebuild to keep."""
        out = {}
        with self._read() as txn:
            cur = txn.cursor(db=self._meta)
            ok = cur.set_range(FENCE_PREFIX)
            while ok and cur.key().startswith(FENCE_PREFIX):
                out[cur.key().decode()] = _U64.unpack(cur.value())[0]
                ok = cur.next()
        return out

    def set_devices(self, ndev: int) -> dict[int, tuple[str, int]]:
        """Tell the index how many devices the store has and load its fences: from now on
        reservations and commits skip the fenced devices' slots. Returns the fences."""
        fences = self.fenced_devices() if ndev > 1 else {}
        self._fence = (max(1, ndev), frozenset(fences))
        return fences

    @property
    def fenced(self) -> frozenset:
        return self._fence[1]

    @_guard
    def fence_device(self, dev: int, ndev: int, reason: str) -> list[Entry]:
        """Fence device `dev` of `ndev`: one transaction records it (meta row `fenced.<d>`,
        the first reason kept) and drops every entry whose slot is on it (its slots go to
        free, where reservations skip them). Returns the dropped entries."""
        import time as _time
        if not 0 <= dev < ndev or ndev < 2:
            raise KVStoreError(f"fence_device: device {dev} of {ndev}")
        code = _FENCE_CODE.get(reason, 1)
        self._free_epoch += 1
        out = self._write(self._fence_txn, dev, ndev, code, int(_time.time()))
        self._fence = (ndev, self._fence[1] | {dev})
        self.sync()     # the fence outlives a crash: a restart never hands its slots out
        return out

    def _fence_txn(self, txn, dev, ndev, code, now):
        name = FENCE_PREFIX + str(dev).encode()
        if txn.get(name, db=self._meta) is None:
            txn.put(name, _FENCE.pack(code, now), db=self._meta)
        out = []
        sdb, kdb, ldb, fdb = self._slots, self._keys, self._lru, self._free
        victims = []
        pause = self.pause
        for n, (sk, key) in enumerate(txn.cursor(db=sdb).iternext(keys=True, values=True)):
            if pause is not None and n and n % (16 * _PAUSE_EVERY) == 0:
                pause()
            s = _U32.unpack(sk)[0]
            if s % ndev == dev:
                victims.append((sk, s, bytes(key)))
        for n, (sk, s, key) in enumerate(victims):
            if pause is not None and n and n % _PAUSE_EVERY == 0:
                pause()
            v = txn.pop(key, db=kdb)
            txn.delete(sk, db=sdb)
            txn.put(sk, b"", db=fdb)
            if v is None:
                continue
            s_, g, t = _VAL.unpack(v)
            txn.delete(_LRU.pack(t, s_), db=ldb)
            out.append(_entry(key, s_, g, t))
        self._shared_set([e.slot for e in out], [0] * len(out), [e.generation for e in out])
        return out

    @_guard
    def readmit_device(self, dev: int) -> bool:
        """Clear device `dev`'s fence (its slots are free again). True if it was fenced."""
        name = FENCE_PREFIX + str(dev).encode()

        def txn_fn(txn):
            return txn.delete(name, db=self._meta)
        self._free_epoch += 1
        done = self._write(txn_fn)
        ndev, fenced = self._fence
        self._fence = (ndev, fenced - {dev})
        if done:
            self.sync()
        return bool(done)

    def count_hits(self, hits: int, misses: int) -> None:
        """Batched in memory; written with the next write txn (or close)."""
        self._live()
        self._pending_hits += hits
        self._pending_misses += misses

    def flush(self) -> None:
        """Write batched counters now."""
        if not self._readonly and (self._pending_hits or self._pending_misses):
            self._write(lambda txn: None)

    # ------------------------------------------------------------------ maintenance

    def check_consistency(self) -> list[str]:
        """Full scan of one snapshot; returns a description of every broken invariant
        (empty list = consistent). O(entries): for fsck and tests, not the serving path."""
        problems: list[str] = []
        with self._read() as txn:
            cap = self._capacity
            hw = self._get(txn, b"high_water")
            tick = self._get(txn, b"tick")
            gen = self._get(txn, b"generation")
            if hw > cap:
                problems.append(f"high_water {hw} > capacity {cap}")
            owner: dict[int, str] = {}

            def claim(slot: int, what: str) -> None:
                if not 0 <= slot < cap:
                    problems.append(f"{what}: slot {slot} outside [0, {cap})")
                elif slot >= hw:
                    problems.append(f"{what}: slot {slot} >= high_water {hw}")
                if slot in owner:
                    problems.append(f"slot {slot} is both {owner[slot]} and {what}")
                else:
                    owner[slot] = what

            lru_expected = set()
            for k, v in txn.cursor(db=self._keys):
                s, g, t = _VAL.unpack(v)
                claim(s, f"used by key {k.hex()}")
                if txn.get(_U32.pack(s), db=self._slots) != k:
                    problems.append(f"slots[{s}] does not point back at key {k.hex()}")
                if t > tick:
                    problems.append(f"key {k.hex()} tick {t} > meta tick {tick}")
                if g > gen:
                    problems.append(f"key {k.hex()} generation {g} > meta generation {gen}")
                lru_expected.add(_LRU.pack(t, s))
            n_slots = txn.stat(self._slots)["entries"]
            n_keys = txn.stat(self._keys)["entries"]
            if n_slots != n_keys:
                problems.append(f"slots db has {n_slots} rows, keys db {n_keys}")
            lru_rows = set(txn.cursor(db=self._lru).iternext(keys=True, values=False))
            if lru_rows != lru_expected:
                problems.append(f"lru has {len(lru_rows - lru_expected)} rows without an entry "
                                f"and misses {len(lru_expected - lru_rows)} entries")
            for sk in txn.cursor(db=self._free).iternext(keys=True, values=False):
                claim(_U32.unpack(sk)[0], "free")
            for sk, v in txn.cursor(db=self._reserved):
                claim(_U32.unpack(sk)[0], "reserved")
                if _U64.unpack_from(v)[0] > gen:
                    problems.append(f"reservation of slot {_U32.unpack(sk)[0]} has generation "
                                    f"> meta generation {gen}")
            if len(owner) != hw:
                problems.append(f"used + free + reserved below high_water = {len(owner)}, "
                                f"expected {hw} (slots lost or counted twice)")
            if self._owned is not None:
                # an engine's reservation names its owner (`owned`): a row whose slot is not
                # reserved would make that owner's reclaim free somebody else's reservation
                for ok in txn.cursor(db=self._owned).iternext(keys=True, values=False):
                    if len(ok) != 16 or txn.get(bytes(ok[12:]), db=self._reserved) is None:
                        problems.append(f"owned row {bytes(ok).hex()} names a slot that is not reserved")
        return problems


class _FencedOrPinned:
    """`pinned` of `Index.reserve` plus every slot of a fenced device."""

    __slots__ = ("pinned", "ndev", "fenced")

    def __init__(self, pinned, ndev, fenced):
        self.pinned, self.ndev, self.fenced = pinned, ndev, fenced

    def __contains__(self, s) -> bool:
        return s % self.ndev in self.fenced or s in self.pinned

    def __len__(self) -> int:
        return len(self.pinned)
