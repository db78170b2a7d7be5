"""Two real `vllm serve` engines with separate local stores on one real Mooncake Store
pool (`kvstore fleet`'s master and pool client on loopback): engine A serves the workload
and publishes its blocks; engine B, on an empty disk, answers the same workload from the
pool (its fleet agent fills B's store, B loads from it) with the reference's greedy
tokens; restarted without the pool, B answers it from its own disk."""
from __future__ import annotations

import time

from e2e_util import MAX_TOKENS, assert_same, wait_stored
from kvstore.drivers.client import Client


def _counter(s, name: str) -> float:
    return s.metrics().get(f"vllm:kvstore_{name}_total", 0.0)


def test_engine_b_answers_engine_a_documents_from_the_pool(serve, workload, reference, fleet_pool,
                                                          tmp_path):
    remote = {"remote": fleet_pool.remote_config()}
    with serve.running(tmp_path / "storeA", extra=remote) as a:
        assert_same(reference, workload.replay(Client(a.url), max_tokens=MAX_TOKENS), workload)
        stored = wait_stored(a)
        assert _counter(a, "pool_published_blocks") == stored
    # (A stopped: its fleet agent finished publishing before it exited)
    with serve.running(tmp_path / "storeB", extra=remote) as b:
        comps = workload.replay(Client(b.url), max_tokens=MAX_TOKENS)
        assert_same(reference, comps, workload)
        filled = _counter(b, "pool_filled_blocks")
        hit_tokens = _counter(b, "hit_tokens")
        assert filled > 0 and hit_tokens > 0, (filled, hit_tokens)
        assert _counter(b, "load_failures") == 0
        print(f"engine A stored {stored:.0f} blocks; engine B filled {filled:.0f} from the pool "
              f"and loaded {hit_tokens:.0f} prompt tokens")
        wait_stored(b)
    # B again, with the pool gone: its own disk has A's documents now
    time.sleep(0.1)
    with serve.running(tmp_path / "storeB",
                       extra={"remote": {**fleet_pool.remote_config(), "master": "127.0.0.1:1"}}) as b:
        assert_same(reference, workload.replay(Client(b.url), max_tokens=MAX_TOKENS), workload)
        assert _counter(b, "hit_tokens") > 0
        assert _counter(b, "pool_filled_blocks") == 0
