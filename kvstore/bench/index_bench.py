"""Benchmark of the LMDB index (`kvstore bench index`): prefix walks, lookups, commits, size,
open time, at a few index sizes, and the connector's lookup path (the scheduler's in-memory
`KeyTable`: build time, 1000-key prefix walks, misses). Touches only a scratch directory."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from kvstore.bench import scratch_dir
from kvstore.index.core import Index
from kvstore.index.maint import bulk_load

DEFAULT_ENTRIES = [100_000, 1_000_000, 10_000_000]
CHAIN = 1000
PREFIX_REPS = 200
LOOKUPS = 100_000
COMMIT_REPS = 21
WALK_BLOCKS = 511     # an 8k-token prompt's full blocks at block size 16

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _keys(n: int, seed: int = 0) -> np.ndarray:
    """n 32-byte keys, ascending: 8-byte big-endian index + 20 random bytes (hash-like
    width and spread, ordered so the build can use LMDB append mode) + 4 zero bytes, so
    each is also the store key of a 28-byte "block hash" in KV cache group 0 (what the
    scheduler's walk over vLLM's block hashes builds)."""
    arr = np.random.default_rng(seed).integers(0, 256, size=(n, 32), dtype=np.uint8)
    arr[:, :8] = np.arange(n, dtype=">u8").view(np.uint8).reshape(n, 8)
    arr[:, 28:] = 0
    return arr


def _walk_cold(table, chains: list, blocks: int = WALK_BLOCKS) -> list[float]:
    """The scheduler's lookup as the connector makes it (`KeyTable.prefix_of` over a
    request's block hashes, pinning each hit), each after 64 MiB of other memory traffic
    (as vLLM's own work between two lookups), so the table's cache lines are cold: ms per
    walk of `blocks` hits."""
    other = np.zeros(64 << 20, dtype=np.uint8)
    out = []
    for c in chains:
        hashes = [k[:28] for k in c[:blocks]]
        np.add(other, 1, out=other)
        t0 = time.perf_counter()
        _, slots, _ = table.prefix_of(hashes, 0, len(hashes), 0, True)
        out.append((time.perf_counter() - t0) * 1e3)
        table.unpin(slots)
        assert len(slots) == len(hashes)
    return out


def _build(path: str, n: int, keys: np.ndarray) -> float:
    t0 = time.perf_counter()
    ix = Index(path, n, create=True, sync=False, map_size=max(1 << 30, n * 600))
    buf = keys.tobytes()
    bulk_load(ix, ((buf[i * 32:(i + 1) * 32], i, i + 1) for i in range(n)),
                 keys_sorted=True, batch=500_000)
    ix.close()
    return time.perf_counter() - t0


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def _open_in_new_process(path: str) -> tuple[float, float]:
    code = ("import time; t0 = time.perf_counter(); from kvstore.index.core import Index; "
            "ix = Index(%r, readonly=True); s = ix.stats(); ix.close(); "
            "print(time.perf_counter() - t0)" % path)
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    return float(out.strip()), time.perf_counter() - t0


def _one(n: int, root: str) -> dict:
    path = os.path.join(root, f"index-{n}")
    keys = _keys(n)
    build_s = _build(path, n, keys)
    buf = keys.tobytes()
    key = lambda i: buf[i * 32:(i + 1) * 32]  # noqa: E731
    rng = np.random.default_rng(1)

    ix = Index(path, sync=True)
    chains = [[key(int(i)) for i in rng.integers(0, n, CHAIN)] for _ in range(PREFIX_REPS)]
    for c in chains[:5]:
        assert len(ix.longest_prefix(c)) == CHAIN
    times = []
    for c in chains:
        t0 = time.perf_counter()
        ix.longest_prefix(c)
        times.append((time.perf_counter() - t0) * 1e3)

    # The connector's lookup path: the scheduler's in-memory table, built from this index.
    from kvstore._keytable import KeyTable
    table = KeyTable(n)
    t0 = time.perf_counter()
    ix.load_keys(table)
    table_build_s = time.perf_counter() - t0
    ttimes = []
    for c in chains:
        t0 = time.perf_counter()
        slots, _ = table.prefix(c)
        ttimes.append((time.perf_counter() - t0) * 1e3)
        assert len(slots) == CHAIN
    wtimes = _walk_cold(table, chains[:100])      # random keys: slots scattered
    # a prefix stored together (its blocks in consecutive slots, as a store job takes them
    # from the pool): the walk follows the run instead of probing each block's bucket
    runs = [[key(int(s) + j) for j in range(WALK_BLOCKS)]
            for s in rng.integers(0, n - WALK_BLOCKS, 100)]
    follows = table.run_follows
    rtimes = _walk_cold(table, runs)
    follows = table.run_follows - follows
    misses = [b"miss" + c[0] for c in chains]
    t0 = time.perf_counter()
    for m in misses:
        table.prefix([m] + chains[0][1:])
    miss_us = (time.perf_counter() - t0) / len(misses) * 1e6
    table_mb = table.nbytes / 2**20
    del table

    probe = [key(int(i)) for i in rng.integers(0, n, LOOKUPS)]
    t0 = time.perf_counter()
    for p in probe:
        ix.lookup(p)
    lookups_per_s = LOOKUPS / (time.perf_counter() - t0)

    # full capacity (built with capacity == n): every reservation evicts
    reserve_ms, commit_ms, total_ms = [], [], []
    for r in range(COMMIT_REPS):
        new = [b"new-%02d-%06d" % (r, i) + b"\x00" * 18 for i in range(CHAIN)]
        t0 = time.perf_counter()
        items, evicted = ix.reserve(new)
        t1 = time.perf_counter()
        ix.commit(items)
        t2 = time.perf_counter()
        assert len(evicted) == CHAIN
        reserve_ms.append((t1 - t0) * 1e3)
        commit_ms.append((t2 - t1) * 1e3)
        total_ms.append((t2 - t0) * 1e3)
    touch_ms = []
    for c in chains[:COMMIT_REPS]:
        t0 = time.perf_counter()
        ix.touch(c)
        touch_ms.append((time.perf_counter() - t0) * 1e3)
    ix.close()

    open_s, open_process_s = _open_in_new_process(path)
    return {
        "entries": n,
        "prefix1000_p50_ms": round(statistics.median(times), 3),
        "prefix1000_p99_ms": round(_pct(times, 99), 3),
        "lookups_per_s": round(lookups_per_s),
        "table_prefix1000_p50_ms": round(statistics.median(ttimes), 3),
        "table_prefix1000_p99_ms": round(_pct(ttimes, 99), 3),
        "table_miss_us": round(miss_us, 2),
        # the connector's walk: 511 block hashes -> pinned hits, caches cold
        "table_walk511_cold_p50_ms": round(statistics.median(wtimes), 3),
        "table_walk511_cold_p99_ms": round(_pct(wtimes, 99), 3),
        # the same over 511 blocks in consecutive slots, and the share of them found by
        # following the run
        "table_walk511_run_cold_p50_ms": round(statistics.median(rtimes), 3),
        "table_walk511_run_cold_p99_ms": round(_pct(rtimes, 99), 3),
        "table_walk511_run_followed": round(follows / (len(runs) * WALK_BLOCKS), 3),
        "table_build_s": round(table_build_s, 2),
        "table_mb": round(table_mb, 1),
        "commit1000_ms": round(statistics.median(total_ms), 3),
        "reserve1000_ms": round(statistics.median(reserve_ms), 3),
        "commit_only1000_ms": round(statistics.median(commit_ms), 3),
        "touch1000_ms": round(statistics.median(touch_ms), 3),
        "bytes_per_entry": round(os.path.getsize(os.path.join(path, "data.mdb")) / n, 1),
        "open_s": round(open_s, 4),
        "open_process_s": round(open_process_s, 4),
        "build_s": round(build_s, 2),
    }


_COLS = [("entries", "entries", "{:>10}"), ("prefix1000_p50_ms", "pfx p50 ms", "{:>10.3f}"),
         ("prefix1000_p99_ms", "pfx p99 ms", "{:>10.3f}"),
         ("table_prefix1000_p50_ms", "tbl p50 ms", "{:>10.3f}"),
         ("table_walk511_cold_p50_ms", "walk511 ms", "{:>10.3f}"),
         ("table_walk511_run_cold_p50_ms", "run511 ms", "{:>9.3f}"), ("table_miss_us", "tbl miss us", "{:>11.2f}"),
         ("table_build_s", "tbl build s", "{:>11.2f}"), ("lookups_per_s", "lookups/s", "{:>10}"),
         ("commit1000_ms", "rsv+cmt ms", "{:>10.2f}"), ("touch1000_ms", "touch ms", "{:>9.2f}"),
         ("bytes_per_entry", "B/entry", "{:>8.1f}"), ("open_s", "open s", "{:>7.3f}"),
         ("build_s", "build s", "{:>8.1f}")]


def run(entries: list[int] | None = None, json_out: bool = False, tmpdir: str | None = None
        ) -> dict:
    """Build an index per size in `entries`, measure, print the table rows as they come
    (unless json_out: then nothing is printed, the caller prints the JSON), return
    {"results": [...]}. Scratch indexes go under tmpdir (default: a temp dir) and are removed."""
    entries = list(entries or DEFAULT_ENTRIES)
    root = scratch_dir("kvstore-index-bench-", tmpdir)
    results = []
    try:
        if not json_out:
            print("  ".join(h.rjust(len(fmt.format(0))) for _, h, fmt in _COLS), flush=True)
        for n in entries:
            res = _one(n, root)
            results.append(res)
            shutil.rmtree(os.path.join(root, f"index-{n}"), ignore_errors=True)
            if not json_out:
                print("  ".join(fmt.format(res[k]) for k, _, fmt in _COLS), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"results": results}


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("entries", nargs="*", type=int)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tmpdir")
    a = ap.parse_args()
    res = run(a.entries or None, a.json, a.tmpdir)
    if a.json:
        print(json.dumps(res, indent=2))
