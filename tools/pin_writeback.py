"""Pins in a file-backed shared map: page faults and latency of the step thread's pin walks.

A serving engine keeps its pin counts in its lease file (MAP_SHARED, in the store
directory). On a disk file system the kernel writes the dirty pages back and
write-protects them, so the next pin of each page faults. This loop pins and unpins 511
random slots of a 10M-slot table attached to maps in DIR (as a lookup of an 8k-token
prompt does), every 2 ms for SECONDS, and reports the latency and the faults taken after
a 3 s warm-up. Run it once on the store's file system and once on tmpfs (/dev/shm).

    .venv/bin/python tools/pin_writeback.py /var/tmp/pins 40
    .venv/bin/python tools/pin_writeback.py /dev/shm/pins 40
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import time

from kvstore._keytable import KeyTable, SharedMap

HDR = 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("seconds", type=float, nargs="?", default=40.0)
    ap.add_argument("--slots", type=int, default=10_000_000)
    a = ap.parse_args()
    if a.seconds <= 3:
        ap.error(f"seconds must be more than the 3 s warm-up, got {a.seconds}")
    if a.slots < 1024:
        ap.error(f"--slots must be at least 1024, got {a.slots}")
    if os.path.exists(a.dir):
        ap.error(f"{a.dir} exists: name a new directory (it is created, then deleted)")
    os.makedirs(a.dir)
    try:
        n = a.slots
        maps = []
        for name, width in (("slots", 8), ("pins", 4)):
            fd = os.open(os.path.join(a.dir, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, HDR + n * width)
            maps.append(SharedMap(fd, HDR + n * width))
            os.close(fd)
        t = KeyTable(n, prefault=False)
        t.attach(*maps)
        rng = random.Random(1)
        start = time.monotonic()
        rows = []
        while time.monotonic() < start + a.seconds:
            slots = [rng.randrange(n) for _ in range(min(511, n))]
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            c = time.perf_counter()
            t.pin(slots)
            t.unpin(slots)
            ms = (time.perf_counter() - c) * 1e3
            rows.append((time.monotonic() - start, ms,
                         resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0))
            time.sleep(0.002)
        late = [r for r in rows if r[0] > 3]
        ms = sorted(r[1] for r in late)
        k = len(ms)
        slow = [r for r in late if r[1] > 0.5]
        print(f"{a.dir}: {k} rounds after 3 s: p50 {ms[k // 2]:.3f} p99 {ms[int(k * .99)]:.3f} "
              f"max {ms[-1]:.3f} ms; {len(slow)} over 0.5 ms ({sum(1 for r in slow if r[2])} "
              f"of them with a fault); page faults {sum(r[2] for r in late)}")
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
