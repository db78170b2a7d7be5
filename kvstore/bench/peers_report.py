"""The report of `kvstore bench peers`: the peer targets (`targets`), the table
(`format_table`, with the per-directory rows) and the figure (`plot`), all from the
JSON-able result of `peers_bench.run`."""
from __future__ import annotations

from kvstore.bench.peers_common import LABELS, SYSTEMS
from kvstore.bench.plotting import size_panels
from kvstore.format.layout import format_size


def targets(results: dict) -> list[dict]:
    """The peer targets (docs/benchmarks.md), each with the numbers it was judged on."""
    out = []

    def add(name, ok, detail):
        out.append({"target": name, "met": bool(ok), "detail": detail})

    for bs, r in results.items():
        k, v, f = r.get("kvstore"), r.get("vllm_fs"), r.get("fio")
        b = int(bs)
        lbl = format_size(b)
        if k and v and b == 128 << 10:
            add(f"{lbl}: store >= 2x vLLM fs", k["store_gbps"] >= 2 * v["store_gbps"],
                f"{k['store_gbps'] / v['store_gbps']:.2f}x")
            add(f"{lbl}: load >= vLLM fs", k["load_gbps"] >= v["load_gbps"],
                f"{k['load_gbps'] / v['load_gbps']:.2f}x")
        fs_ = r.get("fio_slots")
        if k and fs_:   # judged against fio on kvstore's own pattern; sequential fio beside it
            for d in ("store", "load"):
                q = k[f"{d}_gbps"] / fs_[f"{d}_gbps"]
                seq = f" ({k[f'{d}_gbps'] / f[f'{d}_gbps']:.2f}x fio sequential)" if f else ""
                add(f"{lbl}: {d} >= 0.95x fio on kvstore's slots", q >= 0.95, f"{q:.2f}x{seq}")
        elif k and f and b in (128 << 10, 2 << 20):   # fio_slots not run: the sequential bar
            bar = 0.8 if b == 128 << 10 else 0.9
            for d in ("store", "load"):
                q = k[f"{d}_gbps"] / f[f"{d}_gbps"]
                add(f"{lbl}: {d} >= {bar}x fio", q >= bar, f"{q:.2f}x")
        if k and v and b == 2 << 20:
            for d in ("store", "load"):
                q = k[f"{d}_gbps"] / v[f"{d}_gbps"]
                add(f"{lbl}: {d} >= vLLM fs", q >= 1.0, f"{q:.2f}x")
        if k and v:
            q = v["cpu_s_per_gb"] / k["cpu_s_per_gb"]
            add(f"{lbl}: CPU/GB <= 1/3 of vLLM fs", q >= 3.0, f"vLLM uses {q:.2f}x kvstore's")
        if k:
            q = k["prefix_load_p99_ms"] / k["prefix_load_p50_ms"]
            add(f"{lbl}: prefix p99 <= 1.5x p50", q <= 1.5, f"{q:.2f}x")
    return out

def format_table(out: dict) -> str:
    c = out["config"]
    dirs = c.get("dirs") or [c["dir"]]
    multi = len(dirs) > 1
    over = f" over {len(dirs)} directories" if multi else ""
    labels = dict(LABELS, **({"vllm_fs": "vLLM fs tier*", "one_thread": "1 thread/dir"} if multi else {}))
    lines = [f"kvstore bench peers: {format_size(c['size'])} per system per block size{over}, queue depth "
             f"{c['queue_depth']}{' per directory' if multi else ''}, "
             f"{'O_DIRECT' if c['o_direct'] else 'page cache'}, median of "
             f"{c['rounds']} alternating rounds; vLLM {c['vllm_version']} fs tier "
             f"(16+16 threads, fs_io_C={'yes' if c['vllm_fs_io_C'] else 'no'})",
             f"prefix load: p50/p99 over {c['rounds']}x{c['prefix_samples_per_round']} loads of one "
             "prefix while a background thread stores new blocks"]
    if multi:
        lines.append(f"directories: {', '.join(dirs)}; kvstore: one store striped over all, a ring per "
                     "directory; fio: a job per directory at once; 1 thread/dir: a blocking thread per directory")
        lines.append(f"*vLLM fs tier: {dirs[0]} only (it takes one root_dir; several fs tiers would each "
                     "store a copy of every block, not a share)")
    head = (f"{'block':>7} {'system':<13} {'store GB/s':>10} {'load GB/s':>10} {'CPU s/GB':>9} "
            f"{'prefix':>7} {'p50 ms':>8} {'p99 ms':>8} {'bg GB/s':>8}")
    lines.append(head)
    for bs, res in out["results"].items():
        for s, r in res.items():
            d = out.get("details", {}).get(bs, {}).get(s, {})
            cpu = r.get("cpu_s_per_gb", d.get("cpu_s_per_gb"))
            p50 = r.get("prefix_load_p50_ms")
            p99 = r.get("prefix_load_p99_ms")
            bg = d.get("background_store_gbps")
            pre = c["prefix_blocks"][bs] if p50 is not None else None
            lines.append(
                f"{format_size(int(bs)):>7} {labels.get(s, s):<13} {r['store_gbps']:>10.2f} "
                f"{r['load_gbps']:>10.2f} {cpu if cpu is not None else float('nan'):>9.3f} "
                f"{pre if pre is not None else '-':>7} "
                f"{p50 if p50 is not None else float('nan'):>8.1f} "
                f"{p99 if p99 is not None else float('nan'):>8.1f} "
                f"{bg if bg is not None else float('nan'):>8.2f}")
    scaled = [f"{format_size(int(b))}: {p}" for b, p in c["prefix_blocks"].items() if p != 1000]
    if scaled:
        lines.append("prefix scaled down from 1000 blocks (cap 128 MiB / a quarter of --size): "
                     + ", ".join(scaled))
    lines.append("fio CPU s/GB is fio's own usr+sys; fio, slots: fio on kvstore's slots (block + 4 KiB "
                 "header, payload GB/s); bg GB/s = background store rate during the prefix test")
    if multi and out.get("per_device"):
        lines.extend(_per_device_lines(out["per_device"], labels))
    lines.append("targets:")
    for t in out.get("targets", []):
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['detail']}")
    return "\n".join(lines)


def _per_device_lines(per_device: dict, labels: dict) -> list[str]:
    """Per directory and block size: each system's store / load GB/s there."""
    first = next(iter(per_device.values()))
    systems = [s for s in first[0] if s != "dir"]
    width = max(9, max(len(r["dir"]) for rows in per_device.values() for r in rows))
    lines = ["per directory, store / load GB/s (a system's rows add up to its total):",
             f"{'block':>7} {'directory':<{width}} " + " ".join(f"{labels.get(s, s):>15}" for s in systems)]
    for bs, rows in per_device.items():
        for r in rows:
            cells = [f"{r[s]['store_gbps']:>7.2f} /{r[s]['load_gbps']:>6.2f}" for s in systems]
            lines.append(f"{format_size(int(bs)):>7} {r['dir']:<{width}} " + " ".join(cells))
    return lines


def plot(out: dict, path: str) -> None:
    """Bar charts (one panel per metric, grouped by block size) saved as PNG."""
    def value(b, s, field):
        v = out["results"][b].get(s, {}).get(field)
        if v is None and field == "cpu_s_per_gb":
            v = out.get("details", {}).get(b, {}).get(s, {}).get("cpu_s_per_gb")
        return v

    sizes = list(out["results"])
    c = out["config"]
    size_panels(
        path, sizes, [s for s in SYSTEMS if any(s in out["results"][b] for b in sizes)], value,
        [("store_gbps", "store GB/s"), ("load_gbps", "load GB/s"),
         ("cpu_s_per_gb", "CPU s per GB moved"), ("prefix_load_p99_ms", "prefix load p99 ms\n(under stores)")],
        LABELS, {"kvstore": "#1f77b4", "vllm_fs": "#ff7f0e", "one_thread": "#7f7f7f", "fio": "#2ca02c",
                 "fio_slots": "#98df8a"},
        f"kvstore vs vLLM {c['vllm_version']} fs tier vs 1 thread vs fio "
        f"({'O_DIRECT' if c['o_direct'] else 'page cache'}, QD {c['queue_depth']}, "
        f"{format_size(c['size'])} per system)",
        figsize=(14, 3.6))
