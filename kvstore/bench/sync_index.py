"""The synchronous index `kvstore bench connector --baseline` measures the connector with.

`SyncServingIndex` has `kvstore.lookup.table.ServingIndex`'s interface and runs every
operation on the caller's thread (vLLM's scheduler thread): lookups walk LMDB, a store's
slots are reserved (with evictions) when it is planned, and a commit fsyncs there. The
bench's baseline phases make the connector's scheduler build it (`baseline_index`), to
show what the index thread saves; the connector itself always uses `ServingIndex`.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from kvstore._keytable import keys_with_packed, make_keys, pin_counts_add, pin_counts_remove
from kvstore.errors import StoreFull
from kvstore.lookup import devices
from kvstore.lookup.events import Counted, Dropped, Evicted, Outbox
from kvstore.lookup.lookups import count_new_lmdb, lookup_hashes_lmdb, plan_new_lmdb, present_lmdb
from kvstore.lookup.table import ServingIndex, packed_hit, packed_plan, split_failed
from kvstore.lookup.writes import IndexWrites, read_gauges
from kvstore.store.disk import DiskStore


def _never(key) -> bool:
    """No drop is ever pending here: drops are applied at once."""
    return False


class SyncServingIndex(ServingIndex):
    """The synchronous baseline: every operation runs on the caller's thread,
    lookups walk LMDB, a store's slots are reserved (with evictions) when it is planned,
    and a commit fsyncs on the caller's thread. Same interface as `ServingIndex`."""

    # Stores are planned by key: `take` reserves their slots by key on the caller's thread.
    packed_stores = False
    ready = True            # lookups read LMDB: nothing to build
    announcing = False
    build_s = 0.0
    reclaimed = cross_hits = 0

    class _NoTable:
        """Lookups read LMDB: commits have no table to update."""
        def __contains__(self, key):
            return True

        def put_many(self, keys, slots, gens):
            return 0

    def __init__(self, store: DiskStore, *, pool_target: int = 0, announce=None,
                 probe_devices: str | None = None, thread_cpus=None, evicted_keys: bool = True):
        # (`pool_target`, `announce`, `thread_cpus`, `evicted_keys`: `ServingIndex`'s
        # arguments, which the scheduler passes; no pool, no thread, no announcements here)
        self.store = store
        self.lease = None
        self.index = store.writable_index()
        self.capacity = self.index.capacity_slots
        self.ndev = store.geometry.num_devices
        self.fences = self.index.set_devices(self.ndev)
        self.readmitted = []
        if probe_devices is not None and self.ndev > 1:
            self.readmitted = devices.probe_devices(store, self.index, self.fences, self.ndev,
                                                    probe_devices == "direct")
        self.pool_target = 0
        self._outbox = Outbox()
        self._post = self._outbox.post
        # commits applied here, an abort LMDB refuses given up (no later round)
        self._writes = IndexWrites(self.index, self._NoTable(), threading.Lock(), self._outbox)
        self._pins: dict[int, int] = {}
        self._queued = 0

    def wait_ready(self, timeout=None) -> bool:
        return True

    def poll(self):
        return self._outbox.take()

    def wait_events(self, timeout: float) -> None:
        pass

    def pending_commits(self) -> int:
        return self._queued - self._writes.applied

    def announced(self) -> None:
        pass

    def lookup_pin(self, keys):
        entries = self.index.longest_prefix(keys)
        slots = [e.slot for e in entries]
        pin_counts_add(self._pins, slots)
        return slots, [e.generation for e in entries]

    def pin(self, slots):
        pin_counts_add(self._pins, list(slots))

    def unpin(self, slots):
        pin_counts_remove(self._pins, list(slots))

    @property
    def pinned_slots(self):
        return len(self._pins)

    def pin_counts(self):
        return dict(self._pins)

    def contains(self, key):
        return self.index.lookup(key) is not None

    def lookup_hashes(self, hashes, start, stop, group=0, packed=False):
        return packed_hit(lookup_hashes_lmdb(self.lookup_pin, hashes, start, stop, group), packed)

    def present(self, hashes, start, stop, group=0):
        return present_lmdb(self.index, _never, hashes, start, stop, group)

    def plan_new(self, hashes, start, stop, block_ids, skip, limit, group=0, packed=False):
        keys, bids, idx = plan_new_lmdb(self.index, _never, hashes, start, stop, block_ids, skip,
                                        limit, group)
        return packed_plan(hashes, keys, bids, idx, packed)

    def count_dropped(self, hashes, start, stop, skip, group=0):
        self._post(Counted(count=count_new_lmdb(self.index, _never, hashes, start, stop, skip,
                                                group)))

    def available(self):
        return 1 << 30      # no pool: take reserves in LMDB (and evicts) on this thread

    def pooled(self):
        return []

    def take(self, keys, packed=None):
        try:
            items, evicted = self.index.reserve(keys_with_packed(list(keys), packed),
                                                self._pins.keys())
        except StoreFull:
            return [], []
        if evicted:
            self._post(Evicted(keys=[e.key for e in evicted], count=len(evicted)))
        return [s for _, s, _ in items], [g for _, _, g in items]

    def commit(self, good, bad=(), tag=None):
        self._queued += 1
        self._writes.commit(list(good), list(bad), tag)

    def commit_blocks(self, keys, slots, gens, failed=(), tag=None, packed=None, keys_back=True,
                      release=None):
        keys = keys_with_packed(keys, packed)
        self._queued += 1
        self._writes.commit(*split_failed(keys, slots, gens, failed), tag, keys, keys_back,
                            release)

    def abort(self, items):
        if items:
            self.index.abort(list(items))

    def touch(self, keys):
        if keys:
            self.index.touch(list(keys))

    def touch_blocks(self, runs):
        keys = [k for hashes, groups in runs for k in make_keys(hashes, groups)]
        self.touch(keys)

    def drop(self, keys):
        if keys:
            dropped = self.index.drop(list(keys))
            if dropped:
                self._post(Dropped(keys=[e.key for e in dropped]))

    def drop_all(self):
        keys = [e.key for e in self.index.iter_entries()]
        for i in range(0, len(keys), 10000):
            self.drop(keys[i:i + 10000])

    def count_hits(self, hits, misses):
        self.index.count_hits(hits, misses)

    def fence_device(self, dev, reason="io_error"):
        if self.ndev < 2 or not 0 <= dev < self.ndev or dev in self.fences:
            return False
        self.fences[dev] = (reason, int(time.time()))
        dropped = self.index.fence_device(dev, self.ndev, reason)
        if dropped:
            self._post(Dropped(keys=[e.key for e in dropped]))
        return True

    def gauges(self):
        return read_gauges(self.index)

    def flush(self, timeout=60.0):
        pass

    def close(self):
        self._closed = True


@contextmanager
def baseline_index(scheduler_class):
    """While open, `scheduler_class` (`kvstore.vllm.scheduler.KVStoreScheduler`) builds
    a `SyncServingIndex`: the bench's baseline phases, run in this process."""
    saved = scheduler_class.index_class
    scheduler_class.index_class = SyncServingIndex
    try:
        yield
    finally:
        scheduler_class.index_class = saved
