"""The CPU harness's byte-for-byte checks: `Verifier` reads, on every rank and layer,
the blocks a request starts from (a local prefix-cache hit or an external load) and
the Mamba states a running request continues from, compares them with the
deterministic content of `kvstore.drivers.sim_content`, and counts what it saw
(``blocks_verified``, ``blocks_loaded``, ``blocks_mismatched``, ``states_read``) and
the first mismatches. It keeps which blocks the harness's own forward wrote (a block
found with that content is a local hit; anything else was loaded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvstore.drivers.sim_content import expected_state_bytes, expected_token_bytes, slot_positions

if TYPE_CHECKING:
    from kvstore.drivers.sim_build import KVGroups
    from kvstore.drivers.sim_ranks import Rank
    from kvstore.drivers.sim_requests import ReqState, Requests, StateRead, StateWrite, TokenWrites

__all__ = ["Verifier", "MAX_MISMATCHES"]

MAX_MISMATCHES = 16   # details kept of the first mismatches


class Verifier:
    """Checks what the ranks' KV tensors hold against what the forward wrote.

    ``stats`` and ``mismatches`` are the harness's own (shared, updated in place).
    ``block_owner``: block id -> (prefix hash of the last written token, tokens written
    in the block, KV cache group) for the blocks the harness's forward wrote itself.
    """

    def __init__(self, groups: KVGroups, block_size: int, ranks: list[Rank],
                 requests: Requests, stats: dict[str, int], mismatches: list[dict]):
        self.groups = groups
        self.block_size = block_size
        self.ranks = ranks
        self.requests = requests
        self.stats = stats
        self.mismatches = mismatches
        self.block_owner: dict[int, tuple[int, int, int]] = {}

    def _note(self, **mismatch) -> None:
        if len(self.mismatches) < MAX_MISMATCHES:
            self.mismatches.append(mismatch)

    # ------------------------------------------------------------ block owners

    def forget_owner_of_new_blocks(self, pool) -> None:
        """A block vLLM's block pool hands out as new (``get_new_blocks``: free, its
        hash evicted or reset) is not a prefix-cache hit, whatever bytes it still holds:
        forget what the forward once wrote there. Otherwise a load into a block that
        held the same content before (the free queue cycles blocks back to the same
        requests, e.g. a replay after ``reset_prefix_cache``) counted as a local hit,
        not in ``blocks_loaded``."""
        get_new_blocks = pool.get_new_blocks
        owner = self.block_owner

        def new_blocks(num_blocks: int):
            blocks = get_new_blocks(num_blocks)
            for b in blocks:
                owner.pop(b.block_id, None)
            return blocks

        pool.get_new_blocks = new_blocks

    def record_writes(self, writes: list[list[TokenWrites | StateWrite]]) -> None:
        """Remember the blocks this step's forward wrote (``writes[g]``: group ``g``'s)."""
        for g, group_writes in enumerate(writes):
            if self.groups.is_mamba[g]:
                for w in group_writes:
                    self.block_owner[w.block_id] = (w.prefix_hash, w.num_tokens, g)
                continue
            for w in group_writes:
                self._record_owner(w.block_ids, w.offsets, w.hashes, g)

    def _record_owner(self, bidx, off, hashes, group: int = 0) -> None:
        if len(bidx) == 0:
            return
        # last write per block wins; writes within a block are in order
        last = {}
        for b, o, h in zip(bidx.tolist(), off.tolist(), hashes.tolist()):
            last[b] = (h, o + 1, group)
        self.block_owner.update(last)

    # ------------------------------------------------------------------ checks

    def window_start(self, group: int, num_computed: int) -> int:
        """First position of ``num_computed`` computed tokens that ``group`` still
        holds (0 for full attention; for a sliding window the last
        ``num_retained_tokens = sliding_window - 1`` tokens, as vLLM's
        ``SlidingWindowManager.get_num_skipped_tokens``)."""
        retained = self.groups.retained[group]
        if retained is None:
            return 0
        return max(0, num_computed - retained)

    def verify(self, req_id: str, num_computed: int) -> None:
        """Check the prefix of ``num_computed`` tokens a newly scheduled request starts
        from, in every KV cache group."""
        if num_computed <= 0:
            return
        tokens = self.requests.tokens(req_id)
        hashes = np.asarray(
            self.requests.hashes_for(req_id, tokens, num_computed)[:num_computed],
            dtype=np.uint64,
        )
        st = self.requests.states[req_id]
        for g in range(self.groups.num_groups):
            if self.groups.is_mamba[g]:
                self._verify_state(req_id, st, g, num_computed, hashes)
            else:
                self._verify_group(req_id, st, g, num_computed, hashes)

    def _verify_state(self, req_id: str, st: ReqState, g: int, num_computed: int,
                      hashes: np.ndarray) -> None:
        """Check a Mamba group: the one state block a request starts from (the block
        of position ``num_computed - 1``) must hold the state after exactly
        ``num_computed`` tokens on every Mamba layer and rank. A null block there counts
        as mismatched; the other blocks of the table are not read by the model."""
        bs = self.block_size
        i = (num_computed + bs - 1) // bs - 1
        table = st.tables[g]
        bid = table[i] if i < len(table) else 0
        h = int(hashes[num_computed - 1])
        bad = bid == 0
        if bad:
            self._note(req_id=req_id, group=g, rank=None, layer=None,
                       position=num_computed, block_id=0, null=True)
        nbytes = self.groups.mamba_state_bytes
        for rk in self.ranks if bid else ():
            for li in self.groups.group_layers[g]:
                got = rk.byte_views[li][bid, 0, 0, :].numpy()
                exp = expected_state_bytes(h, li, rk.rank, nbytes)
                if (got != exp).any():
                    if not bad:
                        self._note(req_id=req_id, group=g, rank=rk.rank, layer=li,
                                   position=num_computed, block_id=bid, state=True)
                    bad = True
        if bid:
            key = (h, num_computed - i * bs, g)
            owner = self.block_owner.get(bid)
            if owner is None or owner != key:
                self.stats["blocks_loaded"] += 1
            if not bad:
                self.block_owner[bid] = key
        self.stats["blocks_verified"] += 1
        self.stats["blocks_mismatched"] += int(bad)

    def read_state(self, read: StateRead) -> None:
        """The state a running request's step continues from (the block of position
        ``start - 1``, every Mamba layer and rank) must be the state after exactly
        ``start`` tokens: a fake SSM that reads its input state. ``states_read`` counts
        them; a wrong one counts in ``blocks_mismatched``."""
        bs = self.block_size
        g, start = read.group, read.start
        i = (start + bs - 1) // bs - 1
        table = self.requests.states[read.req_id].tables[g]
        bid = table[i] if i < len(table) else 0
        nbytes = self.groups.mamba_state_bytes
        bad = []
        for rk in self.ranks if bid else ():
            for li in self.groups.group_layers[g]:
                got = rk.byte_views[li][bid, 0, 0, :].numpy()
                if (got != expected_state_bytes(read.prefix_hash, li, rk.rank, nbytes)).any():
                    bad.append((rk.rank, li))
        self.stats["states_read"] += 1
        if bid and not bad:
            return
        self.stats["blocks_mismatched"] += 1
        rank, layer = bad[0] if bad else (None, None)
        self._note(req_id=read.req_id, group=g, rank=rank, layer=layer, position=start,
                   block_id=bid, state=True, state_read=True, null=not bid)

    def _verify_group(self, req_id: str, st: ReqState, g: int, num_computed: int,
                      hashes: np.ndarray) -> None:
        """Check the bytes of group ``g``'s layers at the positions the group still
        holds: all of [0, num_computed) for full attention, the window for a sliding
        window. A null block where a held position should be counts as mismatched."""
        import torch

        bs = self.block_size
        hybrid = self.groups.hybrid
        table = st.tables[g]
        lo = self.window_start(g, num_computed)
        first_block = lo // bs
        nblocks = (num_computed + bs - 1) // bs
        bad = np.zeros(nblocks, dtype=bool)
        pos, bidx, off = slot_positions(table, lo, num_computed, bs)
        if hybrid:
            null = bidx == 0
            if null.any():
                for b in np.unique(pos[null] // bs).tolist():
                    bad[b] = True
                    self._note(req_id=req_id, group=g, rank=None, layer=None,
                               position=int(b * bs), block_id=0, null=True)
                keep = ~null
                pos, bidx, off = pos[keep], bidx[keep], off[keep]
        n = len(pos)
        h = hashes[pos] if lo or len(pos) != num_computed else hashes
        tb = torch.from_numpy(bidx)
        to = torch.from_numpy(off)
        for rk in self.ranks:
            for li in self.groups.group_layers[g]:
                bv = rk.byte_views[li]
                got = bv[tb, :, to, :].reshape(n, -1).numpy()
                exp = expected_token_bytes(h, pos, li, rk.rank, got.shape[1])
                tok_bad = (got != exp).any(axis=1)
                if tok_bad.any():
                    bad |= np.bincount(
                        pos[tok_bad] // bs, minlength=nblocks
                    )[:nblocks].astype(bool)
                    j = int(np.flatnonzero(tok_bad)[0])
                    m = dict(req_id=req_id, rank=rk.rank, layer=li,
                             position=int(pos[j]), block_id=int(bidx[j]))
                    if hybrid:
                        m["group"] = g
                    self._note(**m)
        for i in range(first_block, nblocks):
            bid = table[i]
            if bid == 0 and hybrid:
                continue  # counted as mismatched above
            end = min((i + 1) * bs, num_computed)
            key = (int(hashes[end - 1]), end - i * bs, g)
            owner = self.block_owner.get(bid)
            # A block the harness wrote with exactly this content (and vLLM did not
            # hand out anew since, see forget_owner_of_new_blocks) is a local
            # prefix-cache hit; anything else arrived from outside.
            if owner is None or owner[0] != key[0] or owner[1] < key[1] or owner[2] != g:
                self.stats["blocks_loaded"] += 1
            if not bad[i]:
                self.block_owner[bid] = key
        self.stats["blocks_verified"] += nblocks - first_block
        self.stats["blocks_mismatched"] += int(bad.sum())
