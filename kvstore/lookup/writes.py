"""The index thread's LMDB writes: commits, aborts, LRU touches and drops, applied.

`IndexWrites` applies what the step thread queued (`kvstore.lookup.ops`) to LMDB and keeps
the lookup table in step with it: a commit's keys join the table only once the commit is
fsynced (a hit is always durable), a drop's keys leave it as LMDB forgets them. Each
applied commit posts one `Committed` event, also when it failed (its reservations then go
back, now or in a later round). It also keeps the slot gauges (`gauges`: used/free/reserved
as of the last write). The synchronous baseline (`kvstore.bench.sync_index`) applies its
commits with one on the caller's thread.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from kvstore._keytable import KeySet, fingerprints, keys_with_packed
from kvstore.errors import KVStoreError
from kvstore.index.core import Entry
from kvstore.io.records import Columns
from kvstore.lookup.events import Committed, Dropped
from kvstore.lookup.ops import CommitBlocksOp


class Items(Columns):
    """(key, slot, generation) tuples kept as three lists (see `rankio.Columns`): the
    index thread's commits of a store's blocks. Iterating, indexing and reversing make
    the tuples on the fly, freed as the caller moves on."""

    __slots__ = ()

    @staticmethod
    def _item(key, slot, generation):
        return key, slot, generation

    def __iter__(self):
        return zip(self.keys, self.slots, self.generations)

    def __reversed__(self):
        return zip(reversed(self.keys), reversed(self.slots), reversed(self.generations))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


def split_failed(keys, slots, gens, failed) -> tuple[Items, Items]:
    """(good, bad) items of parallel lists; `failed` holds the indices of the bad ones."""
    if not failed:
        return Items(keys, slots, gens), Items([], [], [])
    good = [i for i in range(len(keys)) if i not in failed]
    bad = [i for i in range(len(keys)) if i in failed]
    return (Items([keys[i] for i in good], [slots[i] for i in good], [gens[i] for i in good]),
            Items([keys[i] for i in bad], [slots[i] for i in bad], [gens[i] for i in bad]))


def read_gauges(index) -> dict:
    """used/free/reserved slot counts of `index` now."""
    s = index.stats()
    return {"used_slots": s["used_slots"], "free_slots": s["free_slots"],
            "reserved_slots": s["reserved_slots"]}


def release_fps(release: KeySet | None, fps: bytes) -> bool:
    """Discard fps from `release` (the caller holds the table's lock); False when there
    is no set or no fingerprints (the step thread discards the keys then)."""
    if release is None or not fps:
        return False
    release.discard_fingerprints(fps)
    return True


class IndexWrites:
    """See the module docstring. `table` and `lock`: the lookup table and its lock
    (`TableLookups`); `requeue(items)`: where an abort LMDB refused goes (the index
    thread's queue, tried again next round), None to give it up. `applied` counts the
    commits applied (failed ones too)."""

    def __init__(self, index, table, lock, outbox, requeue=None):
        self.index = index
        self.table = table
        self.lock = lock
        self.outbox = outbox
        self.requeue = requeue
        self.applied = 0
        self.gauges = read_gauges(index)

    def refresh_gauges(self) -> None:
        self.gauges = read_gauges(self.index)

    def commit_blocks(self, op: CommitBlocksOp) -> None:
        """A `CommitBlocksOp`: its keys made here, then `commit`."""
        try:
            keys = keys_with_packed(op.keys, op.packed)
        except Exception as exc:    # (the walk made them: no memory)
            self.unkeyed(op.slots, op.tag, exc, op.packed)
            return
        self.commit(*split_failed(keys, op.slots, op.gens, op.failed), op.tag, keys,
                    op.keys_back, op.release)

    def commit(self, good: list[tuple], bad: list[tuple], tag, keys: list | None = None,
               keys_back: bool = True, release: KeySet | None = None) -> None:
        """Abort bad, commit good; post the `Committed` event (with `keys`: their
        fingerprints, or with `release` those discarded from it here; with `keys_back` the
        keys and committed items too)."""
        failed = len(bad)
        released = False
        error: Exception | None = None
        try:
            fps = fingerprints(keys) if keys is not None else b""
        except Exception:   # (no memory) the keys themselves, then
            fps, keys_back = b"", True
        back = list(keys) if keys is not None and keys_back else []
        try:
            if bad:
                self.index.abort(bad)
            skipped = set()
            dups: list = []
            if good:
                skipped.update(self.index.commit(good, sync=False, dups_out=dups))
                self.index.sync()   # durable before any of it becomes a hit
            live = [x for x in good if x not in skipped] if skipped else good
            failed += len(good) - len(live)
            if dups:
                # stored before us (by another engine, mostly): the entry that stands is
                # the other one, and the table takes it; our slot went back to free
                known = {k for k, _, _ in dups}
                live = [x for x in live if x[0] not in known] + dups
            if live:
                # (their generations were published to the other engines inside the
                # commit's LMDB transaction, `Index.commit`)
                if isinstance(live, Items):
                    ks, ss, gs = list(live.keys), list(live.slots), list(live.generations)
                else:
                    ks, ss, gs = (list(x) for x in zip(*live))
                with self.lock:             # a duplicate keeps the existing entry
                    self.table.put_many(ks, ss, gs)
                    released = release_fps(release, fps)
        except Exception as exc:
            # The index cannot be written (disk full...): the store is dropped and its
            # reservations are given back when the index can be written again.
            error = exc
        finally:
            self.applied += 1
        if not released:        # nothing was put in the table (every block bad, or an error)
            with self.lock:
                released = release_fps(release, fps)
        if released:
            fps = b""
        if error is not None:
            self.outbox.post(Committed(tag=tag, failed=len(good) + len(bad), error=error,
                                       keys=back, fps=fps, released=released))
            self.retry_abort(list(good) + list(bad))
            return
        try:
            self.gauges = read_gauges(self.index)   # the step that takes the event sees them
        except KVStoreError:
            pass
        self.outbox.post(Committed(tag=tag, items=live if keys_back else [], count=len(live),
                                   failed=failed, keys=back, fps=fps, released=released))

    def unkeyed(self, slots: list, tag, exc: Exception, packed: tuple | None = None) -> None:
        """A commit whose keys could not be made: its reservations go back (by slot), and
        its `Committed` event reports every block failed, so the step thread is never
        left waiting for it; the event hands `packed` back (the step thread releases what
        keys of it it can)."""
        self.applied += 1
        self.outbox.post(Committed(tag=tag, failed=len(slots), error=exc, packed=packed))
        self.retry_abort(list(slots))

    def retry_abort(self, items: list[tuple]) -> None:
        try:
            self.index.abort(items)
        except KVStoreError:
            if self.requeue is not None:
                self.requeue(items)     # still unwritable: next round
                time.sleep(0.05)

    def touch(self, keys: list[bytes]) -> None:
        self.index.touch(keys)

    def drop(self, keys: list[bytes]) -> None:
        """Drop keys from LMDB (in batches); those it had leave the table, and a `Dropped`
        event names them."""
        dropped: list[Entry] = []
        for i in range(0, len(keys), 10000):
            dropped.extend(self.index.drop(keys[i:i + 10000]))
        if dropped:     # (their generations were retracted in the drop's transaction)
            with self.lock:
                self.table.remove_many([e.key for e in dropped], [e.slot for e in dropped])
            self.outbox.post(Dropped(keys=[e.key for e in dropped]))

    def drop_all(self) -> None:
        keys = [e.key for e in self.index.iter_entries()]
        self.drop(keys)
        with self.lock:
            self.table.clear()
