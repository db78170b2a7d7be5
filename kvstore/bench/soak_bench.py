"""`kvstore bench soak`: a long replay that must stay flat.

Tens of thousands of requests through the CPU engine harness (real vLLM scheduler and
kvstore connector), with a store far smaller than the working set so eviction never
stops. Prints, at intervals: requests/s, resident memory, open fds, pinned slots, store
usage and evictions. Verdict at the end: memory and fds flat (growth under a threshold
after warm-up), pins back to zero, no mismatched block.

`compare_admission` runs the same workload (same seed) twice, with `admission` "always"
and "second_sight" (wear accounting), and reports bytes written to the store,
blocks stored and the disk hit rate of each side by side.
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
        seed: int = 11, out=print, admission: str = "always",
        admission_window: int | None = None) -> dict:
    from kvstore.drivers.simulator import EngineHarness
    rng = random.Random(seed)
    docs = [[rng.randrange(10, 30000) for _ in range(rng.randrange(64, 512))] for _ in range(400)]
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as d:
        cfg = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.vllm",
               "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"path": os.path.join(d, "store"), "capacity": capacity,
                                             "staging": "16M", "admission": admission}}
        if admission_window is not None:
            cfg["kv_connector_extra_config"]["admission_window"] = admission_window
        prompt_tokens = 0
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
                prompt_tokens += sum(len(p) for p in prompts)
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
            # Wear: bytes every rank wrote to (read from) the store's devices (RankIO's
            # per-device counters, as the connector metrics export them).
            written = sum(int(c.worker.io.io_bytes[:, 1].sum()) for c in h.worker_connectors)
            read = sum(int(c.worker.io.io_bytes[:, 0].sum()) for c in h.worker_connectors)
            sched = h.scheduler_connector.scheduler
            wear = {"admission": admission, "bytes_written": written, "bytes_read": read,
                    "stored_blocks": sched.stored_blocks_total,
                    "prompt_tokens": prompt_tokens,
                    "disk_hit_tokens": h.stats["external_hit_tokens"],
                    "gpu_hit_tokens": h.stats["local_hit_tokens"],
                    "disk_hit_rate": h.stats["external_hit_tokens"] / max(1, prompt_tokens),
                    "rejected_blocks": sched.admission_rejected}
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
    return {"requests": requests, "seconds": elapsed, "req_per_s": requests / elapsed, **wear,
            "samples": samples, "rss_growth_mb_second_half": rss_growth,
            "fd_growth_second_half": fd_growth, "final_pinned": final_pins, "verdict": verdict,
            "ok": all(verdict.values())}


def compare_admission(requests: int = 4000, interval: int = 2000, capacity: str = "16M",
                      seed: int = 11, admission_window: int | None = None, out=print) -> dict:
    """The soak twice over the same workload (same seed): admission "always", then
    "second_sight". Both must pass the soak verdict."""
    runs = {}
    for adm in ("always", "second_sight"):
        out(f"-- admission {adm}")
        runs[adm] = run(requests=requests, interval=interval, capacity=capacity, seed=seed,
                        out=out, admission=adm, admission_window=admission_window)
    off, on = runs["always"], runs["second_sight"]
    out("")
    out(f"{'admission':>13} {'written MiB':>11} {'stored':>7} {'rejected':>8} "
        f"{'disk hit':>8} {'GPU hit':>7} {'req/s':>6}")
    for adm, r in runs.items():
        out(f"{adm:>13} {r['bytes_written'] / 2**20:>11.1f} {r['stored_blocks']:>7} "
            f"{r['rejected_blocks']:>8} {100 * r['disk_hit_rate']:>7.1f}% "
            f"{100 * r['gpu_hit_tokens'] / max(1, r['prompt_tokens']):>6.1f}% {r['req_per_s']:>6.0f}")
    return {"requests": requests, "seed": seed, "capacity": capacity, "runs": runs,
            "bytes_written_ratio": on["bytes_written"] / max(1, off["bytes_written"]),
            "disk_hit_rate_delta": on["disk_hit_rate"] - off["disk_hit_rate"],
            "ok": off["ok"] and on["ok"]}
