"""Store planning on the connector's scheduler side: what each step stores (eager: the
blocks its forward completes; lazy: the cached blocks vLLM evicts next; a Mamba group's
states from vLLM's hand-offs under either policy), second-sight admission, and slots
from the index's pool. The job then is `StoreCommits`'s until its commit."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore._keytable import keys_with_packed, make_keys
from kvstore._seenfilter import SeenFilter
from kvstore.vllm.config import block_key
from kvstore.vllm.metadata import HashedBlocks, StoreJob
from kvstore.vllm.sched_commit import StoreCommits
from kvstore.vllm.sched_context import SchedulerContext
from kvstore.vllm.sched_events import BlockOrigins


@dataclass(slots=True)
class PlannedSpan:
    """The blocks (indices) one walk planned for a request."""
    req_id: str
    blocks: Sequence[int]


@dataclass(slots=True)
class StorePlan:
    """A step's store plan while it is built: blocks whose keys were made (`keys`,
    `bids`: lazy stores, Mamba states, second-sight admission), then hashed blocks (vLLM
    hashes, (group, count) `runs`, `hashed_bids`: eager stores, no key made); `origins`
    of all of them in that order (KV events only); a `PlannedSpan` per eager walk."""
    pool: int = 1 << 62         # slots the index's pool holds (`ServingIndex.available`)
    keys: list[bytes] = field(default_factory=list)
    bids: list[int] = field(default_factory=list)
    hashes: list = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)
    hashed_bids: list[int] = field(default_factory=list)
    origins: BlockOrigins | None = None
    spans: list[PlannedSpan] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.keys) + len(self.hashes)

    @property
    def hashed(self) -> HashedBlocks | None:
        return HashedBlocks(self.hashes, self.runs) if self.hashes else None

    def add_hashed(self, hashes: list, bids: list, g: int) -> None:
        if self.hashes:
            self.hashes += hashes
            self.hashed_bids += bids
        else:       # a step's first walk (mostly its only one): its lists, not a copy
            self.hashes, self.hashed_bids = hashes, bids
        if self.runs and self.runs[-1][0] == g:
            self.runs[-1] = (g, self.runs[-1][1] + len(hashes))
        else:
            self.runs.append((g, len(hashes)))

    def cut(self, n: int) -> list[bytes]:
        """Keep the first n blocks; returns the keys of the others (made here: a pool
        that ran short or a failed plan, not the common path)."""
        nk = len(self.keys)
        if n <= nk:
            dropped = keys_with_packed(self.keys[n:], self.hashed)
            del self.keys[n:], self.bids[n:]
            self.hashes, self.runs, self.hashed_bids = [], [], []
        else:
            m = n - nk
            head, tail = split_runs(self.runs, m)
            dropped = make_keys(self.hashes[m:], tail)
            del self.hashes[m:], self.hashed_bids[m:]
            self.runs = head
        if self.origins is not None:
            self.origins.truncate(n)
        return dropped


class StorePlanner:
    """What each step stores, and the store cursors of the requests (eager stores resume
    after the last block stored or loaded). Its keys join `commits.storing` when planned,
    its job joins `commits` when sent."""

    def __init__(self, ctx: SchedulerContext, commits: StoreCommits, lazy_target: int):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.index = ctx.index
        self.block_size = ctx.block_size
        self.stats = ctx.stats
        self.requests = ctx.requests
        self.commits = commits
        self.storing = commits.storing
        self._lazy_target = lazy_target     # lazy: blocks of the free queue's head walked
        self.counting = 0                       # dry-pool counts the index thread owes
        self._upto: dict[str, int] = {}         # one group: per-request store cursor
        self._upto_g: dict[str, list[int]] = {}  # hybrid: per-request, per-group cursors
        self._kv_cache_manager = None
        self._block_pool = None
        # Admission on second sight (cfg.admission): a planned block is stored only when
        # its key was planned before within the window (`SeenFilter`, one probe per
        # planned block); None stores every block (the default).
        self._admission = SeenFilter(self.cfg.admission_window) \
            if self.cfg.admission == "second_sight" else None
        self._lazy_sighted: set[bytes] = set()   # lazy: first sightings still in the head

    def bind(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._block_pool = getattr(kv_cache_manager, "block_pool", None)

    @property
    def admission_rejected(self) -> int:
        return self._admission.rejected if self._admission else 0

    def loaded(self, req_id: str, start: int, end: int) -> None:
        """Blocks start..end of the request are being loaded from disk: eager stores skip
        them, but not the GPU prefix hit before them (blocks 0..start), which may have
        left the disk."""
        if self.ctx.hybrid:
            ups = self._upto_g.setdefault(req_id, [0] * len(self.ctx.group_kinds))
            for g in range(len(ups)):
                if ups[g] >= self.ctx.group_lo(g, start, end):
                    ups[g] = end
        elif self._upto.get(req_id, 0) >= start:
            self._upto[req_id] = end

    def forget(self, req_id: str) -> None:
        """The request finished: its store cursors go."""
        self._upto.pop(req_id, None)
        self._upto_g.pop(req_id, None)

    def counted(self, count: int) -> None:
        """The index thread counted `count` new blocks a dry pool dropped."""
        self.counting -= 1
        if count:
            self.stats.add(store_dropped_blocks=count)

    # -- planning ----------------------------------------------------------------------
    def plan(self, scheduler_output) -> list[StoreJob]:
        """This step's store job (none, or one for every block planned)."""
        ctx = self.ctx
        limit = self.cfg.max_store_blocks_per_step
        plan = StorePlan()
        if ctx.events_enabled:
            plan.origins = BlockOrigins()
        try:
            plan.pool = self.index.available()
            if ctx.mamba_groups:    # every policy: the hand-offs are this step's only
                self._plan_boundary_states(scheduler_output, limit, plan)
            if self.cfg.store_policy == "eager" and ctx.hybrid:
                if self._kv_cache_manager is not None:
                    self._plan_eager_hybrid(scheduler_output, limit, plan)
            elif self.cfg.store_policy == "eager":
                self._plan_eager(scheduler_output, limit, plan)
            else:
                self._plan_lazy(limit, plan.keys, plan.bids)
            if self._admission is not None:
                rejected = self._admission.take_rejected()
                if rejected:
                    self.stats.add(admission_rejected_blocks=rejected)
            total = plan.count
            if not total:       # (a dry pool's refill: the count queued asks for it)
                return []
            # Slots from the index thread's pool (already reserved, victims already
            # evicted): a prefix of the blocks when the pool runs short.
            slots, gens = self.index.take(plan.keys, plan.hashed)
        except Exception as exc:    # never raises into the engine: nothing is stored
            ctx.warn_once("store planning", exc)
            self.stats.add(store_dropped_blocks=plan.count)
            self.storing.difference_update(plan.cut(0))
            if not ctx.hybrid:
                for span in plan.spans:    # planned again next step
                    self._upto[span.req_id] = min(self._upto.get(span.req_id, 0), span.blocks[0])
            return []
        n = len(slots)
        if n < total:
            self.stats.add(store_dropped_blocks=total - n)
            # The pool ran short (the index thread is behind): the rest is dropped, not
            # retried at later steps (a backlog would grow every step's walk).
            self.storing.difference_update(plan.cut(n))
        if not n:
            return []
        bids = plan.bids + plan.hashed_bids if plan.bids else plan.hashed_bids
        job = StoreJob(ctx.job_id(), bids, plan.keys, slots, gens, plan.hashes, plan.runs)
        self.commits.track(job, plan.origins)
        return [job]

    def _plan_eager(self, scheduler_output, limit: int, plan: StorePlan) -> None:
        """Add to `plan` the blocks this step's forward completes that are neither stored
        nor being stored, `limit` at most; their keys join `storing`. The per-block walk
        is C (`ServingIndex.plan_new`), and makes no Python object per block: the plan
        carries vLLM's hashes (`_plan_range`)."""
        if self._kv_cache_manager is None:
            return
        bs = self.block_size
        requests, upto = self.requests, self._upto
        new_ids = new_block_ids(scheduler_output)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = requests.get(req_id)
            if req is None or n <= 0:
                continue
            done_after = req.num_computed_tokens + n   # schedule() advances it after us
            nfull = min(done_after // bs, len(req.block_hashes))
            first = upto.get(req_id, 0)
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
            upto[req_id] = self._plan_range(plan, req_id, req, first, nfull, blocks, room, 0)

    def _plan_eager_hybrid(self, scheduler_output, limit: int, plan: StorePlan) -> None:
        """_plan_eager for several groups: every group's completed blocks (a sliding-
        window group's table starts with null blocks once the window has moved on: they
        are skipped), keyed with the group id."""
        bs = self.block_size
        kinds = self.ctx.group_kinds
        new_ids = new_block_ids(scheduler_output)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or n <= 0:
                continue
            done_after = req.num_computed_tokens + n
            nfull = min(done_after // bs, len(req.block_hashes))
            ups = self._upto_g.setdefault(req_id, [0] * len(kinds))
            # a new request's block ids as vLLM made them for this step's output
            tables = new_ids.get(req_id) or self._kv_cache_manager.get_block_ids(req_id)
            for g, (kind, _) in enumerate(kinds):
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

    def _plan_range(self, plan: StorePlan, req_id: str, req, first: int, stop: int,
                    blocks: list, room: int, g: int) -> int:
        """One walk of `plan_new` over blocks first..stop of req (group g), `room` at most:
        hashed into `plan` (vLLM's hashes and a group run: no key made), or as keys when
        second-sight admission filters them. Returns the request's store cursor: a walk
        the limit cut short resumes after its last block in a later step."""
        adm = self._admission
        # hashed (plan_new's `packed`) unless admission filters keys, or the index
        # reserves slots by key (`packed_stores`: the bench's synchronous baseline)
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
                                        self.storing, walk, g, packed)
        if len(idx) < walk:
            cursor = stop
        elif pool_room < room:      # the pool ran short: the rest is dropped, not resumed
            cursor = stop
            self._count_dropped(req, idx[-1] + 1, stop, g)
        else:                       # the step's limit: resumed after its last block
            cursor = idx[-1] + 1
        if adm is not None:     # first sightings are left out
            k, b, idx = adm.admit(k, b, idx, self.storing)
        if not idx:
            return cursor
        plan.spans.append(PlannedSpan(req_id, idx))
        if packed:
            plan.add_hashed(k, b, g)
        else:
            plan.keys += k
            plan.bids += b
        if plan.origins is not None:
            bs, add = self.block_size, plan.origins.add
            for i in idx:
                add(req, i, bs)
        return cursor

    def _count_dropped(self, req, first: int, stop: int, g: int) -> None:
        """Blocks first..stop of req are dropped (the pool is short): the index thread
        counts the new ones into `store_dropped_blocks` (a "counted" event)."""
        if first >= min(stop, len(req.block_hashes)):
            return
        self.counting += 1
        try:
            self.index.count_dropped(req.block_hashes, first, stop, self.storing, g)
        except BaseException:
            self.counting -= 1
            raise

    def _plan_boundary_states(self, scheduler_output, limit: int, plan: StorePlan) -> None:
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
        kinds = self.ctx.group_kinds
        storing, contains = self.storing, self.index.contains
        keys, bids, origins = plan.keys, plan.bids, plan.origins
        for req_id, entries in offloads.items():
            req = self.requests.get(req_id)
            if req is None or req_id in gone:
                continue
            for g, block_id, boundary in entries:
                if len(keys) >= limit:
                    return
                if not (0 <= g < len(kinds)) or kinds[g][0] != "mamba" \
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
                if origins is not None:
                    origins.add(req, i, bs)

    def _plan_lazy(self, limit: int, keys: list, bids: list) -> None:
        """Append the cached GPU blocks nearest to eviction (head of vLLM's free queue)
        that are not stored or being stored; their keys join `storing`."""
        pool = self._block_pool
        if pool is None:
            return
        storing, contains = self.storing, self.index.contains
        mamba = self.ctx.mamba_groups
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


def split_runs(runs: list[tuple[int, int]], m: int) -> tuple[list, list]:
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


def new_block_ids(scheduler_output) -> dict:
    """{request id: block ids per KV cache group} of the requests new in this step's
    output: vLLM made these int lists for its workers (`NewRequestData.block_ids`, the
    whole block table), so the store walk reads them instead of vLLM's cold
    `KVCacheBlock` objects or a second `get_block_ids`."""
    return {r.req_id: r.block_ids for r in getattr(scheduler_output, "scheduled_new_reqs", ()) or ()
            if getattr(r, "block_ids", None)}
