"""KVStoreTier: a kvstore store as a secondary tier of vLLM's OffloadingConnector.

vLLM 0.33's `OffloadingConnector` with `TieringOffloadingSpec` keeps a CPU primary tier
(vLLM's own GPU <-> host copies) and cascades every chunk it stores to its secondary tiers;
a chunk missing from the primary is promoted back from a secondary tier. This module is
such a tier, loaded by vLLM without any patch:

    "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.vllm.tier",
                         "path": "/mnt/nvme/kvstore-tier", "capacity": "500G"}]

It needs no GPU code: vLLM moves GPU <-> primary, the tier moves bytes between the
primary's host memory (`primary_kv_view`, one chunk per `strides[0]` bytes) and a kvstore
store, with the store's guarantees: bounded capacity with LRU eviction, data durable before
the index commits it, verified loads (a bad chunk is left out and answers MISS from then
on), persistence across restarts, a layout fingerprint.

Threads. vLLM calls every tier method on its scheduler thread (or its tier-poll thread)
under the manager's lock. Here `lookup` is one probe of the in-memory table
(`ServingIndex.contains`), `touch` queues an LRU update, and `submit_store` /
`submit_load` only queue the job. Four kvstore threads do the rest:

- the **load thread** (`kvstore-tier-load`) takes every queued load job, pins the hits
  in the table, reads and verifies them with one ring batch (its own `RankIO`) straight
  into the primary chunks, unpins, drops the entries that failed and posts the results;
- the **store thread** (`kvstore-tier-store`) takes every queued store job as one batch:
  it skips chunks the store has or is storing, takes reserved slots from the pool, and
  writes header + payload straight from the primary chunks with one ring batch (its own
  `RankIO`); the **sync thread** (`kvstore-tier-sync`) flushes the batches written by
  then with one fdatasync per slot file while the store thread writes the next one, and
  hands their commits to the index thread (group commit); once a commit is applied (an
  LMDB transaction and its fsync) it posts the jobs' results: a finished store is a
  durable hit. It is the one thread that takes the index thread's outcomes;
- the **index thread** (`ServingIndex`) is the only LMDB writer: commits, LRU touches,
  drops, and the pool refill that evicts the least recently used entries.

Data path. When the primary memory and chunk stride are 4096-aligned (vLLM's
`SharedOffloadRegion` is an mmap and pads each chunk to a page, so they are), payloads move
by io_uring between the primary chunks and the slot files with O_DIRECT and no copy; the
primary region is registered with each ring (fixed buffers) when the kernel allows it.
Otherwise (a stride that is not a multiple of 4096 would make a 4096-rounded transfer run
into the next chunk; an unaligned base cannot be read with O_DIRECT) the chunks go through
kvstore's staging memory, copied by numpy on the I/O threads. `KVStoreTier.data_path`
says which ("direct" or "staging") and `data_path_reason` why.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any, ClassVar

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstore.errors import ConfigError, CorruptSlot, KVStoreError
from kvstore.format.layout import HEADER_SIZE, format_size
from kvstore.io.rank import RankIO, fence_reason_of
from kvstore.io.records import SlotRefs
from kvstore.lookup.events import AnnounceBatch, Committed, Dropped, Evicted, Failed
from kvstore.lookup.opening import open_serving_index, open_rank_io
from kvstore.io.threads import make_thread
from kvstore.vllm.tier_config import TierConfig, check_tier_store, tier_identity, tier_layout

log = logging.getLogger("kvstore.tier")

# A store job whose chunks find the slot pool dry waits this long for the index thread to
# refill it (evicting LRU entries) before the rest of the job is dropped.
POOL_WAIT_S = 2.0
METRIC_PREFIX = "vllm:kv_offload_kvstore_"


class TierMetrics:
    """Names of the metrics the tier exports (`build_metric_definitions`)."""

    CAPACITY_BYTES = METRIC_PREFIX + "capacity_bytes"
    USED_BYTES = METRIC_PREFIX + "used_bytes"
    HITS = METRIC_PREFIX + "hits"
    LOADED_CHUNKS = METRIC_PREFIX + "loaded_chunks"
    READ_BYTES = METRIC_PREFIX + "read_bytes"
    WRITTEN_BYTES = METRIC_PREFIX + "written_bytes"
    VERIFY_FAILURES = METRIC_PREFIX + "verify_failures"
    EVICTED_CHUNKS = METRIC_PREFIX + "evicted_chunks"
    STORE_DROPPED_CHUNKS = METRIC_PREFIX + "store_dropped_chunks"


class _Batch:
    """One store batch (every store job queued when the store thread took them)."""

    __slots__ = ("jobs", "keys", "failed", "start", "nbytes")

    def __init__(self, jobs, keys, failed, start):
        self.jobs = jobs        # (job, indices of its chunks in `keys`, ok so far, bytes)
        self.keys = keys
        self.failed = failed    # indices not committed (no slot, write error)
        self.start = start


_ANNOUNCED = object()     # in the event queue: an "announce" batch was published


class KVStoreTier(SecondaryTierManager):
    """A kvstore store behind vLLM's CPU primary tier. See the module docstring."""

    medium: ClassVar[Medium] = Medium.STORAGE
    # How long `drain_jobs` waits at most for the jobs in flight (a device that stopped
    # answering must not hang vLLM's reset_cache), and `shutdown` for the tier's threads
    # to stop before it leaves their rings, store and primary memory alone.
    DRAIN_TIMEOUT_S: ClassVar[float] = 60.0
    SHUTDOWN_JOIN_S: ClassVar[float] = 120.0
    _released = False       # set once shutdown closed the rings and the store

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, **options: Any):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.cfg = cfg = TierConfig.from_options(options)
        self.locality = Locality(cfg.locality) if cfg.locality is not None else None
        self._events_on = bool(cfg.enable_kv_events
                               and offloading_spec.kv_events_config.enable_kv_cache_events)
        if cfg.enable_kv_events and not self._events_on:
            log.warning("kvstore tier: enable_kv_events is set but KV cache events are disabled "
                        "globally (kv_events_config); the tier emits none")
        self.closed = False
        self._store = self._sidx = None
        self._rio_load = self._rio_store = None
        self._threads: list[threading.Thread] = []

        row = int(primary_kv_view.strides[0])
        if row <= 0:
            raise ConfigError("kvstore tier: the primary tier has no chunk bytes (its KV cache "
                              "is empty); nothing to store")
        flat = primary_kv_view.cast("B") if (primary_kv_view.ndim != 1 or
                                             primary_kv_view.format != "B") else primary_kv_view
        self._flat = flat
        self._prim = np.frombuffer(flat, dtype=np.uint8)
        self.row = row
        self.num_chunks = len(self._prim) // row
        self._base = int(self._prim.__array_interface__["data"][0])
        direct_io = cfg.io_mode == "direct"
        if row % HEADER_SIZE:
            self.data_path, self.data_path_reason = "staging", (
                f"the primary chunk stride ({row} bytes) is not a multiple of 4096, so a slot "
                "payload (rounded up to 4096) would run into the next chunk")
        elif direct_io and self._base % HEADER_SIZE:
            self.data_path, self.data_path_reason = "staging", (
                f"the primary memory at 0x{self._base:x} is not 4096-aligned, which O_DIRECT "
                "needs")
        elif not self._prim.flags.writeable:
            self.data_path, self.data_path_reason = "staging", (
                "the primary memory is read-only (loads need to write into it)")
        else:
            self.data_path, self.data_path_reason = "direct", (
                f"primary chunks of {row} bytes at 0x{self._base:x}: 4096-aligned")
        self.registered = False

        self._lock = threading.Lock()           # counters, fences
        self._cv = threading.Condition()        # outstanding jobs
        self._outstanding = 0
        self._results: deque[JobResult] = deque()
        self._events: deque = deque()
        self._load_q: queue.SimpleQueue = queue.SimpleQueue()
        self._store_q: queue.SimpleQueue = queue.SimpleQueue()
        self._storing: set[bytes] = set()       # keys written, not committed (store thread adds,
        #                                          the sync thread removes once committed)
        self._batches = 0                       # sync thread only: commits in flight
        self._sync_q: queue.SimpleQueue = queue.SimpleQueue()   # written, to flush + commit
        self._fenced: set[int] = set()
        self._warned: set[str] = set()
        self._counts = {"hits": 0, "loaded": 0, "read": 0, "written": 0, "verify": 0,
                        "evicted": 0, "dropped": 0}
        self._last_gauges = None

        try:
            self.layout = tier_layout(offloading_spec, row)
            self.identity = tier_identity(offloading_spec)
            check_tier_store(cfg.path, self.layout)
            self._sidx = open_serving_index(
                cfg, self.layout, self.identity,
                pool_target=lambda cap: cfg.slot_pool or min(256, max(1, cap // 8)),
                announce=self._announce if self._events_on else None,
                evicted_keys=self._events_on)
            self._store = self._sidx.store
            cap = self._store.geometry.num_slots
            self.slot_size = self._store.geometry.slot_size
            self.capacity_bytes = cap * self.slot_size
            # (the direct path needs one slot of staging: RankIO keeps one at least)
            staging = self.slot_size if self.data_path == "direct" else cfg.staging_bytes
            self._rio_load = open_rank_io(cfg, self.layout, 0, staging_bytes=staging)
            self._rio_store = open_rank_io(cfg, self.layout, 0, staging_bytes=staging)
            if self.data_path == "direct":
                self.registered = (self._rio_load.register_memory(self._prim)
                                   and self._rio_store.register_memory(self._prim))
            self._threads = [
                make_thread(self._load_loop, "kvstore-tier-load", cfg.thread_cpus,
                            nice=cfg.io_thread_nice),
                make_thread(self._store_loop, "kvstore-tier-store", cfg.thread_cpus,
                            nice=cfg.io_thread_nice),
            ]
            self._sync_thread = make_thread(self._sync_loop, "kvstore-tier-sync",
                                            cfg.thread_cpus, nice=cfg.io_thread_nice)
            self._threads.append(self._sync_thread)
            for t in self._threads:
                t.start()
        except BaseException:
            self._close_store()
            raise
        log.info("kvstore tier at %s: %d slots of %s (%s), %s data path (%s)%s", cfg.path, cap,
                 format_size(self.slot_size), format_size(self.capacity_bytes), self.data_path,
                 self.data_path_reason,
                 "; primary memory registered with the rings" if self.registered else "")

    # ------------------------------------------------------------------ scheduler thread

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self.closed:
            return LookupResult.MISS
        sidx = self._sidx
        if not sidx.contains(key):
            # another engine on the store may have it (in LMDB, not in this table): one
            # index read, only while other engines are attached; the entry joins the table
            slots, _ = sidx.lookup_pin([key])
            if not slots:
                return LookupResult.MISS
            sidx.unpin(slots)
        self._counts["hits"] += 1
        return LookupResult.HIT

    def touch(self, keys, req_context: ReqContext):
        if keys and not self.closed:
            self._sidx.touch(list(keys))

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store_q, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load_q, job_metadata)

    def _submit(self, q, job: TransferJob) -> None:
        with self._cv:
            self._outstanding += 1
        if self.closed:
            self._finish(JobResult(job_id=job.job_id, success=False))
            return
        q.put(job)

    def get_finished_jobs(self):
        out = []
        res = self._results
        while res:
            out.append(res.popleft())
        return out

    def take_events(self):
        out = []
        ev = self._events
        while ev:
            e = ev.popleft()
            if e is _ANNOUNCED:
                self._sidx.announced()      # room for the next batch of re-announcements
            else:
                out.append(e)
        return out

    def drain_jobs(self) -> None:
        """Wait until every submitted job is reported, DRAIN_TIMEOUT_S at most. Past the
        bound the jobs still in flight stay unreported (an error names how many): a load
        still moving writes into its primary chunks, a store still reads from them, so
        neither may be handed back to vLLM before it ends; each is reported when it
        does."""
        deadline = time.monotonic() + self.DRAIN_TIMEOUT_S
        with self._cv:
            while self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("kvstore tier: %d job(s) still in flight after %.0f s; drain_jobs "
                              "returns without them (each is reported when its I/O ends; a "
                              "device that does not answer?)", self._outstanding,
                              self.DRAIN_TIMEOUT_S)
                    return
                if not self._cv.wait(timeout=min(5.0, left)) and self._outstanding:
                    log.warning("kvstore tier: still waiting for %d job(s) to finish",
                                self._outstanding)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict) -> dict[str, OffloadingMetricMetadata]:
        return {
            TierMetrics.CAPACITY_BYTES: OffloadingGaugeMetadata(
                documentation="Bytes the kvstore tier holds at most (its slots)."),
            TierMetrics.USED_BYTES: OffloadingGaugeMetadata(
                documentation="Bytes of the kvstore tier's slots holding a committed chunk."),
            TierMetrics.HITS: OffloadingCounterMetadata(
                documentation="Lookups the kvstore tier answered with a hit."),
            TierMetrics.LOADED_CHUNKS: OffloadingCounterMetadata(
                documentation="Chunks the kvstore tier loaded (verified) into the primary tier."),
            TierMetrics.READ_BYTES: OffloadingCounterMetadata(
                documentation="Payload bytes the kvstore tier read from its disks."),
            TierMetrics.WRITTEN_BYTES: OffloadingCounterMetadata(
                documentation="Payload bytes the kvstore tier wrote (durably) to its disks."),
            TierMetrics.VERIFY_FAILURES: OffloadingCounterMetadata(
                documentation="Chunks whose header or checksum did not verify on a load "
                              "(left out of the load and dropped from the tier)."),
            TierMetrics.EVICTED_CHUNKS: OffloadingCounterMetadata(
                documentation="Chunks the kvstore tier evicted (LRU) to make room."),
            TierMetrics.STORE_DROPPED_CHUNKS: OffloadingCounterMetadata(
                documentation="Chunks a store job could not store (no slot free of pins, "
                              "or a write error)."),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        if self._sidx is None:
            return None
        with self._lock:
            counts = dict(self._counts)
            for k in self._counts:
                self._counts[k] = 0
        stats = OffloadingConnectorStats()
        for name, key in ((TierMetrics.HITS, "hits"), (TierMetrics.LOADED_CHUNKS, "loaded"),
                          (TierMetrics.READ_BYTES, "read"), (TierMetrics.WRITTEN_BYTES, "written"),
                          (TierMetrics.VERIFY_FAILURES, "verify"),
                          (TierMetrics.EVICTED_CHUNKS, "evicted"),
                          (TierMetrics.STORE_DROPPED_CHUNKS, "dropped")):
            if counts[key]:
                stats.increase_counter(name, counts[key])
        gauges = (self.capacity_bytes, self.used_bytes())
        if gauges != self._last_gauges:
            self._last_gauges = gauges
            stats.set_gauge(TierMetrics.CAPACITY_BYTES, gauges[0])
            stats.set_gauge(TierMetrics.USED_BYTES, gauges[1])
        return None if stats.is_empty() else stats

    def used_bytes(self) -> int:
        """Bytes of slots holding committed chunks, as of the index thread's last
        transaction (no LMDB read)."""
        return int(self._sidx.gauges()["used_slots"]) * self.slot_size

    def shutdown(self) -> None:
        """Stop the I/O threads (jobs not started are reported failed; a batch being
        moved finishes, so no I/O touches the primary memory after this returns), apply
        the queued commits, close the store.

        A thread still busy after SHUTDOWN_JOIN_S (a device that does not answer) may
        still move bytes from or into the primary memory: then the rings, the store and
        every reference to the primary memory are kept (vLLM keeps a mapping mapped
        while it is referenced), and an error says so: a leak until the process exits,
        never I/O into freed memory. Calling shutdown again once the threads ended
        closes them."""
        if self._released:
            return
        if not self.closed:
            self.closed = True
            self._load_q.put(None)
            self._store_q.put(None)
        deadline = time.monotonic() + self.SHUTDOWN_JOIN_S
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in self._threads if t.is_alive()]
        if busy:
            log.error("kvstore tier: %s still busy after %.0f s at shutdown (a device that "
                      "does not answer?); leaving its rings, the store and the primary memory "
                      "open until the process exits", ", ".join(busy), self.SHUTDOWN_JOIN_S)
            return
        self._released = True
        self._close_store()

    def _close_store(self) -> None:
        index_stopped = True
        try:
            if self._sidx is not None:
                index_stopped = self._sidx.close() is not False
        finally:
            self._close_rest(index_stopped)

    def _close_rest(self, index_stopped: bool) -> None:
        for rio in (self._rio_load, self._rio_store):
            if rio is not None:
                try:
                    rio.close()
                except Exception as exc:   # pragma: no cover (close errors are logged)
                    log.warning("kvstore tier: closing a ring failed: %s", exc)
        self._rio_load = self._rio_store = None
        try:
            # An index thread still in an LMDB transaction (it logged why) keeps the
            # store open: closing LMDB under it would crash the process.
            if self._store is not None and index_stopped:
                self._store.close()
        finally:
            # every reference to the primary memory goes, so that vLLM can unmap it
            self._prim = None
            if self._flat is not None and self._flat is not self._primary_kv_view:
                try:
                    self._flat.release()
                except BufferError as exc:   # pragma: no cover (a view still exported)
                    log.warning("kvstore tier: primary memory still referenced: %s", exc)
            self._flat = None

    # ------------------------------------------------------------------ I/O threads

    def _finish(self, result: JobResult) -> None:
        self._results.append(result)
        with self._cv:
            self._outstanding -= 1
            if not self._outstanding:
                self._cv.notify_all()

    def _take(self, q, timeout: float | None) -> tuple[list[TransferJob], bool]:
        """Every job queued now (waiting `timeout` for the first); True once told to stop."""
        try:
            first = q.get(timeout=timeout) if timeout is not None else q.get()
        except queue.Empty:
            return [], False
        items = [first]
        while True:
            try:
                items.append(q.get_nowait())
            except queue.Empty:
                break
        stop = any(x is None for x in items)
        return [x for x in items if x is not None], stop

    def _chunk_addrs(self, job: TransferJob) -> np.ndarray | None:
        cids = np.asarray(job.chunk_ids, dtype=np.int64)
        if len(cids) != len(job.keys) or (len(cids) and (cids.min() < 0 or
                                                          cids.max() >= self.num_chunks)):
            self._warn("chunk ids", ValueError(
                f"job {job.job_id}: {len(cids)} chunk ids for {len(job.keys)} keys, or one out "
                f"of the primary's {self.num_chunks} chunks"))
            return None
        return cids

    def _warn(self, what: str, exc: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("kvstore tier: %s failed: %s", what, exc)

    def _check_devices(self, rio: RankIO) -> None:
        """A device the ring found failed is fenced: its entries leave the table."""
        if not rio.failed:
            return
        with self._lock:
            for d, why in list(rio.failed.items()):
                if d not in self._fenced:
                    self._fenced.add(d)
                    reason = fence_reason_of(why)
                    if self._sidx.fence_device(d, reason):
                        log.error("kvstore tier: device %d (%s) failed (%s); fenced", d,
                                  self._store.data_dirs[d], why)

    # -- loads --------------------------------------------------------------------------
    def _serve_queue(self, q, run_batch, what: str) -> bool:
        """One round of an I/O thread: take every queued job and run them as one batch
        (`run_batch(jobs, handed_off)`, which adds each job it reports or hands on to
        `handed_off`); whatever the batch leaves unreported fails, so no job is ever left
        without its result. True once the queue's stop mark was taken."""
        jobs, stop = self._take(q, None)
        if jobs:
            if self.closed:
                for job in jobs:
                    self._finish(JobResult(job_id=job.job_id, success=False))
            else:
                handed_off: set[int] = set()
                try:
                    run_batch(jobs, handed_off)
                except Exception as exc:   # never leave a job unreported
                    self._warn(f"a {what}", exc)
                    log.exception("kvstore tier: %s batch failed", what)
                    for job in jobs:
                        if job.job_id not in handed_off:
                            self._finish(JobResult(job_id=job.job_id, success=False))
        return stop

    def _loop(self, q, run_batch, what: str) -> None:
        """An I/O thread: rounds until the stop mark. A round that fails is logged (its
        jobs were reported by `_serve_queue`) and the next one runs: the thread never
        dies while jobs may still come."""
        while True:
            try:
                if self._serve_queue(q, run_batch, what):
                    return
            except Exception as exc:
                log.exception("kvstore tier: a %s round failed: %s", what, exc)

    def _load_loop(self) -> None:
        self._loop(self._load_q, self._load_batch, "load")

    def _load_batch(self, jobs: list[TransferJob], done: set[int]) -> None:
        """Load a batch of jobs. Whatever fails, every job is reported once (here, or
        by `_serve_queue` for those not in `done`), and a key whose load failed leaves
        the tier: a lookup answers MISS from then on, so vLLM does not promote it again
        at every step."""
        try:
            self._load_jobs(jobs, done)
        except Exception:
            left = [k for job in jobs if job.job_id not in done for k in job.keys]
            if left:
                try:
                    self._sidx.drop(left)
                except Exception as exc:   # (the jobs still fail: reported by the caller)
                    log.warning("kvstore tier: dropping %d chunk(s) of a failed load "
                                "failed: %s", len(left), exc)
            raise

    def _load_jobs(self, jobs: list[TransferJob], done: set[int]) -> None:
        t0 = time.perf_counter()
        sidx = self._sidx
        keys: list[bytes] = []
        slots: list[int] = []
        gens: list[int] = []
        dest: list[int] = []
        plan = []   # (job, keys, positions in the batch or -1 for a miss)
        errors: list = []
        raised = None
        try:
            for job in jobs:
                jkeys = list(job.keys)
                cids = self._chunk_addrs(job)
                pos = []
                if cids is not None:
                    for k, c in zip(jkeys, cids.tolist()):
                        s, g = sidx.lookup_pin([k])     # pinned: no eviction takes it now
                        if s:
                            pos.append(len(keys))
                            keys.append(k)
                            slots.append(s[0])
                            gens.append(g[0])
                            dest.append(c)
                        else:
                            pos.append(-1)
                else:
                    pos = [-1] * len(jkeys)
                plan.append((job, jkeys, pos))
            if keys:
                try:
                    errors = self._read(SlotRefs(keys, slots, gens), dest)
                except Exception as exc:
                    # (the ring's own failure, or the read's): what reached the primary
                    # chunks is unknown, so none of the batch is served
                    raised = exc
                    errors = [exc] * len(keys)
        finally:
            if slots:
                sidx.unpin(slots)
        if keys:
            self._check_devices(self._rio_load)
        bad = [keys[i] for i, e in enumerate(errors) if e is not None]
        corrupt = sum(1 for e in errors if isinstance(e, CorruptSlot))
        if bad:
            # never served again: the table forgets them now (lookups miss), LMDB follows
            sidx.drop(bad)
            if raised is not None:
                log.warning("kvstore tier: a load of %d chunk(s) failed (%s: %s); dropped",
                            len(keys), type(raised).__name__, raised)
            else:
                for i, e in enumerate(errors):
                    if e is not None:
                        log.warning("kvstore tier: chunk %s not loaded (%s); dropped",
                                    keys[i][:-4].hex()[:16], e)
        good_n = len(keys) - len(bad)
        with self._lock:
            self._counts["loaded"] += good_n
            self._counts["read"] += good_n * self.row
            self._counts["verify"] += corrupt
        dt = time.perf_counter() - t0
        touched = []
        for job, jkeys, pos in plan:
            ok = [k for k, p in zip(jkeys, pos) if p >= 0 and errors[p] is None]
            touched.extend(ok)
            if len(ok) == len(jkeys):
                res = JobResult(job_id=job.job_id, success=True, transfer_time=dt,
                                transfer_bytes=len(ok) * self.row or None)
            else:
                res = JobResult(job_id=job.job_id, success=False,
                                successful_keys=tuple(ok) if ok else None, transfer_time=dt,
                                transfer_bytes=len(ok) * self.row or None)
            done.add(job.job_id)
            self._finish(res)
        if touched:
            sidx.touch(touched)

    def _read(self, refs: SlotRefs, dest: list[int]) -> list:
        rio, row = self._rio_load, self.row
        if self.data_path == "direct":
            addrs = np.uint64(self._base) + np.asarray(dest, dtype=np.uint64) * np.uint64(row)
            return rio.read_at(refs, addrs, verify=self.cfg.verify)
        prim = self._prim

        def drain(start, stop, views, errs):
            for j, v in enumerate(views):
                if errs[j] is None:
                    c = dest[start + j]
                    prim[c * row:(c + 1) * row] = v[:row]
        return rio.read_blocks(refs, drain, verify=self.cfg.verify)

    # -- stores -------------------------------------------------------------------------
    def _store_loop(self) -> None:
        try:
            self._loop(self._store_q, self._store_batch, "store")
        finally:
            self._sync_q.put(None)     # the sync thread flushes and commits the rest

    def _store_batch(self, jobs: list[TransferJob], queued: set[int]) -> None:
        t0 = time.perf_counter()
        sidx = self._sidx
        keys: list[bytes] = []
        src: list[int] = []
        seen: dict[bytes, int] = {}
        plan = []       # (job, positions of its new chunks, valid)
        for job in jobs:
            cids = self._chunk_addrs(job)
            if cids is None:
                plan.append((job, [], False))
                continue
            pos = []
            for k, c in zip(job.keys, cids.tolist()):
                if k in seen:
                    pos.append(seen[k])
                    continue
                if k in self._storing or sidx.contains(k):
                    continue        # the store has it, or a commit in flight brings it
                seen[k] = len(keys)
                pos.append(len(keys))
                keys.append(k)
                src.append(c)
            plan.append((job, pos, True))
        failed: set[int] = set()
        slots: list[int] = []
        gens: list[int] = []
        batch = _Batch([], keys, failed, t0)
        batch.jobs = plan
        try:
            # Slots taken here are this thread's until the sync thread has the batch:
            # whatever fails before, they go back (and the jobs fail, `_serve_queue`).
            if keys:
                s, g = sidx.take(keys)
                slots += list(s)
                gens += list(g)
                deadline = time.monotonic() + POOL_WAIT_S
                while len(slots) < len(keys) and not self.closed and time.monotonic() < deadline:
                    # the pool is dry: the index thread refills it (evicting LRU entries)
                    time.sleep(0.0005)
                    s, g = sidx.take(keys[len(slots):])
                    slots += list(s)
                    gens += list(g)
                if len(slots) < len(keys):
                    failed.update(range(len(slots), len(keys)))
                    with self._lock:
                        self._counts["dropped"] += len(keys) - len(slots)
                n = len(slots)
                if n:
                    errors = self._write(SlotRefs(keys[:n], slots, gens), src[:n])
                    self._check_devices(self._rio_store)
                    bad = [i for i, e in enumerate(errors) if e is not None]
                    for i in bad:
                        log.warning("kvstore tier: writing chunk %s failed (%s)",
                                    keys[i][:-4].hex()[:16], errors[i])
                    failed.update(bad)
                    with self._lock:
                        self._counts["written"] += (n - len(bad)) * self.row
                        self._counts["dropped"] += len(bad)
            n = len(slots)
            if n:
                self._storing.update(keys[:n])
                # flushed and committed by the sync thread while this one writes the next
                # batch; from here its jobs are the sync thread's to report
                self._sync_q.put((batch, keys[:n], slots, gens))
        except BaseException:
            if slots:
                self._storing.difference_update(keys[:len(slots)])
                sidx.abort(list(zip(keys[:len(slots)], slots, gens)))
            raise
        queued.update(job.job_id for job, _, _ in plan)
        if not slots:
            self._complete(batch, None)

    def _sync_loop(self) -> None:
        """Make written batches durable and hand them to the index thread, in order, and
        take the index thread's outcomes (the only thread that polls it).

        Every batch queued by then shares one fdatasync per slot file (the store thread
        goes on writing the next batch meanwhile, so the device is not idle while it
        flushes); a batch's chunks are committed only once their file is flushed, and a
        failed flush fails every chunk of its file. A committed batch's jobs are reported
        here, within a millisecond of the commit (not after the store thread's next
        write).

        A round that fails (anything but a failed flush, which fails only its file's
        chunks) fails the batches it had not handed to the index thread yet: their
        reservations go back, their jobs are reported failed, once; the thread goes on
        with the next round."""
        while True:
            # commits in flight: come back soon for their outcome
            items, stop = self._take(self._sync_q, 0.001 if self._batches else 0.05)
            handed: set[int] = set()        # ids of the items the index thread has
            try:
                self._sync_round(items, handed)
            except Exception as exc:
                log.exception("kvstore tier: flushing or committing %d store batch(es) "
                              "failed: %s", len(items) - len(handed), exc)
                for item in items:
                    if id(item) not in handed:
                        self._fail_written(item, exc)
            try:
                self._poll_index()
                if stop:
                    if self._batches:
                        try:
                            self._sidx.flush(timeout=60.0)   # the commits in flight are applied
                        except KVStoreError as exc:
                            self._warn("the last commits", exc)
                        self._poll_index()
                    return
            except Exception as exc:
                log.exception("kvstore tier: taking the index thread's outcomes failed: %s",
                              exc)
                if stop:
                    return

    def _sync_round(self, items: list, handed: set[int]) -> None:
        """Flush the written batches `items` (one fdatasync per slot file) and hand their
        commits to the index thread; `handed` gets the id of each item handed."""
        if not items:
            return
        if self.cfg.durability != "none":
            rio = self._rio_store
            fds_of = []
            touched: set[int] = set()
            for batch, keys, slots, gens in items:
                ok = [i for i in range(len(keys)) if i not in batch.failed]
                fds = rio.locate([slots[i] for i in ok])[0].tolist() if ok else []
                fds_of.append((ok, fds))
                touched.update(fds)
            bad: dict[int, OSError] = {}
            for fd in sorted(touched):
                try:
                    os.fdatasync(fd)
                except OSError as exc:
                    bad[fd] = exc
            for (batch, keys, _, _), (ok, fds) in zip(items, fds_of):
                for i, fd in zip(ok, fds):
                    if fd in bad:
                        batch.failed.add(i)
                        log.warning("kvstore tier: flushing chunk %s failed (%s)",
                                    keys[i][:-4].hex()[:16], bad[fd])
        for item in items:
            batch, keys, slots, gens = item
            self._sidx.commit_blocks(keys, slots, gens,
                                     sorted(batch.failed & set(range(len(keys)))),
                                     tag=batch, keys_back=self._events_on)
            self._batches += 1
            handed.add(id(item))

    def _fail_written(self, item, exc: Exception) -> None:
        """A written batch that never reached the index thread: its reservations go
        back (nothing of it is committed) and its jobs are reported failed."""
        batch, keys, slots, gens = item
        self._storing.difference_update(keys)
        try:
            self._sidx.abort(list(zip(keys, slots, gens)))
        except Exception as abort_exc:     # (reclaimed at the next open)
            log.warning("kvstore tier: giving back %d reserved slot(s) failed: %s",
                        len(keys), abort_exc)
        self._complete(batch, exc)

    def _write(self, refs: SlotRefs, src: list[int]) -> list:
        rio, row = self._rio_store, self.row
        durable = False     # flushed by the sync thread (`_sync_loop`)
        if self.data_path == "direct":
            addrs = np.uint64(self._base) + np.asarray(src, dtype=np.uint64) * np.uint64(row)
            return rio.write_at(refs, addrs, durable=durable)
        prim = self._prim

        def fill(start, stop, views):
            for j, v in enumerate(views):
                c = src[start + j]
                v[:row] = prim[c * row:(c + 1) * row]
        return rio.write_blocks(refs, fill, durable=durable)

    def _complete(self, batch: _Batch, error: Exception | None) -> None:
        dt = time.perf_counter() - batch.start
        for job, pos, valid in batch.jobs:
            ok = valid and error is None and not any(p in batch.failed for p in pos)
            nbytes = sum(1 for p in pos if p not in batch.failed) * self.row
            self._finish(JobResult(job_id=job.job_id, success=ok, transfer_time=dt,
                                   transfer_bytes=nbytes or None))

    def _poll_index(self) -> None:
        for ev in self._sidx.poll():
            try:
                self._index_event(ev)
            except Exception as exc:    # the next events are still taken
                log.exception("kvstore tier: handling %s failed: %s", type(ev).__name__, exc)

    def _index_event(self, ev) -> None:
        if isinstance(ev, Committed):
            batch = ev.tag
            self._batches -= 1
            try:
                self._storing.difference_update(batch.keys)
                if ev.error is not None:
                    self._warn("a commit", ev.error)
                if self._events_on and ev.items:    # (published with the jobs' results)
                    self._events.append(OffloadingEvent(
                        keys=[k for k, _, _ in ev.items], medium=self.medium, removed=False,
                        locality=self.locality))
            finally:
                self._complete(batch, ev.error)
        elif isinstance(ev, (Evicted, Dropped)):
            if isinstance(ev, Evicted):
                with self._lock:
                    self._counts["evicted"] += ev.count or len(ev.keys)
            if self._events_on and ev.keys:
                self._events.append(OffloadingEvent(
                    keys=list(ev.keys), medium=self.medium, removed=True,
                    locality=self.locality))
        elif isinstance(ev, AnnounceBatch):
            self._events.extend(ev.events)
            self._events.append(_ANNOUNCED)
        elif isinstance(ev, Failed):
            self._warn(ev.what, ev.error)

    def _announce(self, keys: list[bytes]) -> list:
        """Index thread, after a restart: the chunks found on disk, as BlockStored."""
        return [OffloadingEvent(keys=list(keys), medium=self.medium, removed=False,
                                locality=self.locality)]
