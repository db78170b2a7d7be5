"""The operations the step thread queues to `ServingIndex`'s index thread: one dataclass per
kind (slots, not frozen: built on vLLM's step thread, a frozen one costs about 4 us, this
about 0.8), one object per call (never one per block: blocks travel as the lists
and arrays a field holds). The index thread dispatches on the class (`match`); `what`
names the operation in the "error" event (`events.Failed`) when applying it fails.
`OpQueue` is the queue itself, with the step thread's side of it: the calls that queue
one operation each, and the hit/miss counts held back until the next one."""
from __future__ import annotations

import queue
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


class OpQueue:
    """The index thread's operations, queued by the step thread (one object per call,
    never waited for) and taken by the index thread (`ops`). `queued` counts the commits
    queued; `hits`/`misses` the lookup counts not sent yet (`count_hits`)."""

    def __init__(self):
        self.ops: queue.SimpleQueue[IndexOp] = queue.SimpleQueue()
        self.queued = 0             # commits queued (the step thread reads it)
        self.hits = self.misses = 0     # counted by the step thread, not sent yet

    def put(self, op: IndexOp) -> None:
        self.ops.put(op)

    def commit(self, good, bad=(), tag=None) -> None:
        """`ServingIndex.commit`."""
        self.queued += 1
        self.ops.put(CommitOp(list(good), list(bad), tag))

    def commit_blocks(self, keys: list, slots: list, gens: list, failed=(), tag=None,
                      packed: tuple | None = None, keys_back: bool = True,
                      release: KeySet | None = None) -> None:
        """`ServingIndex.commit_blocks`."""
        self.queued += 1
        self.ops.put(CommitBlocksOp(keys, slots, gens, failed, tag, packed, keys_back, release))

    def abort(self, items) -> None:
        if items:
            self.ops.put(AbortOp(list(items)))

    def requeue_abort(self, items: list) -> None:
        """An abort LMDB refused (unwritable): tried again next round."""
        self.ops.put(AbortOp(items))

    def touch(self, keys) -> None:
        if keys:
            self.ops.put(TouchOp(list(keys)))

    def touch_blocks(self, runs: list[tuple[list, list]]) -> None:
        if runs:
            self.ops.put(TouchBlocksOp(runs))

    def count_dropped(self, hashes: list, start: int, stop: int, skip, group: int = 0) -> None:
        """`ServingIndex.count_dropped`."""
        self.ops.put(CountNewOp(hashes, start, stop, skip, group))

    def count_hits(self, hits: int, misses: int) -> None:
        """`ServingIndex.count_hits`: summed here, sent with the next operation."""
        self.hits += hits
        self.misses += misses

    def send_counts(self) -> None:
        if self.hits or self.misses:
            self.ops.put(CountHitsOp(self.hits, self.misses))
            self.hits = self.misses = 0

    def refill(self) -> None:
        """The pool was taken from, or is dry: the counts go, and the index thread refills."""
        if self.hits or self.misses:
            self.ops.put(CountHitsOp(self.hits, self.misses))
            self.hits = self.misses = 0
        self.ops.put(REFILL)

    def flush(self, timeout: float) -> bool:
        """Wait until every operation queued so far is applied; False on timeout."""
        done = threading.Event()
        self.send_counts()
        self.ops.put(MarkOp(done))
        return done.wait(timeout)
