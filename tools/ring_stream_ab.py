#!/usr/bin/env python3
"""Streamed ring vs one ring call per chunk, side by side on one store (issue 15).

`RankIO.read_blocks` moves a batch in chunks of the double buffer. With
`RankIO.streamed = False` (the design before the device streams) each chunk is one ring
call per device, and each call drains its queue at its tail; with streaming (the default)
chunk k+1's ops enter each ring while chunk k drains. The difference shows when a
device's share of a chunk is a few queue depths or less: a worker with modest staging,
or short requests. This tool builds a store over the given directories with staging of
`--chunk` slots per device per chunk, then reads the whole store `--rounds` times with
each design, alternating, and prints read GB/s (wall clock) and the mean ops in flight
per ring (the kernel's own counters, as `kvstore bench io` samples them). A third row,
`whole`, is the disk's own limit: every device's slots as one plain ring batch (no
chunks, no checks), all devices at once, each on its own thread.

    .venv/bin/python tools/ring_stream_ab.py --dir /tmp/d0 --block-size 2M
    .venv/bin/python tools/ring_stream_ab.py --dir /tmp/d0,/tmp/d1,/tmp/d2 --block-size 256K
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time

import click


@click.command()
@click.option("--dir", "dirs", required=True, help="Directory, or several comma-separated (one per device).")
@click.option("--size", default="1G", show_default=True, help="Bytes in the store (read whole each round).")
@click.option("--block-size", default="2M", show_default=True, help="Slot size (header included).")
@click.option("--queue-depth", default=32, show_default=True, type=click.IntRange(1, 4096))
@click.option("--chunk", default=None, type=click.IntRange(1, 1 << 20),
              help="Slots per device per chunk (default: one queue depth).")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, 50))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def main(dirs, size, block_size, queue_depth, chunk, rounds, as_json):
    from kvstore.bench.io_bench import QueueSampler
    from kvstore.engine import DiskStore, SlotRef
    from kvstore.layout import Layout, parse_size

    dirs = [d for d in dirs.split(",") if d]
    if not dirs:
        raise click.UsageError("--dir names no directory (give A or A,B,C)")
    for d in dirs:
        if not os.path.isdir(d):
            raise click.UsageError(f"--dir {d}: not a directory (create it first)")
    block = parse_size(block_size)
    if block % 4096 or block < 8192:
        raise click.UsageError("--block-size must be a multiple of 4 KiB and at least 8 KiB")
    chunk = chunk or queue_depth
    ndev = len(dirs)
    n = parse_size(size) // block
    if n < 4 * chunk * ndev:
        raise click.UsageError(f"--size holds {n} slots: give at least {4 * chunk * ndev} "
                               "(four chunks) to see chunk boundaries")
    store = os.path.join(dirs[0], "ring-stream-ab-store")
    data = [os.path.join(d, "ring-stream-ab-data") for d in dirs] if ndev > 1 else None
    for p in [store] + (data or []):
        if os.path.exists(p):
            raise click.UsageError(f"{p} exists: remove it (a previous run's store?)")
    for p in data or []:
        os.mkdir(p, 0o700)
    layout = Layout(model="ring-stream-ab", dtype="uint8", block_size=16, block_bytes=block - 4096,
                    num_layers=1, num_kv_heads=1, head_dim=1)
    out = {"config": {"dirs": dirs, "block_size": block, "queue_depth": queue_depth,
                      "chunk_slots_per_device": chunk, "slots": n, "rounds": rounds},
           "streamed": {"read_gbps": [], "queue_occupancy": []},
           "per_call": {"read_gbps": [], "queue_occupancy": []},
           "whole": {"read_gbps": [], "queue_occupancy": []}}
    try:
        with DiskStore.create(store, layout, n * block, data_dirs=data, io=True, io_mode="direct",
                              queue_depth=queue_depth, staging_bytes=2 * chunk * ndev * block) as st:
            rio = st.ranks[0]
            refs = [SlotRef(b"ab%08d" % i, i, 1) for i in range(n)]
            errs = rio.write_blocks(refs, lambda start, stop, views: None)
            if any(e is not None for e in errs):
                raise click.ClickException(f"writing the store failed: {next(e for e in errs if e)}")
            for _ in range(rounds):
                for name, streamed in (("per_call", False), ("streamed", True)):
                    rio.streamed = streamed
                    with QueueSampler(rio.rings) as q:
                        t = time.perf_counter()
                        errs = rio.read_blocks(refs, lambda *a: None, verify="checksum")
                        dt = time.perf_counter() - t
                    if any(e is not None for e in errs):
                        raise click.ClickException(f"a read failed: {next(e for e in errs if e)}")
                    out[name]["read_gbps"].append(n * block / dt / 1e9)
                    out[name]["queue_occupancy"].append(statistics.fmean(q.mean()))
                gbps, occ = _whole(rio, n, block)
                out["whole"]["read_gbps"].append(gbps)
                out["whole"]["queue_occupancy"].append(occ)
    finally:
        for p in [store] + (data or []):
            shutil.rmtree(p, ignore_errors=True)
    for name in ("per_call", "streamed", "whole"):
        out[name]["median_read_gbps"] = statistics.median(out[name]["read_gbps"])
        out[name]["median_queue_occupancy"] = statistics.median(out[name]["queue_occupancy"])
    if as_json:
        print(json.dumps(out, indent=2))
        return
    print(f"{ndev} device(s), {block >> 10} KiB slots, QD {queue_depth}, chunks of {chunk} "
          f"slots per device, {n} slots read {rounds} times per design (checksums verified)")
    for name, label in (("per_call", "one ring call per chunk"), ("streamed", "streamed ring"),
                        ("whole", "whole: one batch/ring")):
        r = out[name]
        print(f"  {label:<24} read {r['median_read_gbps']:.2f} GB/s "
              f"({', '.join(f'{x:.2f}' for x in r['read_gbps'])}), in flight per ring "
              f"{r['median_queue_occupancy']:.1f} of {queue_depth} "
              f"({', '.join(f'{x:.1f}' for x in r['queue_occupancy'])})")


def _whole(rio, n: int, block: int) -> tuple[float, float]:
    """Every device's slots read as one Ring.submit (payload bytes only, into staging
    reused round robin), all devices at once: what the disk sustains with each ring's
    queue topped up for the whole phase."""
    import threading

    import numpy as np
    from kvstore.bench.io_bench import QueueSampler
    slots = np.arange(n)
    fds, offs, devs = rio._locate(slots.tolist())
    base = np.uint64(rio.staging.address)
    errors = []

    def go(d):
        idx = np.flatnonzero(devs == d)
        addrs = base + (np.arange(idx.size, dtype=np.uint64) % np.uint64(rio.staging_slots)) * np.uint64(block)
        res = rio.rings[d].submit(0, fds[idx], offs[idx], addrs, np.full(idx.size, block, np.uint32))
        if (res != block).any():
            errors.append(f"device {d}: {int((res != block).sum())} reads failed")
    with QueueSampler(rio.rings) as q:
        t = time.perf_counter()
        threads = [threading.Thread(target=go, args=(d,)) for d in range(rio.ndev)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        dt = time.perf_counter() - t
    if errors:
        raise click.ClickException("; ".join(errors))
    return n * block / dt / 1e9, statistics.fmean(q.mean())


if __name__ == "__main__":
    sys.exit(main())
