#!/usr/bin/env python3
"""A/B of the scheduler's store planning walk (issue 14), in isolation:

    .venv/bin/python tools/plan_ab.py [--entries 10000000] [--reps 200]

`KeyTable.plan_new` of 512 new blocks (an 8k-token chunk) over a table of `entries`
keys, as the step thread runs it, each walk after 64 MiB of other memory traffic (vLLM's
own work between two steps) so the table is cold (vLLM's `KVCacheBlock`s of the chunk are
touched after it, as its allocator does in the step), alternating:

- keys: the walk makes a bytes key per planned block and reads `block_id` from vLLM's
  `KVCacheBlock` objects (the design before the packed stores);
- packed: no key made (vLLM's hash objects handed back) over vLLM's `KVCacheBlock`s;
- packed+ids: no key, over the int list vLLM made for the step's `NewRequestData`.

Also the release of a committed job on the step thread (`KeySet.difference_update` of
its keys, then the keys freed). Prints p50/p99 us per variant (medians of alternating
rounds: the machine's noise hits every variant alike).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=10_000_000)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    if a.entries < 513 or a.reps < 1:
        ap.error("--entries must be at least 513 (a walk plans 512 new blocks) and --reps at least 1")
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvstore._keytable import KeySet, KeyTable, make_keys

    n = a.entries
    t0 = time.perf_counter()
    table = KeyTable(n)
    rng = np.random.default_rng(3)
    step = 1_000_000
    for b in range(0, n, step):
        m = min(step, n - b)
        raw = rng.integers(0, 256, size=(m, 36), dtype=np.uint8)
        raw[:, 32:] = 0
        buf = raw.tobytes()
        table.put_many([buf[i * 36:(i + 1) * 36] for i in range(m)], list(range(b, b + m)),
                       [1] * m)
    print(f"table of {n} keys built in {time.perf_counter() - t0:.1f} s", flush=True)
    # vLLM's block pool: KVCacheBlock objects made at start, allocated in any order
    pool = [KVCacheBlock(block_id=i) for i in range(40_000)]
    other = np.zeros(64 << 20, dtype=np.uint8)
    res: dict[str, list[float]] = {"keys": [], "packed": [], "packed+ids": [], "release": []}
    gc.disable()
    for r in range(a.reps):
        hashes = [os.urandom(32) for _ in range(513)]
        picks = rng.integers(0, len(pool), 513)
        blocks = [pool[int(i)] for i in picks]
        ids = [int(i) for i in picks]
        for v in ("keys", "packed", "packed+ids") if r % 2 else ("packed+ids", "packed", "keys"):
            skip = KeySet()
            np.add(other, 1, out=other)
            for blk in blocks:      # vLLM's allocation touched them this step
                blk.ref_cnt += 1
            lst = ids if v == "packed+ids" else blocks
            t0 = time.perf_counter_ns()
            k, bids, idx = table.plan_new(hashes, 0, 512, lst, skip, 512, 0, v != "keys")
            res[v].append((time.perf_counter_ns() - t0) / 1e3)
            assert len(idx) == 512 and bids[5] == ids[5]
            if v == "keys":
                t0 = time.perf_counter_ns()
                skip.difference_update(k)
                del k
                res["release"].append((time.perf_counter_ns() - t0) / 1e3)
        del blocks
    gc.enable()
    print(f"plan_new of 512 new blocks at {n} entries, cold, {a.reps} alternating rounds (us):")
    for v, xs in res.items():
        xs.sort()
        print(f"  {v:<11} p50 {statistics.median(xs):7.1f}  p99 {xs[int(0.99 * (len(xs) - 1))]:7.1f}")
    _ = make_keys


if __name__ == "__main__":
    main()
