"""kvstore's tier with a remote level: two engines (vLLM 0.33's real
`TieringOffloadingManager`, each with its own local tier store) on one real Mooncake
Store pool. Engine B promotes what engine A stored, byte for byte, through B's local store
(its lookups answer RETRY while the pool is asked); with the pool gone, lookups answer
from the local store at once."""
import os
import signal

import numpy as np
from vllm.v1.kv_offload.base import LookupResult

from kvstore.vllm.tier import TierMetrics
from test_tier import Engine, key, payload, tier_entry


def _wait_published(e: Engine, n: int) -> None:
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        e.tier.remote.request_stats()
        time.sleep(0.1)
        if e.tier.remote.stats().get("published_blocks", 0) >= n:
            return
    raise AssertionError(f"published: {e.tier.remote.stats()}")


def _counters(e: Engine) -> dict:
    """The tier's pool counters since the last report, by short name."""
    stats = e.tier.get_stats()
    got = stats.reduce() if stats is not None else {}
    return {name: got.get(getattr(TierMetrics, name.upper()), 0)
            for name in ("pool_lookups", "pool_filled_chunks", "pool_timeouts")}


def test_engine_b_promotes_what_engine_a_stored_through_the_pool(fleet_pool, tmp_path):
    keys = [key(500 + i) for i in range(6)]
    remote = fleet_pool.remote_config()
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    a = Engine(tier_entry("kvstore", tmp_path / "A", remote=remote))
    try:
        a.store(keys)
        _wait_published(a, 6)
    finally:
        a.close()
    b = Engine(tier_entry("kvstore", tmp_path / "B", remote=remote))
    try:
        assert b.lookup(keys + [key(999)]) == [LookupResult.HIT] * 6 + [LookupResult.MISS]
        for k, got in zip(keys, b.read(keys)):
            assert np.array_equal(got, payload(k))
        counters = _counters(b)
        assert counters["pool_lookups"] == 1 and counters["pool_filled_chunks"] == 6, counters
    finally:
        b.close()
    # B's own store has them now: a new engine on it hits without the pool
    b2 = Engine(tier_entry("kvstore", tmp_path / "B", remote={**remote, "master": "127.0.0.1:1"}))
    try:
        assert b2.lookup(keys) == [LookupResult.HIT] * 6
        for k, got in zip(keys, b2.read(keys)):
            assert np.array_equal(got, payload(k))
    finally:
        b2.close()


def test_pool_down_lookups_answer_from_the_local_store(own_fleet_pool, tmp_path):
    keys = [key(700 + i) for i in range(4)]
    e = Engine(tier_entry("kvstore", tmp_path, remote={**own_fleet_pool.remote_config(),
                                                         "fetch_timeout_s": 5.0}))
    try:
        e.store(keys[:2])
        e.evict_from_primary(keys[:2])
        os.kill(own_fleet_pool.master_pid, signal.SIGKILL)
        os.kill(own_fleet_pool.client_pid, signal.SIGKILL)
        assert e.lookup(keys) == [LookupResult.HIT] * 2 + [LookupResult.MISS] * 2
        for k, got in zip(keys[:2], e.read(keys[:2])):
            assert np.array_equal(got, payload(k))
    finally:
        e.close()
