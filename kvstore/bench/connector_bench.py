"""`kvstore bench connector`: scheduler-side cost of the connector, through vLLM's scheduler.

Fills a store with requests whose prompts are `prefix_blocks` (default 1000) blocks long,
restarts the engine (empty GPU cache), replays them, and times every scheduler-side
connector call (lookup, post-allocation planning, per-step metadata, output processing)
inside the real vLLM `Scheduler`. Reports time per step and per scheduled request per
step, next to the scheduler's own `schedule()` time.
"""
from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections import defaultdict

METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
           "update_connector_output", "request_finished_all_groups")


def _pct(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(prefix_blocks: int = 1000, requests: int = 8, block_size: int = 16, workdir: str | None = None) -> dict:
    from kvstore.testing import EngineHarness
    tmp = tempfile.TemporaryDirectory(prefix="kvstore-bench-conn-") if workdir is None else None
    d = workdir or tmp.name
    cfg = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"path": os.path.join(d, "store"), "capacity": "2G",
                                         "staging": "64M"}}
    rng = random.Random(3)
    ntok = prefix_blocks * block_size + block_size // 2
    prompts = [[rng.randrange(10, 30000) for _ in range(ntok)] for _ in range(requests)]
    common = dict(kv_transfer_config=cfg, num_layers=1, num_kv_heads=1, head_dim=16,
                  block_size=block_size, num_gpu_blocks=(prefix_blocks + 8) * 2,
                  max_num_batched_tokens=8192, max_num_seqs=requests, max_model_len=ntok + 64,
                  workdir=d, verify=False)
    try:
        with EngineHarness(**common) as h:        # fill the store
            for p in prompts:
                h.run([p], max_tokens=1)
            h.idle_steps(2)
            h.drain()
        with EngineHarness(**common) as h:        # restart: GPU cache empty, disk full
            conn = h.scheduler_connector
            times = defaultdict(list)
            for name in METHODS:
                orig = getattr(conn, name)

                def timed(*a, _orig=orig, _name=name, **kw):
                    t = time.perf_counter_ns()
                    try:
                        return _orig(*a, **kw)
                    finally:
                        times[_name].append((time.perf_counter_ns() - t) / 1e3)
                setattr(conn, name, timed)
            sched = h.scheduler
            orig_schedule = sched.schedule
            step_us, step_reqs = [], []

            def schedule(*a, **kw):
                t = time.perf_counter_ns()
                so = orig_schedule(*a, **kw)
                step_us.append((time.perf_counter_ns() - t) / 1e3)
                # Requests the scheduler handled this step (running + still waiting).
                step_reqs.append(len(sched.running) + len(sched.waiting))
                return so
            sched.schedule = schedule
            for p in prompts:
                h.add_request(p, max_tokens=4)
            h.drain()
            stats = dict(h.stats)
            stats["blocks_loaded"] = sum(w.worker.loaded_bytes_total for w in h.worker_connectors) \
                // h.scheduler_connector.layout.block_bytes
    finally:
        if tmp is not None:
            tmp.cleanup()
    steps = len(step_us)
    per_step_connector = [0.0] * steps
    total_conn = sum(sum(v) for v in times.values())
    sched_reqs = sum(step_reqs) or 1
    return {
        "prefix_blocks": prefix_blocks,
        "requests": requests,
        "steps": steps,
        "blocks_loaded": stats["blocks_loaded"],
        "disk_hit_tokens": stats["external_hit_tokens"],
        "calls": {name: {"n": len(v), "p50_us": _pct(v, 0.5), "p99_us": _pct(v, 0.99),
                         "total_ms": sum(v) / 1e3} for name, v in times.items()},
        "schedule_p50_us": _pct(step_us, 0.5),
        "schedule_p99_us": _pct(step_us, 0.99),
        "connector_us_per_step": total_conn / max(1, steps),
        "connector_us_per_request_step": total_conn / sched_reqs,
        "scheduled_request_steps": sched_reqs,
    }


def format_table(r: dict) -> str:
    lines = [f"kvstore bench connector: {r['requests']} requests with {r['prefix_blocks']}-block cached "
             f"prefixes, replayed after a restart through vLLM's Scheduler ({r['steps']} steps, "
             f"{r['blocks_loaded']} blocks loaded)",
             f"{'connector call':<30} {'calls':>6} {'p50 us':>9} {'p99 us':>9} {'total ms':>9}"]
    for name, c in r["calls"].items():
        lines.append(f"{name:<30} {c['n']:>6} {c['p50_us']:>9.1f} {c['p99_us']:>9.1f} {c['total_ms']:>9.2f}")
    lines.append(f"Scheduler.schedule() per step (incl. connector): p50 {r['schedule_p50_us']:.1f} us, "
                 f"p99 {r['schedule_p99_us']:.1f} us")
    lines.append(f"connector time per step: {r['connector_us_per_step']:.1f} us; per scheduled request "
                 f"per step: {r['connector_us_per_request_step']:.1f} us (target < 100 us)")
    return "\n".join(lines)
