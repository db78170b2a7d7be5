"""The index's rows (docs/FORMAT.md, "Index"): the struct codecs of its keys and values,
the names of its databases and counters, and `Entry`, a committed row of ``keys``.

Every value is struct-packed, never pickled. The codecs are public for every module of
`kvstore.index` (and the maintenance code, `kvstore.index.maint`, through `core`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["COUNTER", "COUNTERS", "DB_NAMES", "ENTRY_VALUE", "FENCE", "FENCE_CODE", "FENCE_PREFIX",
           "FENCE_REASONS", "FORMAT_VERSION", "ITER_CHUNK", "LRU_KEY", "MAX_SLOTS", "MIN_MAP",
           "PAUSE_EVERY", "REBUILD_HINT", "SLOT_KEY", "Entry", "IndexDBs", "make_entry",
           "new_entry", "set_gen", "set_key", "set_slot", "set_tick"]

FORMAT_VERSION = 1

SLOT_KEY = struct.Struct(">I")      # slot keys: big-endian so LMDB order == numeric order
COUNTER = struct.Struct("<Q")       # meta counters, reservation generation
LRU_KEY = struct.Struct(">QI")      # tick then slot: ordered by age, unique per slot
ENTRY_VALUE = struct.Struct("<IQQ")  # keys-db value: slot, generation, tick

DB_NAMES = (b"keys", b"slots", b"lru", b"free", b"reserved", b"meta", b"owned")
COUNTERS = (b"capacity", b"high_water", b"tick", b"generation", b"hits", b"misses",
            b"evictions", b"duplicates", b"stale_commits", b"format")

MAX_SLOTS = 1 << 32
# A fenced (failed) device of a store over several data directories: meta row
# b"fenced.<d>" = u32 LE reason code, u32 LE unix time (8 bytes, like every meta row).
FENCE_PREFIX = b"fenced."
FENCE = struct.Struct("<II")
FENCE_REASONS = {1: "io_error", 2: "missing", 3: "readonly", 4: "foreign"}
FENCE_CODE = {v: k for k, v in FENCE_REASONS.items()}
MIN_MAP = 1 << 24
REBUILD_HINT = "run `kvstore fsck --rebuild-index` to rebuild it from the slot files"
# Rows per read transaction of the iterators (`IndexEnv.chunks`).
ITER_CHUNK = 4096
# Rows between two calls of the `pause` hook inside a long write transaction.
PAUSE_EVERY = 64


@dataclass(frozen=True, slots=True)
class Entry:
    key: bytes
    slot: int
    generation: int
    tick: int


# A frozen dataclass's __init__ goes through object.__setattr__ per field; setting the slot
# descriptors directly is ~2x faster, which matters in longest_prefix (1000s of entries/call).
new_entry = object.__new__
set_key = Entry.key.__set__          # type: ignore[attr-defined]
set_slot = Entry.slot.__set__        # type: ignore[attr-defined]
set_gen = Entry.generation.__set__   # type: ignore[attr-defined]
set_tick = Entry.tick.__set__        # type: ignore[attr-defined]


def make_entry(key: bytes, slot: int, gen: int, tick: int) -> Entry:
    e = new_entry(Entry)
    set_key(e, key)
    set_slot(e, slot)
    set_gen(e, gen)
    set_tick(e, tick)
    return e


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
