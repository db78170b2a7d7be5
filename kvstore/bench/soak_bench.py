"""`kvstore bench soak`: a long replay that must stay flat.

Tens of thousands of requests through the CPU engine harness (real vLLM scheduler and
kvstore connector), with a store far smaller than the working set so eviction never
stops. Prints, at intervals: requests/s, resident memory, open fds, pinned slots, store
usage and evictions. Verdict at the end: memory and fds flat (growth under a threshold
after warm-up), pins back to zero, no mismatched block.
"""
from __future__ import annotations

import os
import random
import tempfile
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(requests: int = 20000, interval: int = 2000, capacity: str = "16M", batch: int = 16,
        seed: int = 11, out=print) -> dict:
    from kvstore.testing import EngineHarness
    rng = random.Random(seed)
    docs = [[rng.randrange(10, 30000) for _ in range(rng.randrange(64, 512))] for _ in range(400)]
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as d:
        cfg = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.vllm",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"path": os.path.join(d, "store"), "capacity": capacity,
                                             "staging": "16M"}}
        samples = []
        with EngineHarness(kv_transfer_config=cfg, num_layers=2, num_kv_heads=2, head_dim=16,
                           block_size=16, num_gpu_blocks=128, max_num_batched_tokens=1024,
                           max_num_seqs=16, workdir=d) as h:
            store = h.scheduler_connector.scheduler.store
            sidx = h.scheduler_connector.scheduler.index    # pins live in the serving index
            t0 = time.perf_counter()
            last_t, last_n, done = t0, 0, 0
            out(f"{'requests':>9} {'req/s':>7} {'RSS MiB':>8} {'fds':>5} {'pinned':>6} {'used':>6} "
                f"{'evictions':>9} {'loaded':>7} {'mismatch':>8}")
            while done < requests:
                n = min(batch, requests - done)
                prompts = []
                for _ in range(n):
                    doc = rng.choice(docs)
                    prompts.append(doc + [rng.randrange(10, 30000) for _ in range(rng.randrange(1, 32))])
                h.run(prompts, max_tokens=2)
                h.forget_finished()
                done += n
                if done % interval == 0 or done == requests:
                    now = time.perf_counter()
                    s = store.stats()
                    row = {"requests": done, "req_per_s": (done - last_n) / (now - last_t),
                           "rss_mb": _rss_mb(), "fds": _fds(), "pinned": sidx.pinned_slots,
                           "used": s["used_slots"], "evictions": s["evictions"],
                           "loaded": h.stats["blocks_loaded"], "mismatched": h.stats["blocks_mismatched"]}
                    samples.append(row)
                    out(f"{done:>9} {row['req_per_s']:>7.0f} {row['rss_mb']:>8.1f} {row['fds']:>5} "
                        f"{row['pinned']:>6} {row['used']:>6} {row['evictions']:>9} {row['loaded']:>7} "
                        f"{row['mismatched']:>8}")
                    last_t, last_n = now, done
            h.idle_steps(2)
            h.drain()
            h.assert_no_leaks()
            final_pins = sidx.pinned_slots
            elapsed = time.perf_counter() - t0
    warm = samples[len(samples) // 2:] if len(samples) >= 2 else samples
    rss_growth = warm[-1]["rss_mb"] - warm[0]["rss_mb"] if warm else 0.0
    fd_growth = warm[-1]["fds"] - warm[0]["fds"] if warm else 0
    verdict = {
        "memory_flat": rss_growth < 64.0,
        "fds_flat": fd_growth <= 0,
        "pins_zero": final_pins == 0,
        "no_mismatch": samples[-1]["mismatched"] == 0,
        "evicting": samples[-1]["evictions"] > 0,
    }
    return {"requests": requests, "seconds": elapsed, "req_per_s": requests / elapsed,
            "samples": samples, "rss_growth_mb_second_half": rss_growth,
            "fd_growth_second_half": fd_growth, "final_pinned": final_pins, "verdict": verdict,
            "ok": all(verdict.values())}
