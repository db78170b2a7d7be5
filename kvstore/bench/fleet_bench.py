"""`kvstore bench fleet`: the store's remote level (the fleet's KV pool, Mooncake Store),
measured beside Mooncake itself, in one run on a pool started for it (`kvstore fleet up`
on loopback, in a scratch directory).

1. **transfer**: `blocks` blocks of `block_size` bytes (per rank) between a store and
   the pool. kvstore's two directions are the fleet agent's: a publish reads the blocks
   back from the local store (verified), wraps them in records and puts them into the
   pool; a fill reads records from the pool, verifies them and writes them into another
   local store (durable, indexed). Both overlap the pool's transfers with the local disk
   (`FleetAgent`), so neither can beat the slower of the two. The reference is Mooncake's own `batch_put_from` /
   `batch_get_into` of the same bytes from and into registered memory, on the same pool.
   The ratio is kvstore's GB/s over Mooncake's, and the agent's time is split into the
   pool's calls, the local store and kvstore's record work, so a ratio below 1 shows what
   it costs.
2. **step**: the connector's time on vLLM's scheduler thread per step (`kvstore bench
   connector`'s phases, real vLLM scheduler, `index_entries` prefilled) without the pool,
   and with it: its store phase publishes, and its load phase runs on a second, empty
   store whose every block the pool fills.
3. **ttft** (`ttft=True`, a real `vllm serve` of the CPU build): engine A computes
   `samples` documents of `length` tokens (recompute), engine B with an empty store
   answers them from the pool (pool hit), then B restarted answers them from its own disk
   (local hit). The time to first token of each.
"""
from __future__ import annotations

import os
import random
import shutil
import time

import numpy as np

from kvstore.bench import scratch_dir
from kvstore.format.layout import Layout, parse_size


def _gbps(nbytes: int, s: float) -> float | None:
    return round(nbytes / s / 1e9, 3) if s > 0 else None


def _mooncake_reference(cfg, names: list[str], size: int, data: np.ndarray, rounds: int) -> dict:
    """Mooncake's own batch_put_from / batch_get_into of `names` (each `size` bytes from
    `data`, registered), the best of `rounds`."""
    from kvstore.remote.mooncake import MooncakePool
    pool = MooncakePool(cfg)
    try:
        assert pool.available(wait=10), f"the pool is not reachable: {pool.last_error}"
        per = len(pool.buffer) // size
        put_s, get_s = [], []
        for r in range(rounds):
            keys = [f"{n}/ref{r}" for n in names]
            t0 = time.perf_counter()
            for i in range(0, len(keys), per):
                part = keys[i:i + per]
                pool.buffer[:len(part) * size] = data[:len(part) * size]
                codes = pool.put_from(part, [j * size for j in range(len(part))], [size] * len(part))
                assert codes is not None and all(c == 0 for c in codes), codes
            put_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(0, len(keys), per):
                part = keys[i:i + per]
                got = pool.get_into(part, [j * size for j in range(len(part))], [size] * len(part))
                assert got is not None and all(g == size for g in got), got
            get_s.append(time.perf_counter() - t0)
            for k in keys:
                pool.remove(k)
        return {"put_s": min(put_s), "get_s": min(get_s)}
    finally:
        pool.close()


def _timed_agent(path: str, cfg, work, blocks: int, remove=()) -> tuple[float, dict]:
    """Seconds `work(agent)` takes on a `FleetAgent` over the store at `path` (it must
    move `blocks` blocks), and where the agent's time went; then `remove`'s records leave
    the pool (room for the next round)."""
    from kvstore.remote.agent import FleetAgent
    from kvstore.remote.records import pool_key
    ag = FleetAgent(path, cfg)
    try:
        t0 = time.perf_counter()
        assert work(ag) == blocks, ag.stats
        s = time.perf_counter() - t0
        split = dict(pool_s=ag.stats.pool_s, local_s=ag.stats.local_s, records_s=ag.stats.records_s)
        for k in remove:
            ag.pool.remove(pool_key(ag.digest, k, 0))
        return s, split
    finally:
        ag.close()


def transfer(fl, workdir: str, blocks: int, block_size: int, rounds: int) -> dict:
    """Section 1 (module docstring)."""
    from kvstore.remote.records import HEADER_SIZE
    from kvstore.store.config import RemoteConfig
    from kvstore.store.disk import DiskStore
    lay = Layout(model="bench/fleet", dtype="float16", block_size=16, block_bytes=block_size,
                 num_layers=1, num_kv_heads=1, head_dim=block_size // 32)
    buffer = max(64 << 20, 8 * (block_size + HEADER_SIZE + 64))
    cfg = RemoteConfig.parse({**fl.remote_config(), "buffer": buffer})
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, buffer, dtype=np.uint8)
    capacity = (blocks + 64) * (block_size + 4096) * 2
    out = {"blocks": blocks, "block_bytes": block_size, "rounds": rounds, "kvstore": [],
           "mooncake": None}
    best: dict = {}
    for r in range(rounds):
        keys = [b"fleet-bench-%02d-%08d" % (r, i) + bytes(12) for i in range(blocks)]
        a_path, b_path = os.path.join(workdir, f"a{r}"), os.path.join(workdir, f"b{r}")
        with DiskStore.create(a_path, lay, capacity, io=True) as a:
            a.put(keys, lambda i, rank: data[(i * 4099) % (len(data) - block_size):][:block_size])
        DiskStore.create(b_path, lay, capacity).close()
        pub_s, pub = _timed_agent(a_path, cfg, lambda ag: ag.publish(keys), blocks)
        fill_s, fill = _timed_agent(b_path, cfg, lambda ag: ag.fetch(keys), blocks,
                                    remove=keys)
        nbytes = blocks * block_size
        row = {"publish_gbps": _gbps(nbytes, pub_s), "fill_gbps": _gbps(nbytes, fill_s),
               # the pool's side alone (the agent's Mooncake calls, overlapped with the rest)
               "publish_pool_gbps": _gbps(nbytes, pub["pool_s"]),
               "fill_pool_gbps": _gbps(nbytes, fill["pool_s"]),
               "publish_split_s": {k: round(v, 4) for k, v in pub.items()},
               "fill_split_s": {k: round(v, 4) for k, v in fill.items()}}
        out["kvstore"].append(row)
        for k in ("publish_gbps", "fill_gbps", "publish_pool_gbps", "fill_pool_gbps"):
            best[k] = max(best.get(k) or 0, row[k] or 0)
        shutil.rmtree(a_path, ignore_errors=True)
        shutil.rmtree(b_path, ignore_errors=True)
    size = block_size + HEADER_SIZE
    ref = _mooncake_reference(cfg, [f"fleet-bench-ref/{i}" for i in range(blocks)], size, data,
                              rounds)
    out["mooncake"] = {"put_gbps": _gbps(blocks * block_size, ref["put_s"]),
                       "get_gbps": _gbps(blocks * block_size, ref["get_s"])}
    out["best"] = best
    out["ratio_publish_vs_put"] = (round(best["publish_gbps"] / out["mooncake"]["put_gbps"], 3)
                                   if out["mooncake"]["put_gbps"] else None)
    out["ratio_fill_vs_get"] = (round(best["fill_gbps"] / out["mooncake"]["get_gbps"], 3)
                                if out["mooncake"]["get_gbps"] else None)
    return out


def step(fl, workdir: str, index_entries: int, requests: int) -> dict:
    """Section 2 (module docstring)."""
    from kvstore.bench import connector_bench
    # wall time per step, the step thread's own CPU in the connector, and its wait for a
    # CPU (the fleet agent and Mooncake's processes share the machine's cores)
    keep = ("step_p50_ms", "step_p99_ms", "step_max_ms", "step_cpu_p50_ms", "step_cpu_p99_ms",
            "step_runq_p99_ms", "steps", "phase_s", "slowest_steps")
    out = {}
    for name, remote in (("without_pool", None), ("with_pool", fl.remote_config())):
        r = connector_bench.run(index_entries=index_entries, requests=requests, baseline=False,
                                workdir=workdir, remote=remote)
        out[name] = {ph: {k: r["phases"][ph].get(k) for k in keep} for ph in ("store", "load")}
        out[name]["load"]["pool_filled_blocks"] = r["phases"]["load"].get("pool_filled_blocks", 0)
        out[name]["load"]["disk_hit_tokens"] = r["phases"]["load"].get("disk_hit_tokens", 0)
    out["index_entries"], out["requests"] = index_entries, requests
    return out


def ttft(fl, workdir: str, model: str, length: int, samples: int, python: str | None) -> dict:
    """Section 3 (module docstring)."""
    import subprocess

    from kvstore.drivers.client import Client
    from kvstore.drivers.models import SPECS, default_dir, words
    from kvstore.drivers.server import VLLMServer, connector_config, engine_python
    python, engine = engine_python(python)
    spec, model_dir = SPECS[model], default_dir(model)
    r = subprocess.run([python, "-c", f"from kvstore.drivers.models import ensure_model; "
                                      f"ensure_model({model!r}, {model_dir!r})"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"could not make the {model} model: {r.stderr[-2000:]}")
    rng = random.Random(17)
    docs = [words(spec, length, rng) for _ in range(samples)]
    remote = fl.remote_config()
    n_log = [0]

    def server(store: str) -> VLLMServer:
        n_log[0] += 1
        kv = connector_config(store, capacity="4G", remote={**remote, "fetch_timeout_s": 10.0})
        return VLLMServer(model=model_dir, python=python, kv_transfer_config=kv, dtype="bfloat16",
                          log_path=os.path.join(workdir, f"server-{n_log[0]}.log"),
                          max_model_len=length + 256, kv_cache_gib=1)

    def timed(s: VLLMServer, name: str) -> list[float]:
        c = Client(s.url)
        c.complete("<s>", max_tokens=1)
        return [c.complete(d, max_tokens=1).ttft_s for d in docs]

    def counter(s: VLLMServer, name: str) -> float:
        return s.metrics().get(f"vllm:kvstore_{name}_total", 0.0)

    out = {"engine": engine, "model": model, "length": length, "samples": samples}
    a_store, b_store = os.path.join(workdir, "node-a"), os.path.join(workdir, "node-b")
    with server(a_store).start() as a:
        out["recompute_s"] = timed(a, "recompute")
        stored, t0 = -1.0, time.monotonic()
        while time.monotonic() - t0 < 120:      # until A's stores are committed
            n = counter(a, "stored_blocks")
            if n == stored and n > 0:
                break
            stored = n
            time.sleep(1.0)
    with server(b_store).start() as b:
        out["pool_hit_s"] = timed(b, "pool hit")
        out["pool_filled_blocks"] = counter(b, "pool_filled_blocks")
        out["pool_hit_tokens"] = counter(b, "hit_tokens")
    with server(b_store).start() as b:
        out["local_hit_s"] = timed(b, "local hit")
        out["local_hit_tokens"] = counter(b, "hit_tokens")
    return out


def run(blocks: int = 512, block_size="2M", rounds: int = 3, index_entries: int = 100_000,
        requests: int = 64, with_ttft: bool = False, model: str = "demo", length: int = 2000,
        samples: int = 3, python: str | None = None, directory: str | None = None,
        say=print) -> dict:
    from kvstore.tools import fleet
    bs = parse_size(block_size)     # a bad size is refused before anything is made
    workdir = scratch_dir("kvstore-bench-fleet-", directory)
    fl = None
    try:
        fl = fleet.up(os.path.join(workdir, "fleet"),
                      pool_size=max(512 << 20, 2 * blocks * (bs + 4096)))
        out: dict = {"pool": fl.remote_config(), "cpus": len(os.sched_getaffinity(0))}
        out["transfer"] = transfer(fl, workdir, blocks, bs, rounds)
        say(format_transfer(out["transfer"]))
        out["step"] = step(fl, workdir, index_entries, requests)
        say(format_step(out["step"]))
        if with_ttft:
            out["ttft"] = ttft(fl, workdir, model, length, samples, python)
            say(format_ttft(out["ttft"]))
    finally:
        if fl is not None:
            fleet.down(fl.dir)
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def _med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def format_transfer(t: dict) -> str:
    best, mc = t["best"], t["mooncake"]
    last = t["kvstore"][-1]
    return "\n".join([
        f"transfer: {t['blocks']} blocks of {t['block_bytes'] >> 10} KiB, best of {t['rounds']} "
        f"(GB/s of payload)",
        f"  publish (local store -> pool)  kvstore {best['publish_gbps']:.3f}   Mooncake "
        f"batch_put_from {mc['put_gbps']:.3f}   ratio {t['ratio_publish_vs_put']}",
        f"  fill    (pool -> local store)  kvstore {best['fill_gbps']:.3f}   Mooncake "
        f"batch_get_into {mc['get_gbps']:.3f}   ratio {t['ratio_fill_vs_get']}",
        f"  the pool's side alone: publish {best['publish_pool_gbps']:.3f}, fill "
        f"{best['fill_pool_gbps']:.3f} (the agent's Mooncake calls, overlapped with its local I/O)",
        f"  where kvstore's time went (last round, s): publish {last['publish_split_s']}, "
        f"fill {last['fill_split_s']}"])


def format_step(s: dict) -> str:
    lines = [f"step: connector time on vLLM's scheduler thread per step (ms), "
             f"{s['index_entries']:,} entries, {s['requests']} prompts"]
    for name in ("without_pool", "with_pool"):
        for ph in ("store", "load"):
            r = s[name][ph]
            extra = (f", {r.get('pool_filled_blocks', 0)} blocks filled from the pool"
                     if ph == "load" and name == "with_pool" else "")
            lines.append(f"  {name:12s} {ph:5s} p50 {r['step_p50_ms']:.3f}  p99 {r['step_p99_ms']:.3f}  "
                         f"max {r['step_max_ms']:.3f}  (CPU p99 {r['step_cpu_p99_ms']:.3f}, "
                         f"run-queue p99 {r['step_runq_p99_ms']:.3f}; {r['steps']} steps{extra})")
    return "\n".join(lines)


def format_ttft(t: dict) -> str:
    def ms(xs):
        return f"{_med(xs) * 1000:.0f}"
    return (f"ttft: {t['model']} on {t['engine']}, {t['samples']} documents of {t['length']} tokens "
            f"(median ms): recompute {ms(t['recompute_s'])}, pool hit {ms(t['pool_hit_s'])} "
            f"({t['pool_filled_blocks']:.0f} blocks filled), local hit {ms(t['local_hit_s'])}")


def format_table(out: dict) -> str:
    parts = [f"kvstore bench fleet: Mooncake Store pool on {out['pool']['master']}, "
             f"{out['cpus']} CPUs", format_transfer(out["transfer"]), format_step(out["step"])]
    if "ttft" in out:
        parts.append(format_ttft(out["ttft"]))
    return "\n".join(parts)


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = out["transfer"]
    fig, axes = plt.subplots(1, 3 if "ttft" in out else 2, figsize=(13, 4))
    ax = axes[0]
    labels = ["publish / put", "fill / get"]
    ax.bar([0, 2], [t["best"]["publish_gbps"], t["best"]["fill_gbps"]], label="kvstore")
    ax.bar([0.8, 2.8], [t["mooncake"]["put_gbps"], t["mooncake"]["get_gbps"]], label="Mooncake")
    ax.set_xticks([0.4, 2.4], labels)
    ax.set_ylabel("GB/s")
    ax.set_title(f"pool transfer, {t['block_bytes'] >> 10} KiB blocks")
    ax.legend()
    ax = axes[1]
    s = out["step"]
    names = [f"{n.replace('_', ' ')}\n{ph}" for n in ("without_pool", "with_pool") for ph in ("store", "load")]
    p99 = [s[n][ph]["step_p99_ms"] for n in ("without_pool", "with_pool") for ph in ("store", "load")]
    ax.bar(range(4), p99)
    ax.axhline(0.5, ls="--", c="grey")
    ax.set_xticks(range(4), names, fontsize=8)
    ax.set_ylabel("step p99 (ms)")
    ax.set_title("scheduler thread")
    if "ttft" in out:
        tt = out["ttft"]
        ax = axes[2]
        vals = [_med(tt["recompute_s"]), _med(tt["pool_hit_s"]), _med(tt["local_hit_s"])]
        ax.bar(range(3), [v * 1000 for v in vals])
        ax.set_xticks(range(3), ["recompute", "pool hit", "local hit"])
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{tt['model']}, {tt['length']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
