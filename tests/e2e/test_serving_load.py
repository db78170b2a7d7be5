"""kvstore in a real `vllm serve` under concurrent load: SIGKILLs mid-traffic, and a soak.

- Kill under load: 8 clients keep requests in flight over a pool of shared documents larger
  than vLLM's KV cache (so stores and loads run all the time) while the server is SIGKILLed
  at a random point, three times. After each kill `kvstore fsck` is clean, and a new server
  on the same store answers a greedy replay token for token as a server without kvstore
  does; every completion that finished under load matches that reference too.
- Soak: sustained concurrent traffic with constant eviction (vLLM's KV cache and the
  store both far below the working set): the server's resident memory and open fds are
  flat over the second half, no slot stays pinned once the traffic stops, 0 mismatches.
  The number of requests is KVSTORE_SOAK_REQUESTS (default sized for the suite; set it to
  a few thousand for the long version).

Kill points and soak samples are counted in completed requests, never in seconds.
"""
from __future__ import annotations

import os
import random
import threading

import pytest

from e2e_util import MAX_TOKENS, assert_same, fsck, info
from kvstore.drivers.client import Client

CLIENTS = 8
KILLS = 3
# A KV cache of 200 blocks (6,400 tokens) under the pool of 16 documents of 600 tokens
# (fixture `pool`): the engine's own prefix cache evicts all the time. max_model_len must
# fit in that cache.
SMALL = dict(max_model_len=1024, extra_args=["--num-gpu-blocks-override", "200"])
SOAK_REQUESTS = int(os.environ.get("KVSTORE_SOAK_REQUESTS", "240"))
SOAK_SAMPLES = 12


@pytest.fixture
def load_reference(references):
    """What a server without kvstore answers (fixture `references`): the workload's
    completions, and each pool prompt's, sent one at a time."""
    return references["workload"], references["pool"]


class Traffic:
    """CLIENTS threads sending random pool prompts until stopped (or `limit` completions);
    every completion is kept with its pool index. Errors after the server died are expected
    and counted; `reached(n)` is set once n requests completed."""

    def __init__(self, url: str, pool: list[str], seed: int, limit: int | None = None):
        self.url, self.pool, self.limit = url, pool, limit
        self.stop = threading.Event()
        self.lock = threading.Condition()
        self.done: list[tuple[int, object]] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(seed * 100 + i,), daemon=True)
                        for i in range(CLIENTS)]

    def start(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        c = Client(self.url, timeout_s=300)
        while not self.stop.is_set():
            with self.lock:
                if self.limit is not None and len(self.done) >= self.limit:
                    return
            i = rng.randrange(len(self.pool))
            try:
                comp = c.complete(self.pool[i], max_tokens=MAX_TOKENS)
            except Exception as exc:  # noqa: BLE001 - a killed server resets its connections
                with self.lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                if self.stop.wait(0.2):
                    return
                continue
            with self.lock:
                self.done.append((i, comp))
                self.lock.notify_all()

    def wait_done(self, n: int, bound_s: float = 600) -> None:
        """Until n requests completed; a bound only a hung server reaches fails loudly."""
        with self.lock:
            if not self.lock.wait_for(lambda: len(self.done) >= n, bound_s):
                raise AssertionError(f"only {len(self.done)} of {n} requests completed in {bound_s:.0f} s; "
                                     f"errors: {self.errors[-3:]}")

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(330)
            assert not t.is_alive(), "a client thread did not end after the traffic stopped"


def mismatches(done, ref) -> list[str]:
    return [f"pool[{i}]: {c.token_ids} != reference {ref[i].token_ids}"
            for i, c in done if c.token_ids != ref[i].token_ids]


def test_sigkill_under_concurrent_load_then_fsck_clean_and_identical_tokens(
        serve, workload, pool, load_reference, tmp_path):
    ref_wl, ref_pool = load_reference
    store = tmp_path / "store"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    where = f"(kill points from seed {seed})"
    disk_hits, completed_under_load = 0, 0
    for cycle in range(KILLS + 1):
        with serve.running(store, **SMALL) as s:
            c = Client(s.url)
            before = s.metrics()
            got = workload.replay(c, max_tokens=MAX_TOKENS)
            assert_same(ref_wl, got, workload)
            disk_hits += int(s.metrics().get("vllm:kvstore_hit_tokens_total", 0)
                             - before.get("vllm:kvstore_hit_tokens_total", 0))
            if cycle == KILLS:
                break
            # A random kill point, counted in completions: requests are in flight (and
            # stores and loads under way) whenever it comes.
            kill_after = rng.randint(1, 3 * CLIENTS)
            traffic = Traffic(s.url, pool, seed=seed + cycle).start()
            try:
                traffic.wait_done(kill_after)
                s.kill()
            finally:
                traffic.join()
            bad = mismatches(traffic.done, ref_pool)
            assert not bad, f"cycle {cycle} {where}: {len(bad)} completions under load differ: {bad[:3]}"
            completed_under_load += len(traffic.done)
        code, doc = fsck(store)
        assert code == 0 and doc["findings"] == [], f"after kill {cycle + 1} {where}: {doc}"
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc
    assert completed_under_load >= KILLS, completed_under_load
    assert disk_hits > 0, "no replay after a restart loaded anything from the store"


def _server_usage(server) -> tuple[float, int]:
    """(resident MiB, open fds) summed over the server's processes (its session)."""
    rss, fds = 0, 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != server.proc.pid:
                continue
            with open(f"/proc/{pid}/statm") as f:
                rss += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:                  # the process ended meanwhile
            continue
    return rss / (1 << 20), fds


def test_soak_constant_eviction_memory_fds_pins_flat(serve, pool, load_reference, tmp_path):
    _, ref_pool = load_reference
    store = tmp_path / "store"
    # A store of 4 MiB under a working set of about 10 MB of KV: every store evicts.
    with serve.running(store, extra={"capacity": "4M"}, **SMALL) as s:
        traffic = Traffic(s.url, pool, seed=7, limit=SOAK_REQUESTS).start()
        samples = []
        try:
            for k in range(1, SOAK_SAMPLES + 1):
                traffic.wait_done(SOAK_REQUESTS * k // SOAK_SAMPLES)
                rss, fds = _server_usage(s)
                samples.append({"done": len(traffic.done), "rss_mb": rss, "fds": fds,
                                "pinned": info(store)["pinned_slots"]})
        finally:
            traffic.join()
        m = s.metrics()
        idle = info(store)
    bad = mismatches(traffic.done, ref_pool)
    assert not bad, f"{len(bad)} of {len(traffic.done)} completions differ: {bad[:3]}"
    assert not traffic.errors, traffic.errors[:3]
    assert m.get("vllm:kvstore_stored_blocks_total", 0) > 0
    assert m.get("vllm:kvstore_hit_tokens_total", 0) > 0, "the soak never loaded from the store"
    assert idle["evictions"] > 0, idle
    half = samples[len(samples) // 2:]
    rss_growth = half[-1]["rss_mb"] - half[0]["rss_mb"]
    fd_growth = half[-1]["fds"] - half[0]["fds"]
    # Generous bounds: a leak of one buffer or fd per request grows far past them.
    assert rss_growth < 256, f"server RSS grew {rss_growth:.0f} MiB over the second half: {samples}"
    assert fd_growth <= 16, f"server fds grew by {fd_growth} over the second half: {samples}"
    assert max(x["pinned"] for x in half) <= max(64, 2 * max(x["pinned"] for x in samples[:len(half)])), samples
    assert idle["pinned_slots"] == 0, f"slots still pinned with no traffic: {idle}"
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc
