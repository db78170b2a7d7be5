"""kvstore inside a real vLLM engine serving a hybrid model: a Gemma 2 (random weights,
`kvstore.drivers.models.TINY_GEMMA2`) whose every other layer attends to the last 64
tokens only, so vLLM's hybrid KV cache manager keeps a full-attention and a
sliding-window KV cache group (vLLM's CPU build supports the hybrid manager).

Prompts are 100-400 tokens, far past the window. Every run is compared, greedy token for
greedy token (and logprob), with a server without kvstore. One server per phase, shared
by the tests through module fixtures: the reference, the first run (cold store), a
restart on that store (disk hits), a copy of it with flipped bits, and a small KV cache
that makes vLLM preempt.
"""
from __future__ import annotations

import random
import threading

import pytest

from e2e_util import MAX_TOKENS, Serve, assert_same, copy_store, fsck, info, wait_stored
from kvstore.drivers.client import Client
from kvstore.drivers.models import TINY_GEMMA2, words
from kvstore.drivers.workload import Workload
from test_real_engine import _written_slots, hits

# Preemption phase: four concurrent prompts of 300 tokens, each growing by 96 output
# tokens (10 then 13 blocks of 32 tokens in the full-attention group, up to 4 in the
# window's), in a KV cache of 64 blocks that both groups share (32 each): vLLM must preempt.
PREEMPT_PROMPTS, PREEMPT_TOKENS, PREEMPT_OUT, PREEMPT_BLOCKS = 4, 300, 96, 64


@pytest.fixture(scope="module")
def gemma_dir(engine, make_model):
    return make_model(engine[0], TINY_GEMMA2.name)


@pytest.fixture(scope="module")
def hybrid_workload():
    return Workload(TINY_GEMMA2, documents=2, doc_tokens=320, questions=2, sessions=1, turns=2,
                    system_tokens=100, seed=43)


@pytest.fixture(scope="module")
def preempt_prompts():
    rng = random.Random(43)
    return [words(TINY_GEMMA2, PREEMPT_TOKENS, rng) for _ in range(PREEMPT_PROMPTS)]


@pytest.fixture(scope="module")
def hserve(engine, gemma_dir, logs):
    sv = Serve(engine, gemma_dir, logs, "hybrid")
    yield sv
    sv.close()


def replay(server, workload):
    return workload.replay(Client(server.url), max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def hybrid_reference(hserve, hybrid_workload, preempt_prompts):
    """The workload's and the preemption prompts' completions without kvstore."""
    with hserve.running() as s:
        ref = replay(s, hybrid_workload)
        client = Client(s.url)
        pre = [client.complete(p, max_tokens=PREEMPT_OUT) for p in preempt_prompts]
    return ref, pre


@pytest.fixture(scope="module")
def cold_store(hserve, hybrid_workload, hybrid_reference, tmp_path_factory):
    """The first run on an empty store: (store, its metrics after the stores settled)."""
    store = tmp_path_factory.mktemp("hybrid") / "store"
    with hserve.running(store) as s:
        comps = replay(s, hybrid_workload)
        wait_stored(s)
        m = s.metrics()
    assert_same(hybrid_reference[0], comps, hybrid_workload)
    return store, m


def test_hybrid_model_identical_tokens_cold_and_after_restart(hserve, hybrid_workload,
                                                             hybrid_reference, cold_store):
    store, cold = cold_store
    assert cold["vllm:kvstore_stored_blocks_total"] > 0
    assert info(store)["layout"]["groups"] == "swa:64;full"
    with hserve.running(store) as s:
        m0 = s.metrics()
        comps = replay(s, hybrid_workload)
        m1 = s.metrics()
    assert_same(hybrid_reference[0], comps, hybrid_workload)
    k, v = hits(m0, m1)
    assert k > 0, "nothing came from disk after the restart"
    assert k == v, f"kvstore counted {k} hit tokens, vLLM {v}"
    assert m1.get("vllm:kvstore_load_failures_total", 0) == 0
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_hybrid_flipped_bits_are_recomputed_never_served(hserve, hybrid_workload, hybrid_reference,
                                                         cold_store, tmp_path):
    store = copy_store(cold_store[0], tmp_path / "store")
    slots = _written_slots(store)
    assert len(slots) == info(store)["used_slots"] > 8
    assert len({path for path, _ in slots}) == 1          # one slot file: offset -> slot
    slot_size = info(store)["slot_size"]
    damaged = slots[::2]
    for path, off in damaged:                      # one flipped bit in every other payload
        with open(path, "r+b") as f:
            f.seek(off + 4096 + 777)
            b = f.read(1)
            f.seek(off + 4096 + 777)
            f.write(bytes([b[0] ^ 0x10]))
    with hserve.running(store) as s:
        comps = replay(s, hybrid_workload)
        wait_stored(s)
        m = s.metrics()
    assert_same(hybrid_reference[0], comps, hybrid_workload)
    assert m["vllm:kvstore_load_failures_total"] > 0, "no damaged block was ever read"
    # Every damaged slot that was read lost its entry. A sliding-window block that left
    # the window before every hit's end is never read: fsck finds those, and only those
    # are what it finds; a repair then leaves the store clean.
    code, doc = fsck(store, "--deep")
    found = {f["slot"] for f in doc["findings"]}
    assert {f["kind"] for f in doc["findings"]} <= {"payload_corrupt"}, doc
    assert found < {off // slot_size for _, off in damaged}, (found, doc)
    code, doc = fsck(store, "--deep", "--repair")
    assert code in (0, 1) and doc["errors_corrected"] == len(found), doc
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_hybrid_small_kv_cache_preemptions_identical_tokens(hserve, hybrid_reference, preempt_prompts,
                                                            tmp_path):
    store = tmp_path / "store"
    ref = hybrid_reference[1]
    with hserve.running(store, max_model_len=512,
                        extra_args=["--num-gpu-blocks-override", str(PREEMPT_BLOCKS)]) as s:
        rounds = []
        for _ in range(2):        # the second round's prompts are on disk, not in the cache
            out: dict[int, object] = {}

            def one(i, p, url=s.url, out=out):
                out[i] = Client(url).complete(p, max_tokens=PREEMPT_OUT)
            threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(preempt_prompts)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(600)
            rounds.append(out)
            wait_stored(s)
        m = s.metrics()
    assert m.get("vllm:num_preemptions_total", 0) > 0, "no preemption happened"
    for r, out in enumerate(rounds):
        for i in range(len(preempt_prompts)):
            assert out[i].token_ids == ref[i].token_ids, f"round {r} prompt {i}"
    assert m["vllm:kvstore_hit_tokens_total"] > 0, "nothing was loaded from disk"
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc
