"""The operations the step thread queues to `ServingIndex`'s index thread: one dataclass per
kind (slots, not frozen: built on vLLM's step thread, a frozen one costs about 4 us, this
about 0.8), one object per call (never one per block: blocks travel as the lists
and arrays a field holds). The index thread dispatches on the class (`match`); `what`
names the operation in the "error" event (`events.Failed`) when applying it fails."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ClassVar

from kvstore._keytable import KeySet


@dataclass(slots=True)
class CommitOp:
    """Abort `bad`, commit `good` ((key, slot, generation) tuples) with one fsync."""
    what: ClassVar[str] = "commit"
    good: list
    bad: list
    tag: object


@dataclass(slots=True)
class CommitBlocksOp:
    """`ServingIndex.commit_blocks`: parallel lists, the tuples made on the index thread."""
    what: ClassVar[str] = "commit_blocks"
    keys: list
    slots: object           # a sequence of int (array('I') from the pool)
    gens: object            # a sequence of int (array('Q') from the pool)
    failed: object          # indices of the blocks to abort
    tag: object
    packed: tuple | None    # (hashes, group runs): more blocks after `keys`
    keys_back: bool
    release: KeySet | None


@dataclass(slots=True)
class AbortOp:
    """Give (key, slot, generation) reservations (or bare slots) back."""
    what: ClassVar[str] = "abort"
    items: list


@dataclass(slots=True)
class TouchOp:
    what: ClassVar[str] = "touch"
    keys: list


@dataclass(slots=True)
class TouchBlocksOp:
    """Touches of packed hits: (hashes, group runs) each, keys made on the index thread."""
    what: ClassVar[str] = "touch_blocks"
    runs: list


@dataclass(slots=True)
class DropOp:
    what: ClassVar[str] = "drop"
    keys: list


@dataclass(slots=True)
class DropAllOp:
    what: ClassVar[str] = "drop_all"


@dataclass(slots=True)
class FenceOp:
    """Device `dev` failed: drop its entries, record the fence, give `removed` (its slots
    taken out of the pool) back."""
    what: ClassVar[str] = "fence"
    dev: int
    reason: str
    removed: list


@dataclass(slots=True)
class CountNewOp:
    """`ServingIndex.count_dropped`: count the new blocks start..stop of `hashes`."""
    what: ClassVar[str] = "count_new"
    hashes: list
    start: int
    stop: int
    skip: object            # the keys being stored (a KeySet or a set)
    group: int


@dataclass(slots=True)
class CountHitsOp:
    """Hit/miss counts summed on the step thread since its last operation."""
    what: ClassVar[str] = "count"
    hits: int
    misses: int


@dataclass(slots=True)
class RefillOp:
    """The pool was taken from: wake the index thread (every round refills it)."""
    what: ClassVar[str] = "refill"


@dataclass(slots=True)
class MarkOp:
    """`flush`: `done` is set once every operation queued before it is applied."""
    what: ClassVar[str] = "mark"
    done: threading.Event


@dataclass(slots=True)
class StopOp:
    """`close`: apply what is queued, give the pool back, end the thread."""
    what: ClassVar[str] = "stop"


IndexOp = (CommitOp | CommitBlocksOp | AbortOp | TouchOp | TouchBlocksOp | DropOp | DropAllOp
           | FenceOp | CountNewOp | CountHitsOp | RefillOp | MarkOp | StopOp)

# The operations without fields, one object each.
REFILL = RefillOp()
DROP_ALL = DropAllOp()
STOP = StopOp()
