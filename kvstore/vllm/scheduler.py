"""Scheduler side of the kvstore connector: decides, never does I/O.

Owns the store's index (the single LMDB writer of the store): longest-prefix lookups for
new requests, pins on the slots a load is about to read, slot reservations for stores,
the commit of a store once every TP rank reported it durable, LRU touches, KV events and
statistics. It never raises into the engine while serving: a failure becomes a miss, a
dropped store, or a recompute, and is logged once.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvstore.engine import DiskStore, SlotRef, ensure_store
from kvstore.errors import KVStoreError, StoreFull
from kvstore.vllm.config import ConnectorConfig, block_key
from kvstore.vllm.metadata import KVStoreMetadata, KVStoreWorkerMeta, LoadJob, StoreJob
from kvstore.vllm.metrics import KVStoreStats

log = logging.getLogger("kvstore.vllm.scheduler")
MEDIUM = "STORAGE"


class KVStoreScheduler:
    """Per-engine scheduler-side state of the connector (see module docstring)."""

    def __init__(self, cfg: ConnectorConfig, layout, vllm_config, events_enabled: bool):
        self.cfg = cfg
        self.layout = layout
        self.block_size = layout.block_size
        self.tp_size = layout.tp_size
        ensure_store(cfg.path, layout, cfg.capacity, io_mode=cfg.io_mode, create=cfg.create)
        self.store = DiskStore(cfg.path, layout, sync=cfg.durability != "none")
        self.events_enabled = events_enabled
        sc = vllm_config.scheduler_config
        self._lazy_target = 2 * -(-sc.max_num_batched_tokens // self.block_size)
        self._next_job = 1
        self._requests: dict[str, Any] = {}
        self._candidates: dict[str, tuple[int, list[SlotRef]]] = {}  # pinned, pre-alloc
        self._pending_loads: list[LoadJob] = []
        self._inflight_loads: dict[str, tuple[LoadJob, list[SlotRef]]] = {}
        # Requests whose disk load failed (error, corruption, timeout): they recompute and
        # never read the disk again, or a stalled disk would make them load, time out and
        # look up the same blocks forever (a block-0 failure resets num_computed_tokens).
        self._load_failed: set[str] = set()
        # Failed blocks of in-flight loads. A rank reports its failed blocks when its
        # part ends, which can be steps before the last rank finishes the request.
        self._load_invalid: dict[str, set[int]] = {}
        self._inflight_stores: dict[int, dict] = {}
        self._abort_later: list[SlotRef] = []   # reservations whose abort failed
        self._storing_keys: set[bytes] = set()
        self._stored_upto: dict[str, int] = {}
        self._to_touch: list[bytes] = []
        self._events: list = []
        self._stats = KVStoreStats()
        self._kv_cache_manager = None
        self._block_pool = None
        self._warned: set[str] = set()

    # -- helpers ---------------------------------------------------------------------
    def _warn_once(self, what: str, exc: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("kvstore: %s failed (%s); serving continues without it", what, exc)

    def _job_id(self) -> int:
        j = self._next_job
        self._next_job += 1
        return j

    def _request_keys(self, request, start_blk: int, end_blk: int) -> list[bytes]:
        hashes = request.block_hashes
        end_blk = min(end_blk, len(hashes))
        return [block_key(hashes[i]) for i in range(start_blk, end_blk)]

    def _release_candidate(self, req_id: str) -> None:
        cand = self._candidates.pop(req_id, None)
        if cand is not None:
            self.store.unpin(r.slot for r in cand[1])

    def bind(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._block_pool = getattr(kv_cache_manager, "block_pool", None)

    # -- lookups and loads -----------------------------------------------------------
    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        req_id = request.request_id
        self._requests[req_id] = request
        cand = self._candidates.get(req_id)
        if cand is not None and cand[0] == num_computed_tokens // self.block_size:
            # Re-entry while the request waits for GPU blocks: the pinned lookup result
            # is still valid (pins keep it from eviction; a block dropped since then
            # fails verification on load and is recomputed), so skip the index walk.
            return len(cand[1]) * self.block_size, True
        self._release_candidate(req_id)
        if getattr(request.sampling_params, "skip_reading_prefix_cache", False) or \
                req_id in self._inflight_loads or req_id in self._load_failed:
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        # Whole blocks only, and never the last prompt token: vLLM must compute at least
        # one token to sample from.
        end = (request.num_tokens - 1) // bs
        if end <= start:
            return 0, False
        try:
            keys = self._request_keys(request, start, end)
            entries = self.store.longest_prefix(keys)
        except KVStoreError as exc:
            self._warn_once("lookup", exc)
            return 0, False
        if not entries:
            self._stats.add(miss_lookups=1)
            self.store.count_hits(0, 1)
            return 0, False
        refs = [SlotRef(e.key, e.slot, e.generation) for e in entries]
        self.store.pin(r.slot for r in refs)
        self._candidates[req_id] = (start, refs)
        self._stats.add(hit_blocks=len(refs))
        # As DiskStore.get counts: hits in blocks, a miss per lookup that stopped short.
        self.store.count_hits(len(refs), 0 if len(refs) == len(keys) else 1)
        return len(refs) * bs, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        cand = self._candidates.pop(req_id, None)
        if cand is None:
            return
        start, refs = cand
        n = num_external_tokens // self.block_size
        if n <= 0:
            self.store.unpin(r.slot for r in refs)
            return
        self.store.unpin(r.slot for r in refs[n:])
        refs = refs[:n]
        block_ids = list(blocks.get_block_ids()[0][start:start + n])
        if len(block_ids) != n:
            self.store.unpin(r.slot for r in refs)
            self._warn_once("load planning", KVStoreError(f"expected {n} blocks, got {len(block_ids)}"))
            return
        job = LoadJob(self._job_id(), req_id, block_ids, [r.key for r in refs],
                      [r.slot for r in refs], [r.generation for r in refs])
        self._pending_loads.append(job)
        self._inflight_loads[req_id] = (job, refs)
        self._stats.add(hit_tokens=n * self.block_size)

    # -- stores ----------------------------------------------------------------------
    def _plan_eager(self, scheduler_output) -> list[tuple[bytes, int, int | None]]:
        """(key, gpu block id, token offset) of blocks this step's forward completes."""
        if self._kv_cache_manager is None:
            return []
        bs = self.block_size
        out = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(req_id)
            if req is None or n <= 0:
                continue
            done_after = req.num_computed_tokens + n   # schedule() advances it after us
            nfull = min(done_after // bs, len(req.block_hashes))
            first = self._stored_upto.get(req_id, 0)
            if req.num_computed_tokens < first * bs:  # preempted and restarted
                first = req.num_computed_tokens // bs
            if nfull <= first:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            for i in range(first, min(nfull, len(block_ids))):
                out.append((block_key(req.block_hashes[i]), block_ids[i],
                            self._origin(req, i) if self.events_enabled else None))
            self._stored_upto[req_id] = nfull
        return out

    def _origin(self, req, i: int) -> tuple[list[int], Any]:
        """(token ids, parent hash) of block i of req, for its BlockStored event. Taken
        when the store is planned: the request has usually finished (and is gone) by the
        time every rank reported the write durable."""
        bs = self.block_size
        parent = maybe_convert_block_hash(req.block_hashes[i - 1]) if i > 0 else None
        return list(req.all_token_ids[i * bs:(i + 1) * bs]), parent

    def _plan_lazy(self) -> list[tuple[bytes, int, None]]:
        """Cached GPU blocks nearest to eviction (head of vLLM's free queue)."""
        pool = self._block_pool
        if pool is None:
            return []
        out = []
        for seen, node in enumerate(pool.free_block_queue.iter_blocks_after(None)):
            if seen >= self._lazy_target:
                break
            if node.block_hash is not None and not getattr(node, "is_null", False):
                out.append((bytes(node.block_hash), node.block_id, None))
        return out

    def _plan_stores(self, scheduler_output) -> list[StoreJob]:
        cands = self._plan_eager(scheduler_output) if self.cfg.store_policy == "eager" \
            else self._plan_lazy()
        if not cands:
            return []
        seen = set()
        picked = []
        for key, bid, origin in cands:
            if key in seen or key in self._storing_keys:
                continue
            seen.add(key)
            picked.append((key, bid, origin))
        if not picked:
            return []
        try:
            present = {k for k, _, _ in picked if self.store.lookup(k) is not None}
        except KVStoreError as exc:
            self._warn_once("store lookup", exc)
            return []
        picked = [p for p in picked if p[0] not in present][: self.cfg.max_store_blocks_per_step]
        if not picked:
            return []
        try:
            try:
                refs, evicted = self.store.reserve([k for k, _, _ in picked])
            except StoreFull:
                # Store what fits (in prefix order) instead of nothing: slots that are
                # neither pinned nor reserved can still be taken.
                s = self.store.stats()
                room = s["free_slots"] + s["used_slots"] - self.store.pinned_slots
                if room <= 0:
                    raise
                self._stats.add(store_dropped_blocks=len(picked) - room)
                picked = picked[:room]
                refs, evicted = self.store.reserve([k for k, _, _ in picked])
        except StoreFull:
            self._stats.add(store_dropped_blocks=len(picked))
            return []
        except KVStoreError as exc:
            self._warn_once("reserve", exc)
            self._stats.add(store_dropped_blocks=len(picked))
            return []
        if evicted:
            self._stats.add(evicted_blocks=len(evicted))
            self._emit_removed([e.key for e in evicted])
        by_key = {k: (bid, origin) for k, bid, origin in picked}
        job = StoreJob(self._job_id(), [by_key[r.key][0] for r in refs], [r.key for r in refs],
                       [r.slot for r in refs], [r.generation for r in refs])
        self._inflight_stores[job.job_id] = {"refs": refs, "ranks": 0, "failed": set(),
                                             "origins": [by_key[r.key][1] for r in refs],
                                             "reset": False, "t": time.monotonic()}
        self._storing_keys.update(job.keys)
        return [job]

    def build_connector_meta(self, scheduler_output) -> KVStoreMetadata:
        meta = KVStoreMetadata(loads=self._pending_loads, stores=[])
        self._pending_loads = []
        try:
            meta.stores = self._plan_stores(scheduler_output)
        except Exception as exc:  # never raise into the engine
            self._warn_once("store planning", exc)
        return meta

    # -- completions -----------------------------------------------------------------
    def update_connector_output(self, output) -> None:
        wm = output.kv_connector_worker_meta
        if isinstance(wm, KVStoreWorkerMeta):
            for job_id, (n, failed) in wm.store_reports.items():
                st = self._inflight_stores.get(job_id)
                if st is None:
                    continue
                st["ranks"] += n
                st["failed"].update(failed)
                if st["ranks"] >= self.tp_size:
                    self._finish_store(job_id, st)
            if wm.bad_keys:
                self._drop_bad(wm.bad_keys)
        done = set(output.finished_recving or ()) | set(getattr(output, "failed_recving", ()) or ())
        invalid = getattr(output, "invalid_block_ids", None)
        if invalid:
            for job, _ in self._inflight_loads.values():
                hit = invalid.intersection(job.block_ids)
                if hit:
                    self._load_invalid.setdefault(job.req_id, set()).update(hit)
        for req_id in done:
            item = self._inflight_loads.pop(req_id, None)
            if item is None:
                continue
            job, refs = item
            self.store.unpin(r.slot for r in refs)
            # Counted here, once per block: the workers' counts are per rank, and the
            # union of failed blocks over the ranks is only known after aggregation.
            failed = len(self._load_invalid.pop(req_id, ()))
            self._stats.add(loaded_blocks=len(job.block_ids) - failed, load_failures=failed)
            if failed:
                self._load_failed.add(req_id)
            self._to_touch.extend(job.keys)
        self._retry_aborts()
        if self._to_touch:
            try:
                self.store.touch(self._to_touch)
            except KVStoreError as exc:
                self._warn_once("LRU touch", exc)
            self._to_touch = []

    def _finish_store(self, job_id: int, st: dict) -> None:
        del self._inflight_stores[job_id]
        refs = st["refs"]
        self._storing_keys.difference_update(r.key for r in refs)
        if st["reset"]:
            good, bad = [], refs
        else:
            good = [r for i, r in enumerate(refs) if i not in st["failed"]]
            bad = [r for i, r in enumerate(refs) if i in st["failed"]]
        try:
            if bad:
                self.store.abort(bad)
            if good:
                self.store.commit(good)
        except KVStoreError as exc:
            # The index cannot be written (e.g. the disk is full): the store is dropped,
            # and its reservations are given back now or, failing that, on a later step,
            # so a long disk-full episode does not eat the store's capacity.
            self._warn_once("commit", exc)
            self._stats.add(store_dropped_blocks=len(refs) if not st["reset"] else 0)
            self._abort_later.extend(refs)
            self._retry_aborts()
            return
        self._stats.add(stored_blocks=len(good), store_dropped_blocks=len(bad) if not st["reset"] else 0)
        if good and self.events_enabled:
            self._emit_stored(good, st["origins"], refs)

    def _retry_aborts(self) -> None:
        if not self._abort_later:
            return
        try:
            self.store.abort(self._abort_later)
            self._abort_later = []
        except KVStoreError:
            pass  # still unwritable: try again next step

    def _drop_bad(self, keys: list[bytes]) -> None:
        try:
            dropped = self.store.drop(keys)
        except KVStoreError as exc:
            self._warn_once("drop of a corrupt entry", exc)
            return
        self._emit_removed([e.key for e in dropped])

    # -- events ----------------------------------------------------------------------
    def _emit_removed(self, keys: list[bytes]) -> None:
        if self.events_enabled and keys:
            self._events.append(BlockRemoved(
                block_hashes=[maybe_convert_block_hash(k[:-4]) for k in keys], medium=MEDIUM))

    def _emit_stored(self, good, origins, refs) -> None:
        origin_of = {r.key: o for r, o in zip(refs, origins)}
        bs = self.block_size
        for r in good:
            # Lazy stores come from vLLM's free queue, which keeps no tokens: their
            # events carry the hash only.
            tokens, parent = origin_of.get(r.key) or ([], None)
            self._events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(r.key[:-4])], parent_block_hash=parent,
                token_ids=tokens, block_size=bs, lora_id=None, medium=MEDIUM, lora_name=None,
                group_idx=int.from_bytes(r.key[-4:], "big")))

    def take_events(self):
        ev, self._events = self._events, []
        return ev

    # -- lifecycle -------------------------------------------------------------------
    def request_finished(self, request) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self._release_candidate(req_id)
        self._requests.pop(req_id, None)
        self._stored_upto.pop(req_id, None)
        self._load_failed.discard(req_id)
        # Stores copy their blocks out within the step that planned them, and loads keep
        # their blocks through vLLM's own WAITING_FOR_REMOTE_KVS hold, so blocks are
        # never held past the request's end.
        return False, None

    def has_pending_stores(self) -> bool:
        return bool(self._inflight_stores)

    def reset_cache(self) -> bool:
        """Drop every committed entry; in-flight stores abort.

        Entries that in-flight loads are reading are dropped too (a reset that reports
        success must leave nothing to hit): their slots stay pinned, and the index never
        hands out a pinned slot, so those reads still see the bytes they verify.
        """
        for st in self._inflight_stores.values():
            st["reset"] = True
        try:
            drop = [e.key for e in self.store.index.iter_entries()]
            for i in range(0, len(drop), 10000):
                dropped = self.store.drop(drop[i:i + 10000])
                self._emit_removed([e.key for e in dropped])
        except KVStoreError as exc:
            self._warn_once("reset", exc)
            return False
        return True

    def get_stats(self) -> KVStoreStats | None:
        try:
            s = self.store.stats()
            self._stats.data["used_slots"] = s["used_slots"]
            self._stats.data["free_slots"] = s["free_slots"]
        except KVStoreError:
            pass
        if self._stats.is_empty() and "used_slots" not in self._stats.data:
            return None
        out = KVStoreStats(dict(self._stats.data))
        self._stats.reset()
        return out

    def shutdown(self) -> None:
        try:
            abandoned = [r for st in self._inflight_stores.values() for r in st["refs"]]
            if abandoned and not self.store.closed:
                self.store.abort(abandoned)
        except KVStoreError:
            pass
        self._inflight_stores.clear()
        self.store.close()
