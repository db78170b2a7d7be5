"""`kvstore bench ttft`: time to first token of a real `vllm serve`, prefill vs every cache tier.

For each system (kvstore, and each peer connector that starts on this engine) one server
runs three passes over the same prompts (`samples` distinct prompts of each prefix length):

1. cold: the prompt is new, the whole prefix is computed (prefill);
2. GPU hit: the same prompt again at once, served by vLLM's own prefix cache;
3. tier hit: the same prompt after the other prompts pushed it out of vLLM's cache (the
   engine runs with a small KV cache, `--num-gpu-blocks-override`), so the connector's
   tier serves it (kvstore: disk; the CPU offloading tier: host memory);

The systems: kvstore's connector; vLLM's OffloadingConnector with kvstore as its secondary
tier and with vLLM's `fs` tier (`tier_systems`, on the CPU build through
`kvstore.vllm.cpu_offload`); and vLLM's peer connectors as a user configures them
(`peers`), which name their error where they do not start on this engine.

Then, for systems that keep their cache across a restart, a new server on the same store
sends every prompt once more (4. restart hit: kvstore's reason to exist). Every timed
request streams; TTFT is the client's wait for the first token, and each row also says
how many prompt tokens vLLM counted as external hits, so a "hit" that was really a
prefill is visible.
"""
from __future__ import annotations

import contextlib
import glob
import os
import random
import shutil
import time
import uuid

from kvstore.bench import scratch_dir
from kvstore.errors import ConfigError
from kvstore.drivers.client import Client
from kvstore.drivers.models import SPECS, default_dir, words
from kvstore.drivers.server import ServerStartError, VLLMServer, connector_config, engine_python


def peers(workdir: str) -> dict[str, dict]:
    """Peer connectors of vLLM tried the same way (their kv_transfer_config)."""
    return {
        "vllm OffloadingConnector (CPU tier)": {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}},
        "vllm OffloadingConnector (CPU + fs tier)": {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 256 << 20,
                "secondary_tiers": [{"type": "fs", "root_dir": os.path.join(workdir, "fs-tier")}]}},
        "vllm SimpleCPUOffloadConnector (disk)": {
            "kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_offload_backend": "disk",
                                          "disk_path": os.path.join(workdir, "simple-disk")}},
        "LMCache (LMCacheConnectorV1, local disk)": {
            "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
    }


def tier_systems(workdir: str, engine: str) -> dict[str, dict]:
    """vLLM's OffloadingConnector with a CPU primary tier and one disk tier behind it: kvstore's
    `KVStoreTier` ("kvstore-tier") and vLLM's `fs` tier ("fs-tier"), on the same primary
    memory. On vLLM's CPU build
    (which refuses vLLM's own `TieringOffloadingSpec`) they run through
    `kvstore.vllm.cpu_offload.CPUTieringOffloadingSpec`, the same spec with memcpy copies."""
    if "CPU build" in engine:
        spec = {"spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "kvstore.vllm.cpu_offload"}
    else:
        spec = {"spec_name": "TieringOffloadingSpec"}

    def tiering(tier: dict) -> dict:
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {**spec, "cpu_bytes_to_use": 256 << 20,
                                              "secondary_tiers": [tier]}}

    return {
        "kvstore-tier": tiering(
            {"type": "KVStoreTier", "module_path": "kvstore.vllm.tier",
             "path": os.path.join(workdir, "kvstore-tier"), "capacity": "8G"}),
        "fs-tier": tiering(
            {"type": "fs", "root_dir": os.path.join(workdir, "fs-tier-2")}),
    }


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _timed(client: Client, server: VLLMServer, prompt: str) -> tuple[float, int]:
    before = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
    c = client.complete(prompt, max_tokens=1)
    after = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
    return c.ttft_s, int(after - before)


def run(lengths=(1000, 4000, 8000), samples: int = 3, model: str = "demo", python: str | None = None,
        systems: list[str] | None = None, directory: str | None = None, say=print) -> dict:
    python, engine = engine_python(python)
    spec = SPECS[model]
    model_dir = default_dir(model)
    import subprocess
    r = subprocess.run([python, "-c", f"from kvstore.drivers.models import ensure_model; "
                                      f"ensure_model({model!r}, {model_dir!r})"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"could not make the {model} model: {r.stderr[-2000:]}")
    workdir = scratch_dir("kvstore-bench-ttft-", directory)
    rng = random.Random(99)
    prompts = {n: [words(spec, n, rng) for _ in range(samples)] for n in lengths}
    # A KV cache that holds the longest prompt, not all of them: later prompts evict earlier
    # ones. A hybrid model's groups share the blocks: each group gets that many.
    gpu_blocks = (max(lengths) + 2047) // 32 + 8
    all_systems = {"kvstore": connector_config(os.path.join(workdir, "kvstore"), capacity="8G"),
                   **tier_systems(workdir, engine), **peers(workdir)}
    chosen = systems or list(all_systems)
    unknown = [x for x in chosen if x not in all_systems]
    if unknown:
        shutil.rmtree(workdir, ignore_errors=True)
        raise ConfigError(f"--systems: unknown {unknown}; choose from {list(all_systems)}")
    out = {"engine": engine, "model": f"{model} ({spec.approx_params() / 1e6:.0f}M parameters, bf16)",
           "lengths": list(lengths), "samples": samples, "gpu_cache_tokens": gpu_blocks * 32,
           "systems": {}, "not_started": {}}
    log_i = 0
    # OffloadingConnector servers get a known engine id: vLLM's API server stops its engine
    # core with a forced kill, which leaves the CPU primary tier's shared region behind in
    # /dev/shm (vllm_offload_ENGINE_ID.mmap); the bench removes it.
    engine_ids: list[str] = []

    def server(kv):
        nonlocal log_i
        log_i += 1
        if kv.get("kv_connector") == "OffloadingConnector":
            engine_ids.append(f"kvstore-bench-ttft-{uuid.uuid4().hex[:12]}")
            kv = {**kv, "engine_id": engine_ids[-1]}
        return VLLMServer(model=model_dir, python=python, kv_transfer_config=kv, dtype="bfloat16",
                          log_path=os.path.join(workdir, f"server-{log_i}.log"), max_model_len=max(lengths) + 256,
                          kv_cache_gib=1,
                          extra_args=["--num-gpu-blocks-override", str(gpu_blocks * spec.kv_cache_groups)])

    try:
        for name in chosen:
            kv = all_systems[name]
            res = {n: {"cold": [], "gpu_hit": [], "tier_hit": [], "restart_hit": [],
                       "tier_hit_tokens": [], "restart_hit_tokens": []} for n in lengths}
            try:
                s = server(kv).start()
            except ServerStartError as exc:
                out["not_started"][name] = str(exc).split("; log:")[0]
                say(f"{name}: does not start: {out['not_started'][name]}")
                continue
            say(f"{name}: serving ({engine})")
            try:
                c = Client(s.url)
                c.complete("<s>", max_tokens=1)
                for n in lengths:
                    for p in prompts[n]:
                        res[n]["cold"].append(_timed(c, s, p)[0])
                        res[n]["gpu_hit"].append(_timed(c, s, p)[0])
                for n in lengths:
                    for p in prompts[n]:
                        t, hit = _timed(c, s, p)
                        res[n]["tier_hit"].append(t)
                        res[n]["tier_hit_tokens"].append(hit)
                time.sleep(2)      # let the last stores finish before the restart
            finally:
                s.stop()
            try:
                with server(kv) as s:
                    c = Client(s.url)
                    c.complete("<s>", max_tokens=1)
                    for n in lengths:
                        for p in prompts[n]:
                            t, hit = _timed(c, s, p)
                            res[n]["restart_hit"].append(t)
                            res[n]["restart_hit_tokens"].append(hit)
            except ServerStartError as exc:
                say(f"{name}: restart failed: {exc}")
            out["systems"][name] = res
            say(format_system(name, res))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        for engine_id in engine_ids:
            for path in glob.glob(f"/dev/shm/vllm_offload_{engine_id}*"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    return out


def summarize(res: dict) -> dict:
    row = {}
    for n, r in res.items():
        d = {}
        for k in ("cold", "gpu_hit", "tier_hit", "restart_hit"):
            d[f"{k}_p50_s"] = percentile(r[k], 0.5)
            d[f"{k}_p99_s"] = percentile(r[k], 0.99)
        d["tier_hit_tokens_p50"] = percentile(r["tier_hit_tokens"], 0.5)
        d["restart_hit_tokens_p50"] = percentile(r["restart_hit_tokens"], 0.5)
        if d["cold_p50_s"] and d["restart_hit_p50_s"]:
            d["restart_speedup"] = d["cold_p50_s"] / d["restart_hit_p50_s"]
        row[n] = d
    return row


def _ms(x):
    return "-" if x is None else f"{x * 1000:.0f}"


def format_system(name: str, res: dict) -> str:
    rows = [f"{name}",
            f"  {'prefix':>7} {'cold p50':>9} {'GPU hit':>8} {'tier hit p50/p99 (hit tok)':>27} "
            f"{'restart p50/p99 (hit tok)':>27} {'restart speedup':>16}"]
    for n, d in summarize(res).items():
        sp = f"{d['restart_speedup']:.1f}x" if d.get("restart_speedup") else "-"
        tier = f"{_ms(d['tier_hit_p50_s'])}/{_ms(d['tier_hit_p99_s'])} ({d['tier_hit_tokens_p50'] or 0:.0f})"
        rest = f"{_ms(d['restart_hit_p50_s'])}/{_ms(d['restart_hit_p99_s'])} ({d['restart_hit_tokens_p50'] or 0:.0f})"
        rows.append(f"  {n:>7} {_ms(d['cold_p50_s']):>9} {_ms(d['gpu_hit_p50_s']):>8} {tier:>27} {rest:>27} {sp:>16}")
    return "\n".join(rows)


def format_table(out: dict) -> str:
    lines = [f"kvstore bench ttft: {out['engine']}, model {out['model']}, {out['samples']} prompts per "
             f"prefix length, vLLM KV cache {out['gpu_cache_tokens']} tokens; times in ms"]
    for name, res in out["systems"].items():
        lines.append(format_system(name, res))
    for name, why in out["not_started"].items():
        lines.append(f"{name}: did not start: {why}")
    return "\n".join(lines)


def to_json(out: dict) -> dict:
    return {**{k: v for k, v in out.items() if k != "systems"},
            "systems": {name: {"raw": res, "summary": summarize(res)} for name, res in out["systems"].items()}}


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = out["lengths"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = []
    if "kvstore" in out["systems"]:
        s = summarize(out["systems"]["kvstore"])
        series.append(("prefill (cold)", [s[n]["cold_p50_s"] for n in lengths]))
        series.append(("vLLM prefix cache hit", [s[n]["gpu_hit_p50_s"] for n in lengths]))
        series.append(("kvstore after restart", [s[n]["restart_hit_p50_s"] for n in lengths]))
    for name, res in out["systems"].items():
        if name != "kvstore":
            s = summarize(res)
            series.append((f"{name}: tier hit", [s[n]["tier_hit_p50_s"] for n in lengths]))
            if name in ("kvstore-tier", "fs-tier"):
                series.append((f"{name}: after restart", [s[n]["restart_hit_p50_s"] for n in lengths]))
    width = 0.8 / max(1, len(series))
    for i, (label, ys) in enumerate(series):
        xs = [j + i * width for j in range(len(lengths))]
        ax.bar(xs, [(y or 0) * 1000 for y in ys], width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"{n} tokens" for n in lengths])
    ax.set_ylabel("TTFT p50 (ms, log)")
    ax.set_yscale("log")
    ax.set_title(f"Time to first token, {out['engine']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
