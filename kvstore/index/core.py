"""The LMDB index of a store: key -> slot, slot -> key, LRU order, free slots, counters.

Owns the `STORE/index/` LMDB environment and nothing else. It never touches slot files,
never checks payloads and knows nothing about vLLM: keys are opaque bytes (block hash + KV
group id), slots are ints in ``[0, capacity_slots)``.

Named databases (every value struct-packed, never pickled; codecs in `rows`):

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

`Index` is the one class the rest of kvstore uses; it hands each call to the part that does
that job: `env.IndexEnv` (the environment and its transactions), `entries.Entries`
(lookups, commits, LRU touches, drops), `slots.SlotAllocator` (reservations, free slots),
`fences.Fences` (failed devices) and `check.check_consistency`.
"""

from __future__ import annotations

import array
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence

import lmdb

from kvstore.index.entries import Entries
from kvstore.index.env import IndexEnv, guard
from kvstore.index.fences import Fences
from kvstore.index.mapguard import ReadTxn
from kvstore.index.rows import (
    COUNTER, COUNTERS, ENTRY_VALUE, FENCE_PREFIX, FENCE_REASONS, FORMAT_VERSION, LRU_KEY,
    SLOT_KEY, Entry, IndexDBs, make_entry,
)
from kvstore.index.slots import SlotAllocator

__all__ = ["Entry", "Index", "IndexDBs", "FORMAT_VERSION", "SLOT_KEY", "COUNTER", "LRU_KEY",
           "ENTRY_VALUE", "make_entry", "FENCE_PREFIX", "FENCE_REASONS"]


class Index:
    """The LMDB index of one store. See the module docstring for the layout.

    Not thread-safe: one owner thread per instance (the scheduler); LMDB itself keeps
    readers in other processes consistent.
    """

    def __init__(self, path: str, capacity_slots: int | None = None, *, create: bool = False,
                 readonly: bool = False, sync: bool = True, map_size: int | None = None):
        self._lmdb = lm = IndexEnv(path, capacity_slots, create=create, readonly=readonly,
                                   sync=sync, map_size=map_size)
        self._alloc = SlotAllocator(lm)
        self._fences = Fences(lm, self._alloc)
        self._entries = Entries(lm, self._alloc)
        # The database handles under the names tests use to edit rows directly.
        d = lm.dbs
        self._keys, self._slots, self._lru, self._free = d.keys, d.slots, d.lru, d.free
        self._reserved, self._meta, self._owned = d.reserved, d.meta, d.owned

    # ------------------------------------------------------------------ open / close

    def close(self) -> None:
        """Flush batched hit counters, sync (when opened with sync=False) and close. Idempotent."""
        self._lmdb.close()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def capacity_slots(self) -> int:
        self._lmdb.live()
        return self._lmdb.capacity

    @property
    def path(self) -> str:
        return self._lmdb.path

    @property
    def readonly(self) -> bool:
        return self._lmdb.readonly

    @property
    def closed(self) -> bool:
        return self._lmdb.env is None

    @property
    def _env(self) -> lmdb.Environment | None:
        """The LMDB environment, None once closed (for tests that inspect it)."""
        return self._lmdb.env

    # -- settings of this handle, read inside its write transactions

    @property
    def owner(self) -> bytes | None:
        """The engine (`kvstore.store.shared.Lease.owner`) whose reservations this handle
        makes: each one is also a row of `owned`, so survivors can give them back if it
        dies. None: no `owned` rows."""
        return self._alloc.owner

    @owner.setter
    def owner(self, value: bytes | None) -> None:
        self._alloc.owner = value

    @property
    def pause(self):
        """Called every few dozen rows inside long write transactions (commit, touch, drop,
        reserve_pool, fence_device) when set: the serving index's background thread
        releases the GIL there, so vLLM's scheduler thread never waits long for it."""
        return self._lmdb.pause

    @pause.setter
    def pause(self, fn) -> None:
        self._lmdb.pause = fn

    @property
    def shared_slots(self):
        """The store's shared slot generations (`kvstore.store.shared`; None when not
        shared): commits publish, drops and fences retract inside their write transaction,
        put back if it does not commit."""
        return self._lmdb.shared_slots

    @shared_slots.setter
    def shared_slots(self, value) -> None:
        self._lmdb.shared_slots = value

    @property
    def fsyncs_by_thread(self) -> Counter:
        """fsyncs of the index by thread id (`kvstore bench connector` checks that vLLM's
        scheduler thread never pays for one)."""
        return self._lmdb.fsyncs_by_thread

    # -- the maintenance interface: raw transactions and rows, for `kvstore.index.maint`
    # (fsck, rebuild, bulk load). The serving path never uses it.

    @property
    def dbs(self) -> IndexDBs:
        return self._lmdb.dbs

    def env(self) -> lmdb.Environment:
        """The open LMDB environment (StoreClosed once closed)."""
        return self._lmdb.live()

    def read_txn(self) -> ReadTxn:
        """A read transaction: a context manager giving the lmdb txn."""
        return self._lmdb.read()

    def write_txn(self, fn, *args):
        """Run fn(txn, *args) in one write transaction (rerun after a map resize)."""
        return self._lmdb.write(fn, *args)

    _write = write_txn      # (the name tests use)

    def counter(self, txn, name: bytes) -> int:
        """A `meta` counter (docs/FORMAT.md) read in `txn`."""
        return self._lmdb.counter(txn, name)

    def set_counter(self, txn, name: bytes, value: int) -> None:
        self._lmdb.set_counter(txn, name, value)

    def reader_check(self) -> int:
        """Clear LMDB reader slots left by dead processes; how many were cleared."""
        return self._lmdb.reader_check()

    def sync(self) -> None:
        """fsync the index (when opened with sync=True): every transaction so far is durable."""
        self._lmdb.sync()

    def count_hits(self, hits: int, misses: int) -> None:
        """Batched in memory; written with the next write txn (or close)."""
        self._lmdb.count_hits(hits, misses)

    def flush(self) -> None:
        """Write batched counters now."""
        self._lmdb.flush()

    # ------------------------------------------------------------------ entries

    def lookup(self, key: bytes) -> Entry | None:
        return self._entries.lookup(key)

    def get_many(self, keys: Sequence[bytes]) -> list[tuple[bytes, int, int]]:
        """(key, slot, generation) of each of `keys` in the index (`Entries.get_many`)."""
        return self._entries.get_many(keys)

    def longest_prefix(self, keys: Sequence[bytes]) -> list[Entry]:
        """Entries of keys[0..i) where keys[i] is the first key not in the index. One read txn."""
        return self._entries.longest_prefix(keys)

    def oldest_tick(self) -> int | None:
        return self._entries.oldest_tick()

    def iter_entries(self) -> Iterator[Entry]:
        """Every committed entry, in key order."""
        return self._entries.iter_entries()

    def iter_key_batches(self) -> Iterator[list[bytes]]:
        """Every committed key, in key order, in batches (one read transaction each)."""
        return self._entries.iter_key_batches()

    def iter_lru(self, hottest_first: bool = False) -> Iterator[Entry]:
        """Committed entries in eviction order (coldest first unless hottest_first)."""
        return self._entries.iter_lru(hottest_first)

    def load_keys(self, table) -> int:
        """Fill a `KeyTable` with every committed key (`Entries.load_keys`)."""
        return self._entries.load_keys(table)

    def rebuild_generations(self, slots, valid_word: int) -> bool:
        """The store's shared slot generations from this index (`Entries.rebuild_generations`)."""
        return self._entries.rebuild_generations(slots, valid_word)

    def commit(self, items: Sequence[tuple[bytes, int, int]], *, sync: bool = True,
               dups_out: list | None = None) -> list[tuple[bytes, int, int]]:
        """Make reserved items visible to lookups, one write txn and an fsync; returns the
        items skipped (`Entries.commit`)."""
        return self._entries.commit(items, sync=sync, dups_out=dups_out)

    def touch(self, keys: Sequence[bytes]) -> None:
        """LRU update for a prefix hit, one write txn (`Entries.touch`)."""
        self._entries.touch(keys)

    def drop(self, keys: Iterable[bytes]) -> list[Entry]:
        """Remove entries, their slots back to free; returns them (`Entries.drop`)."""
        return self._entries.drop(keys)

    # ------------------------------------------------------------------ slots

    def reserve(self, keys: Iterable[bytes], pinned: Collection[int] = ()
                ) -> tuple[list[tuple[bytes, int, int]], list[Entry]]:
        """One slot per key not committed yet, one write txn; StoreFull if not every key
        gets one (`SlotAllocator.reserve`)."""
        return self._alloc.reserve(keys, pinned)

    def reserve_pool(self, n: int, claim) -> tuple[array.array, array.array, list[bytes]]:
        """Up to n slots for keys not known yet, one write txn (`SlotAllocator.reserve_pool`)."""
        return self._alloc.reserve_pool(n, claim)

    def abort(self, slots_or_items: Iterable[int | tuple[bytes, int, int]]) -> int:
        """Give reservations back to free; how many were released (`SlotAllocator.abort`)."""
        return self._alloc.abort(slots_or_items)

    def reclaim_reserved(self) -> int:
        """Crash recovery, for the writer at open: every reserved slot goes back to free."""
        return self._alloc.reclaim_reserved()

    def reclaim_owner(self, owner: bytes) -> int:
        """A dead engine's reservations go back to free (`SlotAllocator.reclaim_owner`)."""
        return self._alloc.reclaim_owner(owner)

    def owned_counts(self) -> dict[bytes, int]:
        """{owner id: reservations it holds} (for `kvstore info`)."""
        return self._alloc.owned_counts()

    def iter_reserved(self) -> Iterator[tuple[int, int, bytes]]:
        """(slot, generation, key) of every reservation not yet committed or aborted."""
        return self._alloc.iter_reserved()

    def iter_free(self) -> Iterator[int]:
        """Every free slot: the given-back ones (ascending), then high_water..capacity."""
        return self._alloc.iter_free()

    # ------------------------------------------------------------------ failed devices

    def fenced_devices(self) -> dict[int, tuple[str, int]]:
        """{device: (reason, unix time)} of every fenced device (meta rows `fenced.<d>`)."""
        return self._fences.fenced_devices()

    def fence_rows(self) -> dict[str, int]:
        """The raw `fenced.<d>` meta rows (name -> u64), for an index rebuild to keep."""
        return self._fences.fence_rows()

    def set_devices(self, ndev: int) -> dict[int, tuple[str, int]]:
        """Tell the index how many devices the store has and load its fences: from now on
        reservations and commits skip the fenced devices' slots. Returns the fences."""
        return self._fences.set_devices(ndev)

    @property
    def fenced(self) -> frozenset:
        return self._alloc.fence[1]

    def fence_device(self, dev: int, ndev: int, reason: str) -> list[Entry]:
        """Fence device `dev` of `ndev` and drop its entries, one transaction and an fsync;
        returns the dropped entries (`Fences.fence_device`)."""
        return self._fences.fence_device(dev, ndev, reason)

    def readmit_device(self, dev: int) -> bool:
        """Clear device `dev`'s fence (its slots are free again). True if it was fenced."""
        return self._fences.readmit_device(dev)

    # ------------------------------------------------------------------ the whole index

    @guard
    def stats(self) -> dict:
        """Counters and sizes; O(1) (meta rows and LMDB db stats, no scan)."""
        lm = self._lmdb
        env = lm.live()
        with lm.read() as txn:
            m = {name.decode(): lm.counter(txn, name) for name in COUNTERS
                 if txn.get(name, db=self._meta) is not None}
            used = txn.stat(self._keys)["entries"]
            free_rows = txn.stat(self._free)["entries"]
            reserved = txn.stat(self._reserved)["entries"]
            lru_rows = txn.stat(self._lru)["entries"]
            oldest = self._entries.oldest(txn)
        info = env.info()
        cap = m["capacity"]
        return {
            "capacity_slots": cap,
            "used_slots": used,
            "free_slots": free_rows + cap - m["high_water"],
            "reserved_slots": reserved,
            "high_water": m["high_water"],
            "lru_rows": lru_rows,
            "hits": m["hits"] + lm.pending_hits,
            "misses": m["misses"] + lm.pending_misses,
            "evictions": m["evictions"],
            "duplicates": m.get("duplicates", 0),
            "stale_commits": m.get("stale_commits", 0),
            "tick": m["tick"],
            "oldest_tick": oldest,
            "generation": m["generation"],
            "format": m["format"],
            "map_size": info["map_size"],
            "data_bytes": (info["last_pgno"] + 1) * env.stat()["psize"],
            "readonly": lm.readonly,
        }

    def check_consistency(self) -> list[str]:
        """Full scan of one snapshot; returns a description of every broken invariant
        (empty list = consistent). O(entries): for fsck and tests, not the serving path."""
        from kvstore.index.check import check_consistency
        return check_consistency(self._lmdb)
