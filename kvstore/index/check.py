"""The index's invariants, checked over one snapshot (`check_consistency`): O(entries), for
fsck and tests, never the serving path."""

from __future__ import annotations

from kvstore.index.env import IndexEnv
from kvstore.index.rows import COUNTER, ENTRY_VALUE, LRU_KEY, SLOT_KEY

__all__ = ["check_consistency"]

_U32, _U64, _LRU, _VAL = SLOT_KEY, COUNTER, LRU_KEY, ENTRY_VALUE


def check_consistency(lm: IndexEnv) -> list[str]:
    """Full scan of one snapshot; returns a description of every broken invariant
    (empty list = consistent). Every slot below high_water is used, free or reserved,
    exactly once; every entry's rows agree; counters are past every row."""
    problems: list[str] = []
    d = lm.dbs
    with lm.read() as txn:
        cap = lm.capacity
        hw = lm.counter(txn, b"high_water")
        tick = lm.counter(txn, b"tick")
        gen = lm.counter(txn, b"generation")
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
        for k, v in txn.cursor(db=d.keys):
            s, g, t = _VAL.unpack(v)
            claim(s, f"used by key {k.hex()}")
            if txn.get(_U32.pack(s), db=d.slots) != k:
                problems.append(f"slots[{s}] does not point back at key {k.hex()}")
            if t > tick:
                problems.append(f"key {k.hex()} tick {t} > meta tick {tick}")
            if g > gen:
                problems.append(f"key {k.hex()} generation {g} > meta generation {gen}")
            lru_expected.add(_LRU.pack(t, s))
        n_slots = txn.stat(d.slots)["entries"]
        n_keys = txn.stat(d.keys)["entries"]
        if n_slots != n_keys:
            problems.append(f"slots db has {n_slots} rows, keys db {n_keys}")
        lru_rows = set(txn.cursor(db=d.lru).iternext(keys=True, values=False))
        if lru_rows != lru_expected:
            problems.append(f"lru has {len(lru_rows - lru_expected)} rows without an entry "
                            f"and misses {len(lru_expected - lru_rows)} entries")
        for sk in txn.cursor(db=d.free).iternext(keys=True, values=False):
            claim(_U32.unpack(sk)[0], "free")
        for sk, v in txn.cursor(db=d.reserved):
            claim(_U32.unpack(sk)[0], "reserved")
            if _U64.unpack_from(v)[0] > gen:
                problems.append(f"reservation of slot {_U32.unpack(sk)[0]} has generation "
                                f"> meta generation {gen}")
        if len(owner) != hw:
            problems.append(f"used + free + reserved below high_water = {len(owner)}, "
                            f"expected {hw} (slots lost or counted twice)")
        if d.owned is not None:
            # an engine's reservation names its owner (`owned`): a row whose slot is not
            # reserved would make that owner's reclaim free somebody else's reservation
            for ok in txn.cursor(db=d.owned).iternext(keys=True, values=False):
                if len(ok) != 16 or txn.get(bytes(ok[12:]), db=d.reserved) is None:
                    problems.append(f"owned row {bytes(ok).hex()} names a slot that is not reserved")
    return problems
