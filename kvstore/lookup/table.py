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
The index thread is the only LMDB writer. One lock (`TableLookups.lock`) covers the table
and the pins together, so a lookup that pins a slot and an eviction that checks the pins
cannot interleave: the index thread never evicts a pinned slot, and a slot it took is no
longer findable.

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

`ServingIndex` is the entry points; it hands each call to the part that does that job
(the step thread's per-step calls are the parts' own methods, bound at open: no call in
between): `TableLookups` (lookups.py: the table, its lock, pins and pending drops, every
lookup), `SlotPool` (slot_pool.py: the reserved slots `take` hands out, refilled by the index
thread), `IndexThread` (thread.py: the thread and its rounds, the table build,
announcements), `IndexWrites` (writes.py: commits, aborts, touches and drops applied to
LMDB, the slot gauges), `DeviceFences` (devices.py: failed devices), `PeerFollower`
(peers.py: the other engines of a shared store), `OpQueue` (ops.py: the queued operations)
and `Outbox` (events.py: the events not polled yet).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstore._keytable import KeySet
from kvstore.errors import KVStoreError
from kvstore.format.layout import block_key
from kvstore.lookup.devices import READMIT_AT_OPEN, DeviceFences
from kvstore.lookup.events import IndexEvent, Outbox
from kvstore.lookup.lookups import TableLookups, packed_hit, packed_plan, yield_gil
from kvstore.lookup.ops import DROP_ALL, DropOp, OpQueue
from kvstore.lookup.peers import PeerFollower
from kvstore.lookup.slot_pool import SlotPool
from kvstore.lookup.thread import IndexThread
from kvstore.lookup.writes import Items, IndexWrites, split_failed
from kvstore.store.disk import DiskStore

__all__ = ["ServingIndex", "Items", "split_failed", "packed_hit", "packed_plan", "block_key"]


class ServingIndex:
    """See the module docstring. Every method is for the step thread; the index thread
    runs in `IndexThread`."""

    # The scheduler plans eager stores packed (vLLM's hashes, no key made on its thread):
    # this index makes their keys on its own thread.
    packed_stores = True
    # How long `close` waits for the index thread to apply what is queued and stop.
    CLOSE_JOIN_S = 120.0
    READMIT_AT_OPEN = READMIT_AT_OPEN

    def __init__(self, store: DiskStore, *, pool_target: int = 1024, announce=None,
                 probe_devices: str | None = None, thread_cpus: frozenset[int] | None = None,
                 evicted_keys: bool = True):
        self.store = store
        self.index = index = store.writable_index()
        self.capacity = index.capacity_slots
        self.ndev = store.geometry.num_devices
        # The store's `kvstore.store.shared.Lease` (None: not shared).
        self.lease = lease = getattr(store, "lease", None)
        # The pool may hold at most half of a (tiny) store: its slots hold no data.
        self.pool_target = max(1, min(pool_target, self.capacity // 2))
        self._outbox = outbox = Outbox()
        self._requests = requests = OpQueue()
        self._lookups = lookups = TableLookups(index, self.capacity, lease)
        self._pool = pool = SlotPool(index, self.pool_target, lookups, outbox, requests,
                                     evicted_keys=evicted_keys)
        # Failed devices (a store over several data directories): their slots are fenced
        # in the index (never reserved or committed) and their entries are gone.
        self._devices = devices = DeviceFences(store, index, self.ndev, lookups, pool,
                                               requests, outbox)
        self.fences: dict[int, tuple[str, int]] = devices.fences
        self.readmitted: list[int] = devices.readmitted
        if probe_devices is not None and self.ndev > 1:     # before any slot is handed out
            devices.probe(probe_devices == "direct")
        self._peers = peers = PeerFollower(index, lease, lookups)
        if lease is not None:
            peers.attach()
        self._writes = writes = IndexWrites(index, lookups.table, lookups.lock, outbox,
                                            requests.requeue_abort)
        self._worker = worker = IndexThread(index, lookups, writes, pool, peers, devices,
                                            requests, outbox, announce=announce)
        # The parts' state under the names tests use.
        self._table, self._lock, self._ops = lookups.table, lookups.lock, requests.ops
        # The step thread's calls, straight to the part that does the job (no call in
        # between; `commit_blocks` stays the method below, which tests patch on the class).
        self.lookup_pin = lookups.lookup_pin
        self.contains = lookups.contains
        self.lookup_hashes = lookups.lookup_hashes
        self.present = lookups.present
        self.plan_new = lookups.plan_new
        self.pin = lookups.pin
        self.unpin = lookups.unpin
        self.take = pool.take
        self.available = pool.available
        self.commit = requests.commit
        self.abort = requests.abort
        self.touch = requests.touch
        self.touch_blocks = requests.touch_blocks
        self.count_dropped = requests.count_dropped
        self.count_hits = requests.count_hits
        self.poll = worker.poll
        self.wait_events = outbox.wait
        pool.refill()               # stores can start before the table is built
        index.pause = yield_gil
        worker.start(thread_cpus)
        self._thread = worker.thread

    # ------------------------------------------------------------------ state

    @property
    def ready(self) -> bool:
        """True once the lookup table holds every committed key."""
        return self._lookups.ready

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the table is built (tests and benchmarks; serving never waits)."""
        return self._worker.wait_ready(timeout)

    @property
    def build_s(self) -> float:
        """How long the table took to build (0 until it is built)."""
        return self._worker.build_s

    @property
    def cross_hits(self) -> int:
        """Blocks found in LMDB that another engine stored."""
        return self._lookups.cross_hits

    @property
    def reclaimed(self) -> int:
        """Reservations of dead engines given back."""
        return self._peers.reclaimed

    # ------------------------------------------------------------------ lookups
    # (bound to `TableLookups`'s methods at open; these say what they do)

    def lookup_pin(self, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """(slots, generations) of the longest cached prefix of keys (keys[:len(slots)]);
        the slots are pinned (unpin them when done). Plain lists: no object per block."""
        return self._lookups.lookup_pin(keys)

    def contains(self, key: bytes) -> bool:
        return self._lookups.contains(key)

    def adopt(self, keys: list[bytes], slots: list[int], generations: list[int]) -> int:
        """Entries another writer of this store committed and reported (the fleet agent's
        fills: kvstore.remote) join the table now, checked against the slots' current
        generations, so the next lookup finds them without reading LMDB. Returns how many
        joined (a prefix)."""
        return self._lookups.adopt(keys, slots, generations)

    # The step thread's per-step walks take vLLM's block hashes as they are (a list of
    # bytes) and run in C over the table (`KeyTable.prefix_of`, `plan_new`): no Python
    # object per block that is skipped, about 0.1-0.3 us per block.

    def lookup_hashes(self, hashes: list, start: int, stop: int, group: int = 0,
                      packed: bool = False) -> tuple[list[bytes] | None, Sequence[int], Sequence[int]]:
        """(keys, slots, generations) of the longest cached prefix of blocks start..stop
        of `hashes` (vLLM block hashes of KV cache group `group`); the slots are pinned.
        With `packed`: (None, array('I') slots, array('Q') generations), no Python object
        per block (the hit's keys are hashes[start:start + len(slots)] + group)."""
        return self._lookups.lookup_hashes(hashes, start, stop, group, packed)

    def present(self, hashes: list, start: int, stop: int, group: int = 0) -> bytes:
        """A flag per block start..stop: its key is stored (not pinned; see lookup_hashes)."""
        return self._lookups.present(hashes, start, stop, group)

    def plan_new(self, hashes: list, start: int, stop: int, block_ids: list, skip: set,
                 limit: int, group: int = 0, packed: bool = False
                 ) -> tuple[list[bytes], list[int], Sequence[int]]:
        """(keys, block ids, block indices) of blocks start..stop not stored yet and not
        in `skip` (keys being stored), at most `limit`; their keys join `skip`. With
        `packed` (skip a `KeySet`): the planned blocks' vLLM hashes instead of keys (their
        keys are hash + group, made where they are needed: `make_keys`), and the indices
        as an array('I') (no int object per block)."""
        return self._lookups.plan_new(hashes, start, stop, block_ids, skip, limit, group,
                                      packed)

    def count_dropped(self, hashes: list, start: int, stop: int, skip, group: int = 0) -> None:
        """Count what a dry (or short) pool drops of an eager walk, blocks start..stop, as
        `KeyTable.count_new` counts them, on the index thread: the step thread does no per-block
        work for blocks it does not store. The count comes back as a `Counted` event (one
        per call, posted even if counting failed). `hashes` is vLLM's list (only appended
        to); `skip` (the keys being stored) is read under the GIL, as the step thread
        changes it. Queuing it also refills the pool (every round of the index thread
        does)."""
        self._requests.count_dropped(hashes, start, stop, skip, group)

    def pin(self, slots: Iterable[int]) -> None:
        self._lookups.pin(slots)

    def unpin(self, slots: Iterable[int]) -> None:
        self._lookups.unpin(slots)

    @property
    def pinned_slots(self) -> int:
        return self._lookups.table.pinned_slots

    def pin_counts(self) -> dict[int, int]:
        """{slot: pin count} (tests, diagnostics)."""
        return self._lookups.pin_counts()

    # ------------------------------------------------------------------ the slot pool

    def available(self) -> int:
        """Slots in the pool now: how many blocks a store planned this step can take (only
        the step thread takes, so it can only grow until then)."""
        return self._pool.available()

    def pooled(self) -> list[tuple[int, int]]:
        """(slot, generation) of the reserved slots in the pool (tests, `info`)."""
        return self._pool.pooled()

    def take(self, keys: Sequence[bytes], packed: tuple | None = None
             ) -> tuple[Sequence[int], Sequence[int]]:
        """(slots, generations): a reserved slot for each of keys, in order, from the pool
        (arrays "I" and "Q"; lists from the synchronous baseline);
        fewer (for a prefix of keys) when the pool runs short. The index thread refills it.
        `packed` = (hashes, group runs): more blocks after `keys`, as `StoreJob` has them
        (only counted here: no key is made)."""
        return self._pool.take(keys, packed)

    # ------------------------------------------------------------------ queued writes

    def commit(self, good: Sequence[tuple], bad: Sequence[tuple] = (), tag=None) -> None:
        """Queue: abort `bad`, commit `good` ((key, slot, generation) durably written on
        every rank) with one fsync; a `Committed` event with `tag` follows. Keys become hits
        once it is applied."""
        self._requests.commit(good, bad, tag)

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
        discards every key of the job from it itself, under the table's lock once the good
        ones are in the table (a walk sees each key in one or the other, never neither), and
        the event's `fps` is empty: the step thread does no per-block work for a commit."""
        self._requests.commit_blocks(keys, slots, gens, failed, tag, packed, keys_back, release)

    def abort(self, items: Sequence[tuple]) -> None:
        """Queue: give (key, slot, generation) reservations back."""
        self._requests.abort(items)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._requests.touch(keys)

    def touch_blocks(self, runs: list[tuple[list, list]]) -> None:
        """touch() of packed hits: (hashes, group runs) each, as a LoadJob carries them;
        their keys are made on the index thread (`make_keys`)."""
        self._requests.touch_blocks(runs)

    def drop(self, keys: Sequence[bytes]) -> None:
        """Remove entries (a load found them bad): no new lookup hits them from now on,
        not even from LMDB before the index thread applied the drop; a `Dropped` event
        names the ones LMDB removed."""
        if not keys:
            return
        keys = list(keys)
        self._lookups.forget(keys)
        self._requests.put(DropOp(keys))

    def drop_all(self) -> None:
        """Every committed entry goes (reset_cache): misses from now on."""
        self._lookups.forget_all()
        self._requests.put(DROP_ALL)

    def count_hits(self, hits: int, misses: int) -> None:
        """Add to the store's hit/miss counters. Summed here and handed to the index
        thread with the step's next operation (`OpQueue.send_counts`): a queued operation
        wakes the index thread, which on a busy machine is put on the step thread's CPU and
        preempts it in the middle of the connector's call, only to wait for the GIL the
        step thread holds."""
        self._requests.count_hits(hits, misses)

    def fence_device(self, dev: int, reason: str = "io_error") -> bool:
        """A device failed: its entries leave the lookups now (one C call), its slots
        leave the pool, and the index thread drops its entries from LMDB and records
        the fence, after which no reservation or commit touches its slots. False when
        the store has one device or the device is fenced already."""
        return self._devices.fence(dev, reason)

    # ------------------------------------------------------------------ outcomes

    def announced(self) -> None:
        """The step thread published an `AnnounceBatch`: room for the next."""
        self._worker.announced()

    @property
    def announcing(self) -> bool:
        """True until every entry found at open has been announced."""
        return self._worker.announce is not None

    def poll(self) -> list[IndexEvent]:
        """Outcomes of the index thread since the last poll (and the counts summed since
        the last operation go to it: counters never wait more than a step)."""
        return self._worker.poll()

    def wait_events(self, timeout: float) -> None:
        """Sleep until the index thread reports something, `timeout` at most. For an engine
        with nothing else to do than wait for commits: it sleeps instead of spinning (a
        spinning step thread takes the GIL from the index thread it waits for)."""
        self._outbox.wait(timeout)

    def pending_commits(self) -> int:
        return self._requests.queued - self._writes.applied

    def gauges(self) -> dict:
        """used/free slot counts as of the index thread's last transaction (no LMDB read)."""
        return dict(self._writes.gauges)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued operation is applied (tests, benchmarks, shutdown)."""
        if not self._requests.flush(timeout):
            raise KVStoreError(f"index thread did not catch up within {timeout:.0f}s")

    def close(self) -> bool:
        """Apply what is queued, give the pool's slots back, stop the thread. Idempotent.
        False when the thread is still busy after the wait (an LMDB write that does not
        return): the caller must then keep the store open under it."""
        return self._worker.close(self.CLOSE_JOIN_S)

    # -- test seams: the parts' index-thread helpers under the names tests use
    def _claim(self, removed: list):
        return self._lookups.claim(removed)

    def _shared_now(self) -> bool:
        return self._lookups.shared_now()
