"""`kvstore demo`: a real `vllm serve` with kvstore, restarted on the same store.

Starts vLLM's OpenAI-compatible server with a real model (a random-weight Llama of about
175M parameters made on this machine, `kvstore.drivers.models`) and the kvstore connector,
sends multi-turn chats and questions over shared documents through the `openai` client
(several requests in flight: each chat and each document is a lane of its own, lanes run
side by side; `concurrency=1` replays them one at a time), stops the server, starts a new
one on the same store and sends the same traffic again. Prints the time to first token and
the throughput (requests/s, output tokens/s) cold and after the restart, the prompt tokens
that came from disk, and whether every completion matched the first run token for token.

The engine is vLLM's CUDA build where it has a GPU, else its CPU build (`make engine`).
`kvstore demo --simulated` is the older scheduler-level replay (`kvstore.drivers.demo_simulated`).
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time

from kvstore.errors import ConfigError
from kvstore.drivers.client import Client
from kvstore.drivers.models import SERVE_DTYPE, SPECS, ModelSpec, default_dir
from kvstore.drivers.server import VLLMServer, advised_binding_env, connector_config, engine_python
from kvstore.drivers.workload import Workload


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def prepare_model(model: str, python: str) -> tuple[str, ModelSpec]:
    """A model directory and its spec: `model` is a name from SPECS (made on first use, in
    the engine's Python, which has torch and transformers) or a directory made by kvstore."""
    import json
    if model in SPECS:
        path = default_dir(model)
        code = ("import sys; from kvstore.drivers.models import ensure_model; "
                f"print(ensure_model({model!r}, {path!r}))")
        r = subprocess.run([python, "-c", code], capture_output=True, text=True)
        if r.returncode != 0:
            raise ConfigError(f"could not make the {model} model in {path}: {r.stderr.strip()[-2000:]}")
        return path, SPECS[model]
    if not os.path.isdir(model):
        raise ConfigError(f"--model {model}: no such directory; use one of {', '.join(SPECS)} "
                          "(made here on first use) or a directory made by kvstore")
    try:
        with open(os.path.join(model, "kvstore-model.json")) as f:
            return os.path.abspath(model), ModelSpec(**json.load(f))
    except (OSError, ValueError, TypeError):
        raise ConfigError(f"--model {model}: the demo writes prompts in its models' vocabulary and needs a "
                          f"model made by kvstore (kvstore-model.json); use one of {', '.join(SPECS)}") from None


def serve_and_replay(label: str, workload: Workload, *, model_dir: str, store: str, python: str, engine: str,
                     log_path: str, capacity: str, kv_cache_gib: int, max_tokens: int,
                     concurrency: int = 4, say=print) -> dict:
    """One server lifetime: start, replay the workload, read the metrics, stop."""
    t0 = time.perf_counter()
    # On vLLM's CPU build, the core reservation that measured fastest for this model here
    # (`advised_reservation`: none on a 2-core host for the demo model).
    env = advised_binding_env(engine, params=workload.spec.approx_params())
    server = VLLMServer(model=model_dir, log_path=log_path, python=python, kv_cache_gib=kv_cache_gib,
                        max_model_len=16384, dtype=SERVE_DTYPE, env=env,
                        kv_transfer_config=connector_config(store, capacity=capacity))
    with server:
        start_s = time.perf_counter() - t0
        say(f"[{label}] vllm serve up in {start_s:.0f} s ({server.engine}); "
            f"{len(workload.requests)} requests, {concurrency} in flight")
        client = Client(server.url)
        # One short request first, as an operator's readiness probe would: the first forward
        # of a fresh engine process pays one-time set-up that is not prefill or loading.
        client.complete("<s>", max_tokens=1)
        before = server.metrics()

        def on_done(req, c):
            say(f"[{label}]   {req.name:<14} {c.prompt_tokens:>6} prompt tokens  TTFT {c.ttft_s * 1000:8.1f} ms")
        t_replay = time.perf_counter()
        if concurrency > 1:
            comps = workload.replay_concurrent(server.url, concurrency, max_tokens=max_tokens, on_done=on_done)
        else:
            comps = workload.replay(client, max_tokens=max_tokens, on_done=on_done)
        replay_s = time.perf_counter() - t_replay
        after = server.metrics()
        engine = server.engine

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    ttft = [c.ttft_s for c in comps]
    firsts = [c.ttft_s for r, c in zip(workload.requests, comps) if r.name.endswith("/q0")]
    return {
        "ttft_first_question_s": firsts,
        "engine": engine,
        "server_start_s": round(start_s, 1),
        "requests": len(comps),
        "concurrency": concurrency,
        "replay_s": replay_s,
        "throughput_rps": len(comps) / replay_s,
        "output_tps": sum(len(c.token_ids) for c in comps) / replay_s,
        "prompt_tokens": sum(c.prompt_tokens for c in comps),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_s": ttft,
        "disk_hit_tokens": int(delta("vllm:kvstore_hit_tokens_total")),
        "vllm_external_hit_tokens": int(delta("vllm:external_prefix_cache_hits_total")),
        "gpu_prefix_hit_tokens": int(delta("vllm:prefix_cache_hits_total")),
        "stored_blocks": int(delta("vllm:kvstore_stored_blocks_total")),
        "loaded_blocks": int(delta("vllm:kvstore_loaded_blocks_total")),
        "load_failures": int(delta("vllm:kvstore_load_failures_total")),
        "completions": comps,
    }


def run(store: str | None = None, model: str = "demo", python: str | None = None, capacity: str = "4G",
        kv_cache_gib: int = 2, documents: int = 2, doc_tokens: int = 3000, questions: int = 3,
        sessions: int = 3, turns: int = 3, max_tokens: int = 16, concurrency: int = 4, say=print) -> dict:
    """Cold run, restart, replay; returns the report dict (see `to_json`)."""
    python, engine = engine_python(python)
    own = store is None
    workdir = tempfile.mkdtemp(prefix="kvstore-demo-")
    store = os.path.abspath(store or os.path.join(workdir, "store"))
    try:
        say(f"kvstore demo: engine {engine}; model {model}; store {store}")
        model_dir, spec = prepare_model(model, python)
        wl = Workload(spec, documents=documents, doc_tokens=doc_tokens, questions=questions,
                      sessions=sessions, turns=turns)
        kw = dict(model_dir=model_dir, store=store, python=python, engine=engine, capacity=capacity,
                  kv_cache_gib=kv_cache_gib, max_tokens=max_tokens, concurrency=concurrency, say=say)
        cold = serve_and_replay("first run", wl, log_path=os.path.join(workdir, "server-1.log"), **kw)
        warm = serve_and_replay("after restart", wl, log_path=os.path.join(workdir, "server-2.log"), **kw)
    except BaseException:
        if any(n.endswith(".log") for n in os.listdir(workdir)):
            say(f"kvstore demo: server logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    pairs = list(zip(cold["completions"], warm["completions"]))
    identical = all(a.same_tokens(b) for a, b in pairs) and len(pairs) == len(wl.requests)
    return {
        "engine": engine,
        "model": model_dir,
        "store": None if own else store,
        "requests": [r.name for r in wl.requests],
        "first_run": cold,
        "after_restart": warm,
        "identical": identical,
        "mismatched": [r.name for r, (a, b) in zip(wl.requests, pairs) if not a.same_tokens(b)],
        "max_logprob_diff": max((a.max_logprob_diff(b) for a, b in pairs), default=0.0),
    }


def to_json(r: dict) -> dict:
    c, w = r["first_run"], r["after_restart"]
    return {
        "engine": r["engine"],
        "ttft_cold_p50_s": round(c["ttft_p50_s"], 4),
        "ttft_cold_p99_s": round(c["ttft_p99_s"], 4),
        "ttft_restart_p50_s": round(w["ttft_p50_s"], 4),
        "ttft_restart_p99_s": round(w["ttft_p99_s"], 4),
        "concurrency": c["concurrency"],
        "throughput_cold_rps": round(c["throughput_rps"], 3),
        "throughput_restart_rps": round(w["throughput_rps"], 3),
        "output_tps_cold": round(c["output_tps"], 1),
        "output_tps_restart": round(w["output_tps"], 1),
        "disk_hit_tokens": w["disk_hit_tokens"],
        "vllm_external_hit_tokens": w["vllm_external_hit_tokens"],
        "prompt_tokens": w["prompt_tokens"],
        "completions": len(r["requests"]),
        "identical": r["identical"],
        "mismatched": r["mismatched"],
        "max_logprob_diff": r["max_logprob_diff"],
        "ttft_first_question_cold_s": [round(x, 4) for x in c["ttft_first_question_s"]],
        "ttft_first_question_restart_s": [round(x, 4) for x in w["ttft_first_question_s"]],
        "load_failures": w["load_failures"],
        "model": r["model"],
        "store": r["store"],
    }


def format_report(r: dict) -> str:
    c, w = r["first_run"], r["after_restart"]
    rows = [
        ("requests (chats + document questions)", c["requests"], w["requests"]),
        ("prompt tokens", c["prompt_tokens"], w["prompt_tokens"]),
        ("  from vLLM's own prefix cache", c["gpu_prefix_hit_tokens"], w["gpu_prefix_hit_tokens"]),
        ("  from kvstore (disk)", c["disk_hit_tokens"], w["disk_hit_tokens"]),
        ("TTFT p50 (ms)", f"{c['ttft_p50_s'] * 1000:.0f}", f"{w['ttft_p50_s'] * 1000:.0f}"),
        ("TTFT p99 (ms)", f"{c['ttft_p99_s'] * 1000:.0f}", f"{w['ttft_p99_s'] * 1000:.0f}"),
        (f"throughput, {c['concurrency']} in flight (req/s)", f"{c['throughput_rps']:.2f}", f"{w['throughput_rps']:.2f}"),
        ("output tokens/s", f"{c['output_tps']:.1f}", f"{w['output_tps']:.1f}"),
        ("blocks stored / loaded", f"{c['stored_blocks']} / {c['loaded_blocks']}",
         f"{w['stored_blocks']} / {w['loaded_blocks']}"),
        ("server start (s)", c["server_start_s"], w["server_start_s"]),
    ]
    width = max(len(x[0]) for x in rows)
    out = [f"kvstore demo: a real `vllm serve` ({r['engine']}), restarted on the same store",
           f"{'':<{width}}  {'first run':>12}  {'after restart':>14}"]
    out += [f"{name:<{width}}  {str(a):>12}  {str(b):>14}" for name, a, b in rows]
    fc, fw = c["ttft_first_question_s"], w["ttft_first_question_s"]
    if fc and fw:
        out.append("first question over each document (its prefix cold in the first run, on disk after "
                   f"the restart): TTFT {statistics.median(fc) * 1000:.0f} ms -> {statistics.median(fw) * 1000:.0f} ms "
                   f"({statistics.median(fc) / max(statistics.median(fw), 1e-9):.1f}x sooner)")
    if r["identical"]:
        out.append(f"every completion matched the first run token for token: YES ({len(r['requests'])} "
                   f"completions, max logprob difference {r['max_logprob_diff']:.2g})")
    else:
        out.append(f"every completion matched the first run token for token: NO (differ: {', '.join(r['mismatched'])})")
    if r["store"]:
        out.append(f"store kept at {r['store']} (try: kvstore info {r['store']}; kvstore fsck --deep {r['store']})")
    return "\n".join(out)
