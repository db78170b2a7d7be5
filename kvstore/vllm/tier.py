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
`submit_load` only queue the job. Four kvstore threads do the rest: the load, store and
sync threads of `TierIO` (kvstore/vllm/tier_io.py), which this class owns and which report
every job through `_finish`, and the **index thread** (`ServingIndex`), the only LMDB
writer: commits, LRU touches, drops, and the pool refill that evicts the least recently
used entries. This class keeps what vLLM calls, the job accounting (`drain_jobs`), the
metrics and the resources: the store, the index, the rings and the primary memory, which
`shutdown` closes once the threads have ended.

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

from kvstore.errors import ConfigError
from kvstore.format.layout import HEADER_SIZE, format_size
from kvstore.lookup.opening import open_serving_index, open_rank_io
from kvstore.vllm.tier_config import TierConfig, check_tier_store, tier_identity, tier_layout
from kvstore.vllm.tier_io import ANNOUNCED, TierCounts, TierIO

log = logging.getLogger("kvstore.tier")

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
    POOL_LOOKUPS = METRIC_PREFIX + "pool_lookups"
    POOL_FILLED_CHUNKS = METRIC_PREFIX + "pool_filled_chunks"
    POOL_TIMEOUTS = METRIC_PREFIX + "pool_timeouts"


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
        self.io: TierIO | None = None
        # The store's remote level (the fleet's KV pool, kvstore.remote): its fleet
        # agent's client, and the keys asked of it (lookups answer RETRY meanwhile).
        self.remote = None
        self.pool = None
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

        self._cv = threading.Condition()        # outstanding jobs
        self._outstanding = 0
        self._results: deque[JobResult] = deque()
        self._events: deque = deque()
        self._counts = TierCounts()
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
            self.io = TierIO(cfg, self._sidx, self._rio_load, self._rio_store, self._prim, row,
                             self.data_path == "direct", self._finish, self._counts,
                             self._events, self._events_on, self.medium, self.locality)
            self._fenced = self.io.fenced       # the devices the I/O threads fenced
            self._threads = self.io.threads
            if cfg.remote is not None:
                from kvstore.remote.asks import KeyAsks
                from kvstore.remote.client import RemoteClient
                self.remote = RemoteClient(self._store.path, cfg.remote, io_mode=cfg.io_mode)
                self.pool = KeyAsks(self.remote, cfg.remote.fetch_timeout_s, self._sidx.adopt)
                self.io.on_committed = self.remote.publish
            self.io.start()
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
        if self._local(key):
            self._counts.hits += 1
            return LookupResult.HIT
        if self.pool is None:
            return LookupResult.MISS
        # The KV pool: RETRY while it is asked (vLLM defers the request and goes on
        # scanning its keys, which are asked together at the step's end); once it
        # answered, what it had is in the local store.
        state = self.pool.state(key, req_context.req_id)
        if state == "retry":
            return LookupResult.RETRY
        if state == "filled" and self._local(key):
            self._counts.hits += 1
            return LookupResult.HIT
        return LookupResult.MISS

    def _local(self, key: OffloadKey) -> bool:
        sidx = self._sidx
        if sidx.contains(key):
            return True
        # another engine on the store (or the fleet agent) may have it (in LMDB, not in
        # this table): one index read, only while others are attached; it joins the table
        slots, _ = sidx.lookup_pin([key])
        if not slots:
            return False
        sidx.unpin(slots)
        return True

    def serve_external_requests(self, parent) -> None:
        """Once per step (vLLM's manager, at the step's end): the keys this step's
        lookups registered go to the fleet agent."""
        if self.pool is not None and not self.closed:
            self.pool.flush()

    def touch(self, keys, req_context: ReqContext):
        if keys and not self.closed:
            self._sidx.touch(list(keys))

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self.io.store_q, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self.io.load_q, job_metadata)

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
            if e is ANNOUNCED:
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
            TierMetrics.POOL_LOOKUPS: OffloadingCounterMetadata(
                documentation="Requests whose local misses the tier asked of the fleet's "
                              "KV pool (remote)."),
            TierMetrics.POOL_FILLED_CHUNKS: OffloadingCounterMetadata(
                documentation="Chunks the KV pool filled into the tier's local store."),
            TierMetrics.POOL_TIMEOUTS: OffloadingCounterMetadata(
                documentation="Pool lookups not answered within remote.fetch_timeout_s."),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        if self._sidx is None:
            return None
        c = self._counts.take()
        stats = OffloadingConnectorStats()
        for name, n in ((TierMetrics.HITS, c.hits), (TierMetrics.LOADED_CHUNKS, c.loaded),
                        (TierMetrics.READ_BYTES, c.read), (TierMetrics.WRITTEN_BYTES, c.written),
                        (TierMetrics.VERIFY_FAILURES, c.verify),
                        (TierMetrics.EVICTED_CHUNKS, c.evicted),
                        (TierMetrics.STORE_DROPPED_CHUNKS, c.dropped),
                        *self._pool_counts()):
            if n:
                stats.increase_counter(name, n)
        gauges = (self.capacity_bytes, self.used_bytes())
        if gauges != self._last_gauges:
            self._last_gauges = gauges
            stats.set_gauge(TierMetrics.CAPACITY_BYTES, gauges[0])
            stats.set_gauge(TierMetrics.USED_BYTES, gauges[1])
        return None if stats.is_empty() else stats

    def _pool_counts(self) -> list:
        if self.pool is None:
            return []
        asked, filled, timeouts = self.pool.take_counts()
        return [(TierMetrics.POOL_LOOKUPS, asked), (TierMetrics.POOL_FILLED_CHUNKS, filled),
                (TierMetrics.POOL_TIMEOUTS, timeouts)]

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
            if self.io is not None:
                self.io.stop()
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
        if self.remote is not None:
            self.remote.close()
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
            if self.io is not None:
                self.io.release()
            self._prim = None
            if self._flat is not None and self._flat is not self._primary_kv_view:
                try:
                    self._flat.release()
                except BufferError as exc:   # pragma: no cover (a view still exported)
                    log.warning("kvstore tier: primary memory still referenced: %s", exc)
            self._flat = None

    # ------------------------------------------------------------------ jobs, events

    def _finish(self, result: JobResult) -> None:
        """Report a job's result (the I/O threads report through this, once per job)."""
        self._results.append(result)
        with self._cv:
            self._outstanding -= 1
            if not self._outstanding:
                self._cv.notify_all()

    def _announce(self, keys: list[bytes]) -> list:
        """Index thread, after a restart: the chunks found on disk, as BlockStored."""
        return [OffloadingEvent(keys=list(keys), medium=self.medium, removed=False,
                                locality=self.locality)]
