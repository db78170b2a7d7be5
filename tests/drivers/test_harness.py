"""Tests of the CPU engine harness (kvstore.drivers.simulator) against real vLLM."""

import glob
import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvstore.drivers.simulator import EngineHarness, expected_token_bytes, write_model_dir  # noqa: E402


def _prompts(seed, n, length, shared=0):
    rng = random.Random(seed)
    base = [rng.randrange(10, 30000) for _ in range(shared)]
    return [base + [rng.randrange(10, 30000) for _ in range(length - shared)] for _ in range(n)]


def test_model_dir_and_expected_bytes_are_deterministic(tmp_path):
    d = write_model_dir(tmp_path / "m", num_layers=3, num_kv_heads=4, head_dim=8)
    assert os.path.exists(os.path.join(d, "config.json"))
    import numpy as np

    h = np.array([1, 2, 3], dtype=np.uint64)
    p = np.array([0, 1, 2], dtype=np.uint64)
    a = expected_token_bytes(h, p, 0, 0, 100)
    assert a.shape == (3, 100)
    assert (a == expected_token_bytes(h, p, 0, 0, 100)).all()
    assert (a != expected_token_bytes(h, p, 1, 0, 100)).any()
    assert (a != expected_token_bytes(h, p, 0, 1, 100)).any()


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(tp_size=2),
        dict(layout="BLNHC"),
        dict(async_scheduling=True),
        dict(num_gpu_blocks=12, max_num_batched_tokens=48),  # tiny cache, chunked
    ],
)
def test_runs_to_completion_without_connector(kw):
    with EngineHarness(**kw) as h:
        st = h.run(_prompts(0, 6, 70), max_tokens=3)
        assert st["requests_finished"] == 6
        assert all(len(t) == 3 for t in h.finished.values())
        assert st["blocks_mismatched"] == 0
        assert st["blocks_loaded"] == 0
        h.assert_no_leaks()


def test_prefix_cache_hit_inside_vllm_is_verified():
    with EngineHarness(num_gpu_blocks=64) as h:
        prompts = _prompts(1, 4, 100, shared=64)
        h.run(prompts[:1], max_tokens=2)
        st = h.run(prompts[1:], max_tokens=2)
        assert st["local_hit_tokens"] >= 3 * 64
        assert st["blocks_verified"] >= 3 * 4
        assert st["blocks_loaded"] == 0
        assert st["blocks_mismatched"] == 0
        # Same prompt again: the whole prompt but its last token is a hit.
        before = h.stats["blocks_verified"]
        h.run(prompts[:1], max_tokens=1)
        assert h.stats["blocks_verified"] > before
        assert h.stats["blocks_mismatched"] == 0
        h.assert_no_leaks()


def test_verifier_detects_corrupted_local_block():
    with EngineHarness(num_gpu_blocks=64) as h:
        prompts = _prompts(2, 2, 80, shared=48)
        rid = h.add_request(prompts[0], max_tokens=1)
        h.step()
        blocks = h.block_table(rid)
        h.drain()
        h.corrupt_block(blocks[1], layer=1, byte=7)  # still in the prefix cache
        st = h.run(prompts[1:], max_tokens=1)
        assert st["blocks_mismatched"] == 1
        assert h.mismatches[0]["block_id"] == blocks[1]
        h.assert_no_leaks()


def test_abort_leaves_no_leaks():
    with EngineHarness(num_gpu_blocks=32, max_num_batched_tokens=32) as h:
        p = _prompts(3, 2, 90)
        r0 = h.add_request(p[0], max_tokens=20)
        r1 = h.add_request(p[1], max_tokens=20)
        h.step()
        h.abort(r0)
        h.step()
        h.abort([r1])
        h.drain()
        assert h.stats["requests_aborted"] == 2
        h.assert_no_leaks()


def test_example_connector_loads_verify_and_corruption_is_detected(tmp_path):
    store = str(tmp_path / "example_store")
    os.makedirs(store)
    ktc = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": store},
    }
    prompts = _prompts(4, 3, 50)
    # Engine 1 computes and the connector saves the prompts' KV.
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=ktc) as h:
        st = h.run(prompts, max_tokens=2)
        assert st["blocks_loaded"] == 0
        h.assert_no_leaks()
    files = sorted(glob.glob(os.path.join(store, "*", "*.safetensors")))
    assert len(files) == 3 * 2  # 3 prompts x 2 layers

    # Engine 2 (empty "GPU" cache) loads them back: 48 of 50 tokens each.
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=ktc) as h:
        st = h.run(prompts, max_tokens=2)
        assert st["external_hit_tokens"] == 3 * 48
        assert st["blocks_loaded"] == 9
        assert st["blocks_verified"] == 9
        assert st["blocks_mismatched"] == 0, h.mismatches
        h.assert_no_leaks()

    # Flip one value in one stored layer file: engine 3 must notice.
    import safetensors.torch as stt

    t = stt.load_file(files[0])["kv_cache"]
    t.view(-1)[5] += 1
    stt.save_file({"kv_cache": t}, files[0])
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=ktc) as h:
        st = h.run(prompts, max_tokens=2)
        assert st["blocks_loaded"] == 9
        assert st["blocks_mismatched"] == 1
        assert h.mismatches[0]["position"] == 0
        h.assert_no_leaks()


# ---------------------------------------------------------------------------
# A toy asynchronous connector (test-only) to exercise the harness's async
# load path: WAITING_FOR_REMOTE_KVS -> finished_recving -> verified blocks,
# held blocks on finish (finished_sending), and invalid_block_ids recompute.
# ---------------------------------------------------------------------------

from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

_TOY_STORE: dict = {}  # (block_hash, rank, layer) -> tensor of one block
_TOY_FAIL: set = set()  # block hashes whose load "fails"


@dataclass
class _ToyMeta(KVConnectorMetadata):
    loads: dict = field(default_factory=dict)  # req -> [(hash, block_id)]
    stores: dict = field(default_factory=dict)  # req -> [(hash, block_id)]


class ToyAsyncConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.bs = vllm_config.cache_config.block_size
        self.rank = vllm_config.parallel_config.rank
        self._loads: dict = {}
        self._stores: dict = {}
        self._done_recv: set = set()
        self._done_send: set = set()
        self._errors: set = set()
        self.kv = None

    @property
    def requires_kv_delivery(self):
        return False

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hashes = request.block_hashes
        start = num_computed_tokens // self.bs
        limit = (request.num_tokens - 1) // self.bs
        n = 0
        for i in range(start, min(len(hashes), limit)):
            if (hashes[i], 0, 0) not in _TOY_STORE:
                break
            n += 1
        return (n * self.bs, True) if n else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens <= 0:
            return
        ids = blocks.get_block_ids()[0]
        first = request.num_computed_tokens // self.bs
        nb = num_external_tokens // self.bs
        # async: num_computed_tokens is still the local hit here
        self._loads[request.request_id] = [
            (request.block_hashes[i], ids[i]) for i in range(first, first + nb)
        ]

    def build_connector_meta(self, scheduler_output):
        meta = _ToyMeta(loads=self._loads, stores=self._stores)
        self._loads, self._stores = {}, {}
        return meta

    def request_finished(self, request, block_ids):
        pairs = [
            (h, b)
            for h, b in zip(request.block_hashes, block_ids)
            if (h, 0, 0) not in _TOY_STORE
        ][: request.num_computed_tokens // self.bs]
        if not pairs:
            return False, None
        self._stores[request.request_id] = pairs
        return True, None

    # worker side
    def register_kv_caches(self, kv_caches):
        self.kv = kv_caches

    def start_load_kv(self, forward_context, **kwargs):
        for req_id, pairs in self._get_connector_metadata().loads.items():
            for h, b in pairs:
                if h in _TOY_FAIL:
                    self._errors.add(b)
                    continue
                for li, name in enumerate(self.kv):
                    self.kv[name][b].copy_(_TOY_STORE[(h, self.rank, li)])
            self._done_recv.add(req_id)

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        for req_id, pairs in self._get_connector_metadata().stores.items():
            for h, b in pairs:
                for li, name in enumerate(self.kv):
                    _TOY_STORE[(h, self.rank, li)] = self.kv[name][b].clone(
                        memory_format=torch.contiguous_format
                    )
            self._done_send.add(req_id)

    def get_finished(self, finished_req_ids):
        s, r = self._done_send, self._done_recv
        self._done_send, self._done_recv = set(), set()
        return s or None, r or None

    def get_block_ids_with_load_errors(self):
        e, self._errors = self._errors, set()
        return e


if "HarnessToyAsyncConnector" not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector(
        "HarnessToyAsyncConnector", __name__, "ToyAsyncConnector"
    )
_TOY = {"kv_connector": "HarnessToyAsyncConnector", "kv_load_failure_policy": "recompute"}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_async_toy_connector_loads_are_verified(tp_size):
    _TOY_STORE.clear()
    _TOY_FAIL.clear()
    prompts = _prompts(5, 3, 70)
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=_TOY, tp_size=tp_size) as h:
        st = h.run(prompts, max_tokens=2)
        assert st["finished_sending"] == 3
        h.assert_no_leaks()
    assert len(_TOY_STORE) == 3 * 4 * 2 * tp_size  # prompts x blocks x layers x ranks
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=_TOY, tp_size=tp_size) as h:
        st = h.run(prompts, max_tokens=2)
        assert st["finished_recving"] == 3
        assert st["blocks_loaded"] == 3 * 4
        assert st["blocks_mismatched"] == 0, h.mismatches
        h.assert_no_leaks()
    # Corrupt one stored block of the last rank: detected.
    key = next(k for k in _TOY_STORE if k[1] == tp_size - 1 and k[2] == 1)
    _TOY_STORE[key].view(-1)[3] += 1
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=_TOY, tp_size=tp_size) as h:
        st = h.run(prompts, max_tokens=2)
        assert st["blocks_mismatched"] == 1
        h.assert_no_leaks()


def test_async_load_error_is_recomputed():
    _TOY_STORE.clear()
    _TOY_FAIL.clear()
    prompts = _prompts(6, 2, 70)
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=_TOY) as h:
        h.run(prompts, max_tokens=1)
    # Loads of block 2 of every prompt fail: vLLM must recompute from there.
    for p in prompts:
        with EngineHarness(num_gpu_blocks=32, kv_transfer_config=_TOY) as h:
            rid = h.add_request(p, max_tokens=1)
            h.step()
            _TOY_FAIL.add(h.scheduler.requests[rid].block_hashes[2])
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=_TOY) as h:
        st = h.run(prompts, max_tokens=2)
        assert st["invalid_block_ids"] == 2
        assert st["requests_finished"] == 2
        assert st["blocks_mismatched"] == 0, h.mismatches
        assert st["blocks_loaded"] == 2 * 2  # the two good blocks before the failure
        h.assert_no_leaks()


def test_a_load_into_a_block_that_held_the_same_content_counts_as_loaded():
    """vLLM hands a block out as new (free, its hash evicted or reset) whatever bytes it
    still holds: a load into it is a load (`blocks_loaded`), also when the free queue
    cycles the block back to the same position of the same prompt, as a replay after
    reset_prefix_cache does on a small GPU cache (the harness once counted such a block
    as a local hit, which vLLM never made of it)."""
    _TOY_STORE.clear()
    _TOY_FAIL.clear()
    prompts = _prompts(7, 1, 2 * 16 + 1)           # 2 full blocks + 1 token: 3 blocks
    with EngineHarness(num_gpu_blocks=4, kv_transfer_config=_TOY) as h:
        h.run(prompts, max_tokens=1)               # computed, then stored by the toy
        tables = [h.block_table(list(h.finished)[-1])]
        for _ in range(3):
            assert h.scheduler.reset_prefix_cache()
            before = dict(h.stats)
            st = h.run(prompts, max_tokens=1)
            assert st["external_hit_tokens"] - before["external_hit_tokens"] == 2 * 16
            assert st["blocks_loaded"] - before["blocks_loaded"] == 2
            assert st["blocks_mismatched"] == 0, h.mismatches
            tables.append(h.block_table(list(h.finished)[-1]))
        # the case itself: some pass got a loaded block where the pass before had it
        assert any(a[i] == b[i] for a, b in zip(tables, tables[1:]) for i in (0, 1)), tables
        h.assert_no_leaks()


def test_drain_yields_the_gil_after_an_empty_step_as_vllms_engine_core_does(monkeypatch):
    """vLLM's EngineCore sleeps 1 ms after a step that ran no model while requests remain
    (waiting for their KV loads), so a connector's transfer threads get the GIL; the
    harness's drain does the same, or it would spin on empty steps and starve them (the
    bench's load-heavy phase takes 71 s instead of 5 without the pause, docs/benchmarks.md)."""
    import inspect
    import threading
    import time

    from vllm.v1.engine.core import EngineCoreProc

    src = inspect.getsource(EngineCoreProc._process_engine_step)
    assert "not model_executed and self.scheduler.has_requests()" in src
    assert "time.sleep(0.001)" in src

    main = threading.get_ident()
    slept = []
    real_sleep = time.sleep

    def spy(s):
        if threading.get_ident() == main and s == 0.001:
            slept.append(h.last_step_executed)
        real_sleep(s)

    monkeypatch.setattr(time, "sleep", spy)
    _TOY_STORE.clear()
    _TOY_FAIL.clear()
    prompts = _prompts(8, 3, 70)
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=_TOY) as h:
        h.run(prompts, max_tokens=2)
        assert slept.count(True) == 0        # steps that ran the model: no pause
    slept.clear()
    with EngineHarness(num_gpu_blocks=32, kv_transfer_config=_TOY) as h:
        st = h.run(prompts, max_tokens=2)    # async loads: empty steps while they run
        assert st["finished_recving"] == 3
        assert st["blocks_mismatched"] == 0, h.mismatches
    assert slept and not any(slept)          # paused, and only after empty steps
