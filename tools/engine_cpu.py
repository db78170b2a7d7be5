"""Engine data path alone: bandwidth and CPU (user/system s per GB) of RankIO.write_from and
RankIO.read_into (verify=header and verify=checksum), and of the staging path read_blocks,
on one fresh store, with the page cache dropped before each read phase (needs root).

    python tools/engine_cpu.py --dir /var/tmp/kvp --block-size 2M --size 1G [--register]

What issue 6's CPU analysis in docs/benchmarks.md quotes. Not a test: numbers only.
"""
import argparse
import mmap
import os
import resource
import shutil
import time

import numpy as np

from kvstore.bench.io_bench import drop_page_cache
from kvstore.engine import DiskStore, SlotRef
from kvstore.layout import Layout, parse_size


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _rows(n, bb, fill):
    m = mmap.mmap(-1, n * bb, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8).reshape(n, bb)
    a[:] = fill
    return m, a


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--block-size", default="2M")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--prefix", type=int, default=1000, help="blocks per request (load call)")
    ap.add_argument("--register", action="store_true",
                    help="register the source/destination rows with the ring (fixed buffers)")
    args = ap.parse_args()
    bb, size = parse_size(args.block_size), parse_size(args.size)
    n = size // bb
    gb = n * bb / 1e9
    lay = Layout(model="engine-cpu", dtype="bfloat16", block_size=16, block_bytes=bb, num_layers=1,
                 num_kv_heads=1, head_dim=1, kv_layout="bench")
    path = os.path.join(args.dir, "kvstore-engine-cpu")
    shutil.rmtree(path, ignore_errors=True)
    st = DiskStore.create(path, lay, (n + 64) * lay.slot_size, io=True)
    try:
        rio = st.ranks[0]
        _m, src = _rows(n, bb, 7)
        _m2, dst = _rows(n, bb, 1)
        keys = [b"k%031d" % i for i in range(n)]
        if args.register:
            print("rows registered with the ring:", rio.register_memory(src, dst))
        p = max(1, min(args.prefix, n // 4))

        def report(name, dt, c0, c1):
            print(f"{name:28s} {gb / dt:5.2f} GB/s  usr {(c1[0] - c0[0]) / gb:.3f}  "
                  f"sys {(c1[1] - c0[1]) / gb:.3f} s/GB")

        refs, _ = st.reserve(keys)
        t, c = time.perf_counter(), _cpu()
        errs = rio.write_from(refs, src)
        report("write_from", time.perf_counter() - t, c, _cpu())
        assert all(e is None for e in errs)
        st.commit(refs)
        for mode in ("header", "checksum"):
            drop_page_cache()
            t, c = time.perf_counter(), _cpu()
            for f in range(0, n, p):
                rr = [SlotRef(e.key, e.slot, e.generation) for e in st.longest_prefix(keys[f:f + p])]
                errs = rio.read_into(rr, dst[f:f + p], verify=mode)
                assert all(e is None for e in errs)
            report(f"read_into verify={mode}", time.perf_counter() - t, c, _cpu())
        assert np.array_equal(src[:, :64], dst[:, :64])
        drop_page_cache()
        t, c = time.perf_counter(), _cpu()
        for f in range(0, n, p):
            rr = [SlotRef(e.key, e.slot, e.generation) for e in st.longest_prefix(keys[f:f + p])]
            rio.read_blocks(rr, lambda a, b, views, errs: None)
        report("read_blocks (staging)", time.perf_counter() - t, c, _cpu())
    finally:
        st.close()
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
