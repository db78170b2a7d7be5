"""Reservations and free-slot accounting of the index (`SlotAllocator`).

A slot is handed out in a reservation (a ``reserved`` row: a fresh generation, and the key
once known) taken from the free list (``free`` rows), then from never-used slots (``>=
meta.high_water``), then by evicting the least recently used entries; it goes back to free
by an abort or a reclaim (crash recovery, a dead engine's ``owned`` rows). Each of these is
one write transaction. Slots of a fenced device (`fence`, kept by `kvstore.index.fences`)
are never handed out: their free rows stay free.
"""

from __future__ import annotations

import array
from collections import Counter
from collections.abc import Collection, Iterable, Iterator

from kvstore.errors import CorruptIndex, KVStoreError, StoreFull
from kvstore.index.env import IndexEnv, guard
from kvstore.index.rows import (
    COUNTER, ENTRY_VALUE, LRU_KEY, PAUSE_EVERY, REBUILD_HINT, SLOT_KEY, Entry, make_entry,
)

__all__ = ["SlotAllocator"]

_U32, _U64, _LRU, _VAL = SLOT_KEY, COUNTER, LRU_KEY, ENTRY_VALUE


class SlotAllocator:
    """Reserves slots, takes them back, and tells which engine holds a reservation.

    `owner` (`kvstore.store.shared.Lease.owner`, or None): the engine whose reservations
    this handle makes; each one is also a row of ``owned``, so survivors can give them back
    if it dies. `fence`: (number of devices, frozenset of fenced devices); their slots are
    never reserved (and never committed: `kvstore.index.entries`).
    """

    def __init__(self, env: IndexEnv):
        self._lmdb = env
        d = env.dbs
        self._keys, self._slots, self._lru, self._free = d.keys, d.slots, d.lru, d.free
        self._reserved, self._owned = d.reserved, d.owned
        self._capacity = env.capacity
        self.owner: bytes | None = None
        self.fence: tuple[int, frozenset] = (1, frozenset())
        # With a fenced device, the free list can hold only fenced slots (a full store):
        # `reserve_pool` then skips scanning it until a write may have freed another slot
        # (`_free_epoch` counts those writes, `note_freed`; `_free_dry` is the epoch of the
        # last scan that found the list exhausted).
        self._free_epoch = 0
        self._free_dry = -1

    def note_freed(self) -> None:
        """A write may give slots back to the free list (an abort, a drop, a fence...)."""
        self._free_epoch += 1

    # ------------------------------------------------------------------ reservations

    @guard
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
        if self.fence[1]:
            pinned = _FencedOrPinned(pinned, *self.fence)
        return self._lmdb.write(self._reserve_txn, list(keys), pinned)

    def _reserve_txn(self, txn, keys, pinned):
        lm = self._lmdb
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
        hw = lm.counter(txn, b"high_water")
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
                        f"lru row (tick {t}, slot {s}) has no key/slot rows; {REBUILD_HINT}")
                _, g, _ = _VAL.unpack(v)
                lm.evicted_shared([s], [g])      # `pinned` cleared its generation
                evicted.append(make_entry(k, s, g, t))
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
        gen = lm.counter(txn, b"generation")
        rdb = self._reserved
        owner = self.owner
        out = []
        for k, s in zip(todo, slots):
            gen += 1
            put(_U32.pack(s), _U64.pack(gen) + k, db=rdb)
            if owner is not None:
                put(owner + _U32.pack(s), b"", db=self._owned)
            out.append((k, s, gen))
        lm.set_counter(txn, b"generation", gen)
        lm.set_counter(txn, b"high_water", hw)
        if evicted:
            lm.add_counter(txn, b"evictions", len(evicted))
        return out, evicted

    @guard
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
        ndev, fenced = self.fence
        if not fenced:
            return self._lmdb.write(self._reserve_pool_txn, n, claim)[:3]
        inner = claim

        def claim(cands):   # a fenced device's slots are never taken (they stay free)
            return inner([c for c in cands if c[1] % ndev not in fenced])
        epoch = self._free_epoch
        slots, gens, evicted, exhausted = self._lmdb.write(self._reserve_pool_txn, n, claim,
                                                           self._free_dry == epoch)
        if exhausted:
            self._free_dry = epoch
        return slots, gens, evicted

    def _reserve_pool_txn(self, txn, n, claim, skip_free=False):
        lm = self._lmdb

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
                while ok and len(rows) < min(n - len(slots), PAUSE_EVERY):
                    last = cur.key()
                    rows.append(last)
                    ok = cur.next()
                if not rows:
                    return
                yield rows
                if not ok:
                    return
                if lm.pause is not None:
                    lm.pause()

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
        hw = lm.counter(txn, b"high_water")
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
                                       f"slot row; {REBUILD_HINT}")
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
                                           f"has no key row; {REBUILD_HINT}")
                    txn.delete(_U32.pack(s_), db=sdb)
                    txn.delete(lk, db=ldb)
                    ev_s.append(s_)
                    ev_g.append(_VAL.unpack(v)[1])
                    evicted.append(k)
                    slots.append(s_)
            finally:
                lm.evicted_shared(ev_s, ev_g)    # the claim cleared their generations
        gen = lm.counter(txn, b"generation")
        owner = self.owner
        gens = array.array("Q", range(gen + 1, gen + 1 + len(slots)))
        for s_, g_ in zip(slots, gens):
            txn.put(_U32.pack(s_), _U64.pack(g_), db=self._reserved)
            if owner is not None:
                txn.put(owner + _U32.pack(s_), b"", db=self._owned)
        lm.set_counter(txn, b"generation", gen + len(slots))
        lm.set_counter(txn, b"high_water", hw)
        if evicted:
            lm.add_counter(txn, b"evictions", len(evicted))
        return array.array("I", slots), gens, evicted, exhausted

    # ------------------------------------------------------------------ giving slots back

    @guard
    def abort(self, slots_or_items: Iterable[int | tuple[bytes, int, int]]) -> int:
        """Give reservations back to free. Accepts slot ints (released if reserved) or
        (key, slot, generation) items (released only if that reservation still stands).
        Returns how many were released."""
        self._free_epoch += 1
        return self._lmdb.write(self._abort_txn, list(slots_or_items))

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

    @guard
    def reclaim_reserved(self) -> int:
        """Crash recovery, for the writer at open: every reserved slot goes back to free.
        A reserved slot may hold a half-written block; nothing points at it. Returns count."""
        self._free_epoch += 1
        n = self._lmdb.write(self._reclaim_txn)
        self._lmdb.reader_check()
        return n

    def _reclaim_txn(self, txn):
        slots = list(txn.cursor(db=self._reserved).iternext(keys=True, values=False))
        if slots:
            txn.cursor(db=self._free).putmulti(((sk, b"") for sk in slots))
            txn.drop(self._reserved, delete=False)
        if self._owned is not None:
            txn.drop(self._owned, delete=False)
        return len(slots)

    @guard
    def reclaim_owner(self, owner: bytes) -> int:
        """A dead engine's reservations go back to free (its `owned` rows, and the
        reservations they name when still standing), and LMDB reader slots it left (it
        may have died inside a read transaction) are cleared. Returns how many
        reservations were released."""
        self._free_epoch += 1
        n = self._lmdb.write(self._reclaim_owner_txn, owner)
        self._lmdb.reader_check()
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

    # ------------------------------------------------------------------ reads

    @guard
    def owned_counts(self) -> dict[bytes, int]:
        """{owner id: reservations it holds} (for `kvstore info`)."""
        out: Counter = Counter()
        if self._owned is None:
            return {}
        with self._lmdb.read() as txn:
            for k in txn.cursor(db=self._owned).iternext(keys=True, values=False):
                out[bytes(k[:12])] += 1
        return dict(out)

    @guard
    def iter_reserved(self) -> Iterator[tuple[int, int, bytes]]:
        """(slot, generation, key) of every reservation not yet committed or aborted."""
        for rows in self._lmdb.chunks(self._reserved):
            for sk, v in rows:
                yield _U32.unpack(sk)[0], _U64.unpack_from(v)[0], bytes(v[8:])

    @guard
    def iter_free(self) -> Iterator[int]:
        """Every free slot: the given-back ones (ascending), then high_water..capacity."""
        for rows in self._lmdb.chunks(self._free):
            for sk, _ in rows:
                yield _U32.unpack(sk)[0]
        with self._lmdb.read() as txn:
            hw = self._lmdb.counter(txn, b"high_water")
        yield from range(hw, self._capacity)


class _FencedOrPinned:
    """`pinned` of `SlotAllocator.reserve` plus every slot of a fenced device."""

    __slots__ = ("pinned", "ndev", "fenced")

    def __init__(self, pinned, ndev, fenced):
        self.pinned, self.ndev, self.fenced = pinned, ndev, fenced

    def __contains__(self, s) -> bool:
        return s % self.ndev in self.fenced or s in self.pinned

    def __len__(self) -> int:
        return len(self.pinned)
