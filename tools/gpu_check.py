#!/usr/bin/env python3
"""The one prepared script for a lent GPU machine: build, check and time the CUDA path.

Run from the repository root:  python tools/gpu_check.py   (add --device cpu to dry-run
the same flow on a machine without a GPU). It finishes in well under 5 minutes and prints:

1. build: the Cython core is built in place if it is not importable yet;
2. round trip on real CUDA KV tensors: GPU -> staging -> disk (io_uring, O_DIRECT) ->
   staging -> GPU, with byte verification of every block (two layouts: layer-major LBNHC
   and block-major BLNHC);
3. non-blocking: while a long kernel runs on the compute stream, the gather call returns
   to the host at once, and compute work queued after it is not delayed by the copy;
4. bandwidth: kvstore's gather/scatter (device <-> staging) against a plain pinned
   torch copy of the same bytes.
Exit status 0 only if every check passed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build():
    try:
        import kvstore._ring  # noqa: F401
        return "already built"
    except ImportError:
        r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:])
            raise SystemExit("build failed: needs Cython<3.1, numpy and liburing==2024.5.3 installed")
        return "built in place"


def kv_config(num_layers, num_blocks, page, layout):
    """A KVCacheConfig-shaped description (the fields kvstore.transfer reads)."""
    names = [f"layer{i}" for i in range(num_layers)]
    if layout == "LBNHC":   # layer-major: each layer's blocks contiguous
        layer_stride, block_stride = page * num_blocks, page
    else:                   # block-major: each block's pages of all layers contiguous
        layer_stride, block_stride = page, page * num_layers
    tensor = SimpleNamespace(size=page * num_blocks * num_layers, layers=names, layer_stride=layer_stride,
                             block_stride=block_stride, offset=0)
    group = SimpleNamespace(layer_names=names, kv_cache_spec=SimpleNamespace(page_size_bytes=page))
    return SimpleNamespace(kv_cache_groups=[group], kv_cache_tensors=[tensor],
                           num_blocks_of=lambda t: num_blocks), names, tensor


def make_kv(torch, device, num_layers, num_blocks, heads, tokens, head_dim, layout):
    itemsize = 2
    page = tokens * heads * 2 * head_dim * itemsize
    cfg, names, t = kv_config(num_layers, num_blocks, page, layout)
    buf = torch.zeros(t.size, dtype=torch.int8, device=device)
    kv = {}
    C = 2 * head_dim * itemsize
    for l, n in enumerate(names):
        # [B, H, N, C] bytes view, N-major inside a page (NHC)
        kv[n] = buf.as_strided((num_blocks, heads, tokens, C),
                               (t.block_stride, C, heads * C, 1), l * t.layer_stride).view(torch.uint8)
    return buf, kv, cfg, page


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--dir", default=None, help="directory for the test store (default: temp)")
    args = ap.parse_args()
    t0 = time.time()
    ok = True
    print("kvstore gpu_check")
    print(f"  build: {build()}")
    import numpy as np
    import torch
    from kvstore.engine import DiskStore, RankIO, SlotRef
    from kvstore.layout import Layout
    from kvstore.transfer import KVTransfer, register_host_memory

    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible to torch")
        print(f"  device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    L, B, H, N, D = 8, max(args.blocks * 2, 64), 8, 16, 128
    tmp = tempfile.mkdtemp(prefix="kvstore-gpu-", dir=args.dir)
    for layout in ("LBNHC", "BLNHC"):
        buf, kv, cfg, page = make_kv(torch, dev, L, B, H, N, D, layout)
        block_bytes = page * L
        lay = Layout(model="gpu-check", dtype="float16", block_size=N, block_bytes=block_bytes, num_layers=L,
                     num_kv_heads=H, head_dim=D, tp_size=1, kv_layout=layout)
        path = os.path.join(tmp, layout)
        nblk = args.blocks
        st = DiskStore.create(path, lay, (nblk + 8) * lay.slot_size)
        rio = RankIO(path, 0, staging_bytes=(nblk + 2) * lay.slot_size)
        stage_t = rio.staging.torch()
        pinned = register_host_memory(stage_t)
        xfer = KVTransfer(kv, cfg, stage_t, rio.slot_size)
        g = torch.Generator(device=dev).manual_seed(1)
        buf.copy_(torch.randint(-128, 127, buf.shape, dtype=torch.int8, device=dev, generator=g))
        src_blocks = list(range(0, 2 * nblk, 2))
        refs, _ = st.reserve([b"blk%06d" % i for i in src_blocks])
        stage = list(range(nblk))
        t = time.perf_counter()
        pend = xfer.gather(src_blocks, stage)
        KVTransfer.wait(pend)
        t_gather = time.perf_counter() - t
        errs = rio.write_staged(refs, stage)
        assert not any(errs), errs
        st.commit(refs)
        # wipe the blocks on the device, read back from disk, scatter to other blocks
        dst_blocks = list(range(1, 2 * nblk, 2))
        rio.staging.numpy()[:] = 0
        errs = rio.read_staged(refs, stage)
        assert not any(errs), errs
        t = time.perf_counter()
        KVTransfer.wait(xfer.scatter(stage, dst_blocks))
        t_scatter = time.perf_counter() - t
        same = all(torch.equal(kv[n][s], kv[n][d]) for n in kv for s, d in zip(src_blocks, dst_blocks))
        nbytes = nblk * block_bytes
        print(f"  [{layout}] round trip GPU->staging->disk->staging->GPU of {nblk} blocks x "
              f"{block_bytes >> 10} KiB: {'OK' if same else 'MISMATCH'} (pinned staging: {pinned})")
        ok &= same
        print(f"  [{layout}] gather {nbytes / t_gather / 1e9:.2f} GB/s, scatter {nbytes / t_scatter / 1e9:.2f} GB/s")
        if dev.type == "cuda" and layout == "LBNHC":
            # plain pinned torch copies of the same bytes, for reference
            flat = buf[: nbytes]
            host = torch.empty(nbytes, dtype=torch.int8, pin_memory=True)
            torch.cuda.synchronize()
            t = time.perf_counter(); host.copy_(flat, non_blocking=True); torch.cuda.synchronize()
            d2h = nbytes / (time.perf_counter() - t) / 1e9
            t = time.perf_counter(); flat.copy_(host, non_blocking=True); torch.cuda.synchronize()
            h2d = nbytes / (time.perf_counter() - t) / 1e9
            print(f"  [{layout}] reference pinned torch copy: D2H {d2h:.2f} GB/s, H2D {h2d:.2f} GB/s")
            # non-blocking: long kernel on the compute stream, then gather
            a = torch.randn(8192, 8192, device=dev)
            torch.cuda.synchronize()
            compute = torch.cuda.current_stream()
            for _ in range(20):
                a = a @ a * 1e-4
            e1 = torch.cuda.Event(enable_timing=True); e1.record(compute)
            t = time.perf_counter()
            pend = xfer.gather(src_blocks, stage)
            host_s = time.perf_counter() - t
            small = torch.ones(16, device=dev) * 2
            e2 = torch.cuda.Event(enable_timing=True); e2.record(compute)
            torch.cuda.synchronize()
            KVTransfer.wait(pend)
            gap_ms = e1.elapsed_time(e2)
            nb = host_s < 0.05 and gap_ms < 5.0
            print(f"  [{layout}] non-blocking: gather returned to the host in {host_s * 1e3:.2f} ms while the "
                  f"compute stream was busy; compute work queued after it ran {gap_ms:.3f} ms after the "
                  f"previous kernel: {'OK' if nb else 'BLOCKED'}")
            ok &= nb
        rio.close()
        st.close()
    print(f"  total time {time.time() - t0:.1f} s")
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
