"""The pool of slots reserved ahead of time for stores, which `ServingIndex.take` hands out.

`SlotPool` owns the reserved (slot, generation) pairs, as two parallel arrays (taken by
slicing, a copy of machine words: no Python int touched on the step thread; the slots and
generations of a store go to the workers as these arrays, as a lookup's do). Only the
step thread takes; only the index thread refills (`refill`: free slots first, then LRU
victims, whose keys leave the lookup table before their slots are handed out), and gives
what is left back at close.
"""
from __future__ import annotations

import array
import threading
from collections.abc import Sequence

from kvstore.lookup.events import Evicted


def empty_pool() -> tuple[array.array, array.array]:
    """The slot pool's (slots, generations), empty: as a packed lookup's hit has them."""
    return array.array("I"), array.array("Q")


class SlotPool:
    """See the module docstring. `target`: how many slots the index thread keeps in it."""

    def __init__(self, index, target: int, lookups, outbox, requests, *,
                 evicted_keys: bool = True):
        self.index = index
        self.target = target
        self.lookups = lookups      # `TableLookups`: the eviction claim
        self.outbox = outbox        # `Evicted` events
        self.requests = requests    # `OpQueue`: a take wakes the index thread
        # `Evicted` events carry the evicted keys (KV events name them), or only their
        # count: then the keys are freed here, not on the step thread that polls.
        self.evicted_keys = evicted_keys
        self.lock = threading.Lock()
        self.slots, self.gens = empty_pool()

    # ------------------------------------------------------------------ step thread

    def take(self, keys: Sequence[bytes], packed: tuple | None = None
             ) -> tuple[Sequence[int], Sequence[int]]:
        """`ServingIndex.take`."""
        want = len(keys) + (len(packed[0]) if packed else 0)
        with self.lock:
            if want >= len(self.slots):     # all of it (a short pool): no copy
                slots, gens = self.slots, self.gens
                self.slots, self.gens = empty_pool()
            else:
                slots, gens = self.slots[:want], self.gens[:want]
                del self.slots[:want], self.gens[:want]
        if want:    # taken from, or dry (pins may have gone since): the index thread refills
            self.requests.refill()
        return slots, gens

    def available(self) -> int:
        """`ServingIndex.available`."""
        return len(self.slots)

    def pooled(self) -> list[tuple[int, int]]:
        with self.lock:
            return list(zip(self.slots, self.gens))

    def purge(self, dev: int, ndev: int) -> list[int]:
        """Take device `dev`'s slots out of the pool; returns them (still reserved)."""
        with self.lock:
            out = [s_ for s_ in self.slots if s_ % ndev == dev]
            if out:
                keep = [(s_, g) for s_, g in zip(self.slots, self.gens) if s_ % ndev != dev]
                self.slots = array.array("I", [s_ for s_, _ in keep])
                self.gens = array.array("Q", [g for _, g in keep])
        return out

    # ------------------------------------------------------------------ index thread

    def refill(self) -> None:
        """Reserve slots in LMDB up to `target` (also at open, on the opening thread)."""
        while len(self.slots) < self.target:
            removed: list = []
            n = self.target - len(self.slots)
            try:
                slots, gens, evicted = self.index.reserve_pool(n, self.lookups.claim(removed))
            except BaseException:
                self.lookups.restore(removed)   # LMDB still has them: they stay hits
                raise
            with self.lock:
                self.slots.extend(slots)
                self.gens.extend(gens)
            if evicted:
                self.outbox.post(Evicted(keys=evicted if self.evicted_keys else [],
                                         count=len(evicted)))
            if len(slots) < n:
                return      # everything left is pinned or reserved: try again later

    def give_back(self) -> None:
        """At close: the pool's reservations go back to LMDB."""
        with self.lock:
            pool = self.slots.tolist()
            self.slots, self.gens = empty_pool()
        if pool:
            self.index.abort(pool)
