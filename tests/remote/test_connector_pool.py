"""Two engines with separate local stores on one real Mooncake Store pool, through vLLM
0.33's real scheduler (EngineHarness, the kvstore connector with `"remote"`): engine B
loads what engine A stored, byte for byte (the harness checks every loaded block), then
hits it on its own disk; with the pool gone, B serves from its disk and computes the
rest, and no request fails."""
import os
import signal
import time

from connector_util import (
    BS, conn_stats, drop_gpu_cache, kv_harness, loads_ok, prompts, sched, settle,
)


def _published(h, n: int, timeout: float = 60.0) -> dict:
    """Step A until its fleet agent published n blocks; its stats."""
    remote = sched(h).ctx.remote
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        remote.request_stats()
        time.sleep(0.2)
        st = remote.stats()
        if st.get("published_blocks", 0) >= n:
            return st
    raise AssertionError(f"the agent published {remote.stats()} of {n} blocks")


def test_engine_b_loads_what_engine_a_stored_through_the_pool(fleet_pool, tmp_path):
    ps = prompts(7, 3, 8 * BS + 5)
    extra = {"remote": fleet_pool.remote_config()}
    with kv_harness(tmp_path / "storeA", extra=extra) as a:
        a.run(ps)
        settle(a)
        stored = sched(a).store.stats()["used_slots"]
        assert stored == 3 * 8
        st = _published(a, stored)
        assert st["publish_dropped"] == 0 and st["agent_running"]
    with kv_harness(tmp_path / "storeB", extra=extra) as b:
        st = b.run(ps)
        loads_ok(st)            # every block B loaded is byte-identical to A's KV
        assert st["external_hit_tokens"] == 3 * 8 * BS
        cs = conn_stats(b)
        assert cs["pool_lookups"] == 3 and cs["pool_filled_blocks"] == 3 * 8
        assert cs["pool_timeouts"] == 0
        # the agent's answer put the filled blocks into B's table: no LMDB read found them
        assert sched(b).index.cross_hits == 0
        settle(b)
    # B again, after a restart: its own disk has the blocks; the pool is not asked
    with kv_harness(tmp_path / "storeB", extra=extra) as b:
        st = b.run(ps)
        loads_ok(st)
        assert st["external_hit_tokens"] == 3 * 8 * BS
        assert conn_stats(b)["pool_lookups"] == 0
        settle(b)


def test_pool_down_engine_serves_from_its_disk_and_computes_the_rest(own_fleet_pool, tmp_path):
    first = prompts(9, 1, 6 * BS + 3)
    other = prompts(10, 2, 6 * BS + 3)
    extra = {"remote": {**own_fleet_pool.remote_config(), "fetch_timeout_s": 5.0}}
    with kv_harness(tmp_path / "storeA", extra=extra) as a:
        a.run(first)
        settle(a)
        os.kill(own_fleet_pool.master_pid, signal.SIGKILL)
        os.kill(own_fleet_pool.client_pid, signal.SIGKILL)
        drop_gpu_cache(a)
        before = dict(a.stats)
        # a local hit, and misses the pool cannot answer: every request completes, the
        # hit loaded byte for byte, the misses computed
        st = a.run(first + other)
        loads_ok(st)
        assert st["requests_finished"] - before["requests_finished"] == 3
        assert st["external_hit_tokens"] - before["external_hit_tokens"] == 6 * BS
        assert st["requests_aborted"] == 0
        settle(a)
