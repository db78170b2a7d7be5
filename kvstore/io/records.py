"""What the I/O path hands between threads about many blocks at once: `SlotRef` (one
block's place on disk) and `Columns` / `SlotRefs` (many blocks as three parallel lists)."""
from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class SlotRef:
    """One block's place on disk: what a worker needs to write or read it."""

    key: bytes
    slot: int
    generation: int


class Columns(abc.Sequence):
    """Many blocks as three parallel lists (keys, slots, generations): a sequence whose
    items (`_item(key, slot, generation)`) are made on the fly. Code that hands hundreds
    of blocks a step between kvstore's threads passes these, not an object per block:
    objects the garbage collector tracks are what make it run on the thread that
    allocates them, and a collection holds the GIL (for milliseconds: it walks vLLM's
    request lists) while vLLM's step thread waits."""

    __slots__ = ("keys", "slots", "generations")

    def __init__(self, keys: Sequence[bytes], slots: Sequence[int], generations: Sequence[int]):
        if not len(keys) == len(slots) == len(generations):
            raise ValueError(f"{type(self).__name__}: {len(keys)} keys, {len(slots)} slots "
                             f"and {len(generations)} generations")
        self.keys, self.slots, self.generations = keys, slots, generations

    @staticmethod
    def _item(key, slot, generation):
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return type(self)(self.keys[i], self.slots[i], self.generations[i])
        return self._item(self.keys[i], self.slots[i], self.generations[i])

    def __iter__(self):
        return map(self._item, self.keys, self.slots, self.generations)


class SlotRefs(Columns):
    """A sequence of `SlotRef` (the worker's I/O thread hands RankIO its blocks so)."""

    __slots__ = ()
    _item = SlotRef


def ref_parts(refs) -> tuple[list, list, list]:
    """(keys, slots, generations) of a sequence of SlotRef, as lists."""
    if isinstance(refs, SlotRefs):
        return list(refs.keys), list(refs.slots), list(refs.generations)
    return [r.key for r in refs], [r.slot for r in refs], [r.generation for r in refs]


def ref_slots(refs) -> Sequence[int]:
    """The slots of a sequence of SlotRef (SlotRefs' own list, not a copy)."""
    return refs.slots if isinstance(refs, SlotRefs) else [r.slot for r in refs]
