"""The step's lookup budget (`lookup_blocks_per_step`, issue 14): a scheduler step walks at
most that many blocks of disk lookups; a lookup cut by it keeps what it found pinned and
answers None (vLLM's "ask again later"), and the next step goes on from there. Through
vLLM's real scheduler, real store, every loaded block verified byte for byte."""
from __future__ import annotations

import pytest

from connector_util import (BS, conn_stats, drop_gpu_cache, kv_harness, loads_ok, prompts,
                            sched, settle)
from kvstore.errors import ConfigError
from kvstore.vllm.config import ConnectorConfig


def _walks(h) -> list[list[int]]:
    """Blocks walked by the connector's lookups, per scheduler step (the list grows a new
    step at each build_connector_meta)."""
    s = sched(h)
    steps: list[list[int]] = [[]]
    orig_lookup, orig_meta = s.index.lookup_hashes, s.build_connector_meta

    def lookup(hashes, start, stop, group=0, packed=False):
        out = orig_lookup(hashes, start, stop, group, packed)
        steps[-1].append(stop - start)
        return out

    def meta(so):
        steps.append([])
        return orig_meta(so)
    s.index.lookup_hashes, s.build_connector_meta = lookup, meta
    return steps


def _stored(h, ps) -> None:
    """Run ps, let the stores commit, empty vLLM's GPU cache: the next run loads."""
    h.run(ps, max_tokens=1)
    settle(h)
    drop_gpu_cache(h)


def test_a_long_hit_is_walked_over_several_steps_and_loads_whole(tmp_path):
    p = prompts(90, 1, 20 * BS + 3)[0]            # 20 full blocks
    with kv_harness(tmp_path / "store", extra={"lookup_blocks_per_step": 8}) as h:
        _stored(h, [p])
        walks = _walks(h)
        before = dict(h.stats)
        rid = h.add_request(p, max_tokens=2)
        h.step()
        s = sched(h)
        # 8 blocks found and pinned, the request still waits for the rest of its lookup
        assert rid in s._partial and rid not in s._inflight_loads
        assert s._partial[rid][1] == 8 and s.index.pinned_slots == 8
        st = h.drain()
        st = h.stats
        loads_ok(st)
        assert st["external_hit_tokens"] - before["external_hit_tokens"] == 20 * BS
        assert st["blocks_loaded"] - before["blocks_loaded"] == 20
        assert [sum(w) for w in walks if w][:3] == [8, 8, 4]
        assert max(sum(w) for w in walks) <= 8
        assert conn_stats(h)["deferred_lookups"] == 2
        assert not s._partial


def test_the_budget_is_shared_by_a_steps_lookups(tmp_path):
    """Two 6-block hits under an 8-block budget: the first walks 6, the second 2 (then
    None), and goes on the next step; both load everything."""
    ps = prompts(91, 2, 6 * BS + 5)
    with kv_harness(tmp_path / "store", extra={"lookup_blocks_per_step": 8}) as h:
        _stored(h, ps)
        walks = _walks(h)
        before = dict(h.stats)
        for p in ps:
            h.add_request(p, max_tokens=1)
        h.step()
        assert walks[0] == [6, 2] and len(sched(h)._partial) == 1
        h.drain()
        st = h.stats
        loads_ok(st)
        assert st["external_hit_tokens"] - before["external_hit_tokens"] == 12 * BS
        assert max(sum(w) for w in walks) <= 8


def test_misses_cost_one_block_each(tmp_path):
    """A lookup that misses at once walks one block: a step of new prompts is never held
    back by the budget."""
    ps = prompts(92, 6, 10 * BS + 1)
    with kv_harness(tmp_path / "store", extra={"lookup_blocks_per_step": 6},
                    max_num_batched_tokens=2048, num_gpu_blocks=128) as h:
        walks = _walks(h)
        for p in ps:
            h.add_request(p, max_tokens=1)
        h.step()
        # each asks for what the budget has left (capped at its 10 blocks) and spends
        # one block of it: the first block misses
        assert walks[0] == [6, 5, 4, 3, 2, 1]
        assert not sched(h)._partial
        assert h.scheduler.get_request_counts()[1] == 0    # none left waiting
        h.drain()
        settle(h)
        assert conn_stats(h).get("deferred_lookups", 0) == 0


def test_an_abort_during_a_split_lookup_gives_its_pins_back(tmp_path):
    p = prompts(93, 1, 20 * BS + 3)[0]
    with kv_harness(tmp_path / "store", extra={"lookup_blocks_per_step": 8}) as h:
        _stored(h, [p])
        rid = h.add_request(p, max_tokens=1)
        h.step()
        s = sched(h)
        assert s.index.pinned_slots == 8
        h.abort(rid)
        assert not s._partial and s.index.pinned_slots == 0
        h.drain()


def test_a_reset_drops_a_split_lookups_part(tmp_path):
    """reset_cache leaves nothing to hit: what a split lookup found before it is given
    back, and the request computes its prompt."""
    p = prompts(94, 1, 20 * BS + 3)[0]
    with kv_harness(tmp_path / "store", extra={"lookup_blocks_per_step": 8}) as h:
        _stored(h, [p])
        before = dict(h.stats)
        h.add_request(p, max_tokens=1)
        h.step()
        s = sched(h)
        assert s._partial
        assert s.reset_cache() is True
        assert not s._partial and s.index.pinned_slots == 0
        h.drain()
        assert h.stats["external_hit_tokens"] == before["external_hit_tokens"]


def test_a_moved_gpu_hit_walks_again(tmp_path):
    """A split lookup started at block 0; meanwhile vLLM's GPU cache got the first blocks
    (another request computed them): the lookup walks again from the new start."""
    p = prompts(95, 1, 20 * BS + 3)[0]
    with kv_harness(tmp_path / "store", extra={"lookup_blocks_per_step": 8}) as h:
        _stored(h, [p])
        s = sched(h)
        rid = h.add_request(p, max_tokens=1)
        h.step()
        assert s._partial[rid][0] == 0
        req = h.scheduler.requests[rid]
        got = s.get_num_new_matched_tokens(req, 4 * BS)     # as vLLM asks with a GPU hit
        assert got == (None, False)
        assert s._partial[rid][:2] == (4, 12) and s.index.pinned_slots == 8
        h.drain()
        loads_ok(h.stats)


def test_no_budget_walks_a_hit_in_one_step(tmp_path):
    p = prompts(96, 1, 20 * BS + 3)[0]
    with kv_harness(tmp_path / "store", extra={"lookup_blocks_per_step": 0}) as h:
        _stored(h, [p])
        walks = _walks(h)
        rid = h.add_request(p, max_tokens=1)
        h.step()
        assert walks[0] == [20] and rid in sched(h)._inflight_loads
        h.drain()
        loads_ok(h.stats)


def test_the_budget_is_validated():
    assert ConnectorConfig.from_extra_config({"path": "/x"}).lookup_blocks_per_step == 1024
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ConfigError, match="lookup_blocks_per_step"):
            ConnectorConfig.from_extra_config({"path": "/x", "lookup_blocks_per_step": bad})


def test_a_hybrid_lookup_waits_for_a_fresh_budget(tmp_path):
    """Hybrid walks are not split: once a step's budget is spent, the next hybrid lookup
    is deferred whole to the next step; both requests load their hits."""
    ps = prompts(97, 2, 140)                 # 8 full blocks each
    hyb = {"sliding_window": 32, "num_layers": 2}
    with kv_harness(tmp_path / "store", extra={"lookup_blocks_per_step": 4}, **hyb) as h:
        assert sched(h).hybrid
        _stored(h, ps)
        before = dict(h.stats)
        for p in ps:
            h.add_request(p, max_tokens=1)
        h.step()
        s = sched(h)
        assert len(s._inflight_loads) == 1
        h.drain()
        st = h.stats
        loads_ok(st)
        assert st["external_hit_tokens"] - before["external_hit_tokens"] == 2 * 8 * BS
        assert conn_stats(h)["deferred_lookups"] >= 1
