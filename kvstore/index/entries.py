"""The committed entries of the index (`Entries`): key -> (slot, generation, tick) in
``keys``, its reverse row in ``slots`` and its LRU row in ``lru``.

Reads (`lookup`, `longest_prefix`, the iterators) each take short read transactions; each
write (`commit`, `touch`, `drop`) is one write transaction. A commit turns reservations
(`kvstore.index.slots`) into entries and is the one write that fsyncs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import lmdb

from kvstore.index.env import IndexEnv, guard
from kvstore.index.rows import (
    COUNTER, ENTRY_VALUE, LRU_KEY, PAUSE_EVERY, SLOT_KEY, Entry, make_entry, new_entry,
    set_gen, set_key, set_slot, set_tick,
)
from kvstore.index.slots import SlotAllocator

__all__ = ["Entries"]

_U32, _U64, _LRU, _VAL = SLOT_KEY, COUNTER, LRU_KEY, ENTRY_VALUE


class Entries:
    """Lookups, commits, LRU touches and drops of committed entries. Commits consume the
    reservations of `slots` (its `owner` rows, its `fence`) and tell it of slots they
    give back (`note_freed`)."""

    def __init__(self, env: IndexEnv, slots: SlotAllocator):
        self._lmdb = env
        self._alloc = slots
        d = env.dbs
        self._keys, self._slots, self._lru, self._free = d.keys, d.slots, d.lru, d.free
        self._reserved, self._owned = d.reserved, d.owned

    # ------------------------------------------------------------------ reads

    @guard
    def lookup(self, key: bytes) -> Entry | None:
        with self._lmdb.read() as txn:
            v = txn.get(key, db=self._keys)
        if v is None:
            return None
        s, g, t = _VAL.unpack(v)
        return make_entry(key, s, g, t)

    @guard
    def get_many(self, keys: Sequence[bytes]) -> list[tuple[bytes, int, int]]:
        """(key, slot, generation) of each of `keys` that is in the index (in key order
        of the answer, absent keys left out); one read txn, the B-tree walks in C."""
        if not keys:
            return []
        with self._lmdb.read() as txn:
            rows = txn.cursor(db=self._keys).getmulti(list(keys))
        out = []
        for k, v in rows:
            s, g, _ = _VAL.unpack(v)
            out.append((bytes(k), s, g))
        return out

    @guard
    def longest_prefix(self, keys: Sequence[bytes]) -> list[Entry]:
        """Entries of keys[0..i) where keys[i] is the first key not in the index. One read txn."""
        out: list[Entry] = []
        n = len(keys)
        if n == 0:
            return out
        unpack = _VAL.unpack
        append = out.append
        new, set_k, set_s, set_g, set_t = new_entry, set_key, set_slot, set_gen, set_tick
        with self._lmdb.read() as txn:
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

    def oldest(self, txn: lmdb.Transaction) -> int | None:
        """The tick of the coldest entry (the next eviction victim), read in `txn`."""
        cur = txn.cursor(db=self._lru)
        return _LRU.unpack(cur.key())[0] if cur.first() else None

    @guard
    def oldest_tick(self) -> int | None:
        with self._lmdb.read() as txn:
            return self.oldest(txn)

    @guard
    def iter_entries(self) -> Iterator[Entry]:
        """Every committed entry, in key order."""
        for rows in self._lmdb.chunks(self._keys):
            for k, v in rows:
                yield make_entry(k, *_VAL.unpack(v))

    def iter_key_batches(self) -> Iterator[list[bytes]]:
        """Every committed key, in key order, in batches (one read transaction each)."""
        for rows in self._lmdb.chunks(self._keys):
            yield [k for k, _ in rows]

    @guard
    def iter_lru(self, hottest_first: bool = False) -> Iterator[Entry]:
        """Committed entries in eviction order (coldest first unless hottest_first)."""
        for rows in self._lmdb.chunks(self._lru, reverse=hottest_first):
            out = []
            with self._lmdb.read() as txn:
                for lk, _ in rows:
                    _tick, slot = _LRU.unpack(lk)
                    key = txn.get(_U32.pack(slot), db=self._slots)
                    v = txn.get(key, db=self._keys) if key is not None else None
                    if v is None:
                        continue  # changed since the chunk was read
                    s, g, t = _VAL.unpack(v)
                    if s == slot:
                        out.append(make_entry(key, s, g, t))
            yield from out  # outside the txn: see `IndexEnv.chunks`

    @guard
    def load_keys(self, table) -> int:
        """Fill `table` (a `kvstore._keytable.KeyTable`) with every committed key -> (slot,
        generation), from one read transaction. Returns the count. (The store's shared
        slot generations are rebuilt at open, `rebuild_generations`: an entry evicted
        after this snapshot is cut where a lookup meets it.)"""
        with self._lmdb.read() as txn:
            return table.load(txn.cursor(db=self._keys).iternext(keys=True, values=True))

    @guard
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
        return self._lmdb.write(txn_fn)

    # ------------------------------------------------------------------ writes

    @guard
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
        skipped, dups = self._lmdb.write(self._commit_txn, items, dups_out)
        if dups or skipped:
            self._alloc.note_freed()
        if sync and self._lmdb.sync_commits:
            # Only commits are made durable (fdatasync of data.mdb): LMDB writes
            # transactions in order, so syncing here also persists every earlier
            # reservation and eviction, while touches and reservations alone never pay
            # for an fsync. After a crash the index is the state as of some commit.
            self._lmdb.fsync("syncing a commit")
        return skipped

    def _commit_txn(self, txn, items, dups_out=None):
        lm = self._lmdb
        get, put, delete = txn.get, txn.put, txn.delete
        kdb, sdb, ldb, rdb = self._keys, self._slots, self._lru, self._reserved
        owner, odb = self._alloc.owner, self._owned
        if dups_out is not None:
            del dups_out[:]     # a retried transaction starts over
        tick = lm.counter(txn, b"tick")
        skipped = []
        dups = 0
        pub_s: list[int] = []
        pub_g: list[int] = []
        pause = lm.pause
        ndev, fenced = self._alloc.fence
        for n, item in enumerate(reversed(items)):
            if pause is not None and n and n % PAUSE_EVERY == 0:
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
        lm.set_counter(txn, b"tick", tick)
        # Published before the transaction commits, under LMDB's writer lock: an engine
        # that evicts one of these entries does it in a later transaction, so its clear
        # comes after (published after the commit, the generation could land on a slot
        # another engine had evicted and reserved meanwhile). No engine holds these
        # (slot, generation) pairs before the commit is visible.
        lm.shared_set(pub_s, pub_g, [0] * len(pub_s))
        if dups:
            lm.add_counter(txn, b"duplicates", dups)
        if skipped:
            lm.add_counter(txn, b"stale_commits", len(skipped))
            skipped.reverse()
        return skipped, dups

    @guard
    def touch(self, keys: Sequence[bytes]) -> None:
        """LRU update for a prefix hit, one write txn: keys[0] becomes the most recent,
        keys[-1] the least recent of the chain, so a chain is evicted tail first.
        Keys not in the index are ignored."""
        if keys:
            self._lmdb.write(self._touch_txn, keys)

    def _touch_txn(self, txn, keys):
        lm = self._lmdb
        get, put, delete = txn.get, txn.put, txn.delete
        kdb, ldb = self._keys, self._lru
        tick = lm.counter(txn, b"tick")
        unpack, pack, lru = _VAL.unpack, _VAL.pack, _LRU.pack
        pause = lm.pause
        for n, k in enumerate(reversed(keys)):
            if pause is not None and n and n % PAUSE_EVERY == 0:
                pause()
            v = get(k, db=kdb)
            if v is None:
                continue
            s, g, t = unpack(v)
            tick += 1
            delete(lru(t, s), db=ldb)
            put(lru(tick, s), b"", db=ldb, append=True)
            put(k, pack(s, g, tick), db=kdb)
        lm.set_counter(txn, b"tick", tick)

    @guard
    def drop(self, keys: Iterable[bytes]) -> list[Entry]:
        """Remove entries (e.g. a slot failed verification); their slots go back to free.
        Returns the removed entries; absent keys are ignored."""
        self._alloc.note_freed()
        return self._lmdb.write(self._drop_txn, list(keys))

    def _drop_txn(self, txn, keys):
        out = []
        pause = self._lmdb.pause
        for n, k in enumerate(keys):
            if pause is not None and n and n % PAUSE_EVERY == 0:
                pause()
            v = txn.pop(k, db=self._keys)
            if v is None:
                continue
            s, g, t = _VAL.unpack(v)
            sk = _U32.pack(s)
            txn.delete(sk, db=self._slots)
            txn.delete(_LRU.pack(t, s), db=self._lru)
            txn.put(sk, b"", db=self._free)
            out.append(make_entry(k, s, g, t))
        # retracted inside the transaction: once it commits the slot is free, and an
        # engine that reserves it and publishes a new entry must come after
        self._lmdb.shared_set([e.slot for e in out], [0] * len(out),
                              [e.generation for e in out])
        return out
