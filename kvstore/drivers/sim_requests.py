"""The CPU harness's model-runner view of its requests: `Requests` applies each
scheduler output to the per-request, per-group block tables (mirroring the null blocks
of a sliding window), keeps the prefix hashes and the tokens the harness sampled, and
plans a step (`StepPlan`: what the forward writes in each KV cache group, the Mamba
states it reads, the requests scheduled for the first time, the sampled tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.drivers.sim_content import prefix_hashes, slot_positions
from kvstore.drivers.sim_content import HarnessError

if TYPE_CHECKING:
    from kvstore.drivers.sim_build import KVGroups

__all__ = ["ReqState", "TokenWrites", "StateWrite", "StateRead", "FirstScheduled",
           "StepPlan", "Requests"]


@dataclass(slots=True)
class ReqState:
    tables: list[list[int]] = field(default_factory=lambda: [[]])  # per KV cache group
    hashes: list[int] = field(default_factory=list)  # prefix hash per position
    sampled: list[int] = field(default_factory=list)  # tokens the harness emitted

    @property
    def block_ids(self) -> list[int]:  # group 0 block table
        return self.tables[0]


@dataclass(slots=True)
class TokenWrites:
    """Tokens the forward writes in an attention group: positions, their block ids and
    offsets in the blocks, their prefix hashes (parallel arrays)."""
    positions: np.ndarray
    block_ids: np.ndarray
    offsets: np.ndarray
    hashes: np.ndarray


@dataclass(slots=True)
class StateWrite:
    """A Mamba state the forward writes: the state after the prefix whose last token
    hashes to ``prefix_hash``, in ``block_id``, which then covers ``num_tokens`` tokens."""
    block_id: int
    prefix_hash: int
    num_tokens: int


@dataclass(slots=True)
class StateRead:
    """The Mamba state a running request continues from: group ``group``'s state after
    ``start`` tokens, whose last token hashes to ``prefix_hash``."""
    req_id: str
    group: int
    start: int
    prefix_hash: int


@dataclass(slots=True)
class FirstScheduled:
    """A request scheduled for the first time (new or resumed), with the tokens it
    starts from (a local prefix-cache hit or an external load)."""
    req_id: str
    num_computed: int


@dataclass(slots=True)
class StepPlan:
    """What one step runs: ``writes[g]`` the forward's writes in group ``g``
    (`TokenWrites`, or `StateWrite` in a Mamba group); the requests of the model
    runner's output in order with the tokens sampled for each."""
    writes: list[list[Any]]
    req_ids: list[str]
    sampled: list[list[int]]
    first: list[FirstScheduled]
    state_reads: list[StateRead]
    tokens: int = 0          # tokens computed this step


class Requests:
    """Block tables, prefix hashes and sampled tokens of the scheduler's requests, as
    the worker sees them; the tables of freed requests stay readable (``last_tables``)."""

    def __init__(self, scheduler, groups: KVGroups, block_size: int, vocab_size: int):
        self.scheduler = scheduler
        self.groups = groups
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.states: dict[str, ReqState] = {}
        self.last_tables: dict[str, list[list[int]]] = {}  # tables of freed reqs

    def tokens(self, req_id: str) -> list[int]:
        # prompt + the tokens this harness sampled: with async scheduling the
        # scheduler's all_token_ids lags one token behind the worker.
        req = self.scheduler.requests[req_id]
        return list(req.prompt_token_ids) + self.states[req_id].sampled

    def hashes_for(self, req_id: str, tokens: Sequence[int], upto: int) -> list[int]:
        st = self.states.setdefault(req_id, ReqState())
        h = st.hashes
        if len(h) < upto:
            h.extend(
                prefix_hashes(tokens[:upto], start=len(h), prev=h[-1] if h else 0)
            )
        return h

    def tables_of(self, req_id: str) -> tuple[list[int], ...]:
        """Every group's block table of a request, also after it was freed."""
        st = self.states.get(req_id)
        tables = st.tables if st is not None else self.last_tables[req_id]
        return tuple(list(t) for t in tables)

    def drop_freed(self) -> None:
        """Requests freed without output (e.g. aborted) drop their state."""
        for rid in list(self.states):
            if rid not in self.scheduler.requests:
                self.last_tables[rid] = self.states.pop(rid).tables

    # -------------------------------------------------------------- stepping

    def update_block_tables(self, so) -> list[FirstScheduled]:
        """Apply the scheduler output to the per-request, per-group block tables,
        like the model runner does. Returns the requests scheduled for the first
        time (new or resumed)."""
        first: list[FirstScheduled] = []
        ng = self.groups.num_groups
        for nr in so.scheduled_new_reqs:
            st = self.states.setdefault(nr.req_id, ReqState())
            st.tables = [list(nr.block_ids[g]) for g in range(ng)]
            first.append(FirstScheduled(nr.req_id, nr.num_computed_tokens))
        cr = so.scheduled_cached_reqs
        for i, req_id in enumerate(cr.req_ids):
            st = self.states.setdefault(req_id, ReqState())
            nb = cr.new_block_ids[i]
            if req_id in cr.resumed_req_ids:
                st.tables = [list(nb[g]) if nb is not None else [] for g in range(ng)]
                first.append(FirstScheduled(req_id, cr.num_computed_tokens[i]))
            elif nb is not None:
                for g in range(ng):
                    st.tables[g].extend(nb[g])
        if self.groups.hybrid:
            self._sync_null_blocks(so.num_scheduled_tokens)
        return first

    def _sync_null_blocks(self, scheduled) -> None:
        """Mirror into the harness tables the blocks vLLM replaced by the null block
        (sliding-window blocks that left the window, ``remove_skipped_blocks`` in
        ``allocate_slots``). vLLM's model runner keeps the stale ids (its kernels
        never read them); the harness drops them so that ``block_tables`` shows the
        blocks the request still holds, and checks that its tables agree with the
        scheduler's."""
        stms = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        for req_id, st in self.states.items():
            if req_id not in scheduled:
                # Not scheduled this step: its table may be stale (a preempted request
                # that vLLM allocated again for a load it now waits for).
                continue
            for g, stm in enumerate(stms):
                blocks = stm.req_to_blocks.get(req_id)
                if blocks is None:
                    continue  # not allocated (preempted, finished, waiting)
                table = st.tables[g]
                if len(blocks) != len(table):
                    continue  # allocated past what this step's output carried
                for i, b in enumerate(blocks):
                    if b.is_null:
                        table[i] = 0
                    elif table[i] != b.block_id:
                        raise HarnessError(
                            f"{req_id}: group {g} block table {table} disagrees with "
                            f"the scheduler's {[x.block_id for x in blocks]} at {i}"
                        )

    def plan_step(self, so) -> StepPlan:
        """Update the block tables from the scheduler output ``so`` and prepare this
        step's writes (the same for every rank, the content differs), per KV cache
        group, and its sampled tokens."""
        first = self.update_block_tables(so)
        groups = self.groups
        bs = self.block_size
        plan = StepPlan(writes=[[] for _ in range(groups.num_groups)], req_ids=[],
                        sampled=[], first=first, state_reads=[])
        first_ids = {f.req_id for f in first}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # already advanced by schedule()
            start = end - n
            st = self.states[req_id]
            tokens = self.tokens(req_id)
            h = self.hashes_for(req_id, tokens, end)
            hs = np.asarray(h[start:end], dtype=np.uint64)
            for g in range(groups.num_groups):
                if groups.is_mamba[g]:
                    if n > 0 and start > 0 and req_id not in first_ids:
                        # A running request continues from the state its previous
                        # step wrote (a request scheduled for the first time is
                        # checked by Verifier.verify, after the forward).
                        plan.state_reads.append(StateRead(req_id, g, start, int(h[start - 1])))
                    # The state after this step's last token, in the block of that
                    # position (align mode: vLLM ends prefill chunks at block
                    # boundaries, so block i keeps the state after (i+1)*block_size).
                    i = (end + bs - 1) // bs - 1
                    if n > 0 and i < len(st.tables[g]) and st.tables[g][i] != 0:
                        plan.writes[g].append(StateWrite(st.tables[g][i], int(h[end - 1]),
                                                         end - i * bs))
                    continue
                pos, bidx, off = slot_positions(st.tables[g], start, end, bs)
                if groups.hybrid:
                    keep = bidx != 0  # null block: outside the window, not written
                    if not keep.all():
                        plan.writes[g].append(
                            TokenWrites(pos[keep], bidx[keep], off[keep], hs[keep]))
                        continue
                plan.writes[g].append(TokenWrites(pos, bidx, off, hs))
            plan.tokens += n
            plan.req_ids.append(req_id)
            if end >= len(req.prompt_token_ids) and end >= len(tokens):
                tok = int(h[end - 1] % (self.vocab_size - 10)) + 10
                st.sampled.append(tok)
                plan.sampled.append([tok])
            else:
                plan.sampled.append([])
        return plan
