"""The scheduler's serving index: lookups from memory, LMDB writes on a background thread.

vLLM's scheduler thread (the "step thread") must never wait on the disk. `ServingIndex`
sits between it and the store's LMDB `Index`:

- **lookups** (`lookup_pin`, `contains`) read an in-memory table key -> (slot,
  generation) (`kvstore._keytable.KeyTable`, rebuilt from LMDB at open), never LMDB;
- **slots for stores** (`take`) come from a pool of slots the index thread reserved in
  LMDB ahead of time (free slots first, then LRU victims, whose keys leave the table
  before their slots are handed out);
- **writes** (`commit`, `abort`, `touch`, `drop`, hit counters) are queued to the index
  thread and never waited for, one operation object per call (`kvstore.lookup.ops`:
  `CommitBlocksOp`, `TouchOp`, ...); their outcomes (entries committed, evicted, dropped)
  come back through `poll`, one event object each (`kvstore.lookup.events`: `Committed`,
  `Evicted`, `Dropped`, ...).

LMDB stays the durable truth and the table follows it: a key enters the table only after
its commit is fsynced (so a hit is always durable), and leaves it before LMDB forgets it.
The index thread is the only LMDB writer. One lock (`_lock`) covers the table and the pins
together, so a lookup that pins a slot and an eviction that checks the pins cannot
interleave: the index thread never evicts a pinned slot, and a slot it took is no longer
findable.

While the table is being built at open (a few seconds at 10M entries, in the index
thread), lookups go to LMDB through read transactions and the pool keeps the slots
reserved at open.

A store shared with other engine processes (`kvstore.store.shared`): the table keeps this
engine's view, the pins live in its lease file (the others' evictions read them), and the
store's shared slot generations say which entries still stand: a hit whose slot moved on
(another engine evicted or dropped it) is cut there and leaves the table. A lookup that
misses in the table while other engines are attached asks LMDB for the rest of the prefix
(what another engine stored becomes a hit here, and joins the table). The index thread
also reclaims the reservations of engines that died (their lease lock is free), follows
engines that come and go, and sweeps stale entries.

A dropped key (`drop`: a load found it bad or could not read it; `drop_all`) leaves the
table at once, LMDB only when the index thread applies the drop. Until then the key is
never taken from LMDB (the lookups of other engines' entries, the lookups while the table
is being built, the build itself): a drop is final from the moment it is asked for, so a
key that failed to load answers MISS instead of coming back as a hit. A drop LMDB could
not apply keeps its keys out of those lookups until the engine restarts.
"""
from __future__ import annotations

import array
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

from kvstore._keytable import KeySet, KeyTable, fingerprints, keys_with_packed, make_keys
from kvstore.store.disk import DiskStore
from kvstore.errors import KVStoreError
from kvstore.index.core import Entry
from kvstore.format.layout import block_key
from kvstore.io.records import Columns
from kvstore.store.shared import W_ATTACHED
from kvstore.io.threads import make_thread
from kvstore.lookup.events import (AnnounceBatch, Committed, Counted, Dropped, Evicted, Failed,
                                   IndexEvent)
from kvstore.lookup.ops import (DROP_ALL, REFILL, STOP, AbortOp, CommitBlocksOp, CommitOp,
                                CountHitsOp, CountNewOp, DropAllOp, DropOp, FenceOp, IndexOp,
                                MarkOp, RefillOp, StopOp, TouchBlocksOp, TouchOp)

log = logging.getLogger("kvstore.lookup.table")

# Inside its LMDB transactions the index thread sleeps this long every few dozen rows
# (`Index.pause`): the GIL is then free for the step thread, which would otherwise wait for
# it up to the interpreter's switch interval (5 ms) while the index thread runs Python.
_YIELD_S = 0.0001
# A store shared with other engines: how often the index thread looks for engines that
# came, went or died (reclaiming a dead one's reservations), and sweeps the table of
# entries other engines evicted (a slice of the table per round).
_PEERS_EVERY_S = 0.5
# The index thread counts a dry pool's dropped blocks in slices this long (`count_dropped`).
_COUNT_SLICE = 128
_SWEEP_BUCKETS = 1 << 16


def _empty_pool() -> tuple[array.array, array.array]:
    """The slot pool's (slots, generations), empty: as a packed lookup's hit has them."""
    return array.array("I"), array.array("Q")


def packed_hit(hit: tuple, packed: bool) -> tuple:
    """A (keys, slots, generations) hit made of lists, as `lookup_hashes(packed=...)`
    returns it."""
    if not packed:
        return hit
    return None, array.array("I", hit[1]), array.array("Q", hit[2])


def packed_plan(hashes: list, keys: list, bids: list, idx: list, packed: bool) -> tuple:
    """A store plan made of lists, as `plan_new(packed=...)` returns it: with `packed`,
    vLLM's hash objects instead of keys and the block indices as an array('I')."""
    if not packed:
        return keys, bids, idx
    return [hashes[i] for i in idx], bids, array.array("I", idx)


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


class ServingIndex:
    """See the module docstring. Methods without a leading underscore are for the step
    thread; `_run` and the helpers it calls run on the index thread."""

    # The scheduler plans eager stores packed (vLLM's hashes, no key made on its thread):
    # this index makes their keys on its own thread.
    packed_stores = True
    # How long `close` waits for the index thread to apply what is queued and stop.
    CLOSE_JOIN_S = 120.0
    # Drops not applied to LMDB yet (instances set their own; see `drop`).
    _dropping: set[bytes] | frozenset = frozenset()
    _dropping_all = 0

    def __init__(self, store: DiskStore, *, pool_target: int = 1024, announce=None,
                 probe_devices: str | None = None, thread_cpus: frozenset[int] | None = None,
                 evicted_keys: bool = True):
        self.store = store
        # `Evicted` events carry the evicted keys (KV events name them), or only their
        # count: then the keys are freed here, not on the step thread that polls.
        self._evicted_keys = evicted_keys
        # After a restart, every entry on disk is announced (KV events a router learns
        # from): `announce(keys)` makes a batch's events on the index thread, posted in
        # order with evictions and drops (an `AnnounceBatch` event), two batches at most
        # waiting for the step thread (`announced` gives one back).
        self._announce = announce
        self._announce_room = threading.Semaphore(2)
        self.index = store.writable_index()
        self.capacity = self.index.capacity_slots
        # Failed devices (a store over several data directories): their slots are fenced
        # in the index (never reserved or committed) and their entries are gone.
        self.ndev = store.geometry.num_devices
        self.fences: dict[int, tuple[str, int]] = self.index.set_devices(self.ndev)
        self.readmitted: list[int] = []
        if probe_devices is not None and self.ndev > 1:     # before any slot is handed out
            self._probe_devices(probe_devices == "direct")
        # The pool may hold at most half of a (tiny) store: its slots hold no data.
        self.pool_target = max(1, min(pool_target, self.capacity // 2))
        self._lock = threading.Lock()
        # The store's `kvstore.store.shared.Lease` (None: not shared).
        self.lease = getattr(store, "lease", None)
        # The table also holds the pins (a count per slot, in C): a lookup pins its hit in
        # the walk that finds it, the eviction claim reads them without Python objects.
        # (with a lease the pins move to its file at once: no point faulting ours in)
        self._table = KeyTable(self.capacity, prefault=self.lease is None)
        self._epoch = -1
        self._next_peers = 0.0
        self._sweep_at = 0
        self.reclaimed = 0          # reservations of dead engines given back
        self.cross_hits = 0         # blocks found in LMDB that another engine stored
        if self.lease is not None:
            self._table.attach(self.lease.slots, self.lease.pins)
            self._follow_peers()
        self._ready = False
        # The pool: reserved (slot, generation) pairs, as two parallel arrays (taken by
        # slicing, a copy of machine words: no Python int touched on the step thread;
        # the slots and generations of a store go to the workers as these arrays, as a
        # lookup's do).
        self._pool_lock = threading.Lock()
        self._pool_slots, self._pool_gens = _empty_pool()
        self._ops: queue.SimpleQueue[IndexOp] = queue.SimpleQueue()
        self._events: deque[IndexEvent] = deque()
        self._posted = threading.Event()
        self._queued = 0            # commits queued and not applied (step thread reads)
        self._hits = self._misses = 0   # counted by the step thread, not sent yet
        # Drops asked for and not yet applied to LMDB (see the module docstring): keys
        # (`drop`), and how many `drop_all`s are queued. Changed under `_lock`.
        self._dropping: set[bytes] = set()
        self._dropping_all = 0
        self._applied = 0
        self._closed = False
        self._gauges = self._read_gauges()
        self.build_s = 0.0
        self._refill(sync=True)     # stores can start before the table is built
        self.index.pause = self._yield
        self._thread = make_thread(self._run, "kvstore-index", thread_cpus)
        self._thread.start()

    # ------------------------------------------------------------------ step thread

    @property
    def ready(self) -> bool:
        """True once the lookup table holds every committed key."""
        return self._ready

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the table is built (tests and benchmarks; serving never waits)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready and self._thread.is_alive():
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return self._ready

    def lookup_pin(self, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """(slots, generations) of the longest cached prefix of keys (keys[:len(slots)]);
        the slots are pinned (unpin them when done). Plain lists: no object per block."""
        if not self._ready:
            entries = self._undropped(self.index.longest_prefix(keys))   # LMDB read txn,
            #                                                  until the table is built
            slots, gens = [e.slot for e in entries], [e.generation for e in entries]
            with self._lock:
                self._table.pin(slots)
                # another engine may have evicted one since the read: checked as a table
                # hit is (the table is being built: nothing leaves it here)
                n = self._table.validate_pinned(keys[:len(slots)], slots, gens, False)
            del slots[n:], gens[n:]
            return slots, gens
        with self._lock:
            slots, gens = self._table.prefix(keys)
            if slots:
                self._table.pin(slots)
                n = self._table.validate_pinned(keys[:len(slots)], slots, gens)
                del slots[n:], gens[n:]
            if len(slots) < len(keys) and self._shared_now():
                rest = keys[len(slots):]
                more = self._peer_prefix(lambda a, b: rest[a:b], len(rest))
                slots += more[1]
                gens += more[2]
        return slots, gens

    def contains(self, key: bytes) -> bool:
        if not self._ready:
            return not self._dropped(key) and self.index.lookup(key) is not None
        with self._lock:
            return key in self._table

    # The step thread's per-step walks take vLLM's block hashes as they are (a list of
    # bytes) and run in C over the table (`KeyTable.prefix_of`, `plan_new`): no Python
    # object per block that is skipped, about 0.1-0.3 us per block.

    def lookup_hashes(self, hashes: list, start: int, stop: int, group: int = 0,
                      packed: bool = False) -> tuple[list[bytes] | None, Sequence[int], Sequence[int]]:
        """(keys, slots, generations) of the longest cached prefix of blocks start..stop
        of `hashes` (vLLM block hashes of KV cache group `group`); the slots are pinned.
        With `packed`: (None, array('I') slots, array('Q') generations), no Python object
        per block (the hit's keys are hashes[start:start + len(slots)] + group)."""
        if not self._ready:
            return packed_hit(self._lookup_hashes_lmdb(hashes, start, stop, group), packed)
        with self._lock:    # found and pinned in one C walk
            keys, slots, gens = self._table.prefix_of(hashes, start, stop, group, True, packed)
            stop = min(stop, len(hashes))
            base = max(0, start) + len(slots)
            if base < stop and self._shared_now():
                # other engines attached: what they stored may be in LMDB only (keys are
                # made per chunk: a plain miss makes one)
                more = self._peer_prefix(
                    lambda a, b: [block_key(h, group) for h in hashes[base + a:base + b]],
                    stop - base)
                if more[0]:
                    if not packed:
                        keys += more[0]
                    slots += type(slots)("I", more[1]) if packed else more[1]
                    gens += type(gens)("Q", more[2]) if packed else more[2]
            return keys, slots, gens

    def _peer_prefix(self, keys_at, n: int) -> tuple[list, list, list]:
        """The longest prefix of the n keys (`keys_at(a, b)` makes keys a..b) that LMDB
        has (other engines' stores), pinned and checked against the shared slot
        generations; it joins the table. Called under _lock, on a miss in the table while
        other engines are attached: a read transaction per chunk of 1, 8, 64, then 512
        keys, so a plain miss costs one lookup."""
        out_k, out_s, out_g = [], [], []
        pos, chunk = 0, 1
        ss = []                 # pinned and not yet in out_s (validate_pinned unpins the rest)
        try:
            while pos < n:
                part = keys_at(pos, min(n, pos + chunk))
                try:
                    entries = self._undropped(self.index.longest_prefix(part))
                except KVStoreError as exc:     # e.g. a map another engine grew, not adopted yet
                    log.debug("kvstore: LMDB lookup for other engines' blocks failed: %s", exc)
                    break                       # a miss: vLLM computes the rest
                if not entries:
                    break
                ks = [e.key for e in entries]
                new_s = [e.slot for e in entries]
                gs = [e.generation for e in entries]
                self._table.pin(new_s)          # undoes its own pins when it raises
                ss = new_s
                kept = self._table.validate_pinned(ks, ss, gs)
                out_k += ks[:kept]
                out_s += ss[:kept]
                out_g += gs[:kept]
                ss = []
                if kept < len(entries) or len(entries) < len(part):
                    break
                pos += chunk
                chunk = min(chunk * 8, 512)
            if out_k:
                self._table.put_many(out_k, out_s, out_g)
        except Exception as exc:
            # Anything else (no memory, a malformed record): a miss, and nothing it
            # pinned stays pinned (the caller's own hit is the caller's).
            self._table.unpin(out_s + ss)
            log.warning("kvstore: lookup of other engines' blocks failed (%s: %s); treated "
                        "as a miss", type(exc).__name__, exc)
            return [], [], []
        if out_k:
            self.cross_hits += len(out_k)
        return out_k, out_s, out_g

    def present(self, hashes: list, start: int, stop: int, group: int = 0) -> bytes:
        """A flag per block start..stop: its key is stored (not pinned; see lookup_hashes)."""
        if not self._ready:
            return self._present_lmdb(hashes, start, stop, group)
        with self._lock:
            flags = self._table.present(hashes, start, stop, group)
            if b"\0" in flags and self._shared_now():
                flags = self._peer_present(hashes, max(0, start), group, flags)
            return flags

    def _peer_present(self, hashes: list, start: int, group: int, flags: bytes) -> bytes:
        """present() for the blocks the table lacks, from LMDB (other engines' stores),
        while other engines are attached; what is found (and whose slot still holds its
        generation) joins the table. Under _lock; one read transaction."""
        miss = [i for i, f in enumerate(flags) if not f]
        keys = [block_key(hashes[start + i], group) for i in miss]
        try:
            found = self.index.get_many(keys)
        except KVStoreError as exc:
            log.debug("kvstore: LMDB lookup for other engines' blocks failed: %s", exc)
            return flags
        if not found:
            return flags
        slots = self.lease.slots
        ok = [(k, s_, g) for k, s_, g in found
              if slots.generation(s_) == g and not self._dropped(k)]
        if not ok:
            return flags
        self._table.put_many([x[0] for x in ok], [x[1] for x in ok], [x[2] for x in ok])
        self.cross_hits += len(ok)
        have = {x[0] for x in ok}
        out = bytearray(flags)
        for i, key in zip(miss, keys):
            if key in have:
                out[i] = 1
        return bytes(out)

    def plan_new(self, hashes: list, start: int, stop: int, block_ids: list, skip: set,
                 limit: int, group: int = 0, packed: bool = False
                 ) -> tuple[list[bytes], list[int], Sequence[int]]:
        """(keys, block ids, block indices) of blocks start..stop not stored yet and not
        in `skip` (keys being stored), at most `limit`; their keys join `skip`. With
        `packed` (skip a `KeySet`): the planned blocks' vLLM hashes instead of keys (their
        keys are hash + group, made where they are needed: `make_keys`), and the indices
        as an array('I') (no int object per block)."""
        if not self._ready:
            keys, bids, idx = self._plan_new_lmdb(hashes, start, stop, block_ids, skip,
                                                  limit, group)
            return packed_plan(hashes, keys, bids, idx, packed)
        with self._lock:
            return self._table.plan_new(hashes, start, stop, block_ids, skip, limit, group,
                                        packed)

    def count_dropped(self, hashes: list, start: int, stop: int, skip, group: int = 0) -> None:
        """Count what a dry (or short) pool drops of an eager walk, blocks start..stop, as
        `KeyTable.count_new` counts them, on the index thread: the step thread does no per-block
        work for blocks it does not store. The count comes back as a `Counted` event (one
        per call, posted even if counting failed). `hashes` is vLLM's list (only appended
        to); `skip` (the keys being stored) is read under the GIL, as the step thread
        changes it. Queuing it also refills the pool (every round of the index thread
        does)."""
        self._ops.put(CountNewOp(hashes, start, stop, skip, group))

    def available(self) -> int:
        """Slots in the pool now: how many blocks a store planned this step can take (only
        the step thread takes, so it can only grow until then)."""
        return len(self._pool_slots)

    # The same walks over LMDB (while the table is built; the synchronous baseline).
    def _present_lmdb(self, hashes, start, stop, group):
        return bytes(not self._dropped(k) and self.index.lookup(k) is not None
                     for k in (block_key(h, group) for h in hashes[max(0, start):stop]))

    def _lookup_hashes_lmdb(self, hashes, start, stop, group):
        keys = [block_key(h, group) for h in hashes[max(0, start):stop]]
        slots, gens = self.lookup_pin(keys)
        return keys[:len(slots)], slots, gens

    def _plan_new_lmdb(self, hashes, start, stop, block_ids, skip, limit, group):
        keys, bids, idx = [], [], []
        for i in range(max(0, start), min(stop, len(hashes), len(block_ids))):
            if len(keys) >= limit:
                break
            k = block_key(hashes[i], group)
            if k in skip or (not self._dropped(k) and self.index.lookup(k) is not None):
                continue
            skip.add(k)
            keys.append(k)
            b = block_ids[i]        # an int, or vLLM's KVCacheBlock (as KeyTable.plan_new reads it)
            bids.append(b if isinstance(b, int) else b.block_id)
            idx.append(i)
        return keys, bids, idx

    def _count_new_lmdb(self, hashes, start, stop, skip, group):
        return sum(1 for h in hashes[max(0, start):stop]
                   if (k := block_key(h, group)) not in skip
                   and (self._dropped(k) or self.index.lookup(k) is None))

    def pin(self, slots: Iterable[int]) -> None:
        slots = slots if isinstance(slots, list) else list(slots)
        with self._lock:
            self._table.pin(slots)

    def unpin(self, slots: Iterable[int]) -> None:
        # a lookup's array('I') goes to the table as it is (no int object per slot)
        if not isinstance(slots, (list, array.array)):
            slots = list(slots)
        if slots:
            with self._lock:
                self._table.unpin(slots)

    def pooled(self) -> list[tuple[int, int]]:
        """(slot, generation) of the reserved slots in the pool (tests, `info`)."""
        with self._pool_lock:
            return list(zip(self._pool_slots, self._pool_gens))

    @property
    def pinned_slots(self) -> int:
        return self._table.pinned_slots

    def pin_counts(self) -> dict[int, int]:
        """{slot: pin count} (tests, diagnostics)."""
        with self._lock:
            return self._table.pins_dict()

    def take(self, keys: Sequence[bytes], packed: tuple | None = None
             ) -> tuple[Sequence[int], Sequence[int]]:
        """(slots, generations): a reserved slot for each of keys, in order, from the pool
        (arrays "I" and "Q"; lists from the synchronous baseline);
        fewer (for a prefix of keys) when the pool runs short. The index thread refills it.
        `packed` = (hashes, group runs): more blocks after `keys`, as `StoreJob` has them
        (only counted here: no key is made)."""
        want = len(keys) + (len(packed[0]) if packed else 0)
        with self._pool_lock:
            if want >= len(self._pool_slots):   # all of it (a short pool): no copy
                slots, gens = self._pool_slots, self._pool_gens
                self._pool_slots, self._pool_gens = _empty_pool()
            else:
                slots, gens = self._pool_slots[:want], self._pool_gens[:want]
                del self._pool_slots[:want], self._pool_gens[:want]
        if want:    # taken from, or dry (pins may have gone since): the index thread refills
            self._send_counts()
            self._ops.put(REFILL)
        return slots, gens

    def commit(self, good: Sequence[tuple], bad: Sequence[tuple] = (), tag=None) -> None:
        """Queue: abort `bad`, commit `good` ((key, slot, generation) durably written on
        every rank) with one fsync; a `Committed` event with `tag` follows. Keys become hits
        once it is applied."""
        self._queued += 1
        self._ops.put(CommitOp(list(good), list(bad), tag))

    def commit_blocks(self, keys: list, slots: list, gens: list, failed=(), tag=None,
                      packed: tuple | None = None, keys_back: bool = True,
                      release: KeySet | None = None) -> None:
        """commit() of parallel lists, block indices in `failed` aborted: the (key, slot,
        generation) tuples are made on the index thread, not the step thread. `packed` =
        (hashes, group runs): more blocks after `keys`, whose keys the index thread makes
        too. The `Committed` event's `fps` are every block's key fingerprint, in order
        (`KeySet.discard_fingerprints`); its `keys` (every key) and `items` only with
        `keys_back`: without, no key or tuple of the job is freed on the step thread.
        With `release` (the step thread's set of keys being stored), the index thread
        discards every key of the job from it itself, under `_lock` once the good ones
        are in the table (a walk sees each key in one or the other, never neither), and
        the event's `fps` is empty: the step thread does no per-block work for a commit."""
        self._queued += 1
        self._ops.put(CommitBlocksOp(keys, slots, gens, failed, tag, packed, keys_back, release))

    def abort(self, items: Sequence[tuple]) -> None:
        """Queue: give (key, slot, generation) reservations back."""
        if items:
            self._ops.put(AbortOp(list(items)))

    def touch(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._ops.put(TouchOp(list(keys)))

    def touch_blocks(self, runs: list[tuple[list, list]]) -> None:
        """touch() of packed hits: (hashes, group runs) each, as a LoadJob carries them;
        their keys are made on the index thread (`make_keys`)."""
        if runs:
            self._ops.put(TouchBlocksOp(runs))

    def drop(self, keys: Sequence[bytes]) -> None:
        """Remove entries (a load found them bad): no new lookup hits them from now on,
        not even from LMDB before the index thread applied the drop; a `Dropped` event
        names the ones LMDB removed."""
        if not keys:
            return
        keys = list(keys)
        with self._lock:
            self._table.remove_many(keys)
            self._dropping.update(keys)
        self._ops.put(DropOp(keys))

    def drop_all(self) -> None:
        """Every committed entry goes (reset_cache): misses from now on."""
        with self._lock:
            self._table.clear()
            self._dropping_all += 1
        self._ops.put(DROP_ALL)

    def _dropped(self, key: bytes) -> bool:
        """A drop of key is asked for and not applied to LMDB yet: LMDB's entry for it
        must not be served or taken into the table."""
        return bool(self._dropping_all) or key in self._dropping

    def _undropped(self, entries: list) -> list:
        """The prefix of LMDB `entries` up to the first one with a drop pending."""
        if not self._dropping and not self._dropping_all:
            return entries
        for i, e in enumerate(entries):
            if self._dropped(e.key):
                return entries[:i]
        return entries

    def count_hits(self, hits: int, misses: int) -> None:
        """Add to the store's hit/miss counters. Summed here and handed to the index
        thread with the step's next operation (`_send_counts`): a queued operation wakes
        the index thread, which on a busy machine is put on the step thread's CPU and
        preempts it in the middle of the connector's call, only to wait for the GIL the
        step thread holds."""
        self._hits += hits
        self._misses += misses

    def _send_counts(self) -> None:
        if self._hits or self._misses:
            self._ops.put(CountHitsOp(self._hits, self._misses))
            self._hits = self._misses = 0

    # -- failed devices --------------------------------------------------------------
    def fence_device(self, dev: int, reason: str = "io_error") -> bool:
        """A device failed: its entries leave the lookups now (one C call), its slots
        leave the pool, and the index thread drops its entries from LMDB and records
        the fence, after which no reservation or commit touches its slots. False when
        the store has one device or the device is fenced already."""
        if self.ndev < 2 or not 0 <= dev < self.ndev or dev in self.fences:
            return False
        self.fences[dev] = (reason, int(time.time()))
        with self._lock:
            self._table.remove_device(self.ndev, dev)
        removed = self._purge_pool(dev)
        self._ops.put(FenceOp(dev, reason, removed))
        return True

    # A fence of these reasons is lifted at open once the device probes fine (it was
    # away or read-only: its entries were dropped, its free slots hold nothing anyone
    # reads); an I/O error fence is lifted only by `kvstore fsck --repair`.
    READMIT_AT_OPEN = ("missing", "readonly", "foreign")

    def _probe_devices(self, direct: bool) -> None:
        """At open: fence every device whose data directory is not usable (missing,
        read-only, another store's), re-admit a fenced one that is back (see
        READMIT_AT_OPEN). Runs before the pool is filled and the table is built."""
        from kvstore.io.datadirs import probe_data_dir
        for d, path in enumerate(self.store.data_dirs):
            bad = probe_data_dir(path, self.store.path, d, direct)
            if bad is None and d in self.fences and self.fences[d][0] in self.READMIT_AT_OPEN:
                self.index.readmit_device(d)
                reason = self.fences.pop(d)[0]
                self.readmitted.append(d)
                log.warning("kvstore: device %d (%s) is back (fenced as %s); re-admitted",
                            d, path, reason)
            elif bad is not None and d not in self.fences:
                dropped = self.index.fence_device(d, self.ndev, bad[0])
                self.fences[d] = (bad[0], int(time.time()))
                log.error("kvstore: device %d (%s) is not usable (%s); fenced, %d entries "
                          "dropped", d, path, bad[1], len(dropped))
            elif d in self.fences:
                # still fenced: drop what an index rebuild (or a crash) may have left on it
                self.index.fence_device(d, self.ndev, self.fences[d][0])

    def _purge_pool(self, dev: int) -> list[int]:
        """Take device `dev`'s slots out of the pool; returns them (still reserved)."""
        nd = self.ndev
        with self._pool_lock:
            out = [s_ for s_ in self._pool_slots if s_ % nd == dev]
            if out:
                keep = [(s_, g) for s_, g in zip(self._pool_slots, self._pool_gens) if s_ % nd != dev]
                self._pool_slots = array.array("I", [s_ for s_, _ in keep])
                self._pool_gens = array.array("Q", [g for _, g in keep])
        return out

    def _fence(self, dev: int, reason: str, removed: list[int]) -> None:
        dropped = self.index.fence_device(dev, self.ndev, reason)   # retracted in its txn
        removed = removed + self._purge_pool(dev)   # a refill that ran before the fence
        if removed:
            self.index.abort(removed)
        with self._lock:
            self._table.remove_device(self.ndev, dev)
        log.warning("kvstore: device %d (%s) fenced (%s): %d entries dropped, its slots are "
                    "not used until `kvstore fsck --repair` re-admits it", dev,
                    self.store.data_dirs[dev], reason, len(dropped))
        if dropped:
            self._post(Dropped(keys=[e.key for e in dropped]))

    def announced(self) -> None:
        """The step thread published an `AnnounceBatch`: room for the next."""
        self._announce_room.release()

    @property
    def announcing(self) -> bool:
        """True until every entry found at open has been announced."""
        return self._announce is not None

    def poll(self) -> list[IndexEvent]:
        """Outcomes of the index thread since the last poll (and the counts summed since
        the last operation go to it: counters never wait more than a step)."""
        self._send_counts()
        out = []
        ev = self._events
        while ev:
            out.append(ev.popleft())
        return out

    def wait_events(self, timeout: float) -> None:
        """Sleep until the index thread reports something, `timeout` at most. For an engine
        with nothing else to do than wait for commits: it sleeps instead of spinning (a
        spinning step thread takes the GIL from the index thread it waits for)."""
        if self._posted.wait(timeout):
            self._posted.clear()

    def pending_commits(self) -> int:
        return self._queued - self._applied

    def gauges(self) -> dict:
        """used/free slot counts as of the index thread's last transaction (no LMDB read)."""
        return dict(self._gauges)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued operation is applied (tests, benchmarks, shutdown)."""
        done = threading.Event()
        self._send_counts()
        self._ops.put(MarkOp(done))
        if not done.wait(timeout):
            raise KVStoreError(f"index thread did not catch up within {timeout:.0f}s")

    def close(self) -> bool:
        """Apply what is queued, give the pool's slots back, stop the thread. Idempotent.
        False when the thread is still busy after the wait (an LMDB write that does not
        return): the caller must then keep the store open under it."""
        if self._closed:
            return not self._thread.is_alive()
        self._closed = True
        self._send_counts()
        self._ops.put(STOP)
        self._thread.join(timeout=self.CLOSE_JOIN_S)
        self.index.pause = None
        if self._thread.is_alive():
            log.error("kvstore: index thread still busy after %.0fs at shutdown; its "
                      "reservations are reclaimed at the next open", self.CLOSE_JOIN_S)
            return False
        return True

    # ------------------------------------------------------------------ index thread

    def _post(self, ev: IndexEvent) -> None:
        self._events.append(ev)
        self._posted.set()

    def _fail(self, what: str, exc: Exception) -> None:
        self._post(Failed(what=what, error=exc))

    def _read_gauges(self) -> dict:
        s = self.index.stats()
        return {"used_slots": s["used_slots"], "free_slots": s["free_slots"],
                "reserved_slots": s["reserved_slots"]}

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            # (the store's shared slot generations were made complete at open, by
            # `DiskStore`: hits are checked against them from the first lookup)
            self.index.load_keys(self._table)
            with self._lock:    # drops asked for during the build (applied below)
                if self._dropping_all:
                    self._table.clear()
                elif self._dropping:
                    self._table.remove_many(list(self._dropping))
        except Exception as exc:  # LMDB lookups stay in use: slower, still correct
            log.error("kvstore: building the lookup table failed (%s); lookups read LMDB", exc)
            self._fail("building the lookup table", exc)
        else:
            self.build_s = time.perf_counter() - t0
            self._ready = True
        announcing = None
        if self._announce is not None and self._ready:
            announcing = self.index.iter_key_batches()
        else:
            self._announce = None
        stop = False
        while not stop:
            if announcing is not None:
                # One batch per round, between the rounds of operations (never ahead of
                # them), while the step thread has room for it.
                if self._announce_room.acquire(blocking=False):
                    announcing = self._announce_next(announcing)
                try:
                    ops = [self._ops.get(timeout=0.05)]
                except queue.Empty:
                    self._upkeep_shared_safe()
                    continue
            elif self.lease is not None:
                try:
                    ops = [self._ops.get(timeout=_PEERS_EVERY_S)]
                except queue.Empty:
                    self._upkeep_shared_safe()
                    continue
            else:
                ops = [self._ops.get()]
            while True:     # everything queued by now is handled in this round
                try:
                    ops.append(self._ops.get_nowait())
                except queue.Empty:
                    break
            touches: list[bytes] = []
            hits = misses = 0
            marks = []
            for op in ops:
                try:
                    match op:
                        case TouchOp(keys):
                            touches.extend(keys)
                            continue
                        case TouchBlocksOp(runs):
                            for hashes, groups in runs:
                                touches.extend(make_keys(hashes, groups))
                            continue
                    if touches:         # keep the order of touches and the other writes
                        self._touch(touches)
                        touches = []
                    match op:
                        case CommitOp(good, bad, tag):
                            self._commit(good, bad, tag)
                        case CommitBlocksOp():
                            self._commit_blocks(op)
                        case AbortOp(items):
                            self.index.abort(items)
                        case DropOp(keys):
                            self._drop(keys)
                            with self._lock:    # applied: LMDB lookups may see them again
                                self._dropping.difference_update(keys)
                        case DropAllOp():
                            self._drop_all()
                            with self._lock:
                                self._dropping_all -= 1
                        case FenceOp(dev, reason, removed):
                            self._fence(dev, reason, removed)
                        case CountNewOp(hashes, start, stop_at, skip, group):
                            n = 0
                            try:
                                n = self._count_dropped(hashes, start, stop_at, skip, group)
                            finally:        # the step thread waits for every count
                                self._post(Counted(count=n))
                        case CountHitsOp():
                            hits += op.hits
                            misses += op.misses
                        case MarkOp():
                            marks.append(op.done)
                        case StopOp():
                            stop = True
                        case RefillOp():
                            pass            # every round refills the pool
                except Exception as exc:
                    self._fail(op.what, exc)
            try:
                if touches:
                    self._touch(touches)
                if hits or misses:
                    self.index.count_hits(hits, misses)
                if stop:
                    self._shutdown()
                else:
                    self._upkeep_shared()
                    self._refill()
                self._gauges = self._read_gauges()
            except Exception as exc:
                self._fail("index upkeep", exc)
            for m in marks:
                m.set()

    def _commit_blocks(self, op: CommitBlocksOp) -> None:
        try:
            keys = keys_with_packed(op.keys, op.packed)
        except Exception as exc:    # (the walk made them: no memory)
            self._unkeyed(op.slots, op.tag, exc, op.packed)
            return
        self._commit(*split_failed(keys, op.slots, op.gens, op.failed), op.tag, keys,
                     op.keys_back, op.release)

    def _announce_next(self, batches):
        """Post the next batch of announcements (1024 keys); None (and `announcing`
        false) when every entry found at open is announced or announcing failed."""
        try:
            keys = next(batches, None)
            if keys is None:
                self._announce = None
                return None
            events = []
            for i in range(0, len(keys), 1024):
                events.extend(self._announce(keys[i:i + 1024]))
                self._yield()
            # In order with evictions and drops; not a wake-up for the step thread.
            self._events.append(AnnounceBatch(events=events))
            return batches
        except Exception as exc:
            self._announce = None
            self._fail("announcing the stored blocks", exc)
            return None

    def _count_dropped(self, hashes, start, stop, skip, group) -> int:
        """`count_dropped`'s count, in slices of `_COUNT_SLICE` blocks (each a few dozen
        microseconds holding the GIL) with the GIL let go between them."""
        n = 0
        for b in range(max(0, start), stop, _COUNT_SLICE):
            e = min(stop, b + _COUNT_SLICE)
            if self._ready:
                with self._lock:
                    n += self._table.count_new(hashes, b, e, skip, group)
            else:       # the table could not be built: LMDB lookups
                n += self._count_new_lmdb(hashes, b, e, skip, group)
            if e < stop:
                self._yield()
        return n

    @staticmethod
    def _yield() -> None:
        time.sleep(_YIELD_S)

    def _claim(self, removed: list):
        """reserve_pool's claim: refuse pinned slots; evicted keys leave the table first."""
        table = self._table
        lease = self.lease

        def claim(cands):
            with self._lock:        # one C call: the step thread waits microseconds at most
                for _ in range(3):
                    if lease is None or not table.peers_stale:
                        break
                    # an engine came or went since the peers were listed: list them
                    # again now (the claim takes nothing from stale peers), without the
                    # ATTACH lock: this runs inside an LMDB write transaction
                    epoch = lease.epoch
                    table.set_peers(lease.peers(probe=False), epoch)
                taken, gone = table.claim(cands, self._ready)
            removed.extend(gone)
            return taken
        return claim

    def _refill(self, sync: bool = False) -> None:
        while len(self._pool_slots) < self.pool_target:
            removed: list = []
            n = self.pool_target - len(self._pool_slots)
            try:
                slots, gens, evicted = self.index.reserve_pool(n, self._claim(removed))
            except BaseException:
                with self._lock:    # LMDB still has them: they stay hits
                    for i in range(0, len(removed), 3):
                        self._table.put(removed[i], removed[i + 1], removed[i + 2])
                raise
            with self._pool_lock:
                self._pool_slots.extend(slots)
                self._pool_gens.extend(gens)
            if evicted:
                self._post(Evicted(keys=evicted if self._evicted_keys else [], count=len(evicted)))
            if len(slots) < n:
                return      # everything left is pinned or reserved: try again later

    def _commit(self, good: list[tuple], bad: list[tuple], tag, keys: list | None = None,
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
                with self._lock:            # a duplicate keeps the existing entry
                    self._table.put_many(ks, ss, gs)
                    released = self._release(release, fps)
        except Exception as exc:
            # The index cannot be written (disk full...): the store is dropped and its
            # reservations are given back when the index can be written again.
            error = exc
        finally:
            self._applied += 1
        if not released:        # nothing was put in the table (every block bad, or an error)
            with self._lock:
                released = self._release(release, fps)
        if released:
            fps = b""
        if error is not None:
            self._post(Committed(tag=tag, failed=len(good) + len(bad), error=error, keys=back,
                                 fps=fps, released=released))
            self._retry_abort(list(good) + list(bad))
            return
        try:
            self._gauges = self._read_gauges()  # the step that takes the event sees them
        except KVStoreError:
            pass
        self._post(Committed(tag=tag, items=live if keys_back else [], count=len(live),
                             failed=failed, keys=back, fps=fps, released=released))

    @staticmethod
    def _release(release: KeySet | None, fps: bytes) -> bool:
        """Discard fps from `release` (the caller holds `_lock`); False when there is no
        set or no fingerprints (the step thread discards the keys then)."""
        if release is None or not fps:
            return False
        release.discard_fingerprints(fps)
        return True

    def _unkeyed(self, slots: list, tag, exc: Exception, packed: tuple | None = None) -> None:
        """A commit whose keys could not be made: its reservations go back (by slot), and
        its `Committed` event reports every block failed, so the step thread is never
        left waiting for it; the event hands `packed` back (the step thread releases what
        keys of it it can)."""
        self._applied += 1
        self._post(Committed(tag=tag, failed=len(slots), error=exc, packed=packed))
        self._retry_abort(list(slots))

    def _retry_abort(self, items: list[tuple]) -> None:
        try:
            self.index.abort(items)
        except KVStoreError:
            self._ops.put(AbortOp(items))  # still unwritable: next round
            time.sleep(0.05)

    def _touch(self, keys: list[bytes]) -> None:
        self.index.touch(keys)

    def _drop(self, keys: list[bytes]) -> None:
        dropped: list[Entry] = []
        for i in range(0, len(keys), 10000):
            dropped.extend(self.index.drop(keys[i:i + 10000]))
        if dropped:     # (their generations were retracted in the drop's transaction)
            with self._lock:
                self._table.remove_many([e.key for e in dropped], [e.slot for e in dropped])
            self._post(Dropped(keys=[e.key for e in dropped]))

    def _drop_all(self) -> None:
        keys = [e.key for e in self.index.iter_entries()]
        self._drop(keys)
        with self._lock:
            self._table.clear()

    # -- a store shared with other engines ------------------------------------------
    def _follow_peers(self) -> None:
        """Map the pin arrays of the engines attached now (after one came or went)."""
        epoch = self.lease.epoch
        if epoch == self._epoch:
            return
        peers = self.lease.peers()      # listed after the epoch was read: see set_peers
        with self._lock:
            self._table.set_peers(peers, epoch)
        self._epoch = epoch

    def _upkeep_shared(self) -> None:
        """Index thread, between rounds: follow engines that came or went, reclaim a dead
        engine's reservations, sweep a slice of the table of entries other engines
        evicted. Cheap when alone (one shared word read)."""
        if self.lease is None:
            return
        self._follow_peers()
        now = time.monotonic()
        if now < self._next_peers:
            return
        self._next_peers = now + _PEERS_EVERY_S
        if self._table.peer_count or self._shared_now():
            # an engine whose lease lock is free died: its reservations go back now
            gone = self.lease.reap(self._reclaim_owner)
            if gone:
                self._follow_peers()
        if self._ready and (self._table.peer_count or self._sweep_at):
            with self._lock:
                _, nxt = self._table.sweep(self._sweep_at, _SWEEP_BUCKETS)
            self._sweep_at = nxt

    def _upkeep_shared_safe(self) -> None:
        try:
            self._upkeep_shared()
        except Exception as exc:
            if not self._closed:
                self._fail("following the other engines", exc)

    def _shared_now(self) -> bool:
        """Other engines are attached (one shared word; the step thread asks it on a miss)."""
        return self.lease is not None and self.lease.slots.load(W_ATTACHED) > 1

    def _reclaim_owner(self, owner) -> None:
        if owner is not None:
            self.reclaimed += self.index.reclaim_owner(owner)

    def _shutdown(self) -> None:
        with self._pool_lock:
            pool = self._pool_slots.tolist()
            self._pool_slots, self._pool_gens = _empty_pool()
        if pool:
            self.index.abort(pool)
