"""Scheduler side of the kvstore connector: decides, never does I/O.

Owns the store (the single LMDB writer of the store) through a `ServingIndex`:
longest-prefix lookups for new requests and pins on the slots a load is about to read
(in memory), slots for stores (from the index thread's pool), the commit of a store once
every TP rank reported it durable, LRU touches and drops (queued to the index thread,
never waited for), KV events and statistics. It never raises into the engine while
serving: a failure becomes a miss, a dropped store, or a recompute, and is logged once.

`KVStoreScheduler` takes vLLM's calls and composes one part per job, which share a
`SchedulerContext` (`sched_context.py`): `Lookups` (`sched_lookup.py`: lookups, pinned
hits, load jobs and their end), `StorePlanner` (`sched_store.py`: eager, lazy and Mamba
store planning, second-sight admission), `StoreCommits` (`sched_commit.py`: store jobs in
flight until the index thread committed them) and `KVEvents` (`sched_events.py`).
"""
from __future__ import annotations

import logging
import time

from kvstore.errors import KVStoreError
from kvstore.io.rank import fence_reason_of
from kvstore.lookup.events import AnnounceBatch, Committed, Counted, Dropped, Evicted, Failed
from kvstore.lookup.opening import open_serving_index
from kvstore.lookup.table import ServingIndex
from kvstore.vllm.config import ConnectorConfig
from kvstore.vllm.metadata import KVStoreMetadata, KVStoreWorkerMeta
from kvstore.vllm.metrics import DEVICE_FAILED, KVStoreStats
from kvstore.vllm.sched_commit import StoreCommits
from kvstore.vllm.sched_context import SchedulerContext
from kvstore.vllm.sched_events import KVEvents
from kvstore.vllm.sched_lookup import Lookups
from kvstore.vllm.sched_store import StorePlanner

log = logging.getLogger("kvstore.vllm.scheduler")


class KVStoreScheduler:
    """Per-engine scheduler-side state of the connector (see module docstring)."""

    # The index it builds (`kvstore bench connector`'s baseline sets its synchronous one).
    index_class = ServingIndex

    def __init__(self, cfg: ConnectorConfig, layout, vllm_config, events_enabled: bool,
                 group_kinds: list[tuple[str, int]] | None = None, identity=None):
        self.cfg = cfg
        self.layout = layout
        self.block_size = layout.block_size
        # KV cache groups: (kind, tokens a hit needs before its end) each, "full", "swa"
        # or "mamba" (`kv_group_kinds`).
        self.group_kinds = group_kinds or _kinds_of_layout(layout)
        self.hybrid = len(self.group_kinds) > 1
        self.has_mamba = any(kind == "mamba" for kind, _ in self.group_kinds)
        self.tp_size = layout.tp_size
        self.events_enabled = events_enabled
        sc = vllm_config.scheduler_config
        lazy_target = 2 * -(-sc.max_num_batched_tokens // self.block_size)
        # The pool holds four steps' worth of store slots (eager: the blocks a step's
        # tokens complete, one more per request, in every attention group, plus one
        # Mamba state per request), 16 at least, and an eighth of the store at most: its
        # slots hold no data (`slot_pool` sets it, up to half the store).
        attn_groups = sum(1 for kind, _ in self.group_kinds if kind != "mamba")
        per_step = min(cfg.max_store_blocks_per_step,
                       (lazy_target if cfg.store_policy == "lazy"
                        else lazy_target // 2 + sc.max_num_seqs) * attn_groups
                       + (sc.max_num_seqs if self.has_mamba else 0))
        self.events = KVEvents(self.block_size, events_enabled)
        self.index = open_serving_index(
            cfg, layout, identity, index_class=self.index_class,
            pool_target=lambda cap: cfg.slot_pool or min(max(16, 4 * per_step), max(1, cap // 8)),
            announce=self.events.announce if events_enabled else None,
            evicted_keys=events_enabled)
        self.store = self.index.store
        # The store's remote level (a KV pool the fleet shares): its agent process fills
        # the local store on a miss and publishes what is stored here (kvstore.remote).
        remote = None
        if cfg.remote is not None:
            from kvstore.remote.client import RemoteClient
            remote = RemoteClient(self.store.path, cfg.remote, io_mode=cfg.io_mode)
        self.ctx = SchedulerContext(cfg, self.index, self.block_size, self.group_kinds,
                                    events_enabled, remote)
        self.requests = self.ctx.requests       # vLLM's requests by id, until finished
        self.lookups = Lookups(self.ctx)
        self.commits = StoreCommits(self.ctx, self.tp_size)
        self.stores = StorePlanner(self.ctx, self.commits, lazy_target)
        self._reported_gauges = None    # (used, free, failed devices) of the last report

    def bind(self, kv_cache_manager) -> None:
        self.stores.bind(kv_cache_manager)

    # -- lookups and loads -------------------------------------------------------------
    def on_new_request(self, request) -> None:
        self.requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.lookups.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        loaded = self.lookups.allocated(request, blocks, num_external_tokens)
        if loaded is not None:      # on disk already: eager stores skip them
            self.stores.loaded(request.request_id, *loaded)

    # -- the step's metadata -----------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> KVStoreMetadata:
        meta = KVStoreMetadata(loads=self.lookups.take_pending(), stores=[])
        try:
            meta.stores = self.stores.plan(scheduler_output)
        except Exception as exc:  # never raise into the engine
            self.ctx.warn_once("store planning", exc)
        return meta

    # -- completions -------------------------------------------------------------------
    def update_connector_output(self, output) -> None:
        wm = output.kv_connector_worker_meta
        if isinstance(wm, KVStoreWorkerMeta):
            for job_id, report in wm.store_reports.items():
                self.commits.reported(job_id, report)
            if wm.bad_keys:
                self.index.drop(wm.bad_keys)
            for dev, why in sorted(wm.failed_devices.items()):
                self._device_failed(dev, why)
        self.lookups.finished(output)
        self._index_events()

    def _device_failed(self, dev: int, why: str) -> None:
        """A worker found device `dev` failed: fence it (its entries leave the lookups now;
        loads in flight from it fail on the workers and are recomputed; stores go to the
        other devices)."""
        reason = fence_reason_of(why)
        try:
            if self.index.fence_device(dev, reason):
                log.error("kvstore: device %d (%s) failed on a worker (%s); fenced: its blocks are "
                          "no longer served, stores go to the other devices", dev,
                          self.store.data_dirs[dev], why)
        except KVStoreError as exc:
            self.ctx.warn_once("fencing a failed device", exc)

    def _index_events(self) -> None:
        """Outcomes of the index thread: commits applied, entries evicted or dropped."""
        for ev in self.index.poll():
            match ev:
                case Committed():
                    keys = self.commits.committed(ev)
                    if ev.items and self.events_enabled:
                        self.events.stored(ev.items, keys, ev.tag.origins)
                case Evicted():
                    self.ctx.stats.add(evicted_blocks=ev.count)
                    self.events.removed(ev.keys)
                case Counted():         # new blocks a dry pool dropped
                    self.stores.counted(ev.count)
                case Dropped():
                    self.events.removed(ev.keys)
                case AnnounceBatch():   # entries found on disk at start
                    self.events.pending.extend(ev.events)
                    self.index.announced()
                case Failed():
                    self.ctx.warn_once(ev.what, ev.error)

    def take_events(self):
        return self.events.take()

    # -- lifecycle ---------------------------------------------------------------------
    def request_finished(self, request) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self.lookups.forget(req_id)
        self.stores.forget(req_id)
        self.requests.pop(req_id, None)
        # Stores copy their blocks out within the step that planned them, and loads keep
        # their blocks through vLLM's own WAITING_FOR_REMOTE_KVS hold, so blocks are
        # never held past the request's end.
        return False, None

    def has_pending_stores(self) -> bool:
        # A store is pending until its commit's outcome is taken in a step (its stats and
        # events are published with that step's output).
        inflight, committing = self.commits.inflight, self.commits.committing
        counting = self.stores.counting
        if not self.requests and inflight:
            # Nothing to schedule but stores the workers are still writing: vLLM steps
            # empty steps back to back meanwhile (1 ms apart), and each one keeps its
            # worker's message loop busy-polling; with one core per engine that starved
            # the worker's I/O thread until the stores never finished (seen in the e2e
            # tests with VLLM_CPU_OMP_THREADS_BIND one core per server, 4 of 4 runs; with
            # this pause 0 of 3). Idle engines only: a request arriving waits 5 ms at most.
            time.sleep(0.005)
        elif (committing or counting) and not inflight and not self.requests:
            # Nothing but commits (or dry-pool counts) left: the engine would spin on
            # empty steps, taking the GIL from the index thread it waits for; sleep until
            # it reports (2 ms at most).
            self.index.wait_events(0.002)
        return bool(inflight) or committing > 0 or counting > 0

    def reset_cache(self) -> bool:
        """Drop every committed entry; in-flight stores abort.

        Entries that in-flight loads are reading are dropped too (a reset that reports
        success must leave nothing to hit): their slots stay pinned, and the index never
        hands out a pinned slot, so those reads still see the bytes they verify.
        """
        self.commits.reset()
        try:
            self.index.drop_all()   # misses from now on; LMDB follows on the index thread
        except KVStoreError as exc:
            self.ctx.warn_once("reset", exc)
            return False
        return True

    def get_stats(self) -> KVStoreStats | None:
        """This step's counters and the gauges; None when there is nothing new (counters
        all zero, gauges as last reported): vLLM calls it every step, on its scheduler
        thread, and carries what it returns to the Prometheus logger."""
        self._index_events()
        stats = self.ctx.stats
        data = stats.data
        g = self.index.gauges()
        data["used_slots"] = g["used_slots"]
        data["free_slots"] = g["free_slots"]
        fences = getattr(self.index, "fences", None)
        if fences is not None and self.index.ndev > 1:
            data["failed_devices"] = len(fences)
            for d in fences:
                data[DEVICE_FAILED + self.store.data_dirs[d]] = 1
        gauges = (g["used_slots"], g["free_slots"], data.get("failed_devices"))
        if gauges == self._reported_gauges and stats.is_empty():
            return None
        self._reported_gauges = gauges
        # the counters handed out; the parts go on adding to the same (reset) object
        out = KVStoreStats(data=data)
        stats.reset()
        return out

    @property
    def stored_blocks_total(self) -> int:
        """Blocks committed since start (benchmarks)."""
        return self.commits.stored_blocks_total

    @property
    def admission_rejected(self) -> int:
        """Blocks the second-sight admission filter kept out (0 with admission "always")."""
        return self.stores.admission_rejected

    def shutdown(self) -> None:
        index_stopped = True
        if self.ctx.remote is not None:
            self.ctx.remote.close()
        try:
            abandoned = self.commits.abandoned()
            if abandoned and not self.store.closed:
                self.index.abort(abandoned)
            # applies queued commits, gives the pool back; False: the index thread is
            # still in an LMDB write, and LMDB stays open under it (it logged why)
            index_stopped = self.index.close() is not False
        except KVStoreError:
            pass
        finally:
            self.commits.inflight.clear()
            if index_stopped:
                self.store.close()


def _kinds_of_layout(layout) -> list[tuple[str, int]]:
    """Group kinds from the layout's `groups` field ("full;swa:4096;mamba:..."), for a scheduler
    built without vLLM's KV cache config: a window of W tokens retains W - 1."""
    if not getattr(layout, "groups", ""):
        return [("full", 0)]
    out = []
    for part in layout.groups.split(";"):
        kind, _, w = part.partition(":")
        out.append(("swa", int(w) - 1) if kind == "swa"
                   else ("mamba", 0) if kind == "mamba" else ("full", 0))
    return out
