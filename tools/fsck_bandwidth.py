#!/usr/bin/env python3
"""fsck --deep read bandwidth against fio on the same disk (the issue's target: >= 80%).

Builds a full store of --size (default 3 GiB) with --block-bytes payloads (default 2 MiB,
so a slot is 2 MiB + 4 KiB) in a temporary directory under --dir, then alternates, for
--rounds rounds:

  fio     sequential read of the store's own slot file(s), io_uring engine, O_DIRECT,
          iodepth 32, block size = the slot size (what fsck reads per I/O), --readonly;
  fsck    `kvstore fsck --deep --json STORE` in a fresh process (every used slot read
          through the ring and its header and payload checksum verified).

It prints both bandwidths (medians; GB/s = 1e9 bytes/s) and their ratio, for fsck's read
phase and for the whole command (process start, index scan and all). Usage:

    .venv/bin/python tools/fsck_bandwidth.py [--dir /tmp] [--size 3G] [--rounds 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from kvstore.engine import DiskStore, slot_file_path  # noqa: E402
from kvstore.layout import Layout, format_size, parse_size, read_fingerprint  # noqa: E402


def drop_caches() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def build_store(path: str, size: int, block_bytes: int) -> int:
    lay = Layout(model="fsck-bandwidth", dtype="bfloat16", block_size=16, block_bytes=block_bytes,
                 num_layers=32, num_kv_heads=8, head_dim=128)
    base = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8)
    with DiskStore.create(path, lay, size, io=True, staging_bytes=256 << 20) as st:
        n = st.geometry.num_slots
        keys = [i.to_bytes(8, "big") * 4 + b"\x00" for i in range(n)]

        def payload(i, rank):
            buf = base.copy()
            buf[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            return buf
        for start in range(0, n, 128):
            st.put(keys[start:start + 128], lambda i, r, s=start: payload(s + i, r))
        assert st.stats()["used_slots"] == n
    return n


def run_fio(files: list[str], bs: int, qd: int) -> float:
    total = rt = 0
    for f in files:
        out = subprocess.run(
            ["fio", "--name=read", f"--filename={f}", "--rw=read", f"--bs={bs}", f"--iodepth={qd}",
             "--ioengine=io_uring", "--direct=1", "--numjobs=1", "--readonly", "--output-format=json",
             f"--size={os.path.getsize(f)}"],
            capture_output=True, text=True, check=True)
        job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]["read"]
        total += job["io_bytes"]
        rt += job["runtime"] / 1000.0
    return total / rt / 1e9


def run_fsck(store: str, qd: int) -> tuple[float, float, dict]:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "fsck", "--deep", "--json", "-q",
                          f"--queue-depth={qd}", store], capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"fsck failed (exit {out.returncode}): {out.stdout}{out.stderr}")
    doc = json.loads(out.stdout)
    st = doc["stats"]
    return st["bytes_read"] / st["read_seconds"] / 1e9, st["bytes_read"] / wall / 1e9, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp", help="where the temporary store goes (the disk measured)")
    ap.add_argument("--size", default="3G")
    ap.add_argument("--block-bytes", default="2M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--store", default=None, help="reuse an existing store (not removed)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed")
    own = a.store is None
    tmp = tempfile.mkdtemp(prefix="kvstore-fsck-bw-", dir=a.dir) if own else None
    store = os.path.join(tmp, "store") if own else a.store
    try:
        if own:
            t = time.perf_counter()
            n = build_store(store, parse_size(a.size), parse_size(a.block_bytes))
            build_s = time.perf_counter() - t
        else:
            n, build_s = None, 0.0
        _, geo, _ = read_fingerprint(store)
        files = [slot_file_path(store, 0, i) for i in range(geo.num_files)]
        fio, fsck_read, fsck_wall = [], [], []
        doc = None
        for _ in range(a.rounds):
            drop_caches()
            fio.append(run_fio(files, geo.slot_size, a.queue_depth))
            drop_caches()
            r, w, doc = run_fsck(store, a.queue_depth)
            fsck_read.append(r)
            fsck_wall.append(w)
        res = {
            "store": store, "slots": geo.num_slots, "slot_size": geo.slot_size,
            "store_bytes": geo.num_slots * geo.slot_size, "build_seconds": round(build_s, 1),
            "queue_depth": a.queue_depth, "rounds": a.rounds,
            "fio_read_gbps": statistics.median(fio), "fsck_read_gbps": statistics.median(fsck_read),
            "fsck_wall_gbps": statistics.median(fsck_wall),
            "samples": {"fio": fio, "fsck_read": fsck_read, "fsck_wall": fsck_wall},
            "fsck_clean": doc["clean"], "slots_verified": doc["stats"]["slots_checked"],
        }
        res["ratio_read"] = res["fsck_read_gbps"] / res["fio_read_gbps"]
        res["ratio_wall"] = res["fsck_wall_gbps"] / res["fio_read_gbps"]
        # A shared or virtual disk drifts between rounds: the ratio of each round's
        # adjacent runs is the steadier number.
        res["ratio_read_per_round_median"] = statistics.median(r / f for r, f in zip(fsck_read, fio))
        # On a disk whose speed jumps between modes (a shared virtual disk: ~1.3 vs ~3.2
        # GB/s here, for fio as for fsck), the best of the rounds shows what each reaches.
        res["fio_best_gbps"] = max(fio)
        res["fsck_read_best_gbps"] = max(fsck_read)
        res["ratio_read_best"] = max(fsck_read) / max(fio)
        if a.json:
            print(json.dumps(res, indent=2))
        else:
            print(f"store: {format_size(res['store_bytes'])}, {geo.num_slots} slots of "
                  f"{format_size(geo.slot_size)} (built in {res['build_seconds']} s), queue depth "
                  f"{a.queue_depth}, O_DIRECT, median of {a.rounds} alternating rounds")
            print(f"fio (io_uring, bs={geo.slot_size}, iodepth {a.queue_depth}): "
                  f"{res['fio_read_gbps']:.2f} GB/s  samples {[round(x, 2) for x in fio]}")
            print(f"kvstore fsck --deep, read phase:     {res['fsck_read_gbps']:.2f} GB/s  "
                  f"samples {[round(x, 2) for x in fsck_read]}  -> {100 * res['ratio_read']:.0f}% of fio")
            print(f"kvstore fsck --deep, whole command:  {res['fsck_wall_gbps']:.2f} GB/s  "
                  f"samples {[round(x, 2) for x in fsck_wall]}  -> {100 * res['ratio_wall']:.0f}% of fio")
            print(f"read phase / fio, median of the per-round ratios: "
                  f"{100 * res['ratio_read_per_round_median']:.0f}%")
            print(f"best round: fio {res['fio_best_gbps']:.2f} GB/s, fsck read phase "
                  f"{res['fsck_read_best_gbps']:.2f} GB/s -> {100 * res['ratio_read_best']:.0f}%")
            print(f"fsck verdict: {'clean' if res['fsck_clean'] else 'NOT CLEAN'}, "
                  f"{res['slots_verified']} slots verified (header + xxh3 payload checksum)")
    finally:
        if own:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
