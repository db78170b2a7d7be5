"""EngineHarness with two KV cache groups (full attention + sliding window), run by
vLLM's real scheduler with the hybrid KV cache manager, without a KV connector."""

import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvstore.drivers.simulator import EngineHarness  # noqa: E402

BS = 16


def _prompts(seed, n, length):
    rng = random.Random(seed)
    return [[rng.randrange(10, 30000) for _ in range(length)] for _ in range(n)]


def _cdiv(a, b):
    return -(-a // b)


def test_two_groups_are_planned_and_allocated_like_vllm():
    import torch
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    with EngineHarness(num_layers=4, sliding_window=48, num_gpu_blocks=32) as h:
        cfg = h.kv_cache_config
        assert h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert isinstance(h.scheduler.kv_cache_manager.coordinator, HybridKVCacheCoordinator)
        g0, g1 = cfg.kv_cache_groups
        assert type(g0.kv_cache_spec) is FullAttentionSpec
        assert type(g1.kv_cache_spec) is SlidingWindowSpec
        assert g1.kv_cache_spec.sliding_window == 48
        assert g0.kv_cache_spec.block_size == g1.kv_cache_spec.block_size == BS
        assert g0.layer_names == h.layer_names[:2] and g1.layer_names == h.layer_names[2:]
        assert h.layer_groups == [0, 0, 1, 1]
        assert h.layers_of_group(1) == [2, 3]
        assert cfg.num_blocks == 32 and cfg.hash_block_size == BS
        # One KVCacheTensor per group, both aliasing one allocation from byte 0.
        assert [t.layers for t in cfg.kv_cache_tensors] == [g0.layer_names, g1.layer_names]
        assert all(t.offset == 0 for t in cfg.kv_cache_tensors)
        kv = h.ranks[0].kv_caches
        base = {v.untyped_storage().data_ptr() for v in kv.values()}
        assert len(base) == 1
        ptr = {n: v.data_ptr() for n, v in kv.items()}
        n = h.layer_names
        assert ptr[n[0]] == ptr[n[2]] and ptr[n[1]] == ptr[n[3]] and ptr[n[0]] != ptr[n[1]]
        for v in kv.values():
            assert tuple(v.shape) == (32, 2, BS, 2 * 16) and v.dtype == torch.float16  # K|V


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_layers=2),
        dict(num_layers=4, async_scheduling=True),
        dict(num_layers=4, layout="BLNHC", tp_size=2),
    ],
)
def test_second_pass_hits_the_gpu_prefix_cache_and_verifies(kw):
    window, length, n, max_tokens = 32, 100, 3, 2
    hit = (length - 1) // BS * BS  # 96: the whole prompt but its last token, aligned
    with EngineHarness(sliding_window=window, max_num_batched_tokens=64, **kw) as h:
        prompts = _prompts(1, n, length)
        st = h.run(prompts, max_tokens=max_tokens)
        assert st["requests_finished"] == n
        assert st["tokens_computed"] == n * (length + max_tokens - 1)
        assert st["local_hit_tokens"] == 0 and st["blocks_verified"] == 0
        computed = st["tokens_computed"]

        st = h.run(prompts, max_tokens=max_tokens)
        assert st["requests_finished"] == 2 * n
        assert st["local_hit_tokens"] == n * hit
        assert st["tokens_computed"] - computed == n * (length - hit + max_tokens - 1)
        # full attention: every block of the hit; sliding window: the blocks that
        # hold positions >= hit - (window - 1).
        per_req = hit // BS + (_cdiv(hit, BS) - (hit - (window - 1)) // BS)
        assert st["blocks_verified"] == n * per_req
        assert st["blocks_mismatched"] == 0 and h.mismatches == []
        assert st["blocks_loaded"] == 0
        h.assert_no_leaks()


def test_corrupted_sliding_window_byte_is_detected_inside_the_window_only():
    window, length = 32, 100
    hit = 96
    lo = hit - (window - 1)  # 65: first position the sliding-window group still needs
    with EngineHarness(num_layers=4, sliding_window=window) as h:
        (prompt,) = _prompts(2, 1, length)
        rid = h.add_request(prompt, max_tokens=2)
        h.drain()
        full, swa = h.block_tables(rid)
        assert h.block_table(rid) == full and 0 not in full
        blk = swa[lo // BS]  # index 4: positions 64..79, held by vLLM for the hit
        assert blk != 0
        layer = h.layers_of_group(1)[1]
        nc = h.ranks[0].byte_views[layer].shape[3]  # bytes per token per head

        # Position 64 = lo - 1: outside the window, so not checked.
        h.corrupt_block(blk, layer=layer, byte=0 * nc + 5)
        st = h.run([prompt], max_tokens=1)
        assert st["local_hit_tokens"] == hit
        assert st["blocks_mismatched"] == 0

        # Position 65 = lo: inside the window, detected.
        h.corrupt_block(blk, layer=layer, byte=1 * nc + 5)
        st = h.run([prompt], max_tokens=1)
        assert st["local_hit_tokens"] == 2 * hit
        assert st["blocks_mismatched"] == 1
        m = h.mismatches[0]
        assert (m["group"], m["layer"], m["block_id"], m["position"]) == (1, layer, blk, lo)

        # The same kind of corruption of a full-attention layer, far outside any
        # window, is detected too.
        h.corrupt_block(full[0], layer=h.layers_of_group(0)[0], byte=3)
        st = h.run([prompt], max_tokens=1)
        assert st["blocks_mismatched"] == 3  # 1 + the old sliding-window one + block 0
        assert {(m["group"], m["block_id"]) for m in h.mismatches} == {(1, blk), (0, full[0])}
        h.assert_no_leaks()


def test_window_shorter_than_prompt_leaves_null_blocks_at_the_head():
    window, length = 32, 200
    with EngineHarness(num_layers=2, sliding_window=window, max_num_batched_tokens=64,
                       num_gpu_blocks=64) as h:
        (prompt,) = _prompts(3, 1, length)
        rid = h.add_request(prompt, max_tokens=4)
        req = h.scheduler.requests[rid]
        nulls_seen = 0
        while rid in h.scheduler.requests:
            h.step()
            if rid not in h.scheduler.requests:
                break
            full, swa = h.block_tables(rid)
            assert (full, swa) == h.scheduler.kv_cache_manager.get_block_ids(rid)
            assert 0 not in full
            done = req.num_computed_tokens  # this step's tokens included
            k = next(i for i, b in enumerate(swa) if b != 0)
            assert all(b != 0 for b in swa[k:])  # nulls only at the head
            # vLLM frees blocks wholly before the window of the tokens processed
            # by the previous step; every block the window still needs is held.
            assert k * BS <= max(0, done - (window - 1))
            nulls_seen = max(nulls_seen, k)
        assert nulls_seen >= (length - (window - 1)) // BS - 1 >= 8
        assert h.stats["blocks_mismatched"] == 0

        # A second request for the same prompt starts from a GPU hit whose
        # sliding-window table is null at the head; verification skips the nulls.
        rid2 = h.add_request(prompt, max_tokens=2)
        h.step()
        hit = (length - 1) // BS * BS
        assert h.scheduler.requests[rid2].num_computed_tokens == length
        full2, swa2 = h.block_tables(rid2)
        nulls = (hit - (window - 1)) // BS
        assert swa2[:nulls] == [0] * nulls and 0 not in swa2[nulls:]
        assert 0 not in full2
        assert h.stats["local_hit_tokens"] == hit
        h.drain()
        assert h.stats["blocks_mismatched"] == 0
        assert h.stats["blocks_verified"] == hit // BS + (_cdiv(hit, BS) - nulls)
        h.assert_no_leaks()


def test_window_longer_than_prompt_behaves_like_full_attention():
    with EngineHarness(num_layers=2, sliding_window=4096) as h:
        prompts = _prompts(4, 2, 70)
        h.run(prompts, max_tokens=2)
        st = h.run(prompts, max_tokens=2)
        assert st["local_hit_tokens"] == 2 * 64
        assert st["blocks_verified"] == 2 * (4 + 4)
        assert st["blocks_mismatched"] == 0
        assert all(0 not in t for r in h.finished for t in h.block_tables(r))
        h.assert_no_leaks()


@pytest.mark.parametrize(
    "kw, err",
    [
        (dict(num_layers=3, sliding_window=32), "even num_layers"),
        (dict(num_layers=2, sliding_window=0), "positive int"),
    ],
)
def test_bad_sliding_window_arguments_are_refused(kw, err):
    with pytest.raises(ValueError, match=err):
        EngineHarness(**kw)


def test_preemption_with_a_small_cache_verifies_every_resume():
    rng = random.Random(5)
    base = [rng.randrange(10, 30000) for _ in range(40)]
    prompts = [base + [rng.randrange(10, 30000) for _ in range(rng.randrange(10, 60))]
               for _ in range(8)]
    with EngineHarness(num_layers=2, sliding_window=32, num_gpu_blocks=30,
                       max_num_batched_tokens=64) as h:
        preempt, count = h.scheduler._preempt_request, []

        def counting(*a, **k):
            count.append(1)
            return preempt(*a, **k)

        h.scheduler._preempt_request = counting
        st = h.run(prompts, max_tokens=150)
        assert count, "the cache is meant to be too small for all requests at once"
        assert st["requests_finished"] == 8
        assert st["local_hit_tokens"] > 0 and st["blocks_verified"] > 0
        assert st["blocks_mismatched"] == 0
        h.assert_no_leaks()


# -- three groups: full attention + sliding window + Mamba ("align") -----------------

MAMBA = dict(num_layers=3, sliding_window=32, mamba=True)


def test_three_groups_are_planned_and_allocated_like_vllm():
    import torch
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    with EngineHarness(num_gpu_blocks=32, **MAMBA) as h:
        cfg = h.kv_cache_config
        assert h.vllm_config.cache_config.mamba_cache_mode == "align"
        coord = h.scheduler.kv_cache_manager.coordinator
        assert isinstance(coord, HybridKVCacheCoordinator)
        assert isinstance(coord.single_type_managers[2], MambaManager)
        g0, g1, g2 = cfg.kv_cache_groups
        assert [type(g.kv_cache_spec) for g in (g0, g1, g2)] == \
            [FullAttentionSpec, SlidingWindowSpec, MambaSpec]
        ssm = g2.kv_cache_spec
        assert ssm.mamba_cache_mode == "align" and ssm.block_size == BS
        assert ssm.page_size_bytes == g0.kv_cache_spec.page_size_bytes == 2048
        assert ssm.real_page_size_bytes == h.mamba_state_bytes == 1408
        assert h.group_is_mamba == [False, False, True]
        assert all(t.offset == 0 for t in cfg.kv_cache_tensors)
        kv = h.ranks[0].kv_caches
        full, swa, state = (kv[g.layer_names[0]] for g in (g0, g1, g2))
        # The Mamba view: one state per block, raw int8, on the attention page.
        assert tuple(state.shape) == (32, 1, 1, 1408) and state.dtype == torch.int8
        assert state.stride(0) == full.stride(0) * full.element_size() == 2048
        assert state.data_ptr() == full.data_ptr() == swa.data_ptr()


def test_second_pass_verifies_the_mamba_state_at_the_hit():
    length, n = 140, 3
    hit = (length - 1) // BS * BS      # 128: the replay boundary, whose state vLLM keeps
    with EngineHarness(max_num_batched_tokens=64, **MAMBA) as h:
        prompts = _prompts(6, n, length)
        st = h.run(prompts, max_tokens=3)
        assert st["blocks_verified"] == 0
        st = h.run(prompts, max_tokens=3)
        assert st["local_hit_tokens"] == n * hit
        # full: 8 blocks; window (31 tokens before 128): 2; Mamba: the one state.
        assert st["blocks_verified"] == n * (8 + 2 + 1)
        assert st["blocks_mismatched"] == 0 and st["blocks_loaded"] == 0
        h.assert_no_leaks()


def test_a_corrupt_mamba_state_is_detected_and_its_padding_is_not_read():
    length = 140
    with EngineHarness(**MAMBA) as h:
        (prompt,) = _prompts(7, 1, length)
        rid = h.add_request(prompt, max_tokens=1)
        h.drain()
        blk = h.block_tables(rid)[2][7]          # the state after 128 tokens
        layer = h.layers_of_group(2)[0]
        bv = h.ranks[0].byte_views[layer]
        # A byte of the padding after the state (the page is the attention page): not
        # part of the state, not checked.
        pad = bv.as_strided((1,), (1,), bv.storage_offset() + blk * bv.stride(0)
                            + h.mamba_state_bytes)
        was = int(pad[0])
        pad ^= 0xFF
        assert int(pad[0]) == was ^ 0xFF and bv[blk, 0, 0].numel() == h.mamba_state_bytes
        st = h.run([prompt], max_tokens=1)
        assert st["local_hit_tokens"] == 128 and st["blocks_mismatched"] == 0
        # A byte of the state itself: detected on the next hit.
        h.corrupt_block(blk, layer=layer, byte=h.mamba_state_bytes - 1)
        st = h.run([prompt], max_tokens=1)
        assert st["local_hit_tokens"] == 256 and st["blocks_mismatched"] == 1
        m = h.mismatches[0]
        assert (m["group"], m["layer"], m["block_id"], m["position"], m["state"]) == \
            (2, layer, blk, 128, True)


def test_mamba_harness_arguments_are_checked():
    with pytest.raises(ValueError, match="multiple of 3"):
        EngineHarness(num_layers=4, sliding_window=32, mamba=True)
    with pytest.raises(ValueError, match="number of Mamba groups"):
        EngineHarness(num_layers=3, mamba=-1)
    with EngineHarness(num_layers=2, mamba=True) as h:     # full + Mamba: two groups
        assert h.group_kinds == ["full", "mamba"] and h.num_groups == 2
        st = h.run(_prompts(8, 2, 70), max_tokens=2)
        st = h.run(_prompts(8, 2, 70), max_tokens=2)
        assert st["local_hit_tokens"] == 2 * 64 and st["blocks_mismatched"] == 0
        assert st["blocks_verified"] == 2 * (4 + 1)


def test_a_running_request_reads_its_mamba_state_at_every_step():
    """The fake forward reads the state it continues from, as an SSM does: a running
    request's state block overwritten between two of its steps (say, by a load scattered
    into the wrong block) is a mismatch at its next step, though no request starts from
    that state; an untouched run checks the state at every step and finds none."""
    with EngineHarness(**MAMBA) as h:
        rid = h.add_request(_prompts(10, 1, 40)[0], max_tokens=6)
        h.step()                                  # prefill to 32 (a block edge)
        h.step()                                  # 32 -> 40: the state in block 2
        blk = h.block_tables(rid)[2][2]
        layer = h.layers_of_group(2)[0]
        h.corrupt_block(blk, layer=layer, byte=5)
        h.step()                                  # 40 -> 41 reads it
        assert h.stats["blocks_mismatched"] == 1
        m = h.mismatches[-1]
        assert (m["req_id"], m["group"], m["layer"], m["block_id"], m["position"]) == \
            (rid, 2, layer, blk, 40) and m["state_read"]
        h.drain()
        assert h.stats["blocks_mismatched"] == 1   # the next steps read the new states
    with EngineHarness(**MAMBA) as h:
        st = h.run(_prompts(9, 1, 40), max_tokens=6)
        # 0 -> 32, 32 -> 40, then 5 decode steps: all but the first continue from the
        # state their predecessor wrote
        assert st["blocks_mismatched"] == 0 and st["states_read"] == 6
