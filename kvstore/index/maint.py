"""Index maintenance: what only fsck, `--rebuild-index` and benchmarks use.

Snapshots over every database (`snapshot`, `IndexSnapshot`), bulk loading of an empty index (`bulk_load`) and the rebuild that
swaps a new index in (`rebuild_index`). The serving path (`kvstore.index.core.Index`, the
scheduler's `kvstore.lookup.table.ServingIndex`) never imports this module: everything here is
O(entries) and reads the index's databases directly.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import lmdb

from kvstore.errors import KVStoreError
from kvstore.index.core import (
    COUNTER, ENTRY_VALUE, LRU_KEY, SLOT_KEY, Entry, Index, make_entry,
)

__all__ = ["IndexSnapshot", "bulk_load", "rebuild_index", "snapshot"]


def bulk_load(ix: Index, entries: Iterable[tuple[bytes, int, int]], *, keys_sorted: bool = False,
              batch: int = 200_000) -> int:
    """Fill an empty index with committed (key, slot, generation) entries, fast.

    For `fsck --rebuild-index` (entries scanned from slot headers) and benchmarks. Ticks
    follow input order (first = coldest). keys_sorted=True promises ascending keys and
    uses LMDB append mode. Slots not loaded below the highest one become free. Raises
    KVStoreError on a duplicate key or slot, or if the index is not empty (partial
    batches already written stay; recreate the index to retry). Returns the count.
    """
    ix.env()
    with ix.read_txn() as txn:
        if (txn.stat(ix.dbs.keys)["entries"] or txn.stat(ix.dbs.reserved)["entries"]
                or ix.counter(txn, b"high_water")):
            raise KVStoreError(f"bulk_load: index at {ix.path} is not empty")
    cap = ix.capacity_slots
    seen = bytearray(cap)
    state = {"tick": 0, "gen": 0, "hw": 0, "n": 0, "last_slot": -1}

    def flush(rows):
        slot_sorted = all(rows[i][1] < rows[i + 1][1] for i in range(len(rows) - 1)) \
            and rows[0][1] > state["last_slot"]
        t0 = state["tick"]
        kv = [(k, ENTRY_VALUE.pack(s, g, t0 + i + 1)) for i, (k, s, g) in enumerate(rows)]
        sv = [(SLOT_KEY.pack(s), k) for k, s, _ in rows]
        if not slot_sorted:
            sv.sort()
        lv = [(LRU_KEY.pack(t0 + i + 1, s), b"") for i, (_, s, _) in enumerate(rows)]

        def txnfn(txn):
            _, added = txn.cursor(db=ix.dbs.keys).putmulti(kv, overwrite=False,
                                                          append=keys_sorted)
            if added != len(kv):
                raise KVStoreError("bulk_load: duplicate key in input")
            txn.cursor(db=ix.dbs.slots).putmulti(sv, append=slot_sorted)
            txn.cursor(db=ix.dbs.lru).putmulti(lv, append=True)
            ix.set_counter(txn, b"tick", t0 + len(rows))
            ix.set_counter(txn, b"generation", max(state["gen"], max(g for _, _, g in rows)))
            ix.set_counter(txn, b"high_water", max(state["hw"], max(s for _, s, _ in rows) + 1))

        ix.write_txn(txnfn)
        state["tick"] = t0 + len(rows)
        state["gen"] = max(state["gen"], max(g for _, _, g in rows))
        state["hw"] = max(state["hw"], max(s for _, s, _ in rows) + 1)
        state["last_slot"] = max(state["last_slot"], max(s for _, s, _ in rows))
        state["n"] += len(rows)

    rows: list[tuple[bytes, int, int]] = []
    for k, s, g in entries:
        if not 0 <= s < cap:
            raise KVStoreError(f"bulk_load: slot {s} outside [0, {cap})")
        if seen[s]:
            raise KVStoreError(f"bulk_load: slot {s} appears twice")
        seen[s] = 1
        rows.append((k, s, g))
        if len(rows) >= batch:
            flush(rows)
            rows = []
    if rows:
        flush(rows)
    hw = state["hw"]
    holes = []
    i = seen.find(0, 0, hw)
    while i != -1:
        holes.append((SLOT_KEY.pack(i), b""))
        i = seen.find(0, i + 1, hw)
    if holes:
        ix.write_txn(lambda txn: txn.cursor(db=ix.dbs.free).putmulti(holes, append=True))
    return state["n"]


def snapshot(ix: Index) -> "IndexSnapshot":
    """One read transaction over every database, for fsck: a context manager whose
    iterators all see the same committed state, even while a writer (another process)
    keeps committing. Hold it only as long as a scan takes."""
    return IndexSnapshot(ix)


class IndexSnapshot:
    """Typed, read-only iterators over the raw rows of one consistent snapshot.

    Rows that do not decode (wrong length) are not yielded; they are recorded in
    `malformed` as (db name, row key) so that fsck can report them.
    """

    def __init__(self, index: Index):
        self._ix = index
        self._txn: lmdb.Transaction | None = None
        self.malformed: list[tuple[str, bytes]] = []

    def __enter__(self) -> "IndexSnapshot":
        self._txn = self._ix.read_txn()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._txn is not None:
            self._txn.abort()
            self._txn = None

    def _rows(self, db) -> Iterator[tuple[bytes, bytes]]:
        if self._txn is None:
            raise KVStoreError("IndexSnapshot used outside its `with` block")
        return self._txn.cursor(db=db).iternext(keys=True, values=True)

    def counters(self) -> dict[str, int]:
        out = {}
        for k, v in self._rows(self._ix.dbs.meta):
            if len(v) == COUNTER.size:
                out[k.decode(errors="replace")] = COUNTER.unpack(v)[0]
            else:
                self.malformed.append(("meta", bytes(k)))
        return out

    def count(self, name: str) -> int:
        db = {"keys": self._ix.dbs.keys, "slots": self._ix.dbs.slots, "lru": self._ix.dbs.lru,
              "free": self._ix.dbs.free, "reserved": self._ix.dbs.reserved}[name]
        return self._txn.stat(db)["entries"]

    def entries(self) -> Iterator[Entry]:
        """keys db: every committed entry, in key order."""
        for k, v in self._rows(self._ix.dbs.keys):
            if len(v) != ENTRY_VALUE.size:
                self.malformed.append(("keys", bytes(k)))
                continue
            yield make_entry(bytes(k), *ENTRY_VALUE.unpack(v))

    def slot_rows(self) -> Iterator[tuple[int, bytes]]:
        """slots db: (slot, key) reverse rows."""
        for sk, k in self._rows(self._ix.dbs.slots):
            if len(sk) != SLOT_KEY.size:
                self.malformed.append(("slots", bytes(sk)))
                continue
            yield SLOT_KEY.unpack(sk)[0], bytes(k)

    def lru_rows(self) -> Iterator[tuple[int, int]]:
        """lru db: (tick, slot), coldest first."""
        for lk, _ in self._rows(self._ix.dbs.lru):
            if len(lk) != LRU_KEY.size:
                self.malformed.append(("lru", bytes(lk)))
                continue
            yield LRU_KEY.unpack(lk)

    def free_rows(self) -> Iterator[int]:
        """free db: the given-back slots (not the never-used ones >= high_water)."""
        for sk, _ in self._rows(self._ix.dbs.free):
            if len(sk) != SLOT_KEY.size:
                self.malformed.append(("free", bytes(sk)))
                continue
            yield SLOT_KEY.unpack(sk)[0]

    def owned_rows(self) -> Iterator[tuple[bytes, int]]:
        """owned db: (owner id, slot) of each engine's reservation (none in an older
        store, which has no `owned` db)."""
        if self._ix.dbs.owned is None:
            return iter(())
        return self._owned_rows()

    def _owned_rows(self) -> Iterator[tuple[bytes, int]]:
        for k, _ in self._rows(self._ix.dbs.owned):
            if len(k) != 16:
                self.malformed.append(("owned", bytes(k)))
                continue
            yield bytes(k[:12]), SLOT_KEY.unpack(k[12:])[0]

    def reserved_rows(self) -> Iterator[tuple[int, int, bytes]]:
        """reserved db: (slot, generation, key)."""
        for sk, v in self._rows(self._ix.dbs.reserved):
            if len(sk) != SLOT_KEY.size or len(v) < COUNTER.size:
                self.malformed.append(("reserved", bytes(sk)))
                continue
            yield SLOT_KEY.unpack(sk)[0], COUNTER.unpack_from(v)[0], bytes(v[8:])


_KEPT_COUNTERS = ("hits", "misses", "evictions", "duplicates", "stale_commits")


def rebuild_index(path: str, capacity_slots: int, entries: Iterable[tuple[bytes, int, int]], *,
                  counters: dict | None = None, sync: bool = True) -> int:
    """Replace the index at `path` by one holding exactly `entries` (fsck --repair and
    --rebuild-index). The caller must hold the store's writer lock and have no Index open
    on `path`.

    `entries` are committed (key, slot, generation), coldest first (their order becomes
    the LRU order). `counters` carries hits/misses/evictions/duplicates/stale_commits over
    from the old index and a `generation` floor: the generation counter never goes back,
    so a slot header written before the rebuild can never match a later reservation.
    The new index is built next to the old one (`index.rebuild`) and swapped in with two
    renames; a crash in between leaves no index/, which `fsck --rebuild-index` recovers
    from the slot headers. Returns the number of entries loaded.
    """
    path = os.path.abspath(os.fspath(path)).rstrip(os.sep)
    tmp, old = path + ".rebuild", path + ".old"
    import shutil
    def remove(p):
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)

    for p in (tmp, old):
        remove(p)
    with Index(tmp, capacity_slots, create=True, sync=sync) as ix:
        n = bulk_load(ix, entries)
        counters = dict(counters or {})

        def txnfn(txn):
            for name in _KEPT_COUNTERS:
                if name in counters:
                    ix.set_counter(txn, name.encode(), int(counters[name]))
            for name, v in counters.items():    # fenced devices stay fenced
                if name.startswith("fenced."):
                    ix.set_counter(txn, name.encode(), int(v))
            floor = int(counters.get("generation", 0))
            if floor > ix.counter(txn, b"generation"):
                ix.set_counter(txn, b"generation", floor)
        ix.write_txn(txnfn)
    if os.path.lexists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    remove(old)
    return n
