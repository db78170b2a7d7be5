"""The LMDB environment of one index and its transactions (`IndexEnv`).

Opening (symlink refusal, creation, the format and capacity checks), read and write
transactions, map growth and the adoption of a map another process grew (under the
`mapguard.MapGuard`), the conversion of LMDB and decoding errors into `KVStoreError`s
(`guard`, a write that fails), fsyncs, batched hit/miss counters, and the hooks every
long write transaction honours: `pause` (release the GIL) and the undo of the shared
slot generations it changed. The entry, slot and fence operations (`entries`, `slots`, `fences`) run their
transactions through here; nothing here knows what their rows mean beyond the counters.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import weakref
from collections import Counter
from collections.abc import Iterator

import lmdb

from kvstore.errors import ConfigError, CorruptIndex, KVStoreError, StoreClosed
from kvstore.index.mapguard import MapGuard, ReadTxn
from kvstore.index.rows import (
    COUNTER, COUNTERS, DB_NAMES, FORMAT_VERSION, ITER_CHUNK, LRU_KEY, MAX_SLOTS, MIN_MAP,
    REBUILD_HINT, IndexDBs,
)

__all__ = ["IndexEnv", "guard"]

# The index's logger (named after `kvstore.index.core`, the module of `Index`).
log = logging.getLogger("kvstore.index.core")

_U64 = COUNTER
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadValsizeError)


def guard(fn):
    """Turn a damaged record (bad length, garbage bytes) into CorruptIndex, not a crash.

    Every value read from LMDB is struct-unpacked; a record that does not parse means the
    index was damaged on disk. Callers get a KVStoreError naming the repair, never a
    struct.error or an lmdb internal error from deep inside.
    """
    import functools
    import inspect

    def convert(exc):
        return CorruptIndex(f"index record unreadable in {fn.__name__}() ({type(exc).__name__}: {exc}); "
                            f"{REBUILD_HINT}, or `kvstore fsck --repair` to drop damaged rows")

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


# A step thread that meets MDB_MAP_RESIZED waits this long for the other thread's
# transaction to end before it gives up (a KVStoreError: the lookup is a miss); the index
# thread may be inside a write transaction that waits for the step thread's lock.
REMAP_WAIT_S = 0.05

# Index environments of this process: a child forked from it must never use (or close) them.
_OPEN: "weakref.WeakSet[IndexEnv]" = weakref.WeakSet()
_INHERITED: list = []


def _forget_after_fork() -> None:
    """In a forked child: LMDB environments must not be used across fork, and closing one
    (as py-lmdb does when it is freed) would clear the parent's reader slots (LMDB clears
    those of the pid that opened it). Each inherited environment is kept, unused, until
    the child exits; its index reads as closed."""
    for ie in list(_OPEN):
        env = ie.env
        if env is not None:
            _INHERITED.append(env)
            ie.env = None


os.register_at_fork(after_in_child=_forget_after_fork)


class IndexEnv:
    """The open LMDB environment of one index (`env`, None once closed) and its
    transactions. Opening checks the format and the capacity (`capacity`), and a writable
    open creates missing databases (`dbs`) and repairs a lagging tick counter."""

    def __init__(self, path: str, capacity_slots: int | None = None, *, create: bool = False,
                 readonly: bool = False, sync: bool = True, map_size: int | None = None):
        if create and readonly:
            raise ConfigError("Index: create=True and readonly=True are exclusive")
        self.path = os.fspath(path)
        self.readonly = readonly
        # Commits fsync (`fsync`, `sync`) only with sync=True.
        self.sync_commits = sync
        self.env: lmdb.Environment | None = None
        # Hit and miss counts not written yet: `count_hits` adds, the next write txn writes.
        self.pending_hits = 0
        self.pending_misses = 0
        # fsyncs of the index by thread id: benchmarks prove which thread pays for them
        # (`kvstore bench connector` checks that vLLM's scheduler thread never does).
        self.fsyncs_by_thread: Counter = Counter()
        # Called every PAUSE_EVERY rows inside long write transactions (commit, touch,
        # drop, reserve_pool, fence) when set: the serving index's background thread
        # releases the GIL there, so vLLM's scheduler thread never waits long for it.
        self.pause = None
        # The store's shared slot generations (`kvstore.store.shared`; None when not shared):
        # commits publish, drops and fences retract inside their write transaction, so
        # every change to them is ordered by LMDB's writer lock with the other engines'
        # (an eviction claim clears them inside its transaction too). `_undo` holds what
        # the current write transaction changed, put back if it does not commit.
        self.shared_slots = None
        self._undo: list | None = None
        self._map = MapGuard()
        data = os.path.join(self.path, "data.mdb")
        for p in (self.path, data, os.path.join(self.path, "lock.mdb")):
            # LMDB opens its files without O_NOFOLLOW: refuse links here, as every other
            # file of a store is refused (a link could point the index anywhere).
            if os.path.islink(p):
                raise CorruptIndex(
                    f"refusing index {p}: it is a symlink (kvstore never follows symlinks "
                    f"inside a store); move the real files into place, or {REBUILD_HINT}")
        exists = os.path.isfile(data)
        if create and not exists:
            if capacity_slots is None or not 0 < capacity_slots <= MAX_SLOTS:
                raise ConfigError(
                    f"Index: capacity_slots must be in 1..{MAX_SLOTS} to create an index "
                    f"(got {capacity_slots!r})")
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        elif not exists:
            raise CorruptIndex(f"index not found at {self.path} (no data.mdb); {REBUILD_HINT}")
        if map_size is None:
            # Room for ~2x the steady-state footprint (~200 B/entry) so that growth is rare.
            cap = capacity_slots or 0
            map_size = max(MIN_MAP, cap * 512)
        try:
            env = lmdb.open(self.path, map_size=map_size, subdir=True, readonly=readonly,
                            lock=True, sync=False, metasync=False, create=create, max_dbs=8, mode=0o700,
                            readahead=False, max_spare_txns=4)
        except lmdb.Error as e:
            if "already open in this process" in str(e):
                # LMDB forbids two handles on one env in a process (its locks would break).
                raise KVStoreError(
                    f"index at {self.path} is already open in this process; share that "
                    f"Index instead of opening a second one") from e
            raise CorruptIndex(f"cannot open index at {self.path}: {e}; {REBUILD_HINT}") from e
        self.env = env  # _open_dbs may write (a lagging tick counter): it needs a live env
        try:
            self._open_dbs(env, create and not exists, capacity_slots)
        except BaseException:
            self.env = None
            env.close()
            raise
        _OPEN.add(self)

    @guard
    def _open_dbs(self, env: lmdb.Environment, fresh: bool, capacity: int | None) -> None:
        try:
            if self.readonly:
                dbs = [env.open_db(n, create=False) for n in DB_NAMES[:6]]
                try:    # made by the first writable open: a read-only opener may not find it
                    dbs.append(env.open_db(b"owned", create=False))
                except lmdb.Error:
                    dbs.append(None)
            else:
                with env.begin(write=True) as txn:
                    dbs = [env.open_db(n, txn=txn, create=True) for n in DB_NAMES]
                    meta = dbs[5]
                    if fresh:
                        for name in COUNTERS:
                            txn.put(name, _U64.pack(0), db=meta)
                        txn.put(b"capacity", _U64.pack(capacity), db=meta)
                        txn.put(b"format", _U64.pack(FORMAT_VERSION), db=meta)
        except lmdb.Error as e:
            raise CorruptIndex(
                f"index at {self.path} is missing its databases ({e}); {REBUILD_HINT}") from e
        self.dbs = IndexDBs(*dbs)
        self._meta = meta = self.dbs.meta
        with env.begin() as txn:
            raw_cap = txn.get(b"capacity", db=meta)
            raw_fmt = txn.get(b"format", db=meta)
            if raw_cap is None or raw_fmt is None:
                raise CorruptIndex(f"index at {self.path} has no meta counters; {REBUILD_HINT}")
            fmt = _U64.unpack(raw_fmt)[0]
            if fmt != FORMAT_VERSION:
                raise CorruptIndex(
                    f"index at {self.path} has format {fmt}, this kvstore reads "
                    f"{FORMAT_VERSION}; {REBUILD_HINT}")
            self.capacity = _U64.unpack(raw_cap)[0]
            last_tick = 0
            cur = txn.cursor(db=self.dbs.lru)
            if cur.last():
                last_tick = LRU_KEY.unpack(cur.key())[0]
            meta_tick = _U64.unpack(txn.get(b"tick", db=meta))[0]
        if capacity is not None and capacity != self.capacity:
            raise ConfigError(
                f"Index: {self.path} was created with capacity_slots={self.capacity}, "
                f"opened with {capacity}; resizing an index is not supported (recreate the store)")
        if not self.readonly and last_tick > meta_tick:
            # lru appends rely on tick being past every row; repair a lagging counter.
            self.write(lambda txn: txn.put(b"tick", _U64.pack(last_tick), db=meta))

    def close(self) -> None:
        """Flush batched hit counters, sync (when opened with sync=False) and close. Idempotent."""
        env = self.env
        if env is None:
            return
        try:
            if not self.readonly:
                if self.pending_hits or self.pending_misses:
                    self.write(lambda txn: None)
                env.sync(True)
        except (KVStoreError, lmdb.Error) as exc:
            # Closing must not fail (the store's lock is released after this): what is
            # lost are batched hit/miss counters, and commits were already synced.
            log.warning("index at %s: final flush on close failed: %s", self.path, exc)
        finally:
            self.env = None
            env.close()

    def __del__(self) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            try:
                env.close()
            except Exception:
                pass

    # ------------------------------------------------------------------ transactions

    def live(self) -> lmdb.Environment:
        """The open LMDB environment (StoreClosed once closed)."""
        env = self.env
        if env is None:
            raise StoreClosed(f"index is closed ({self.path})")
        return env

    def read(self) -> ReadTxn:
        """A read transaction (a context manager giving the lmdb txn; or `abort()` it)."""
        env = self.live()
        for _ in range(3):
            self._map.enter()
            try:
                txn = env.begin()
            except lmdb.MapResizedError:
                # Another process grew the map past ours: adopt its size (once no
                # transaction of this process is open), then begin again.
                self._map.exit()
                self._map.remap(lambda: env.set_mapsize(0), REMAP_WAIT_S)
                continue
            except BaseException:
                self._map.exit()
                raise
            return ReadTxn(txn, self._map)
        raise KVStoreError(f"index at {self.path}: another process grew the map and this "
                           "process's other transactions kept it from adopting the new size; "
                           "retry")

    def write(self, fn, *args):
        """Run fn(txn, *args) in one write txn; on MapFullError double the map and rerun
        (and adopt a map another process grew). Shared slot generations fn changed
        (`shared_set`) are put back when fn fails.

        fn must not change Python-side state: a rerun starts from scratch.
        """
        env = self.live()
        if self.readonly:
            raise KVStoreError(f"index at {self.path} is opened read-only")
        ph, pm = self.pending_hits, self.pending_misses
        while True:
            grow = None
            self._map.enter()
            try:
                with env.begin(write=True) as txn:
                    self._undo = []
                    try:
                        if ph or pm:
                            self.add_counter(txn, b"hits", ph)
                            self.add_counter(txn, b"misses", pm)
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
                raise  # a damaged record: `guard` makes it CorruptIndex
            except lmdb.Error as exc:
                # ENOSPC, EIO, ...: the transaction was not committed and nothing changed.
                raise self._write_failed(exc, "committing a transaction") from exc
            finally:
                self._map.exit()
            try:
                if not self._map.remap(lambda: env.set_mapsize(grow), None):
                    raise KVStoreError(
                        f"index at {self.path}: cannot re-map it while this thread has a "
                        "read transaction open")
            except lmdb.Error as exc:
                raise self._write_failed(exc, f"growing its map to {grow} bytes") from exc
        self.pending_hits -= ph
        self.pending_misses -= pm
        return result

    # Iterators read in chunks of short transactions rather than holding one snapshot: a
    # long-lived read txn pins old pages (the map grows) and would block map growth in this
    # process. With the writer lock held (fsck, warmup) nothing moves underneath anyway.

    def chunks(self, db, reverse: bool = False) -> Iterator[list[tuple[bytes, bytes]]]:
        """The rows of `db` in key order (descending with `reverse`), in lists of at most
        ITER_CHUNK, each read in its own read transaction."""
        last: bytes | None = None
        while True:
            with self.read() as txn:
                cur = txn.cursor(db=db)
                rows: list[tuple[bytes, bytes]] = []
                if not reverse:
                    ok = cur.set_range(last) if last is not None else cur.first()
                    if ok and last is not None and cur.key() == last:
                        ok = cur.next()
                    while ok and len(rows) < ITER_CHUNK:
                        rows.append(cur.item())
                        ok = cur.next()
                else:
                    if last is None:
                        ok = cur.last()
                    else:
                        ok = cur.set_range(last)
                        ok = cur.prev() if ok else cur.last()
                    while ok and len(rows) < ITER_CHUNK:
                        rows.append(cur.item())
                        ok = cur.prev()
            if not rows:
                return
            yield rows
            if len(rows) < ITER_CHUNK:
                return
            last = rows[-1][0]

    # ------------------------------------------------------------------ counters

    def counter(self, txn: lmdb.Transaction, name: bytes) -> int:
        """A `meta` counter (docs/FORMAT.md) read in `txn`."""
        return _U64.unpack(txn.get(name, db=self._meta))[0]

    def set_counter(self, txn: lmdb.Transaction, name: bytes, value: int) -> None:
        txn.put(name, _U64.pack(value), db=self._meta)

    def add_counter(self, txn: lmdb.Transaction, name: bytes, delta: int) -> None:
        raw = txn.get(name, db=self._meta)
        txn.put(name, _U64.pack((_U64.unpack(raw)[0] if raw else 0) + delta), db=self._meta)

    def count_hits(self, hits: int, misses: int) -> None:
        """Batched in memory; written with the next write txn (or close)."""
        self.live()
        self.pending_hits += hits
        self.pending_misses += misses

    def flush(self) -> None:
        """Write batched counters now."""
        if not self.readonly and (self.pending_hits or self.pending_misses):
            self.write(lambda txn: None)

    # ------------------------------------------------------------------ shared generations

    def shared_set(self, slots: list[int], gens: list[int], before: list[int]) -> None:
        """Inside a write txn: slots[j] holds generation gens[j] (0: nothing) from now on,
        in the shared slot generations (other engines check their hits there); before[j]
        is what the index said until now (put back if the transaction fails)."""
        sm = self.shared_slots
        if sm is None or not slots:
            return
        if self._undo is not None:
            self._undo.append((slots, before))
        sm.publish(slots, gens)

    def evicted_shared(self, slots: list[int], gens: list[int]) -> None:
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

    # ------------------------------------------------------------------ durability, failures

    def sync(self) -> None:
        """fsync the index (when opened with sync=True): every transaction so far is durable."""
        if self.sync_commits:
            self.fsync("syncing a commit")

    def fsync(self, doing: str) -> None:
        self.fsyncs_by_thread[threading.get_ident()] += 1
        try:
            self.live().sync(True)
        except lmdb.Error as exc:
            raise self._write_failed(exc, doing) from exc

    def reader_check(self) -> int:
        """Clear LMDB reader slots left by dead processes (an engine killed inside a read
        transaction keeps its snapshot pinned otherwise: no page freed since is reused, so
        the file grows with every write, and the slot is lost to the 126 there are).
        Returns how many were cleared."""
        try:
            return self.live().reader_check()
        except lmdb.Error:
            return 0

    def _write_failed(self, exc: Exception, doing: str) -> KVStoreError:
        msg = f"cannot write the index at {self.path} ({doing}): {exc}"
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
            st = os.statvfs(self.path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < 64 << 10
