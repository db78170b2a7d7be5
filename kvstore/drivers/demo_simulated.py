"""`kvstore demo --simulated`: the scheduler-level demo, end to end, without running a model.

Replays a realistic prefix-heavy workload (multi-turn chats over a shared system prompt,
and questions over a few long shared documents: far more context than the simulated GPU
KV cache holds) through the real vLLM scheduler with kvstore's connector (the CPU engine
harness of `kvstore.drivers.simulator`), then restarts the engine on the same store and replays the
same traffic. Every block loaded from disk is checked byte for byte against what
recompute would have produced. Prints hit rates, tokens and bytes loaded instead of
recomputed, load throughput, and the verification count.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

from kvstore.format.layout import format_size


def make_workload(seed: int = 7, sessions: int = 12, turns: int = 4, documents: int = 3,
                  doc_tokens: int = 1536, questions_per_doc: int = 6, vocab: int = 30000):
    """Deterministic prompts (lists of token ids) in arrival order."""
    rng = random.Random(seed)

    def text(n):
        return [rng.randrange(10, vocab) for _ in range(n)]

    system = text(256)
    docs = [text(doc_tokens) for _ in range(documents)]
    prompts = []
    history = [list(system) for _ in range(sessions)]
    for turn in range(turns):
        for s in range(sessions):
            history[s] += text(rng.randrange(24, 96))          # the user's message
            prompts.append(list(history[s]))
            history[s] += text(rng.randrange(32, 128))         # the assistant's answer
        for d, doc in enumerate(docs):
            for q in range(questions_per_doc // turns + (1 if turn < questions_per_doc % turns else 0)):
                prompts.append(list(system[:64]) + doc + text(rng.randrange(16, 48)))
    return prompts


def _connector_cfg(store: str, capacity: str, io_mode: str) -> dict:
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"path": store, "capacity": capacity, "io_mode": io_mode,
                                          "staging": "64M"}}


def _replay(prompts, store, capacity, io_mode, gpu_blocks, batch, workdir, tp_size):
    from kvstore.drivers.simulator import EngineHarness, write_model_dir
    t0 = time.perf_counter()
    # The model's identity is part of the store's layout: the demo model lives at one
    # fixed path, so a store kept with --store serves the next `kvstore demo` run too.
    model_dir = write_model_dir(os.path.join(tempfile.gettempdir(), "kvstore-demo-model"),
                                num_layers=4, num_kv_heads=4, head_dim=64)
    with EngineHarness(model_dir=model_dir, kv_transfer_config=_connector_cfg(store, capacity, io_mode),
                       num_layers=4, num_kv_heads=4, head_dim=64, block_size=16,
                       num_gpu_blocks=gpu_blocks, max_num_batched_tokens=1024, max_num_seqs=8,
                       max_model_len=8192, tp_size=tp_size, workdir=workdir) as h:
        setup_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            h.run(prompts[i:i + batch], max_tokens=4)
        h.idle_steps(2)
        h.drain()
        elapsed = time.perf_counter() - t1
        h.assert_no_leaks()
        conn = h.scheduler_connector
        store_stats = conn.scheduler.store.stats()
        worker_stats = [w.worker for w in h.worker_connectors]
        load_busy = sum(w.load_busy_s for w in worker_stats)
        loaded_bytes = sum(w.loaded_bytes_total for w in worker_stats)
        stats = dict(h.stats)
        block_bytes = conn.layout.block_bytes
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "gpu_hit_tokens": stats["local_hit_tokens"],
        "disk_hit_tokens": stats["external_hit_tokens"],
        "computed_tokens": stats["tokens_computed"],
        "hit_rate": stats["external_hit_tokens"] / prompt_tokens,
        "blocks_loaded": stats["blocks_loaded"],
        "blocks_verified": stats["blocks_verified"],
        "blocks_mismatched": stats["blocks_mismatched"],
        "bytes_loaded": loaded_bytes,
        "load_gbps": (loaded_bytes / load_busy / 1e9) if load_busy > 0 else 0.0,
        "block_bytes": block_bytes,
        "store_used_slots": store_stats["used_slots"],
        "store_evictions": store_stats["evictions"],
        "seconds": elapsed,
        "setup_seconds": setup_s,
    }


def run(store: str | None = None, capacity: str = "1G", io_mode: str = "direct",
        gpu_blocks: int = 256, sessions: int = 12, seed: int = 7, tp_size: int = 1) -> dict:
    """Cold replay, restart, warm replay; returns the report dict."""
    own = store is None
    workdir = tempfile.mkdtemp(prefix="kvstore-demo-")
    store = store or os.path.join(workdir, "store")
    prompts = make_workload(seed=seed, sessions=sessions)
    try:
        cold = _replay(prompts, store, capacity, io_mode, gpu_blocks, 8, workdir, tp_size)
        warm = _replay(prompts, store, capacity, io_mode, gpu_blocks, 8, workdir, tp_size)
    finally:
        shutil.rmtree(workdir, ignore_errors=True) if own else shutil.rmtree(
            os.path.join(workdir, "model"), ignore_errors=True)
    return {
        "store": None if own else store,
        "gpu_cache_tokens": gpu_blocks * 16,
        "workload_prompt_tokens": cold["prompt_tokens"],
        "first_run": cold,
        "after_restart": warm,
        "hit_rate_after_restart": warm["hit_rate"],
        "blocks_loaded": cold["blocks_loaded"] + warm["blocks_loaded"],
        "blocks_verified": cold["blocks_verified"] + warm["blocks_verified"],
        "blocks_mismatched": cold["blocks_mismatched"] + warm["blocks_mismatched"],
    }


def format_report(r: dict) -> str:
    c, w = r["first_run"], r["after_restart"]
    rows = [
        ("requests", c["requests"], w["requests"]),
        ("prompt tokens", c["prompt_tokens"], w["prompt_tokens"]),
        ("  from vLLM's GPU prefix cache", c["gpu_hit_tokens"], w["gpu_hit_tokens"]),
        ("  loaded from kvstore (disk)", c["disk_hit_tokens"], w["disk_hit_tokens"]),
        ("tokens computed", c["computed_tokens"], w["computed_tokens"]),
        ("disk hit rate", f"{c['hit_rate']:.1%}", f"{w['hit_rate']:.1%}"),
        ("blocks loaded / verified", f"{c['blocks_loaded']} / {c['blocks_verified']}",
         f"{w['blocks_loaded']} / {w['blocks_verified']}"),
        ("bytes loaded instead of recomputed", format_size(c["bytes_loaded"]), format_size(w["bytes_loaded"])),
        ("load throughput (GB/s, I/O thread busy time)", f"{c['load_gbps']:.2f}", f"{w['load_gbps']:.2f}"),
        ("store: used slots / evictions", f"{c['store_used_slots']} / {c['store_evictions']}",
         f"{w['store_used_slots']} / {w['store_evictions']}"),
        ("wall time (s)", f"{c['seconds']:.1f}", f"{w['seconds']:.1f}"),
    ]
    width = max(len(r0) for r0, _, _ in rows)
    out = [f"kvstore demo: {c['requests']} requests (multi-turn chats + shared documents), "
           f"{r['workload_prompt_tokens']} prompt tokens, simulated GPU KV cache of "
           f"{r['gpu_cache_tokens']} tokens, through the real vLLM {_vllm_version()} scheduler",
           f"{'':<{width}}  {'first run':>14}  {'after restart':>14}"]
    out += [f"{name:<{width}}  {str(a):>14}  {str(b):>14}" for name, a, b in rows]
    ok = r["blocks_mismatched"] == 0 and r["blocks_verified"] >= r["blocks_loaded"] > 0
    out.append(f"every loaded block matched recompute: {'YES' if ok else 'NO'} "
               f"({r['blocks_verified']} verified, {r['blocks_mismatched']} mismatched)")
    if r["store"]:
        out.append(f"store kept at {r['store']} (try: kvstore info {r['store']}; kvstore fsck --deep {r['store']})")
    return "\n".join(out)


def _vllm_version() -> str:
    try:
        import vllm
        return vllm.__version__
    except Exception:  # pragma: no cover
        return "?"
