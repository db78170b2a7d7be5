"""Mamba hybrids through vLLM's real scheduler: full attention + sliding window + Mamba
(vLLM's MambaSpec, mamba_cache_mode "align"), three KV cache groups run by vLLM's
HybridKVCacheCoordinator, every loaded block (Mamba states included) byte-verified by
the harness against recompute.

A disk hit is what vLLM's hybrid coordinator accepts: full-attention blocks from the GPU
hit to the end, the window of sliding-window blocks before the end, and the Mamba state
at the end (key: the block hash at end - 1 + the Mamba group id). Mamba states are stored
only from vLLM's boundary hand-offs (by default the prompt's replay boundary,
(num_prompt - 1) // block_size * block_size).
"""
from __future__ import annotations

import pytest

import vllm  # noqa: E402,F401  (needed: a vLLM that does not import fails these tests)

from connector_util import (BS, Gate, conn_stats, drop_gpu_cache,  # noqa: E402
                            flip_payload_byte, keys_of, kv_config, kv_harness, loads_ok, open_fds,
                            prompts, sched, set_injector, settle)

from kvstore.errors import ConfigError, LayoutMismatch  # noqa: E402

WINDOW = 32          # tokens: the window before a hit's end is 2 blocks
MAMBA = {"sliding_window": WINDOW, "mamba": True, "num_layers": 3}
FULL, SWA, SSM = 0, 1, 2     # group ids



def _on_disk(h, keys) -> list[bool]:
    st = sched(h).store
    return [st.lookup(k) is not None for k in keys]


def _replay(h, ps, **kw):
    """Empty vLLM's GPU prefix cache, run `ps` again: (stats, tokens hit on disk by it)."""
    drop_gpu_cache(h)
    before = h.stats["external_hit_tokens"]
    s = h.run(ps, **kw)
    return s, s["external_hit_tokens"] - before


@pytest.mark.parametrize("kw", [
    dict(),
    dict(tp_size=2, layout="BLNHC", extra={"capacity": "8M"}),
    dict(async_scheduling=True),
], ids=["tp1-LBNHC", "tp2-BLNHC", "async"])
def test_three_groups_round_trip_through_a_restart(tmp_path, kw):
    store = tmp_path / "store"
    ps = prompts(81, 3, 140)                 # 8 full blocks; replay boundary 128 = block 7
    tp = kw.get("tp_size", 1)
    with kv_harness(store, **kw, **MAMBA) as h:
        s = sched(h)
        assert s.hybrid and s.has_mamba
        assert [k for k, _ in s.group_kinds] == ["full", "swa", "mamba"]
        # The state shapes are per rank (vLLM shards them over TP).
        assert s.layout.groups == (f"full;swa:{WINDOW};mamba:mamba2:3x{64 // tp},"
                                   f"2x16x{16 // tp}:float16,float16")
        h.run(ps, max_tokens=2)
        settle(h)
        for p in ps:
            assert all(_on_disk(h, keys_of(h, p, group=FULL))) and all(_on_disk(h, keys_of(h, p, group=SWA)))
            # Mamba: only the state vLLM handed off, the one at the replay boundary.
            assert _on_disk(h, keys_of(h, p, group=SSM)) == [False] * 7 + [True]
        s_, hit = _replay(h, ps, max_tokens=2)
        loads_ok(s_)
        assert hit == 3 * 8 * BS
        assert s_["failed_recving"] == 0
    with kv_harness(store, **kw, **MAMBA) as h:     # restart: the GPU cache is empty
        s_ = h.run(ps, max_tokens=2)
        loads_ok(s_)
        assert s_["external_hit_tokens"] == 3 * 8 * BS
        # Each request loads its 8 full-attention blocks, the 2 window blocks and the
        # one state at 128, and the harness verified each against recompute.
        assert s_["blocks_loaded"] == 3 * (8 + WINDOW // BS + 1)
        assert s_["blocks_verified"] == 3 * (8 + WINDOW // BS + 1)
        assert s_["invalid_block_ids"] == 0 and s_["failed_recving"] == 0


def test_a_hit_ends_at_the_last_stored_mamba_state(tmp_path):
    """States on disk at 128 (prompt a) and 192 (prompt c = a + 60 tokens). A prompt that
    shares c's first 176 tokens has full-attention and window blocks on disk up to 176,
    but the longest end with a state is 128: the hit is exactly 128 tokens. A prompt
    sharing only 96 tokens has no state on disk at or before 96: no hit at all."""
    store = tmp_path / "store"
    a = prompts(82, 1, 140)[0]
    tail = prompts(83, 1, 60)[0]
    c = a + tail
    with kv_harness(store, **MAMBA) as h:
        h.run([a], max_tokens=1)
        settle(h)
        h.run([c], max_tokens=1)
        settle(h)
        ssm = _on_disk(h, keys_of(h, c, group=SSM))
        assert [i for i, x in enumerate(ssm) if x] == [7, 11]
        d = c[:176] + prompts(84, 1, 40)[0]
        assert all(_on_disk(h, keys_of(h, d, group=FULL)[:11]))
        assert all(_on_disk(h, keys_of(h, d, group=SWA)[:11]))
        s, hit = _replay(h, [d], max_tokens=1)
        loads_ok(s)
        assert hit == 128
        e = c[:96] + prompts(85, 1, 60)[0]
        s, hit = _replay(h, [e], max_tokens=1)
        assert hit == 0 and s["blocks_mismatched"] == 0
        # The state of a full 12-block hit is on disk: c itself hits 192 tokens.
        s, hit = _replay(h, [c], max_tokens=1)
        loads_ok(s)
        assert hit == 192


@pytest.mark.parametrize("interval, chunk, states", [
    (64, 64, [3, 7, 11]),       # every 64 tokens, where a 64-token prefill chunk ended
    (64, 256, [11]),            # one chunk: no state at 64 or 128 was ever computed
    (0, 64, [11]),              # vLLM's default: the replay boundary only
])
def test_hits_land_on_the_states_vllm_retained(tmp_path, interval, chunk, states):
    """vLLM's prefix_cache_retention_interval decides which Mamba states are handed off
    (align mode materializes a state only where a prefill chunk ends): a prompt sharing
    150 or 100 tokens of a 200-token one hits exactly up to the last retained state at
    or before its shared blocks, or not at all."""
    store = tmp_path / "store"
    a = prompts(95, 1, 200)[0]
    with kv_harness(store, retention_interval=interval, max_num_batched_tokens=chunk,
                    **MAMBA) as h:
        h.run([a], max_tokens=1)
        settle(h)
        assert [i for i, x in enumerate(_on_disk(h, keys_of(h, a, group=SSM))) if x] == states
        assert all(_on_disk(h, keys_of(h, a, group=SWA)))      # sliding window: stored densely
        for share in (150, 100):
            b = a[:share] + prompts(96, 1, 60)[0]
            s, hit = _replay(h, [b], max_tokens=1)
            want = max([(i + 1) * BS for i in states if (i + 1) * BS <= share], default=0)
            assert hit == want, (share, hit)
            assert s["blocks_mismatched"] == 0
            if want:
                loads_ok(s)


def test_several_mamba_groups_each_need_their_state(tmp_path):
    """A hybrid with twice as many Mamba layers as attention layers: vLLM makes two Mamba
    groups. A restart hits with both states; with one group's state dropped, there is
    no hit (every group must have its state at the end)."""
    store = tmp_path / "store"
    kw = dict(num_layers=4, sliding_window=WINDOW, mamba=2)
    ps = prompts(98, 2, 140)
    with kv_harness(store, **kw) as h:
        assert [k for k, _ in sched(h).group_kinds] == ["full", "swa", "mamba", "mamba"]
        h.run(ps, max_tokens=2)
        settle(h)
        for g in (2, 3):
            assert all(_on_disk(h, keys_of(h, p, group=g)) == [False] * 7 + [True] for p in ps)
    with kv_harness(store, **kw) as h:
        s = h.run(ps, max_tokens=2)
        loads_ok(s)
        assert s["external_hit_tokens"] == 2 * 8 * BS
        assert s["blocks_loaded"] == 2 * (8 + WINDOW // BS + 2)
        sched(h).index.drop([keys_of(h, ps[0], group=3)[7]])
        sched(h).index.flush()
        s, hit = _replay(h, ps, max_tokens=1)
        assert hit == 8 * BS and s["blocks_mismatched"] == 0   # only ps[1] hits


def test_a_hit_moves_back_when_the_state_is_dropped(tmp_path):
    """With the state at 128 dropped from disk, the same prompt finds no state at or
    before its end: a miss (not a hit without its state), recomputed and stored again."""
    store = tmp_path / "store"
    p = prompts(86, 1, 140)[0]
    with kv_harness(store, **MAMBA) as h:
        h.run([p], max_tokens=1)
        settle(h)
        key = keys_of(h, p, group=SSM)[7]
        sched(h).index.drop([key])
        sched(h).index.flush()
        s, hit = _replay(h, [p], max_tokens=1)
        assert hit == 0 and s["blocks_mismatched"] == 0
        settle(h)
        assert _on_disk(h, [key]) == [True]      # handed off again, stored again
        s, hit = _replay(h, [p], max_tokens=1)
        loads_ok(s)
        assert hit == 8 * BS


def test_a_corrupt_mamba_slot_fails_the_request_through_failed_recving(tmp_path):
    """A corrupt state slot fails the request's load (failed_recving), the request
    recomputes with no mismatch, the entry is dropped, and the recomputed state is
    stored again (a later pass loads it cleanly)."""
    store = tmp_path / "store"
    p = prompts(87, 1, 140)[0]
    with kv_harness(store, **MAMBA) as h:
        h.run([p], max_tokens=1)
        settle(h)
        key = keys_of(h, p, group=SSM)[7]
        entry = sched(h).store.lookup(key)
        flip_payload_byte(store, 0, entry.slot, byte=100)   # inside the state's bytes
        drop_gpu_cache(h)
        before = dict(h.stats)
        s = h.run([p], max_tokens=2)
        assert s["failed_recving"] - before["failed_recving"] == 1
        assert s["invalid_block_ids"] == before["invalid_block_ids"]
        assert s["external_hit_tokens"] == before["external_hit_tokens"] + 8 * BS
        assert s["blocks_mismatched"] == 0          # recomputed, never served corrupt
        settle(h)
        assert conn_stats(h)["load_failures"] == 8 + WINDOW // BS + 1
        new = sched(h).store.lookup(key)
        assert new is not None and (new.slot, new.generation) != (entry.slot, entry.generation)
        s, hit = _replay(h, [p], max_tokens=1)
        loads_ok(s)
        assert hit == 8 * BS and s["failed_recving"] == before["failed_recving"] + 1


@pytest.mark.parametrize("old", [dict(sliding_window=WINDOW, num_layers=2),
                                 dict(mamba=True, num_layers=2)])
def test_a_store_of_another_group_structure_is_refused_naming_groups(tmp_path, old):
    """A full + sliding-window (or full + Mamba) store, opened by a three-group engine of
    the same per-group geometry: refused, the field named, nothing left open."""
    from kvstore.drivers.simulator import EngineHarness
    store = tmp_path / "store"
    with kv_harness(store, **old) as h:
        h.run(prompts(88, 1, 40), max_tokens=1)
        settle(h)
        groups = sched(h).layout.groups
    before = open_fds()
    with pytest.raises(LayoutMismatch) as ei:
        EngineHarness(kv_transfer_config=kv_config(store), workdir=str(tmp_path), **MAMBA)
    assert ei.value.field == "groups"
    assert "groups" in str(ei.value) and groups in str(ei.value)
    assert not open_fds() - before


def test_preemption_under_gpu_pressure_keeps_every_state_right(tmp_path):
    store = tmp_path / "store"
    ps = prompts(89, 4, 140)
    with kv_harness(store, num_gpu_blocks=40, max_num_batched_tokens=64, **MAMBA) as h:
        preempt, count = h.scheduler._preempt_request, []

        def counting(*a, **k):
            count.append(1)
            return preempt(*a, **k)

        h.scheduler._preempt_request = counting
        h.run(ps, max_tokens=24)
        settle(h)
        first = len(count)
        s, hit = _replay(h, ps, max_tokens=24)
        loads_ok(s)
        assert count, "the cache is meant to be too small for all requests at once"
        assert hit >= 8 * BS and s["blocks_mismatched"] == 0
        assert len(count) >= first


def test_abort_while_a_mamba_load_is_in_flight(tmp_path):
    """Loads of all three groups held at the disk; two of three requests aborted
    meanwhile: every pin stays until the worker reports, then goes; the third request is
    served from disk, its state byte-verified."""
    store = tmp_path / "store"
    ps = prompts(90, 3, 100)                 # 6 full blocks, 2 window blocks, 1 state
    per_req = 6 + WINDOW // BS + 1
    with kv_harness(store, **MAMBA) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        gate = Gate("read")
        set_injector(h, gate)
        rids = [h.add_request(p, max_tokens=4) for p in ps]
        h.step()
        s = sched(h)
        assert set(s.lookups.inflight) == set(rids)
        assert s.index.pinned_slots == 3 * per_req
        h.abort(rids[:2])
        for _ in range(5):
            h.step()
        assert s.index.pinned_slots == 3 * per_req
        gate.wait_hit()
        gate.open()
        h.drain()
        set_injector(h, None)
        assert s.index.pinned_slots == 0
        assert rids[2] in h.finished and rids[0] not in h.finished
        assert h.stats["blocks_mismatched"] == 0 and h.stats["failed_recving"] == 0
        assert h.stats["external_hit_tokens"] >= 6 * BS


def test_a_mamba_lookup_that_fails_midway_leaves_no_pin(tmp_path, monkeypatch):
    """Full and window blocks pinned, then the Mamba group's lookup raises: a miss,
    nothing pinned, the request recomputes."""
    from kvstore.errors import KVStoreError
    store = tmp_path / "store"
    p = prompts(91, 1, 140)[0]
    with kv_harness(store, **MAMBA) as h:
        h.run([p], max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        ix = sched(h).index
        orig = ix.lookup_hashes
        calls = []

        def flaky(hashes, lo, end, group=0, **kw):
            calls.append(group)
            if group == SSM:
                raise KVStoreError("injected")
            return orig(hashes, lo, end, group, **kw)
        monkeypatch.setattr(ix, "lookup_hashes", flaky)
        before = dict(h.stats)
        s = h.run([p], max_tokens=1)
        assert SSM in calls and FULL in calls
        assert s["external_hit_tokens"] == before["external_hit_tokens"]
        assert ix.pinned_slots == 0 and s["blocks_mismatched"] == 0
        monkeypatch.undo()


def test_hand_offs_are_read_in_build_connector_meta_and_filtered(tmp_path):
    """The connector sees vLLM's boundary hand-offs in build_connector_meta (vLLM clears
    them from the scheduler output right after) and plans the state it names; the same
    hand-off of a request preempted or finished that step is not stored."""
    import dataclasses

    store = tmp_path / "store"
    p = prompts(94, 1, 140)[0]
    with kv_harness(store, **MAMBA) as h:
        s = sched(h)
        seen = []
        orig = s.build_connector_meta

        def spy(so):
            bs = so.kv_connector_block_state
            if bs is not None and bs.boundary_state_offloads:
                seen.append((so, {r: list(e) for r, e in bs.boundary_state_offloads.items()}))
            return orig(so)
        s.build_connector_meta = spy
        rid = h.add_request(p, max_tokens=2)
        h.step()
        assert len(seen) == 1
        so, offloads = seen[0]
        ((g, block_id, boundary),) = offloads[rid]
        assert (g, boundary) == (SSM, 128) and block_id != 0
        assert so.kv_connector_block_state is None          # cleared by vLLM
        key = keys_of(h, p, group=SSM)[7]
        assert key in s.stores.storing                      # planned from the hand-off
        from vllm.v1.core.sched.output import KVConnectorBlockState

        from kvstore.vllm.sched_store import StorePlan
        blocks = KVConnectorBlockState(req_ids={rid}, resolve_block_ids=lambda r: (),
                                       boundary_state_offloads=offloads)
        s.stores.storing.discard(key)        # as if not planned: only the filters decide
        try:
            for gone, want in ((dict(preempted_req_ids={rid}), []),
                               (dict(finished_req_ids={rid}), []),
                               ({}, [key])):
                out = dataclasses.replace(so, kv_connector_block_state=blocks, **gone)
                plan = StorePlan()
                s.stores._plan_boundary_states(out, 16, plan)
                assert plan.keys == want, gone
                assert plan.bids == ([block_id] if want else [])
        finally:
            s.stores.storing.add(key)        # the real store job still holds it
        h.drain()
        settle(h)
        assert _on_disk(h, [key]) == [True] and key not in s.stores.storing


def test_lazy_policy_stores_mamba_states_from_the_hand_offs(tmp_path):
    """With store_policy lazy, attention blocks are stored as vLLM is about to evict
    them, and Mamba states only from the hand-offs (the free queue's Mamba blocks are
    never taken, however long they wait there); a restart hits the whole prefix."""
    store = tmp_path / "store"
    ps = prompts(92, 2, 140)
    lazy = {"extra": {"store_policy": "lazy"}, "num_gpu_blocks": 32}
    with kv_harness(store, **lazy, **MAMBA) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        # Push the prompts' blocks through the head of the free queue and out.
        h.run(prompts(93, 4, 120), max_tokens=1)
        settle(h)
        for p in ps:
            assert all(_on_disk(h, keys_of(h, p, group=FULL)))
            assert _on_disk(h, keys_of(h, p, group=SSM)) == [False] * 7 + [True]
    with kv_harness(store, **lazy, **MAMBA) as h:
        s = h.run(ps, max_tokens=1)
        loads_ok(s)
        assert s["external_hit_tokens"] == 2 * 8 * BS


def test_a_stored_mamba_state_is_announced_with_its_group(tmp_path):
    """The STORAGE BlockStored event of a Mamba state names the Mamba group and the
    block hash at its boundary, and carries that block's tokens."""
    from connector_util import event_hash
    from vllm.distributed.kv_events import BlockStored
    store = tmp_path / "store"
    ps = prompts(97, 2, 140)
    with kv_harness(store, kv_events=True, **MAMBA) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        h.step()                                    # publish the last step's events
        ev = [e for e in h.events if isinstance(e, BlockStored) and e.medium == "STORAGE"
              and e.group_idx == SSM]
        want = {event_hash(keys_of(h, p, group=SSM)[7]): p[7 * BS:8 * BS] for p in ps}
        assert {e.block_hashes[0]: list(e.token_ids) for e in ev} == want
        assert all(len(e.block_hashes) == 1 and e.block_size == BS for e in ev)


# -- refusals at start ------------------------------------------------------------------

def _groups(*specs):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    return [KVCacheGroupSpec([f"l{g}"], s) for g, s in enumerate(specs)]


def _specs(mode="align", mamba_bs=16, spec_blocks=0, layers=1):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16,
                            dtype=torch.float16, sliding_window=WINDOW)
    ssm = MambaSpec(block_size=mamba_bs, shapes=((3, 64),), dtypes=(torch.float16,),
                    page_size_padded=full.page_size_bytes, mamba_cache_mode=mode,
                    num_speculative_blocks=spec_blocks)
    return full, swa, ssm


def test_a_served_three_group_layout_names_every_group():
    from kvstore.vllm.config import check_kv_cache_groups, kv_group_kinds
    full, swa, ssm = _specs()
    groups = _groups(full, swa, ssm)
    assert check_kv_cache_groups(groups) == f"full;swa:{WINDOW};mamba:mamba2:3x64:float16"
    assert kv_group_kinds(groups) == [("full", 0), ("swa", WINDOW - 1), ("mamba", 0)]
    assert check_kv_cache_groups(_groups(full, ssm)) == "full;mamba:mamba2:3x64:float16"


@pytest.mark.parametrize("kw, groups, words", [
    (dict(mode="none"), "fsm", ["--enable-prefix-caching", "mamba_cache_mode=none"]),
    (dict(mamba_bs=64), "fsm", ["--mamba-block-size", "block sizes [16, 64]"]),
    (dict(spec_blocks=1), "fsm", ["speculative", "num_speculative_blocks=1"]),
    (dict(), "sm", ["next to full-attention"]),
])
def test_mamba_setups_kvstore_cannot_serve_are_refused_saying_what_to_do(kw, groups, words):
    from kvstore.vllm.config import check_kv_cache_groups
    full, swa, ssm = _specs(**kw)
    pick = {"f": full, "s": swa, "m": ssm}
    with pytest.raises(ConfigError) as ei:
        check_kv_cache_groups(_groups(*(pick[c] for c in groups)))
    msg = str(ei.value)
    assert "MambaSpec" in msg and "remove the kvstore connector" in msg
    for w in words:
        assert w in msg, msg


def test_a_mamba_view_that_does_not_overlay_the_carrier_is_refused(tmp_path):
    """check_groups_alias on the harness's real tensors passes; the same Mamba view
    moved by one block, or stepping by another stride, is refused naming the layer."""
    from kvstore.drivers.simulator import EngineHarness
    from kvstore.vllm.transfer import check_groups_alias
    with EngineHarness(**MAMBA) as h:
        kv = dict(h.ranks[0].kv_caches)
        cfg = h.kv_cache_config
        check_groups_alias(kv, cfg, 0)
        name = cfg.kv_cache_groups[SSM].layer_names[0]
        v = kv[name]
        assert tuple(v.shape) == (h.num_gpu_blocks, 1, 1, h.mamba_state_bytes)
        for bad in (v[1:], v.as_strided(v.shape, (v.stride(0) // 2,) + v.stride()[1:])):
            with pytest.raises(ConfigError, match=name):
                check_groups_alias({**kv, name: bad}, cfg, 0)


@pytest.mark.parametrize("kw, group, block", [(MAMBA, SSM, 7), (dict(), 0, 3)],
                         ids=["three-groups", "one-group"])
def test_a_request_aborted_while_its_failing_load_is_in_flight_leaves_nothing(
        tmp_path, kw, group, block):
    """A corrupt slot's load held at the disk, the request aborted meanwhile (vLLM calls
    request_finished before the worker reports): once the failure arrives (failed_recving
    with three groups, invalid_block_ids with one) nothing of the request is kept, its
    pins are gone and the bad entry is dropped (kv_harness's leak checks)."""
    store = tmp_path / "store"
    p = prompts(99, 1, 140)[0]
    with kv_harness(store, **kw) as h:
        h.run([p], max_tokens=1)
        settle(h)
        key = keys_of(h, p, group=group)[block]
        entry = sched(h).store.lookup(key)
        flip_payload_byte(store, 0, entry.slot, byte=100)
        drop_gpu_cache(h)
        gate = Gate("read")
        set_injector(h, gate)
        rid = h.add_request(p, max_tokens=2)
        h.step()
        s = sched(h)
        assert rid in s.lookups.inflight
        h.abort(rid)
        h.step()
        gate.wait_hit()
        gate.open()
        settle(h)
        set_injector(h, None)
        assert rid not in s.lookups.inflight and s.index.pinned_slots == 0
        assert rid not in s.lookups.failed
        assert not any(load.invalid for load in s.lookups.inflight.values())
        assert sched(h).store.lookup(key) is None       # the bad entry is dropped
        assert h.stats["blocks_mismatched"] == 0


@pytest.mark.parametrize("interval, states, want, asy", [
    (32, [5, 7], 128, False),           # 96 ends the prompt's first chunk; 128 a decode step
    (None, [5, 6, 7, 8], 144, True),    # dense: every block edge the decode passed
], ids=["interval-32", "dense-async"])
def test_states_vllm_retains_during_decode_are_stored_and_hit(tmp_path, interval, states,
                                                              want, asy):
    """A decode step ends at every token, so vLLM keeps (and hands off) the states at the
    retained block edges the decode passes, not only where a prefill chunk ended: a
    conversation continued from the answer hits up to the last of them."""
    store = tmp_path / "store"
    a = prompts(70, 1, 100)[0]
    with kv_harness(store, retention_interval=interval, async_scheduling=asy, **MAMBA) as h:
        rid = h.add_request(a, max_tokens=60)
        h.drain()
        settle(h)
        full = a + h.finished[rid]
        assert [i for i, x in enumerate(_on_disk(h, keys_of(h, full, group=SSM))) if x] == states
        s, hit = _replay(h, [full[:150] + prompts(71, 1, 20)[0]], max_tokens=1)
        loads_ok(s)
        assert hit == want and s["states_read"] > 0


@pytest.mark.parametrize("kw, group, block", [(MAMBA, SSM, 7), (dict(), 0, 3)],
                         ids=["three-groups", "one-group"])
def test_a_failed_load_under_policy_fail_leaves_nothing(tmp_path, kw, group, block):
    """kv_load_failure_policy "fail" (vLLM's default): vLLM finishes the request with an
    error (request_finished) before it hands the connector the failure, so kvstore must
    not remember the request afterwards; its pins go, the bad entry is dropped."""
    import os

    from connector_util import assert_quiescent

    from kvstore.drivers.simulator import EngineHarness
    store = tmp_path / "store"
    p = prompts(100, 1, 140)[0]
    cfg = kv_config(store)
    cfg["kv_load_failure_policy"] = "fail"
    before = open_fds()
    h = EngineHarness(kv_transfer_config=cfg, workdir=str(tmp_path), **kw)
    try:
        h.run([p], max_tokens=1)
        settle(h)
        key = keys_of(h, p, group=group)[block]
        flip_payload_byte(store, 0, sched(h).store.lookup(key).slot, byte=100)
        drop_gpu_cache(h)
        h.run([p], max_tokens=2)
        settle(h)
        s = sched(h)
        assert h.stats["failed_recving" if kw else "invalid_block_ids"] >= 1
        assert not s.lookups.failed and not s.requests
        assert s.store.lookup(key) is None
        assert_quiescent(h, str(store), before)
    finally:
        h.shutdown()
    assert not {f for f in open_fds() - before if "pytest" not in f and os.sep in f}
