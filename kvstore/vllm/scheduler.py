"""Scheduler side of the kvstore connector: decides, never does I/O.

Owns the store (the single LMDB writer of the store) through a `ServingIndex`:
longest-prefix lookups for new requests and pins on the slots a load is about to read
(in memory), slots for stores (from the index thread's pool), the commit of a store once
every TP rank reported it durable, LRU touches and drops (queued to the index thread,
never waited for), KV events and statistics. It never raises into the engine while
serving: a failure becomes a miss, a dropped store, or a recompute, and is logged once.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys)

from kvstore._keytable import KeySet, keys_with_packed, make_keys
from kvstore._seenfilter import SeenFilter
from kvstore.errors import KVStoreError
from kvstore.lookup.events import AnnounceBatch, Committed, Counted, Dropped, Evicted, Failed
from kvstore.io.rank import fence_reason_of
from kvstore.lookup.opening import open_serving_index
from kvstore.lookup.table import ServingIndex
from kvstore.vllm.config import ConnectorConfig, block_key
from kvstore.vllm.metadata import KVStoreMetadata, KVStoreWorkerMeta, LoadJob, StoreJob
from kvstore.vllm.metrics import DEVICE_FAILED, KVStoreStats

log = logging.getLogger("kvstore.vllm.scheduler")
MEDIUM = "STORAGE"


@dataclass
class InflightStore:
    """A store job between planning and its commit: reported by `ranks` ranks so far.
    Blocks are parallel lists (no object per block: a step stores hundreds of them):
    `keys`, then the blocks of `packed` (vLLM hashes and (group, count) runs, as in
    `StoreJob`; their keys are made by the index thread)."""
    keys: list[bytes]
    slots: Sequence[int]            # arrays "I" / "Q" from the slot pool, or lists
    generations: Sequence[int]
    origins: list                   # (token ids, parent hash) per block, for BlockStored events
    started: float
    packed: tuple | None = None
    ranks: int = 0
    failed: set[int] = field(default_factory=set)   # block indices, from any rank
    reset: bool = False             # reset_cache ran meanwhile: nothing is committed

    def all_keys(self) -> list[bytes]:
        return keys_with_packed(self.keys, self.packed)


class KVStoreScheduler:
    """Per-engine scheduler-side state of the connector (see module docstring)."""

    # The index it builds (`kvstore bench connector`'s baseline sets its synchronous one).
    index_class = ServingIndex

    def __init__(self, cfg: ConnectorConfig, layout, vllm_config, events_enabled: bool,
                 group_kinds: list[tuple[str, int]] | None = None, identity=None):
        self.cfg = cfg
        self.layout = layout
        self.block_size = layout.block_size
        # KV cache groups: (kind, tokens a hit needs before its end) each, "full" or "swa"
        # (`kv_group_kinds`). One group is the fast path; several (a hybrid model) store
        # and load every group as vLLM's hybrid coordinator defines a hit.
        self.group_kinds = group_kinds or _kinds_of_layout(layout)
        self.hybrid = len(self.group_kinds) > 1
        self._mamba_groups = {g for g, (kind, _) in enumerate(self.group_kinds)
                              if kind == "mamba"}
        self.has_mamba = bool(self._mamba_groups)
        self._stored_upto_g: dict[str, list[int]] = {}   # hybrid: per-group store cursor
        self.tp_size = layout.tp_size
        self.events_enabled = events_enabled
        sc = vllm_config.scheduler_config
        self._lazy_target = 2 * -(-sc.max_num_batched_tokens // self.block_size)
        # The pool holds four steps' worth of store slots (eager: the blocks a step's
        # tokens complete, one more per request, in every attention group, plus one
        # Mamba state per request), 16 at least, and an eighth of the store at most: its
        # slots hold no data (`slot_pool` sets it, up to half the store).
        attn_groups = sum(1 for kind, _ in self.group_kinds if kind != "mamba")
        per_step = min(cfg.max_store_blocks_per_step,
                       (self._lazy_target if cfg.store_policy == "lazy"
                        else self._lazy_target // 2 + sc.max_num_seqs) * attn_groups
                       + (sc.max_num_seqs if self.has_mamba else 0))
        self.index = open_serving_index(
            cfg, layout, identity, index_class=self.index_class,
            pool_target=lambda cap: cfg.slot_pool or min(max(16, 4 * per_step), max(1, cap // 8)),
            announce=self._announce_events if events_enabled else None,
            evicted_keys=events_enabled)
        self.store = self.index.store
        self._next_job = 1
        self._requests: dict[str, Any] = {}
        # req -> (first block, end block, pinned slots, hit) of its pinned lookup, pre-alloc:
        # the hit is the generations (one group) or the groups' parts (hybrid)
        self._candidates: dict[str, tuple[int, int, Any, Any]] = {}
        self._pending_loads: list[LoadJob] = []
        self._inflight_loads: dict[str, tuple[LoadJob, list[int]]] = {}   # job, pinned slots
        # Requests whose disk load failed (error, corruption, timeout): they recompute and
        # never read the disk again, or a stalled disk would make them load, time out and
        # look up the same blocks forever (a block-0 failure resets num_computed_tokens).
        self._load_failed: set[str] = set()
        # Failed blocks of in-flight loads. A rank reports its failed blocks when its
        # part ends, which can be steps before the last rank finishes the request.
        self._load_invalid: dict[str, set[int]] = {}
        self._inflight_stores: dict[int, InflightStore] = {}
        self._committing = 0                    # stores handed to the index thread
        self._counting = 0                      # dry-pool counts it has not reported
        self.stored_blocks_total = 0            # blocks committed since start (benchmarks)
        # planned, not yet committed or dropped: fingerprints in C (`plan_new` probes it
        # with the ones its walk made), a set's API for the other planners
        self._storing_keys = KeySet()
        self._stored_upto: dict[str, int] = {}
        self._to_touch: list[tuple[list, list]] = []     # (hashes, group runs) of loads
        self._events: list = []
        self._stats = KVStoreStats()
        self._reported_gauges = None    # (used, free, failed devices) of the last report
        self._kv_cache_manager = None
        self._block_pool = None
        self._warned: set[str] = set()
        # Admission on second sight (cfg.admission): a planned block is stored only when
        # its key was planned before within the window (`SeenFilter`, one probe per
        # planned block); None stores every block (the default).
        self._admission = SeenFilter(cfg.admission_window) \
            if cfg.admission == "second_sight" else None
        self._lazy_sighted: set[bytes] = set()   # lazy: first sightings still in the head

    # -- helpers ---------------------------------------------------------------------
    def _warn_once(self, what: str, exc: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("kvstore: %s failed (%s); serving continues without it", what, exc)

    def _job_id(self) -> int:
        j = self._next_job
        self._next_job += 1
        return j

    def _release_candidate(self, req_id: str) -> None:
        cand = self._candidates.pop(req_id, None)
        if cand is not None:
            self.index.unpin(cand[2])

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
        if cand is not None:
            if cand[0] == num_computed_tokens // self.block_size:
                # Re-entry while the request waits for GPU blocks: the pinned lookup
                # result is still valid (pins keep it from eviction; a block dropped
                # since then fails verification on load and is recomputed), so skip the
                # index walk.
                return (cand[1] - cand[0]) * self.block_size, True
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
        if self.hybrid:
            return self._hybrid_lookup(request, start, end)
        try:
            # In C over the in-memory table; pinned: eviction skips them. Packed: the
            # slots and generations as arrays, no key made (they are the hashes + group).
            _, slots, gens = self.index.lookup_hashes(request.block_hashes, start, end,
                                                      packed=True)
        except Exception as exc:    # never raises into the engine: a miss
            self._warn_once("lookup", exc)
            return 0, False
        n = len(slots)
        if not n:
            self._stats.add(miss_lookups=1)
            self.index.count_hits(0, 1)
            return 0, False
        self._candidates[req_id] = (start, start + n, slots, gens)
        self._stats.add(hit_blocks=n)
        # As DiskStore.get counts: hits in blocks, a miss per lookup that stopped short.
        self.index.count_hits(n, 0 if n == min(end, len(request.block_hashes)) - start else 1)
        return n * bs, True

    def _queue_load(self, job: LoadJob, pinned: list[int]) -> None:
        """Send `job` to the workers with this step's metadata; its slots stay pinned
        until vLLM reports the request's load finished."""
        self._pending_loads.append(job)
        self._inflight_loads[job.req_id] = (job, pinned)

    # -- hybrid models (several KV cache groups) ---------------------------------------
    def _window_blocks(self, retained: int) -> int:
        return -(-retained // self.block_size)

    def _group_lo(self, g: int, start: int, end: int) -> int:
        """First block group g needs for a hit ending at block `end`: the whole prefix
        after the GPU hit (full attention), only the window before the end (sliding
        window), or only the state at the end (Mamba)."""
        kind, retained = self.group_kinds[g]
        if kind == "full":
            return start
        if kind == "mamba":
            return end - 1
        return max(start, end - self._window_blocks(retained))

    def _hybrid_lookup(self, request, start: int, end: int) -> tuple[int, bool]:
        """vLLM's hybrid hit against the disk: the longest end such that every full-
        attention group has blocks start..end, every sliding-window group the blocks
        of its window before end (the GPU hit before `start` covers the rest: vLLM's
        local hit guarantees the window before it) and every Mamba group the state at
        end (key hashes[end-1] + group), found as a fixed point (each group can only
        move the end back). Then every needed block is pinned."""
        hashes = request.block_hashes
        end = min(end, len(hashes))
        index = self.index
        pinned: list[int] = []
        try:
            for g, (kind, _) in enumerate(self.group_kinds):
                if kind == "full" and end > start:
                    end = start + len(index.present(hashes, start, end, g).split(b"\0", 1)[0])
            changed = True
            while changed and end > start:      # each group can only move the end back
                changed = False
                for g, (kind, retained) in enumerate(self.group_kinds):
                    if kind == "full" or end <= start:
                        continue
                    flags = index.present(hashes, start, end, g)
                    if kind == "mamba":         # the last stored state at or before end
                        new_end = start + len(flags.rstrip(b"\0"))
                    else:
                        new_end = _window_end(flags, start, end, self._window_blocks(retained))
                    if new_end != end:
                        end, changed = new_end, True
            if end <= start:
                self._stats.add(miss_lookups=1)
                index.count_hits(0, 1)
                return 0, False
            parts, pinned = [], []
            for g in range(len(self.group_kinds)):
                lo = self._group_lo(g, start, end)
                _, slots, gens = index.lookup_hashes(hashes, lo, end, g, packed=True)
                pinned += slots
                if len(slots) != end - lo:      # evicted meanwhile: a miss this time
                    end = start
                    break
                parts.append((g, lo, slots, gens))
            if end <= start:
                index.unpin(pinned)
                self._stats.add(miss_lookups=1)
                index.count_hits(0, 1)
                return 0, False
        except Exception as exc:    # never raises into the engine: a miss
            if pinned:
                index.unpin(pinned)
            self._warn_once("lookup", exc)
            return 0, False
        self._candidates[request.request_id] = (start, end, pinned, parts)
        self._stats.add(hit_blocks=end - start)
        index.count_hits(end - start, 0)
        return (end - start) * self.block_size, True

    def _hybrid_alloc(self, request, blocks, num_external_tokens: int, cand) -> None:
        start, end, pinned, parts = cand
        req_id = request.request_id
        n = num_external_tokens // self.block_size
        if n <= 0:
            self.index.unpin(pinned)
            return
        ids = blocks.get_block_ids()
        block_ids, hashes, groups, slots, gens = [], [], [], [], []
        ok = start + n == end
        for g, lo, s_, ge in parts if ok else ():
            got = list(ids[g][lo:end]) if g < len(ids) else []
            if len(got) != end - lo or 0 in got:    # a null block where data is due
                ok = False
                break
            block_ids += got
            hashes += request.block_hashes[lo:end]
            groups.append((g, end - lo))
            slots += s_
            gens += ge
        if not ok:
            # vLLM holds the request for this load (WAITING_FOR_REMOTE_KVS): it fails at
            # once on the workers and the request recomputes.
            self.index.unpin(pinned)
            self._warn_once("load planning", KVStoreError(
                f"vLLM allocated {n} external blocks of a {end - start}-block hybrid hit"))
            self._queue_load(LoadJob(self._job_id(), req_id, [], [], [], [], [], unavailable=True), [])
            return
        ups = self._stored_upto_g.setdefault(req_id, [0] * len(self.group_kinds))
        for g in range(len(ups)):
            if ups[g] >= self._group_lo(g, start, end):
                ups[g] = end
        self._queue_load(LoadJob(self._job_id(), req_id, block_ids, hashes, groups, slots, gens),
                         slots)
        self._stats.add(hit_tokens=n * self.block_size)

    def _plan_eager_hybrid(self, scheduler_output, limit: int, plan: "_Plan") -> None:
        """_plan_eager for several groups: every group's completed blocks (a sliding-
        window group's table starts with null blocks once the window has moved on: they
        are skipped), keyed with the group id."""
        bs = self.block_size
        new_ids = _new_block_ids(scheduler_output)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(req_id)
            if req is None or n <= 0:
                continue
            done_after = req.num_computed_tokens + n
            nfull = min(done_after // bs, len(req.block_hashes))
            ups = self._stored_upto_g.setdefault(req_id, [0] * len(self.group_kinds))
            # a new request's block ids as vLLM made them for this step's output
            tables = new_ids.get(req_id) or self._kv_cache_manager.get_block_ids(req_id)
            for g, (kind, _) in enumerate(self.group_kinds):
                if kind == "mamba":     # stored from vLLM's boundary hand-offs only
                    continue
                first = ups[g]
                if req.num_computed_tokens < first * bs:
                    first = req.num_computed_tokens // bs
                ids = tables[g]
                stop = min(nfull, len(ids))
                while first < stop and ids[first] == 0:     # null: outside the window
                    first += 1
                room = limit - plan.count
                if stop <= first or room <= 0:
                    ups[g] = max(ups[g], first) if room > 0 else ups[g]
                    continue
                ups[g] = self._plan_range(plan, req_id, req, first, stop, ids, room, g)

    def _plan_boundary_states(self, scheduler_output, limit: int, plan: "_Plan") -> None:
        """Mamba stores: the exact state blocks vLLM hands off this step
        (`kv_connector_block_state.boundary_state_offloads`, {req: [(group, block id,
        boundary tokens)]}; vLLM clears it after build_connector_meta). This step's
        forward writes them (wait_for_save copies them out after it). A Mamba table
        cannot be read positionally (align mode nulls and relocates interior states),
        so nothing else is stored for a Mamba group. Dropped: requests finished,
        preempted or unknown this step (their blocks may already be someone else's),
        null or unhashed blocks, boundaries off a block edge, blocks whose hash is not
        the request's hash at that boundary, and keys stored or being stored.
        Never filtered by second-sight admission (`admission`): vLLM hands a state off
        only from the forward that computes it, never on a GPU hit, so a state left out
        at its first sighting would be stored only if the prefix were computed again,
        and a prefix seen twice would have its attention blocks on disk but no state
        to end a hit at. A state is one block per hand-off."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(state, "boundary_state_offloads", None) if state is not None else None
        if not offloads:
            return
        gone = set(getattr(scheduler_output, "preempted_req_ids", None) or ()) | \
            set(getattr(scheduler_output, "finished_req_ids", None) or ())
        pool = self._block_pool
        bs = self.block_size
        storing, contains = self._storing_keys, self.index.contains
        keys, bids, origins = plan.keys, plan.bids, plan.origins
        for req_id, entries in offloads.items():
            req = self._requests.get(req_id)
            if req is None or req_id in gone:
                continue
            for g, block_id, boundary in entries:
                if len(keys) >= limit:
                    return
                if not (0 <= g < len(self.group_kinds)) or self.group_kinds[g][0] != "mamba" \
                        or block_id <= 0 or boundary <= 0 or boundary % bs:
                    continue
                i = boundary // bs - 1
                if i >= len(req.block_hashes):
                    continue
                key = block_key(req.block_hashes[i], g)
                if pool is not None:
                    blk = pool.blocks[block_id]
                    if blk.is_null or blk.block_hash is None or bytes(blk.block_hash) != key:
                        continue
                if key in storing or contains(key):
                    continue
                storing.add(key)
                keys.append(key)
                bids.append(block_id)
                if self.events_enabled:
                    origins.append(self._origin(req, i))

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        cand = self._candidates.pop(req_id, None)
        if cand is None:
            return
        if self.hybrid:
            return self._hybrid_alloc(request, blocks, num_external_tokens, cand)
        start, _, slots, gens = cand
        n = num_external_tokens // self.block_size
        if n <= 0:
            self.index.unpin(slots)
            return
        if n < len(slots):
            self.index.unpin(slots[n:])
            slots, gens = slots[:n], gens[:n]
        block_ids = [b.block_id for b in blocks.blocks[0][start:start + n]]
        if len(block_ids) != n:
            self.index.unpin(slots)
            self._warn_once("load planning", KVStoreError(f"expected {n} blocks, got {len(block_ids)}"))
            return
        # The loaded blocks are on disk already: eager stores skip them, but not the GPU
        # prefix hit before them (blocks 0..start), which may have left the disk.
        if self._stored_upto.get(req_id, 0) >= start:
            self._stored_upto[req_id] = start + n
        hashes = request.block_hashes[start:start + n]
        self._queue_load(LoadJob(self._job_id(), req_id, block_ids, hashes, [(0, n)], slots, gens),
                         slots)
        self._stats.add(hit_tokens=n * self.block_size)

    # -- stores ----------------------------------------------------------------------
    def _plan_eager(self, scheduler_output, limit: int, plan: "_Plan") -> None:
        """Add to `plan` the blocks this step's forward completes that are neither stored
        nor being stored, `limit` at most; their keys join `_storing_keys`. The per-block
        walk is C (`ServingIndex.plan_new`), and makes no Python object per block: the
        plan carries vLLM's hashes (`_plan_range`)."""
        if self._kv_cache_manager is None:
            return
        bs = self.block_size
        new_ids = _new_block_ids(scheduler_output)
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
            room = limit - plan.count
            if room <= 0:
                break
            # A new request's block ids as vLLM made them for this step's output (ints it
            # just made: warm); else vLLM's own block list (KVCacheBlock objects): the C
            # walk reads the block id of the planned blocks only.
            ids = new_ids.get(req_id)
            if ids is not None:
                blocks = ids[0]
            else:
                blocks = self._kv_cache_manager.get_blocks(req_id).blocks[0]
            if not isinstance(blocks, list):
                blocks = list(blocks)
            self._stored_upto[req_id] = self._plan_range(plan, req_id, req, first, nfull,
                                                         blocks, room, 0)

    def _plan_range(self, plan: "_Plan", req_id: str, req, first: int, stop: int, blocks: list,
                    room: int, g: int) -> int:
        """One walk of `plan_new` over blocks first..stop of req (group g), `room` at most:
        packed into `plan` (vLLM's hashes and a group run: no key made), or as keys when
        second-sight admission filters them. Returns the request's store cursor: a walk
        the limit cut short resumes after its last block in a later step."""
        adm = self._admission
        # packed unless admission filters keys, or the index reserves slots by key
        # (`packed_stores`: the bench's synchronous baseline)
        packed = adm is None and self.index.packed_stores
        stop = min(stop, len(blocks))
        # The walk plans what the slot pool can take, no more: when the pool is short
        # (the index thread is behind), the rest of the range is dropped, as `take`
        # would drop it, and counted by the index thread (`count_dropped`: the step
        # thread makes no key, claims nothing, plans no block to cut; the count comes
        # back as an event). Not with admission (it must see every block). (Two
        # requests of one step sharing dropped blocks each count them: nothing is
        # claimed for a block not planned.)
        pool_room = plan.pool - plan.count if adm is None else room
        walk = min(room, pool_room)
        if walk <= 0:       # the pool is dry
            self._count_dropped(req, first, stop, g)
            return stop
        k, b, idx = self.index.plan_new(req.block_hashes, first, stop, blocks,
                                        self._storing_keys, walk, g, packed)
        if len(idx) < walk:
            cursor = stop
        elif pool_room < room:      # the pool ran short: the rest is dropped, not resumed
            cursor = stop
            self._count_dropped(req, idx[-1] + 1, stop, g)
        else:                       # the step's limit: resumed after its last block
            cursor = idx[-1] + 1
        if adm is not None:     # first sightings are left out
            k, b, idx = adm.admit(k, b, idx, self._storing_keys)
        if not idx:
            return cursor
        plan.spans.append((req_id, idx))
        if packed:
            plan.add_packed(k, b, g)
        else:
            plan.keys += k
            plan.bids += b
        if self.events_enabled:
            plan.origins += [self._origin(req, i) for i in idx]
        return cursor

    def _count_dropped(self, req, first: int, stop: int, g: int) -> None:
        """Blocks first..stop of req are dropped (the pool is short): the index thread
        counts the new ones into `store_dropped_blocks` (a "counted" event)."""
        if first >= min(stop, len(req.block_hashes)):
            return
        self._counting += 1
        try:
            self.index.count_dropped(req.block_hashes, first, stop, self._storing_keys, g)
        except BaseException:
            self._counting -= 1
            raise

    def _origin(self, req, i: int) -> tuple:
        """What block i of req's BlockStored event carries besides its hash, as vLLM's
        own GPU events do: (token ids, parent hash, LoRA id, LoRA name, extra keys, session
        id). Taken when the store is planned: the request has usually finished (and is
        gone) by the time every rank reported the write durable."""
        bs = self.block_size
        parent = maybe_convert_block_hash(req.block_hashes[i - 1]) if i > 0 else None
        lora = req.lora_request
        extra, _ = generate_block_hash_extra_keys(req, i * bs, (i + 1) * bs, 0)
        return (list(req.all_token_ids[i * bs:(i + 1) * bs]), parent,
                lora.adapter_id if lora else None, lora.name if lora else None,
                to_event_extra_keys([extra]), getattr(req, "session_id", None))

    def _plan_lazy(self, limit: int, keys: list, bids: list) -> None:
        """Append the cached GPU blocks nearest to eviction (head of vLLM's free queue)
        that are not stored or being stored; their keys join `_storing_keys`."""
        pool = self._block_pool
        if pool is None:
            return
        storing, contains = self._storing_keys, self.index.contains
        mamba = self._mamba_groups
        # Second sight: a block waiting in the head of the free queue is seen at every
        # step until it leaves it; only a sighting after it left (reused by a hit and
        # freed again, or evicted and computed again) is a second one. `sighted` holds
        # the first sightings still in the head, which are skipped without a probe.
        adm = self._admission
        sighted, now = self._lazy_sighted, set()
        cut = False
        for seen, node in enumerate(pool.free_block_queue.iter_blocks_after(None)):
            if seen >= self._lazy_target or len(keys) >= limit:
                cut = len(keys) >= limit
                break
            if node.block_hash is None or getattr(node, "is_null", False):
                continue
            key = bytes(node.block_hash)
            if key in storing or contains(key):
                continue
            if mamba and int.from_bytes(key[-4:], "big") in mamba:
                continue        # Mamba states are stored from vLLM's hand-offs only
            if adm is not None:
                if key in sighted:
                    now.add(key)
                    continue
                if not adm.sight(key):      # a first sighting: remembered, not stored
                    now.add(key)
                    continue
            storing.add(key)
            keys.append(key)
            bids.append(node.block_id)
        if adm is not None:
            # A walk the limit cut short did not see the rest of the head: keep its
            # first sightings too (bounded: reset once it outgrows the head 4 times).
            if cut and len(sighted) + len(now) <= 4 * self._lazy_target:
                now |= sighted
            self._lazy_sighted = now

    def _plan_stores(self, scheduler_output) -> list[StoreJob]:
        limit = self.cfg.max_store_blocks_per_step
        plan = _Plan()
        try:
            plan.pool = self.index.available()
            if self.has_mamba:      # every policy: the hand-offs are this step's only
                self._plan_boundary_states(scheduler_output, limit, plan)
            if self.cfg.store_policy == "eager" and self.hybrid:
                if self._kv_cache_manager is not None:
                    self._plan_eager_hybrid(scheduler_output, limit, plan)
            elif self.cfg.store_policy == "eager":
                self._plan_eager(scheduler_output, limit, plan)
            else:
                self._plan_lazy(limit, plan.keys, plan.bids)
            if self._admission is not None:
                rejected = self._admission.take_rejected()
                if rejected:
                    self._stats.add(admission_rejected_blocks=rejected)
            total = plan.count
            if not total:       # (a dry pool's refill: the count queued asks for it)
                return []
            if not self.events_enabled:
                plan.origins = [None] * total
            # Slots from the index thread's pool (already reserved, victims already
            # evicted): a prefix of the blocks when the pool runs short.
            slots, gens = self.index.take(plan.keys, plan.packed)
        except Exception as exc:    # never raises into the engine: nothing is stored
            self._warn_once("store planning", exc)
            self._stats.add(store_dropped_blocks=plan.count)
            self._storing_keys.difference_update(plan.cut(0))
            if not self.hybrid:
                for req_id, idx in plan.spans:    # planned again next step
                    self._stored_upto[req_id] = min(self._stored_upto.get(req_id, 0), idx[0])
            return []
        n = len(slots)
        if n < total:
            self._stats.add(store_dropped_blocks=total - n)
            # The pool ran short (the index thread is behind): the rest is dropped, not
            # retried at later steps (a backlog would grow every step's walk).
            self._storing_keys.difference_update(plan.cut(n))
        if not n:
            return []
        job = StoreJob(self._job_id(), plan.bids + plan.pbids if plan.bids else plan.pbids,
                       plan.keys, slots, gens, plan.hashes, plan.groups)
        self._inflight_stores[job.job_id] = InflightStore(
            keys=plan.keys, slots=slots, generations=gens, origins=plan.origins,
            started=time.monotonic(), packed=job.packed)
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
            for job_id, report in wm.store_reports.items():
                st = self._inflight_stores.get(job_id)
                if st is None:
                    continue
                st.ranks += report.ranks
                st.failed.update(report.failed)
                if st.ranks >= self.tp_size:
                    self._finish_store(job_id, st)
            if wm.bad_keys:
                self.index.drop(wm.bad_keys)
            for dev, why in sorted(wm.failed_devices.items()):
                self._device_failed(dev, why)
        failed_reqs = set(getattr(output, "failed_recving", ()) or ())
        done = set(output.finished_recving or ()) | failed_reqs
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
            job, slots = item
            self.index.unpin(slots)
            # Counted here, once per block: the workers' counts are per rank, and the
            # union of failed blocks over the ranks is only known after aggregation.
            failed = len(self._load_invalid.pop(req_id, ()))
            # A request aborted during its load is gone (request_finished ran): no
            # reason to remember that it must not read the disk again.
            live = req_id in self._requests
            if req_id in failed_reqs:   # a hybrid model's load fails as a whole
                failed = len(job.block_ids)
                if job.unavailable and live:
                    self._load_failed.add(req_id)
            self._stats.add(loaded_blocks=len(job.block_ids) - failed, load_failures=failed)
            if failed and live:
                self._load_failed.add(req_id)
            if job.hashes:
                self._to_touch.append((job.hashes, job.groups))
        if self._to_touch:      # keys made on the index thread
            self.index.touch_blocks(self._to_touch)
            self._to_touch = []
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
            self._warn_once("fencing a failed device", exc)

    def _finish_store(self, job_id: int, st: InflightStore) -> None:
        """Every rank reported: the good blocks are durable. Their commit (and its fsync)
        is the index thread's; the keys stay in `_storing_keys` until it is applied."""
        del self._inflight_stores[job_id]
        self._committing += 1
        # The keys of st.packed are made by the index thread. After a reset every block
        # is aborted (nothing is committed).
        failed = set(range(len(st.slots))) if st.reset else st.failed
        # The index thread releases the job's keys from `_storing_keys` itself, once its
        # good blocks are in the table: no per-block work here when the commit comes back.
        self.index.commit_blocks(st.keys, st.slots, st.generations, failed, tag=st,
                                 packed=st.packed, keys_back=self.events_enabled,
                                 release=self._storing_keys)
        # The queued commit holds vLLM's hashes now, mostly their last reference (the
        # requests have finished): they are freed on the index thread, not here.
        st.packed = None

    def _index_events(self) -> None:
        """Outcomes of the index thread: commits applied, entries evicted or dropped."""
        for ev in self.index.poll():
            if isinstance(ev, Committed):
                st = ev.tag
                self._committing -= 1
                # every key of the job left `_storing_keys` on the index thread (`release`);
                # as fingerprints if it could not release them, as keys when it could not
                # make fingerprints; `keys` when KV events need them
                keys = ev.keys
                if ev.fps:
                    self._storing_keys.discard_fingerprints(ev.fps)
                elif not ev.released:   # a commit the index thread could not key
                    keys = keys or _keys_or_made(st, ev.packed)
                    self._storing_keys.difference_update(keys)
                if ev.error is not None:
                    # The index cannot be written (e.g. the disk is full): the store is
                    # dropped; its reservations are given back when the index can be.
                    self._warn_once("commit", ev.error)
                self.stored_blocks_total += ev.count or len(ev.items)
                if not st.reset:
                    self._stats.add(stored_blocks=ev.count or len(ev.items),
                                    store_dropped_blocks=ev.failed)
                if ev.items and self.events_enabled:
                    self._emit_stored(ev.items, st, keys)
            elif isinstance(ev, Evicted):
                self._stats.add(evicted_blocks=ev.count)
                self._emit_removed(ev.keys)
            elif isinstance(ev, Counted):     # new blocks a dry pool dropped
                self._counting -= 1
                if ev.count:
                    self._stats.add(store_dropped_blocks=ev.count)
            elif isinstance(ev, Dropped):
                self._emit_removed(ev.keys)
            elif isinstance(ev, AnnounceBatch):     # entries found on disk at start
                self._events.extend(ev.events)
                self.index.announced()
            elif isinstance(ev, Failed):
                self._warn_once(ev.what, ev.error)

    # -- events ----------------------------------------------------------------------
    def _emit_removed(self, keys: list[bytes]) -> None:
        if self.events_enabled and keys:
            self._events.append(BlockRemoved(
                block_hashes=[maybe_convert_block_hash(k[:-4]) for k in keys], medium=MEDIUM))

    def _emit_stored(self, good, st: InflightStore, keys: list[bytes]) -> None:
        origin_of = dict(zip(keys, st.origins))
        bs = self.block_size
        for key, _slot, _gen in good:
            # Lazy stores come from vLLM's free queue, which keeps no tokens: their
            # events carry the hash only.
            tokens, parent, lora_id, lora_name, extra, session = \
                origin_of.get(key) or ([], None, None, None, None, None)
            self._events.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(key[:-4])], parent_block_hash=parent,
                token_ids=tokens, block_size=bs, lora_id=lora_id, medium=MEDIUM,
                lora_name=lora_name, extra_keys=extra, session_id=session,
                group_idx=int.from_bytes(key[-4:], "big")))

    def _announce_events(self, keys: list[bytes]) -> list:
        """BlockStored events for entries found on disk at start (index thread): the
        hashes only (the store keeps no tokens, parents or LoRA names), one event per
        KV cache group in the batch."""
        by_group: dict[int, list] = {}
        for k in keys:
            by_group.setdefault(int.from_bytes(k[-4:], "big"), []).append(
                maybe_convert_block_hash(k[:-4]))
        return [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                            block_size=self.block_size, lora_id=None, medium=MEDIUM,
                            lora_name=None, group_idx=g)
                for g, hashes in by_group.items()]

    def take_events(self):
        ev, self._events = self._events, []
        return ev

    # -- lifecycle -------------------------------------------------------------------
    def request_finished(self, request) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self._release_candidate(req_id)
        self._requests.pop(req_id, None)
        self._stored_upto.pop(req_id, None)
        self._stored_upto_g.pop(req_id, None)
        self._load_failed.discard(req_id)
        # Stores copy their blocks out within the step that planned them, and loads keep
        # their blocks through vLLM's own WAITING_FOR_REMOTE_KVS hold, so blocks are
        # never held past the request's end.
        return False, None

    def has_pending_stores(self) -> bool:
        # A store is pending until its commit's outcome is taken in a step (its stats and
        # events are published with that step's output).
        if not self._requests and self._inflight_stores:
            # Nothing to schedule but stores the workers are still writing: vLLM steps
            # empty steps back to back meanwhile (1 ms apart), and each one keeps its
            # worker's message loop busy-polling; with one core per engine that starved
            # the worker's I/O thread until the stores never finished (seen in the e2e
            # tests with VLLM_CPU_OMP_THREADS_BIND one core per server, 4 of 4 runs; with
            # this pause 0 of 3). Idle engines only: a request arriving waits 5 ms at most.
            time.sleep(0.005)
        elif (self._committing or self._counting) and not self._inflight_stores \
                and not self._requests:
            # Nothing but commits (or dry-pool counts) left: the engine would spin on
            # empty steps, taking the GIL from the index thread it waits for; sleep until
            # it reports (2 ms at most).
            self.index.wait_events(0.002)
        return bool(self._inflight_stores) or self._committing > 0 or self._counting > 0

    def reset_cache(self) -> bool:
        """Drop every committed entry; in-flight stores abort.

        Entries that in-flight loads are reading are dropped too (a reset that reports
        success must leave nothing to hit): their slots stay pinned, and the index never
        hands out a pinned slot, so those reads still see the bytes they verify.
        """
        for st in self._inflight_stores.values():
            st.reset = True
        try:
            self.index.drop_all()   # misses from now on; LMDB follows on the index thread
        except KVStoreError as exc:
            self._warn_once("reset", exc)
            return False
        return True

    def get_stats(self) -> KVStoreStats | None:
        """This step's counters and the gauges; None when there is nothing new (counters
        all zero, gauges as last reported): vLLM calls it every step, on its scheduler
        thread, and carries what it returns to the Prometheus logger."""
        self._index_events()
        data = self._stats.data
        g = self.index.gauges()
        data["used_slots"] = g["used_slots"]
        data["free_slots"] = g["free_slots"]
        fences = getattr(self.index, "fences", None)
        if fences is not None and self.index.ndev > 1:
            data["failed_devices"] = len(fences)
            for d in fences:
                data[DEVICE_FAILED + self.store.data_dirs[d]] = 1
        gauges = (g["used_slots"], g["free_slots"], data.get("failed_devices"))
        if gauges == self._reported_gauges and self._stats.is_empty():
            return None
        self._reported_gauges = gauges
        out, self._stats = self._stats, KVStoreStats()
        return out

    @property
    def admission_rejected(self) -> int:
        """Blocks the second-sight admission filter kept out (0 with admission "always")."""
        return self._admission.rejected if self._admission else 0

    def shutdown(self) -> None:
        index_stopped = True
        try:
            try:
                abandoned = [x for st in self._inflight_stores.values()
                             for x in zip(st.all_keys(), st.slots, st.generations)]
            except Exception:   # (no memory to make keys) by slot, then
                abandoned = [s_ for st in self._inflight_stores.values() for s_ in st.slots]
            if abandoned and not self.store.closed:
                self.index.abort(abandoned)
            # applies queued commits, gives the pool back; False: the index thread is
            # still in an LMDB write, and LMDB stays open under it (it logged why)
            index_stopped = self.index.close() is not False
        except KVStoreError:
            pass
        finally:
            self._inflight_stores.clear()
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


def _window_end(flags: bytes, start: int, end: int, window: int) -> int:
    """The largest e in (start, end] such that the blocks max(start, e - window)..e are
    all present (flags: one per block start..end-1), or start when there is none."""
    run = 0
    runs = [0]
    for f in flags:
        run = run + 1 if f else 0
        runs.append(run)
    for e in range(end, start, -1):
        if runs[e - start] >= min(window, e - start):
            return e
    return start


class _Plan:
    """A step's store plan while it is built: blocks whose keys were made (`keys`,
    `bids`: lazy stores, Mamba states, second-sight admission), then packed blocks
    (vLLM hashes, (group, count) runs, `pbids`: eager stores, no key made); `origins`
    of all of them in that order; `spans` (request id, block indices) per eager walk."""
    __slots__ = ("keys", "bids", "hashes", "groups", "pbids", "origins", "spans", "pool")

    def __init__(self):
        self.pool = 1 << 62         # slots the index's pool holds (`ServingIndex.available`)
        self.keys: list[bytes] = []
        self.bids: list[int] = []
        self.hashes: list[bytes] = []
        self.groups: list[tuple[int, int]] = []
        self.pbids: list[int] = []
        self.origins: list = []
        self.spans: list = []

    @property
    def count(self) -> int:
        return len(self.keys) + len(self.hashes)

    @property
    def packed(self) -> tuple | None:
        return (self.hashes, self.groups) if self.hashes else None

    def add_packed(self, hashes: list, bids: list, g: int) -> None:
        if self.hashes:
            self.hashes += hashes
            self.pbids += bids
        else:       # a step's first walk (mostly its only one): its lists, not a copy
            self.hashes, self.pbids = hashes, bids
        if self.groups and self.groups[-1][0] == g:
            self.groups[-1] = (g, self.groups[-1][1] + len(hashes))
        else:
            self.groups.append((g, len(hashes)))

    def cut(self, n: int) -> list[bytes]:
        """Keep the first n blocks; returns the keys of the others (made here: a pool
        that ran short or a failed plan, not the common path)."""
        nk = len(self.keys)
        if n <= nk:
            dropped = keys_with_packed(self.keys[n:], self.packed)
            del self.keys[n:], self.bids[n:]
            self.hashes, self.groups, self.pbids = [], [], []
        else:
            m = n - nk
            head, tail = _split_runs(self.groups, m)
            dropped = make_keys(self.hashes[m:], tail)
            del self.hashes[m:], self.pbids[m:]
            self.groups = head
        del self.origins[n:]
        return dropped


def _keys_or_made(st: InflightStore, packed: tuple | None = None) -> list[bytes]:
    """Every key of st, or the ones made at planning if the rest cannot be made. Once its
    commit is queued, st's packed blocks went with it: `packed` is what the index thread
    handed back with a commit it could not key."""
    try:
        return keys_with_packed(st.keys, packed) if packed is not None else st.all_keys()
    except Exception:   # (no memory) what was made at planning, then
        return st.keys


def _split_runs(runs: list[tuple[int, int]], m: int) -> tuple[list, list]:
    """(group, count) runs covering blocks 0..m, and those covering the rest."""
    head, tail = [], []
    for g, c in runs:
        if m >= c:
            head.append((g, c))
        elif m > 0:
            head.append((g, m))
            tail.append((g, c - m))
        else:
            tail.append((g, c))
        m = max(0, m - c)
    return head, tail


def _new_block_ids(scheduler_output) -> dict:
    """{request id: block ids per KV cache group} of the requests new in this step's
    output: vLLM made these int lists for its workers (`NewRequestData.block_ids`, the
    whole block table), so the store walk reads them instead of vLLM's cold
    `KVCacheBlock` objects or a second `get_block_ids`."""
    return {r.req_id: r.block_ids for r in getattr(scheduler_output, "scheduled_new_reqs", ()) or ()
            if getattr(r, "block_ids", None)}
