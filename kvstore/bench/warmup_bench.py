"""`kvstore bench warmup`: a store copied by `kvstore warmup --from-store SRC --all`
against fio doing the same I/O.

Per block size, a source store holding `--size` bytes of blocks is written once (not
timed). Then, in alternating rounds:

- kvstore: `warmup(DST, from_store=SRC, all_blocks=True)` into a new directory, by the
  wall clock: the new store created, every block read from the source and verified (header
  and XXH3 checksum), written, fdatasynced and committed to the new store's index;
- fio: the same bytes in slot-sized blocks (the block and its 4096-byte header) with as
  many in flight as kvstore's rings (`ring_depth`), registered buffers and files, O_DIRECT:
  a read pass over a file of that size, then a write pass into a new file (fdatasync at
  its end). The copy's time is the sum of fio's two runtimes: its I/O alone, with neither
  its start nor its file's creation counted.

The page cache is dropped before each copy, so the source is read from the device. GB/s
are bytes of block payload copied per second (1e9); CPU s/GB is the process's user+system
time (kvstore) or fio's own. Target: kvstore copies at >= 0.95x fio's rate.
"""
from __future__ import annotations

import os
import resource
import shutil
import statistics
import tempfile
import time

import numpy as np

from kvstore.bench.io_bench import drop_page_cache
from kvstore.errors import BenchmarkFailed, ConfigError, MissingDependency
from kvstore.format.layout import HEADER_SIZE, Layout, format_size, parse_size
from kvstore.io.rings import INFLIGHT_BYTES, ring_depth

DEFAULT_BLOCKS = ("128K", "2M")
TARGET = 0.95
QUEUE_DEPTH = 32


def _layout(block: int) -> Layout:
    return Layout(model="bench/warmup", dtype="bfloat16", block_size=16, block_bytes=block,
                  num_layers=1, num_kv_heads=1, head_dim=1, kv_layout="bench")


def _keys(n: int) -> list[bytes]:
    from kvstore.bench.peers_common import bench_keys
    return bench_keys("warmup", 0, n)


def _fill_source(path: str, block: int, n: int) -> None:
    from kvstore.store.disk import DiskStore
    from kvstore.tools.warmup import PART_BYTES
    lay = _layout(block)
    DiskStore.create(path, lay, (n + 64) * lay.slot_size).close()
    keys = _keys(n)
    payload = np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8)
    part = max(1, PART_BYTES // block)
    with DiskStore(path, io=True) as s:
        for i in range(0, n, part):
            s.put(keys[i:i + part], lambda j, r: payload)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _kvstore_round(src: str, dst: str, block: int, n: int) -> dict:
    from kvstore.tools.warmup import warmup
    shutil.rmtree(dst, ignore_errors=True)
    drop_page_cache()
    c0, t0 = _cpu(), time.perf_counter()
    sm = warmup(dst, from_store=src, all_blocks=True)
    dt, cpu = time.perf_counter() - t0, _cpu() - c0
    if sm.blocks_written != n:
        raise BenchmarkFailed(f"kvstore warmup copied {sm.blocks_written} of {n} blocks "
                              f"({sm.to_json()})")
    gb = n * block / 1e9
    shutil.rmtree(dst, ignore_errors=True)
    return {"copy_gbps": gb / dt, "cpu_s_per_gb": cpu / gb}


def _fio_round(directory: str, block: int, n: int) -> dict:
    from kvstore.bench.peers_baselines import FioCPU
    slot = block + HEADER_SIZE
    qd = ring_depth(slot, QUEUE_DEPTH, INFLIGHT_BYTES)
    a, b = os.path.join(directory, "fio-src"), os.path.join(directory, "fio-dst")
    os.makedirs(a, exist_ok=True)
    os.makedirs(b, exist_ok=True)
    src, dst = FioCPU(a, n * slot, slot, qd, True), FioCPU(b, n * slot, slot, qd, True)
    try:
        src.write()                 # the source file (not timed)
        src.cpu_s = 0.0
        drop_page_cache()
        r = src.read()
        w = dst.write()
    finally:
        src.close()
        dst.close()
    seconds = n * slot / r + n * slot / w
    gb = n * block / 1e9
    return {"copy_gbps": gb / seconds, "read_gbps": r * block / slot / 1e9,
            "write_gbps": w * block / slot / 1e9, "cpu_s_per_gb": (src.cpu_s + dst.cpu_s) / gb}


def run(directory: str | None = None, block_sizes=DEFAULT_BLOCKS, size="1G", rounds: int = 3,
        log=None) -> dict:
    """Run the benchmark; returns {"results": {block bytes: {system: {...}}}, "config",
    "targets"}."""
    if shutil.which("fio") is None:
        raise MissingDependency("fio is not installed (Debian: apt-get install fio); `make` installs it")
    if log is None:
        def log(msg):
            pass
    size_b = parse_size(size)
    blocks = [parse_size(b) for b in block_sizes]
    for b in blocks:
        if b <= 0 or b % 4096:
            raise ConfigError(f"--block-sizes: {b} is not a positive multiple of 4096 bytes")
        if size_b // b < 2:
            raise ConfigError(f"--size {format_size(size_b)} holds fewer than 2 blocks of "
                              f"{format_size(b)}; raise --size")
    if directory is not None and not os.path.isdir(directory):
        raise ConfigError(f"--dir {directory} is not a directory")
    tmp = tempfile.mkdtemp(prefix="kvstore-warmup-bench-", dir=directory or "/var/tmp")
    results: dict = {}
    try:
        for block in blocks:
            n = size_b // block
            src = os.path.join(tmp, "src")
            shutil.rmtree(src, ignore_errors=True)
            log(f"{format_size(block)}: writing the source store ({format_size(n * block)})")
            _fill_source(src, block, n)
            samples: dict = {"kvstore": [], "fio": []}
            for rnd in range(rounds):
                log(f"{format_size(block)} round {rnd + 1}/{rounds}: kvstore")
                samples["kvstore"].append(_kvstore_round(src, os.path.join(tmp, "dst"), block, n))
                log(f"{format_size(block)} round {rnd + 1}/{rounds}: fio")
                samples["fio"].append(_fio_round(tmp, block, n))
            shutil.rmtree(src, ignore_errors=True)
            results[str(block)] = {
                s: {**{k: statistics.median(x[k] for x in xs) for k in xs[0]},
                    "copy_gbps_samples": [x["copy_gbps"] for x in xs]}
                for s, xs in samples.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"results": results,
            "config": {"dir": directory or "(a temporary directory under /var/tmp)",
                       "size": size_b, "block_sizes": blocks, "rounds": rounds,
                       "ring_depth": {str(b): ring_depth(b + HEADER_SIZE, QUEUE_DEPTH,
                                                         INFLIGHT_BYTES) for b in blocks},
                       "o_direct": True},
            "targets": targets(results)}


def targets(results: dict) -> list[dict]:
    out = []
    for block, r in results.items():
        ratio = r["kvstore"]["copy_gbps"] / r["fio"]["copy_gbps"]
        out.append({"target": f"{format_size(int(block))}: copy >= {TARGET}x fio (read pass + "
                              "write pass)",
                    "met": ratio >= TARGET, "detail": f"{ratio:.2f}x"})
    return out


def format_table(out: dict) -> str:
    c = out["config"]
    lines = [f"kvstore bench warmup: a store of {format_size(c['size'])} copied by `kvstore "
             f"warmup --from-store --all` vs fio reading then writing the same slots "
             f"(O_DIRECT, median of {c['rounds']} alternating rounds)",
             f"{'block':>10} {'system':<8} {'copy GB/s':>10} {'read GB/s':>10} "
             f"{'write GB/s':>10} {'CPU s/GB':>9}"]
    for block, r in out["results"].items():
        k, f = r["kvstore"], r["fio"]
        lines.append(f"{format_size(int(block)):>10} {'kvstore':<8} {k['copy_gbps']:>10.2f} "
                     f"{'-':>10} {'-':>10} {k['cpu_s_per_gb']:>9.3f}")
        lines.append(f"{format_size(int(block)):>10} {'fio':<8} {f['copy_gbps']:>10.2f} "
                     f"{f['read_gbps']:>10.2f} {f['write_gbps']:>10.2f} {f['cpu_s_per_gb']:>9.3f}")
    lines.append("targets:")
    for t in out["targets"]:
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['detail']}")
    return "\n".join(lines)
