"""Lookups and loads of the connector's scheduler side: vLLM's
`get_num_new_matched_tokens` against the disk (one KV cache group, or a hybrid model's
groups as vLLM's hybrid coordinator defines a hit), the pinned hit kept across a
request's re-entries, the load job once vLLM allocated its blocks, and the load's end
(unpins, LRU touches, failed blocks)."""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.errors import KVStoreError
from kvstore.format.layout import block_key
from kvstore.vllm.metadata import LoadJob
from kvstore.vllm.sched_context import SchedulerContext


@dataclass(slots=True)
class Candidate:
    """One KV cache group's pinned hit: blocks start..end of the request, their slots
    (pinned: eviction skips them) and generations as the packed lookup returns them."""
    start: int
    end: int
    slots: Sequence[int]            # array('I')
    generations: Sequence[int]      # array('Q')

    @property
    def pinned(self) -> Sequence[int]:
        return self.slots


@dataclass(slots=True)
class GroupHit:
    """A hybrid hit's part in group `group`: its blocks lo..end of the hit."""
    group: int
    lo: int
    slots: Sequence[int]            # array('I'), pinned
    generations: Sequence[int]      # array('Q')


@dataclass(slots=True)
class HybridCandidate:
    """A hybrid model's pinned hit: blocks start..end, the part each group needs, and
    every slot pinned for them."""
    start: int
    end: int
    pinned: list[int]
    parts: list[GroupHit]


@dataclass(slots=True)
class PoolWait:
    """A lookup the fleet agent is answering from the KV pool: vLLM asks again each step
    (the lookup answered None: "not known yet") until `deadline`."""
    token: int
    deadline: float
    keys: list[bytes]


@dataclass(slots=True)
class InflightLoad:
    """A load the workers run: its job (`job.slots` are pinned until it ends) and the
    blocks of it any rank reported failed so far (a rank reports when its part ends,
    which can be steps before the last rank finishes the request)."""
    job: LoadJob
    invalid: set[int] = field(default_factory=set)


class Lookups:
    """Lookups, the pinned hits between lookup and allocation (`candidates`), the load
    jobs of the next step (`pending`) and those the workers run (`inflight`)."""

    def __init__(self, ctx: SchedulerContext):
        self.ctx = ctx
        self.index = ctx.index
        self.block_size = ctx.block_size
        self.stats = ctx.stats
        self.requests = ctx.requests
        self.candidates: dict[str, Candidate | HybridCandidate] = {}
        self.pending: list[LoadJob] = []
        self.inflight: dict[str, InflightLoad] = {}
        # Requests whose disk load failed (error, corruption, timeout): they recompute and
        # never read the disk again, or a stalled disk would make them load, time out and
        # look up the same blocks forever (a block-0 failure resets num_computed_tokens).
        self.failed: set[str] = set()
        # The store's remote level (`ctx.remote`): a request's local miss is asked of the
        # KV pool once; the lookup answers None (vLLM asks again next step) until the
        # fleet agent filled the local store or `fetch_timeout_s` passed.
        self.remote = ctx.remote
        self.pool_wait: dict[str, PoolWait] = {}
        self.pool_asked: set[str] = set()
        self._pool_tokens = itertools.count(1)

    def release(self, req_id: str) -> None:
        """Unpin the request's hit, if a lookup pinned one that no load took."""
        cand = self.candidates.pop(req_id, None)
        if cand is not None:
            self.index.unpin(cand.pinned)

    def forget(self, req_id: str) -> None:
        """The request finished (or was aborted)."""
        self.release(req_id)
        self.failed.discard(req_id)
        if self.remote is not None:
            self.pool_asked.discard(req_id)
            w = self.pool_wait.pop(req_id, None)
            if w is not None:
                self.remote.abandon(w.token)

    def take_pending(self) -> list[LoadJob]:
        """The load jobs for this step's metadata."""
        out, self.pending = self.pending, []
        return out

    # -- lookups -----------------------------------------------------------------------
    def match(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """`get_num_new_matched_tokens`: tokens on disk after the GPU hit, pinned."""
        req_id = request.request_id
        self.requests[req_id] = request
        cand = self.candidates.get(req_id)
        bs = self.block_size
        if cand is not None:
            if cand.start == num_computed_tokens // bs:
                # Re-entry while the request waits for GPU blocks: the pinned lookup
                # result is still valid (pins keep it from eviction; a block dropped
                # since then fails verification on load and is recomputed), so skip the
                # index walk.
                return (cand.end - cand.start) * bs, True
            self.release(req_id)
        if getattr(request.sampling_params, "skip_reading_prefix_cache", False) or \
                req_id in self.inflight or req_id in self.failed:
            return 0, False
        start = num_computed_tokens // bs
        # Whole blocks only, and never the last prompt token: vLLM must compute at least
        # one token to sample from.
        end = (request.num_tokens - 1) // bs
        if end <= start:
            return 0, False
        if self.ctx.hybrid:
            return self._match_hybrid(request, start, end)
        if req_id in self.pool_wait and self._pool_pending(req_id):
            return None, False
        try:
            # In C over the in-memory table; pinned: eviction skips them. Packed: the
            # slots and generations as arrays, no key made (they are the hashes + group).
            _, slots, gens = self.index.lookup_hashes(request.block_hashes, start, end,
                                                      packed=True)
        except Exception as exc:    # never raises into the engine: a miss
            self.ctx.warn_once("lookup", exc)
            return 0, False
        n = len(slots)
        want = min(end, len(request.block_hashes)) - start
        if n < want and self.remote is not None and req_id not in self.pool_asked \
                and self._ask_pool(req_id, request.block_hashes, start + n, start + want):
            if n:
                self.index.unpin(slots)
            return None, False
        if not n:
            self.stats.add(miss_lookups=1)
            self.index.count_hits(0, 1)
            return 0, False
        self.candidates[req_id] = Candidate(start, start + n, slots, gens)
        self.stats.add(hit_blocks=n)
        # As DiskStore.get counts: hits in blocks, a miss per lookup that stopped short.
        self.index.count_hits(n, 0 if n == min(end, len(request.block_hashes)) - start else 1)
        return n * bs, True

    # -- the KV pool (the store's remote level) ------------------------------------------
    # Blocks asked of the pool at most per lookup (the agent fills the local store with
    # the prefix of them the pool has).
    POOL_ASK_BLOCKS = 4096

    def _ask_pool(self, req_id: str, hashes, lo: int, hi: int) -> bool:
        """Ask the fleet agent for blocks lo..hi of the request (once per request): True
        when it took the question, and the lookup answers None until it is answered."""
        self.pool_asked.add(req_id)
        keys = [block_key(h) for h in hashes[lo:min(hi, lo + self.POOL_ASK_BLOCKS)]]
        token = next(self._pool_tokens)
        if not self.remote.ask(token, keys):
            return False
        self.stats.add(pool_lookups=1)
        self.pool_wait[req_id] = PoolWait(token, time.monotonic() + self.ctx.cfg.remote.fetch_timeout_s,
                                          keys)
        return True

    def _pool_pending(self, req_id: str) -> bool:
        """Whether the request still waits for the pool; once not, its lookup reads the
        local store, which holds what the agent filled."""
        w = self.pool_wait[req_id]
        ans = self.remote.answer(w.token)
        if ans is None and time.monotonic() < w.deadline and not self.remote.down:
            return True
        del self.pool_wait[req_id]
        if ans is None:
            self.remote.abandon(w.token)
            self.stats.add(pool_timeouts=1)
        elif ans.blocks:
            self.stats.add(pool_filled_blocks=ans.blocks)
            try:    # into the table now: the lookup that follows finds them without LMDB
                self.index.adopt(w.keys[:ans.blocks], ans.slots, ans.generations)
            except Exception as exc:    # never raises into the engine: LMDB finds them
                self.ctx.warn_once("adopting the pool's blocks", exc)
        return False

    def _match_hybrid(self, request, start: int, end: int) -> tuple[int, bool]:
        """vLLM's hybrid hit against the disk: the longest end such that every full-
        attention group has blocks start..end, every sliding-window group the blocks
        of its window before end (the GPU hit before `start` covers the rest: vLLM's
        local hit guarantees the window before it) and every Mamba group the state at
        end (key hashes[end-1] + group), found as a fixed point (each group can only
        move the end back). Then every needed block is pinned."""
        ctx = self.ctx
        kinds = ctx.group_kinds
        hashes = request.block_hashes
        end = min(end, len(hashes))
        index = self.index
        pinned: list[int] = []
        try:
            for g, (kind, _) in enumerate(kinds):
                if kind == "full" and end > start:
                    end = start + len(index.present(hashes, start, end, g).split(b"\0", 1)[0])
            changed = True
            while changed and end > start:      # each group can only move the end back
                changed = False
                for g, (kind, retained) in enumerate(kinds):
                    if kind == "full" or end <= start:
                        continue
                    flags = index.present(hashes, start, end, g)
                    if kind == "mamba":         # the last stored state at or before end
                        new_end = start + len(flags.rstrip(b"\0"))
                    else:
                        new_end = window_end(flags, start, end, ctx.window_blocks(retained))
                    if new_end != end:
                        end, changed = new_end, True
            if end <= start:
                self.stats.add(miss_lookups=1)
                index.count_hits(0, 1)
                return 0, False
            parts: list[GroupHit] = []
            for g in range(len(kinds)):
                lo = ctx.group_lo(g, start, end)
                _, slots, gens = index.lookup_hashes(hashes, lo, end, g, packed=True)
                pinned += slots
                if len(slots) != end - lo:      # evicted meanwhile: a miss this time
                    end = start
                    break
                parts.append(GroupHit(g, lo, slots, gens))
            if end <= start:
                index.unpin(pinned)
                self.stats.add(miss_lookups=1)
                index.count_hits(0, 1)
                return 0, False
        except Exception as exc:    # never raises into the engine: a miss
            if pinned:
                index.unpin(pinned)
            ctx.warn_once("lookup", exc)
            return 0, False
        self.candidates[request.request_id] = HybridCandidate(start, end, pinned, parts)
        self.stats.add(hit_blocks=end - start)
        index.count_hits(end - start, 0)
        return (end - start) * self.block_size, True

    # -- loads -------------------------------------------------------------------------
    def allocated(self, request, blocks, num_external_tokens: int) -> tuple[int, int] | None:
        """`update_state_after_alloc`: the load of the hit vLLM allocated blocks for, sent
        with the next step's metadata. Returns the blocks it loads (start, end), which are
        on disk already (no store needed), or None when nothing loads."""
        cand = self.candidates.pop(request.request_id, None)
        if cand is None:
            return None
        if isinstance(cand, HybridCandidate):
            return self._allocated_hybrid(request, blocks, num_external_tokens, cand)
        start, slots, gens = cand.start, cand.slots, cand.generations
        n = num_external_tokens // self.block_size
        if n <= 0:
            self.index.unpin(slots)
            return None
        if n < len(slots):
            self.index.unpin(slots[n:])
            slots, gens = slots[:n], gens[:n]
        block_ids = [b.block_id for b in blocks.blocks[0][start:start + n]]
        if len(block_ids) != n:
            self.index.unpin(slots)
            self.ctx.warn_once("load planning",
                               KVStoreError(f"expected {n} blocks, got {len(block_ids)}"))
            return None
        hashes = request.block_hashes[start:start + n]
        self._queue(LoadJob(self.ctx.job_id(), request.request_id, block_ids, hashes, [(0, n)],
                            slots, gens))
        self.stats.add(hit_tokens=n * self.block_size)
        return start, start + n

    def _allocated_hybrid(self, request, blocks, num_external_tokens: int,
                          cand: HybridCandidate) -> tuple[int, int] | None:
        start, end = cand.start, cand.end
        req_id = request.request_id
        n = num_external_tokens // self.block_size
        if n <= 0:
            self.index.unpin(cand.pinned)
            return None
        ids = blocks.get_block_ids()
        block_ids, hashes, groups, slots, gens = [], [], [], [], []
        ok = start + n == end
        for part in cand.parts if ok else ():
            g, lo = part.group, part.lo
            got = list(ids[g][lo:end]) if g < len(ids) else []
            if len(got) != end - lo or 0 in got:    # a null block where data is due
                ok = False
                break
            block_ids += got
            hashes += request.block_hashes[lo:end]
            groups.append((g, end - lo))
            slots += part.slots
            gens += part.generations
        if not ok:
            # vLLM holds the request for this load (WAITING_FOR_REMOTE_KVS): it fails at
            # once on the workers and the request recomputes.
            self.index.unpin(cand.pinned)
            self.ctx.warn_once("load planning", KVStoreError(
                f"vLLM allocated {n} external blocks of a {end - start}-block hybrid hit"))
            self._queue(LoadJob(self.ctx.job_id(), req_id, [], [], [], [], [], unavailable=True))
            return None
        self._queue(LoadJob(self.ctx.job_id(), req_id, block_ids, hashes, groups, slots, gens))
        self.stats.add(hit_tokens=n * self.block_size)
        return start, end

    def _queue(self, job: LoadJob) -> None:
        """Send `job` to the workers with this step's metadata; its slots stay pinned
        until vLLM reports the request's load finished."""
        self.pending.append(job)
        self.inflight[job.req_id] = InflightLoad(job)

    def finished(self, output) -> None:
        """The loads vLLM reports finished (or failed) in `output`: unpinned, counted
        once per block, touched in the LRU (on the index thread, keys made there)."""
        failed_reqs = set(getattr(output, "failed_recving", ()) or ())
        done = set(output.finished_recving or ()) | failed_reqs
        invalid = getattr(output, "invalid_block_ids", None)
        if invalid:
            for load in self.inflight.values():
                hit = invalid.intersection(load.job.block_ids)
                if hit:
                    load.invalid.update(hit)
        touch: list[tuple[list, list]] = []     # (hashes, group runs) of the loads
        for req_id in done:
            load = self.inflight.pop(req_id, None)
            if load is None:
                continue
            job = load.job
            self.index.unpin(job.slots)
            # Counted here, once per block: the workers' counts are per rank, and the
            # union of failed blocks over the ranks is only known after aggregation.
            failed = len(load.invalid)
            # A request aborted during its load is gone (request_finished ran): no
            # reason to remember that it must not read the disk again.
            live = req_id in self.requests
            if req_id in failed_reqs:   # a hybrid model's load fails as a whole
                failed = len(job.block_ids)
                if job.unavailable and live:
                    self.failed.add(req_id)
            self.stats.add(loaded_blocks=len(job.block_ids) - failed, load_failures=failed)
            if failed and live:
                self.failed.add(req_id)
            if job.hashes:
                touch.append((job.hashes, job.groups))
        if touch:
            self.index.touch_blocks(touch)


def window_end(flags: bytes, start: int, end: int, window: int) -> int:
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
