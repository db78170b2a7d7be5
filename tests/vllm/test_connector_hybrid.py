"""Hybrid models through vLLM's real scheduler: a full-attention and a sliding-window KV
cache group (vLLM's HybridKVCacheCoordinator), byte-verified by the harness.

A hit is what vLLM's hybrid coordinator would accept: the full-attention group's blocks
from the GPU hit to the end, the sliding-window group's blocks of the window before the
end (null blocks are never stored or loaded). Keys keep their group id.
"""
from __future__ import annotations

import pytest

import vllm  # noqa: E402,F401  (needed: a vLLM that does not import fails these tests)

from connector_util import (BS, conn_stats, drop_gpu_cache, flip_payload_byte,  # noqa: E402
                            keys_of, kv_config, kv_harness, loads_ok, open_fds, prompts,
                            sched, settle)

from kvstore.errors import LayoutMismatch  # noqa: E402

WINDOW = 32          # tokens: the window before a hit's end is 2 blocks
HYB = {"sliding_window": WINDOW, "num_layers": 2}



def _replay(h, ps, **kw):
    """Empty vLLM's GPU prefix cache, run `ps` again: (stats, tokens hit on disk by it)."""
    drop_gpu_cache(h)
    before = h.stats["external_hit_tokens"]
    s = h.run(ps, **kw)
    return s, s["external_hit_tokens"] - before


def test_two_groups_round_trip_through_a_restart(tmp_path):
    store = tmp_path / "store"
    ps = prompts(71, 3, 140)                 # 8 full blocks each, 140 tokens
    with kv_harness(store, **HYB) as h:
        assert sched(h).hybrid and sched(h).layout.groups == f"full;swa:{WINDOW}"
        h.run(ps, max_tokens=2)
        settle(h)
        st = sched(h).store
        for p in ps:                         # every group's completed blocks are stored
            for g in (0, 1):
                assert all(st.lookup(k) is not None for k in keys_of(h, p, group=g)), g
        failed_before = h.stats["failed_recving"]
        s, hit = _replay(h, ps, max_tokens=2)
        loads_ok(s)
        assert hit == 3 * 8 * BS
        assert s["failed_recving"] == failed_before
    with kv_harness(store, **HYB) as h:      # restart: the GPU cache is empty
        s = h.run(ps, max_tokens=2)
        loads_ok(s)
        assert s["external_hit_tokens"] == 3 * 8 * BS
        # Loads read each full-attention block and only the window's sliding-window
        # blocks: 8 + 2 per prompt.
        assert s["blocks_loaded"] >= 3 * (8 + WINDOW // BS)
        assert s["invalid_block_ids"] == 0


def test_a_hit_ends_where_the_window_is_on_disk(tmp_path):
    """The sliding-window group's blocks 5..7 were dropped: a hit at 8 blocks would need
    blocks 6 and 7; the longest hit vLLM accepts ends at block 5 (window blocks 3, 4)."""
    store = tmp_path / "store"
    p = prompts(72, 1, 140)[0]
    with kv_harness(store, **HYB) as h:
        h.run([p], max_tokens=1)
        settle(h)
        sw = keys_of(h, p, group=1)
        sched(h).index.drop(sw[5:8])
        sched(h).index.flush()
        s, hit = _replay(h, [p], max_tokens=1)
        loads_ok(s)
        assert hit == 5 * BS
        settle(h)
        # The recomputed blocks were stored again: the next pass hits all 8.
        assert all(sched(h).store.lookup(k) is not None for k in sw)
        s, hit = _replay(h, [p], max_tokens=1)
        loads_ok(s)
        assert hit == 8 * BS


def test_a_corrupt_slot_fails_the_whole_request_through_failed_recving(tmp_path):
    """vLLM refuses per-block invalid_block_ids with several groups: a bad block fails
    the request's load (failed_recving), the request recomputes, tokens stay right, and
    the bad entry is dropped."""
    store = tmp_path / "store"
    p = prompts(73, 1, 140)[0]
    with kv_harness(store, **HYB) as h:
        h.run([p], max_tokens=1)
        settle(h)
        full = keys_of(h, p, group=0)
        entry = sched(h).store.lookup(full[3])
        flip_payload_byte(store, 0, entry.slot)
        drop_gpu_cache(h)
        before = dict(h.stats)
        s = h.run([p], max_tokens=2)
        assert s["failed_recving"] - before["failed_recving"] == 1
        assert s["invalid_block_ids"] == before["invalid_block_ids"]
        assert s["blocks_mismatched"] == 0          # recomputed, never served corrupt
        settle(h)
        assert conn_stats(h)["load_failures"] > 0
        # The bad block is recomputed and stored again; a later pass loads it cleanly.
        s, hit = _replay(h, [p], max_tokens=1)
        assert hit in (0, 8 * BS)
        assert s["blocks_mismatched"] == 0


def test_a_store_of_another_group_structure_is_refused_with_the_field(tmp_path):
    from kvstore.drivers.simulator import EngineHarness
    store = tmp_path / "store"
    with kv_harness(store, num_layers=1) as h:      # one group: a plain model
        h.run(prompts(74, 1, 40), max_tokens=1)
        settle(h)
    before = open_fds()
    with pytest.raises(LayoutMismatch) as ei:
        EngineHarness(kv_transfer_config=kv_config(store), workdir=str(tmp_path),
                      sliding_window=WINDOW, num_layers=2)
    assert ei.value.field in ("groups", "num_layers")
    assert ei.value.field in str(ei.value)
    assert not open_fds() - before


def test_preemption_under_gpu_pressure_keeps_tokens_right(tmp_path):
    store = tmp_path / "store"
    ps = prompts(75, 4, 140)
    with kv_harness(store, num_gpu_blocks=48, **HYB) as h:
        h.run(ps, max_tokens=24)
        settle(h)
        s, _ = _replay(h, ps, max_tokens=24)
        loads_ok(s)
        assert s["blocks_mismatched"] == 0


def test_abort_while_a_hybrid_load_is_in_flight(tmp_path):
    """Loads of both groups held at the disk; two of three requests aborted meanwhile:
    every pin stays until the worker reports, then goes; the third request is served
    from disk, byte-verified."""
    from connector_util import Gate, set_injector
    store = tmp_path / "store"
    ps = prompts(76, 3, 100)                 # 6 full blocks: 6 + 2 window blocks each
    with kv_harness(store, **HYB) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        gate = Gate("read")
        set_injector(h, gate)
        rids = [h.add_request(p, max_tokens=4) for p in ps]
        h.step()
        s = sched(h)
        assert set(s.lookups.inflight) == set(rids)
        assert s.index.pinned_slots == 3 * (6 + WINDOW // BS)
        h.abort(rids[:2])
        for _ in range(5):
            h.step()
        assert s.index.pinned_slots == 3 * (6 + WINDOW // BS)
        gate.wait_hit()
        gate.open()
        h.drain()
        set_injector(h, None)
        assert s.index.pinned_slots == 0
        assert rids[2] in h.finished and rids[0] not in h.finished
        assert h.stats["blocks_mismatched"] == 0 and h.stats["failed_recving"] == 0


def test_a_stalled_hybrid_load_times_out_and_recomputes(tmp_path):
    from connector_util import Gate, set_injector
    store = tmp_path / "store"
    p = prompts(77, 1, 100)[0]
    with kv_harness(store, extra={"load_timeout_s": 0.5}, **HYB) as h:
        h.run([p], max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        gate = Gate("read")
        set_injector(h, gate)
        before = dict(h.stats)
        rid = h.add_request(p, max_tokens=2)
        h.drain(timeout_s=30)
        assert rid in h.finished
        assert h.stats["failed_recving"] - before["failed_recving"] == 1
        assert h.stats["blocks_mismatched"] == 0
        gate.open()
        set_injector(h, None)


def test_info_and_fsck_name_the_groups_of_a_hybrid_store(tmp_path):
    from kvstore.tools import info
    from kvstore.tools.fsck import fsck
    store = tmp_path / "store"
    with kv_harness(store, **HYB) as h:
        h.run(prompts(78, 1, 70), max_tokens=1)
        settle(h)
    got = info.gather(str(store))
    assert got["layout"]["groups"] == f"full;swa:{WINDOW}"
    assert f"groups=full;swa:{WINDOW}" in info.format_text(got)
    rep = fsck(str(store), deep=True)        # both groups' slots verify offline
    assert rep.exit_code == 0 and not rep.findings, rep.to_json()


def test_a_hybrid_lookup_that_fails_midway_leaves_no_pin(tmp_path, monkeypatch):
    """Group 0's blocks are pinned, then group 1's lookup raises: a miss, nothing pinned."""
    from kvstore.errors import KVStoreError
    store = tmp_path / "store"
    p = prompts(79, 1, 140)[0]
    with kv_harness(store, **HYB) as h:
        h.run([p], max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        ix = sched(h).index
        orig = ix.lookup_hashes

        def flaky(hashes, lo, end, group=0, **kw):
            if group == 1:
                raise KVStoreError("injected")
            return orig(hashes, lo, end, group, **kw)
        monkeypatch.setattr(ix, "lookup_hashes", flaky)
        before = dict(h.stats)
        s = h.run([p], max_tokens=1)
        assert s["external_hit_tokens"] == before["external_hit_tokens"]
        assert ix.pinned_slots == 0 and s["blocks_mismatched"] == 0
        monkeypatch.undo()
