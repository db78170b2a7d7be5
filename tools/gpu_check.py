#!/usr/bin/env python3
"""kvstore's prepared device check: the CUDA data path, end to end, in one run.

Proves (or refutes) on one GPU what the CPU test suite cannot: that the copy engine
(kvstore/_copy.pyx: segment lists -> cuMemcpyBatchAsync on two low-priority streams,
straight between the KV cache and the pinned staging io_uring uses) is byte-exact, keeps
vLLM's ordering, never holds vLLM's step thread, is as fast as a plain copy, and leaks
nothing. Writes gpu_check.json and gpu_check.txt (a readable summary) to --out.

Correctness and performance are reported apart: the exit status and the RESULT line
count the correctness sections only; the performance sections print their numbers and
targets on a PERFORMANCE line.

Sections (each reports ok/fail and its numbers; one failing does not stop the others):
  env          python/torch/driver versions, cuMemcpyBatchAsync present, KV source
  roundtrip    KV caches from vLLM's allocate_kv_cache (or, without vLLM, the same
               KVCacheTensor views built here): bf16, fp8 and an MLA shape, layer-major
               (LBNHC) and block-major (BLNHC); GPU -> staging -> disk (io_uring) ->
               staging -> other GPU blocks, byte-exact, every other block untouched;
               CUDA also runs the per-segment cuMemcpyAsync fallback
  hybrid       a hybrid model's KV cache (12 layers interleaved Mamba, sliding window,
               full attention: three KV cache groups overlaying one allocation, the
               Mamba state padded to the attention page), placed as vLLM 0.33's
               planner places it (checked field for field against vLLM's planner and
               allocate_kv_cache where vLLM imports), layer- and block-major: the
               worker's check_groups_alias, then blocks of every group stored and
               loaded through the carrier (first full-attention) group's views: the
               loaded pages byte-exact (through each group's own views too: attention
               pages, Mamba states, and the padding after each state, which travels
               with its page), every other byte of the allocation untouched, the store
               read-only, staging payloads = the carrier pages with each Mamba state at
               its page's head, and a misplaced Mamba view refused
  ordering     (streams) a store issued behind a slow kernel that writes the block, then
               a write of the same block enqueued on the compute stream before the step
               ends (vLLM zeroing or copying into a reallocated block): the staged bytes
               are the first kernel's; a write of a block behind a slow kernel, then
               mark + scatter into it: the loaded bytes win; on device 0 and on another
               device where there is one
  fail_closed  (driver stand-in only: it injects driver failures) the real
               KVStoreWorker: a load whose mark fails is recomputed without a copy;
               staging a failed gather may still write goes back only after that copy
               completed
  step_thread  (performance) host time of the step thread's calls (gather =
               wait_for_save's work, mark, the load poll = get_finished's work; and the
               real KVStoreWorker.wait_for_save/get_finished when vLLM is importable)
               issued behind a 300 ms kernel: target < 1 ms each
  store_cost   (performance) host time of a 512-block store of a 32-layer layer-major
               cache (16K segments), and how long it holds the next forward back (the
               compute stream waits for the store)
  bandwidth    (performance) gather (D2H) and scatter (H2D) of 1..1024 blocks of 64 KiB, 512 KiB and
               2.5 MiB, block-major and layer-major, against one plain copy of the same
               bytes between device and pinned memory: targets >= 0.8x at 2.5 MiB and
               >= 0.5x at 64 KiB (at the largest count)
  compute      (performance, CUDA) slowdown of a matmul loop while 1 GiB moves both ways
  memory       device memory, pinned/resident host memory and copy events over 100
               store+load rounds (after a warm-up): target no growth

Run on a lent GPU machine as docs/gpu.md says (tools/gpu_run.sh: an io_uring probe, then
this check, from a working tree that carries a bundle made with tools/gpu_bundle.sh).
It needs about 2-4 minutes there (budget: under 8). On a machine without a GPU,
`--device cpu` runs every section that does not need streams (the copy engine's CPU
backend, the same segment lists), and `--device standin` runs the stream sections
(ordering, fail_closed, store_cost) against tools/cuda_standin.c, a stand-in for the
driver calls the copy engine makes (built here with gcc; the check re-runs itself with
it on LD_LIBRARY_PATH). Exit status 0 only if every correctness check passed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "standin"),
                    help="where the KV cache lives (default cuda; cpu dry-runs the flow; standin "
                         "runs the stream sections against tools/cuda_standin.c)")
    ap.add_argument("--out", default=None, help="directory for gpu_check.json and gpu_check.txt")
    ap.add_argument("--bundle", default=None,
                    help="folder made by tools/gpu_bundle.sh (extensions + packages for this python)")
    ap.add_argument("--dir", default=None, help="directory for the test stores (default: a temp dir)")
    ap.add_argument("--kv-source", default="auto", choices=("auto", "vllm", "own"),
                    help="KV caches from vLLM's allocate_kv_cache (auto: when vLLM imports) or built here")
    ap.add_argument("--max-blocks", type=int, default=None,
                    help="largest block count of the bandwidth sweep (default 1024 on cuda, 64 on cpu)")
    ap.add_argument("--rounds", type=int, default=100, help="store+load rounds of the memory check")
    ap.add_argument("--probe", action="store_true",
                    help="only probe io_uring: one block written and read back through kvstore's "
                         "ring with O_DIRECT (the first step on a lent machine; exit 0 if it works)")
    ap.add_argument("--only", default=None,
                    help="comma-separated sections to run (env always runs)")
    return ap.parse_args(argv)


# -- set-up -------------------------------------------------------------------------
def use_bundle(bundle: str | None) -> str:
    sys.path.insert(0, ROOT)
    if not bundle:
        return "none (extensions built in the checkout)"
    bundle = os.path.abspath(bundle)
    site = os.path.join(bundle, "site")
    if os.path.isdir(site):
        sys.path.insert(0, site)
    import kvstore
    kvstore.__path__.append(os.path.join(bundle, "kvstore"))
    return bundle


class Report:
    def __init__(self):
        self.data: dict = {"sections": {}}
        self.lines: list[str] = []
        self.ok = True
        self.perf: dict = {}

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def section(self, name: str, fn, *args, perf: bool = False) -> None:
        self.line(f"== {name}" + ("  (performance)" if perf else ""))
        t0 = time.time()
        try:
            res = fn(self, *args)
        except Exception as exc:  # a failing section is a result, not the end of the run
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()}
            self.line(f"   ERROR {res['error']}")
            self.line("   " + traceback.format_exc().strip().replace("\n", "\n   "))
        res.setdefault("ok", True)
        res["seconds"] = round(time.time() - t0, 2)
        res["kind"] = "performance" if perf else "correctness"
        self.data["sections"][name] = res
        if perf:
            self.perf[name] = res["ok"]
        else:
            self.ok &= bool(res["ok"])
        self.line(f"   -> {'ok' if res['ok'] is True else ('n/a' if res['ok'] == 'n/a' else 'FAIL')} "
                  f"({res['seconds']} s)")

    def write(self, out: str | None) -> None:
        self.data["ok"] = self.ok
        if not out:
            return
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        with open(os.path.join(out, "gpu_check.txt"), "w") as f:
            f.write("\n".join(self.lines) + "\n")


class Ctx:
    """What every section shares: the device, torch, the KV builder, a store dir."""

    def __init__(self, args):
        import torch
        self.torch = torch
        self.args = args
        self.cuda = args.device == "cuda"
        self.standin = args.device == "standin"
        self.streams = self.cuda or self.standin     # copies run on streams, later
        self.dev = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.tmp = tempfile.mkdtemp(prefix="kvstore-gpu-check-", dir=args.dir)
        self.kv_source = args.kv_source
        if self.kv_source == "auto":
            try:
                import vllm.v1.worker.utils  # noqa: F401
                self.kv_source = "vllm"
            except Exception:
                self.kv_source = "own"
        self.io_mode = "direct"
        self._n = 0

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def path(self, name):
        self._n += 1
        return os.path.join(self.tmp, f"{self._n:02d}-{name}")

    # KV caches -------------------------------------------------------------------
    def spec(self, kind: str, page: int | None = None):
        """(dtype, heads, head_size, per-token content) of a KV kind; `page` overrides
        the geometry for the bandwidth sweep (bytes of one layer of one block)."""
        t = self.torch
        if kind == "bf16":
            return dict(dtype=t.bfloat16, heads=8, head=128, mla=False)
        if kind == "fp8":
            return dict(dtype=t.float8_e4m3fn, heads=8, head=128, mla=False)
        if kind == "mla":
            return dict(dtype=t.bfloat16, heads=1, head=576, mla=True)
        raise ValueError(kind)

    def build_kv(self, kind: str, layout: str, num_layers: int, num_blocks: int,
                 block_size: int = 16, page: int | None = None, dev=None):
        """(kv_cache_config, layer names, {name: view}, page bytes) on the device."""
        t = self.torch
        dev = self.dev if dev is None else dev
        s = self.spec(kind)
        block_major = layout.startswith("BL")
        if page is not None:   # bandwidth sweep: a bf16 cache with this page size
            heads = max(1, page // (block_size * 2 * 128 * 2))
            s = dict(dtype=t.bfloat16, heads=heads, head=128, mla=False)
            block_size = page // (heads * 2 * 128 * 2)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        if self.kv_source == "vllm":
            from vllm.v1.kv_cache_interface import (
                FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec,
            )
            from vllm.v1.kv_cache_layout import KVCacheLayout
            from vllm.v1.worker.utils import allocate_kv_cache
            if s["mla"]:
                spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=s["head"], dtype=s["dtype"])
            else:
                spec = FullAttentionSpec(block_size=block_size, num_kv_heads=s["heads"], head_size=s["head"],
                                         dtype=s["dtype"])
            pg = spec.page_size_bytes
            ls, bs = (pg, num_layers * pg) if block_major else (num_blocks * pg, pg)
            cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                                kv_cache_tensors=[KVCacheTensor(size=num_layers * num_blocks * pg, layers=names,
                                                                layer_stride=ls, block_stride=bs)])
            cfg.kv_cache_layout = layout
            kv = allocate_kv_cache(cfg, dev, KVCacheLayout[layout], [block_size])
            return cfg, names, kv, pg
        # Without vLLM: the same KVCacheTensor placement, one [B, page] view per layer.
        from types import SimpleNamespace as NS
        es = t.empty(0, dtype=s["dtype"]).element_size()
        pg = block_size * s["heads"] * s["head"] * (1 if s["mla"] else 2) * es
        ls, bs = (pg, num_layers * pg) if block_major else (num_blocks * pg, pg)
        buf = t.zeros(num_layers * num_blocks * pg, dtype=t.int8, device=dev)
        kv = {n: buf.view(t.uint8).as_strided((num_blocks, pg), (bs, 1), l * ls).view(s["dtype"])
              for l, n in enumerate(names)}
        tensor = NS(size=buf.numel(), layers=names, layer_stride=ls, block_stride=bs, offset=0)
        spec = NS(page_size_bytes=pg, num_kv_heads=s["heads"])
        cfg = NS(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_layout=layout,
                 kv_cache_groups=[NS(layer_names=names, kv_cache_spec=spec)],
                 num_blocks_of=lambda _t: num_blocks)
        return cfg, names, kv, pg

    def randomize(self, kv, names, seed=1):
        t = self.torch
        g = t.Generator(device=self.dev).manual_seed(seed)
        for n in names:
            u8 = kv[n].view(t.uint8)
            u8.copy_(t.randint(0, 256, u8.shape, dtype=t.uint8, device=self.dev, generator=g))

    def store(self, name, layout_kw, nslots, staging_slots):
        """A DiskStore + RankIO over a Staging of `staging_slots` slots (O_DIRECT when the
        file system takes it)."""
        from kvstore.store.disk import DiskStore
        from kvstore.errors import KVStoreError
        from kvstore.format.layout import Layout
        from kvstore.io.rank import RankIO
        from kvstore.io.staging import Staging
        lay = Layout(model="gpu-check", **layout_kw)
        path = self.path(name)
        for mode in (self.io_mode, "page_cache"):
            try:
                st = DiskStore.create(path, lay, (nslots + 2) * lay.slot_size, io_mode=mode)
                staging = Staging(staging_slots, lay.slot_size, lay.block_bytes)
                rio = RankIO(path, 0, layout=lay, io_mode=mode, staging=staging)
                self.io_mode = mode
                return st, rio, staging, lay
            except (OSError, KVStoreError) as exc:
                if mode == "page_cache":
                    raise
                self.io_mode = "page_cache"
                path = self.path(name + "-pc")
                print(f"   (O_DIRECT refused here: {exc}; using the page cache)")
        raise AssertionError("unreachable")


    def transfer(self, kv, cfg, staging, compute=None, use_batch=True):
        """The worker's KVTransfer over `kv`; with the driver stand-in, its copy engine
        is a CUDA one (device `compute.device`) over the host-memory KV cache, ordered
        against `compute`'s stream, exactly as on a GPU."""
        from kvstore.vllm.transfer import KVTransfer
        xfer = KVTransfer(kv, cfg, staging, use_batch=use_batch)
        if self.standin:
            adopt_standin(xfer, compute, use_batch)
        return xfer


def adopt_standin(xfer, compute, use_batch=True):
    """Give a host-memory KVTransfer a CUDA copy engine on the driver stand-in, ordered
    against the stand-in compute stream `compute`."""
    from kvstore._copy import CopyEngine
    st = xfer.staging
    xfer.engine.close()
    xfer.engine = CopyEngine(xfer.rows, xfer.kv_base, xfer.kv_nbytes, st.address, st.nbytes,
                             st.slot_size, device=compute.device, use_batch=use_batch)
    xfer.cuda = True
    xfer._stream = lambda: compute.stream


class Compute:
    """vLLM's compute stream on one device, and the kernels the ordering checks put on
    it: `hold()` (a kernel that keeps the stream busy: a ~300 ms spin on a GPU, a gate
    the check opens with the stand-in; returns the opener), `fill` (a kernel writing one
    byte value over a block's pages, as vLLM zeroing a reallocated block does)."""

    def __init__(self, ctx, device: int = 0):
        self.ctx, self.device = ctx, device
        if ctx.standin:
            import ctypes
            self.lib = ctypes.CDLL("libcuda.so.1")
            self.lib.standin_stream_create.restype = ctypes.c_void_p
            self.lib.standin_fill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
            self.lib.standin_gate.argtypes = [ctypes.c_void_p, ctypes.c_int]
            self.lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
            self.lib.standin_stream_destroy.argtypes = [ctypes.c_void_p]
            self.stream = self.lib.standin_stream_create()
            self._gate = 0
            # Copies start 5 ms late (a busy DMA engine): a write the copy is not
            # ordered before really does land first.
            self.lib.standin_set_copy_latency_us(5000)
        else:
            t = ctx.torch
            self.dev = t.device("cuda", device)
            t.cuda.set_device(self.dev)
            self.stream = t.cuda.current_stream(self.dev).cuda_stream

    def hold(self):
        if self.ctx.standin:
            self._gate += 1
            g = self._gate % 64
            self.lib.standin_gate(self.stream, g)
            return lambda: self.lib.standin_open_gate(g)
        spin(self.ctx, 300)
        return lambda: None

    def fill(self, kv, names, block: int, value: int):
        t = self.ctx.torch
        for nm in names:
            page = kv[nm][block].view(t.uint8)
            if self.ctx.standin:
                self.lib.standin_fill(self.stream, page.data_ptr(), value, page.numel())
            else:
                page.fill_(value)

    def sync(self):
        if self.ctx.standin:
            self.lib.cuStreamSynchronize(self.stream)
        else:
            self.ctx.torch.cuda.synchronize(self.dev)

    def close(self):
        if self.ctx.standin and self.stream:
            self.lib.standin_stream_destroy(self.stream)
            self.stream = None


def use_standin(argv) -> None:
    """Build tools/cuda_standin.c as libcuda.so.1 and re-run this check with it first on
    LD_LIBRARY_PATH (the dynamic loader reads that variable at process start)."""
    if os.environ.get("KVSTORE_CUDA_STANDIN"):
        return
    import subprocess
    lib_dir = tempfile.mkdtemp(prefix="kvstore-cuda-standin-")
    src = os.path.join(ROOT, "tools", "cuda_standin.c")
    r = subprocess.run(["gcc", "-O2", "-Wall", "-shared", "-fPIC", "-pthread", "-o",
                        os.path.join(lib_dir, "libcuda.so.1"), src], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"gpu_check: cannot build the driver stand-in ({src}): {r.stderr}")
    env = dict(os.environ, KVSTORE_CUDA_STANDIN=lib_dir,
               LD_LIBRARY_PATH=lib_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    try:
        rc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=env).returncode
    finally:
        import shutil
        shutil.rmtree(lib_dir, ignore_errors=True)
    sys.exit(rc)


def layout_kw(kind, names, page, block_size=16, heads=8, head=128, layout="LBNHC"):
    return dict(dtype={"bf16": "bfloat16", "fp8": "fp8_e4m3", "mla": "bfloat16"}[kind],
                block_size=block_size, block_bytes=page * len(names), num_layers=len(names),
                num_kv_heads=heads, head_dim=head, kv_layout=f"pages:{layout[-3:]}")


def timed(fn, reps=5, min_total=0.02):
    """Median wall time of fn() (which must finish its own work) after one untimed
    warm-up run: at least `reps` runs and at least `min_total` seconds of them."""
    fn()
    ts = []
    while len(ts) < reps or (sum(ts) < min_total and len(ts) < 200):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def proc_status() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmLck", "VmPin"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def spin(ctx, ms: float):
    """Keep the compute stream busy for about `ms` milliseconds (GPU-side only)."""
    t = ctx.torch
    if not hasattr(ctx, "_cycles_per_ms"):
        t.cuda._sleep(1000)
        ctx.sync()
        e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        e0.record()
        t.cuda._sleep(10_000_000)
        e1.record()
        ctx.sync()
        ctx._cycles_per_ms = 10_000_000 / max(e0.elapsed_time(e1), 1e-3)
    t.cuda._sleep(int(ms * ctx._cycles_per_ms))


def io_uring_probe(directory: str | None) -> int:
    """One block written and read back through kvstore's io_uring path (O_DIRECT, then
    the page cache), before anything needs the GPU: a sandbox whose io_uring is partial
    (gVisor) fails here in seconds, with the error, instead of mid-check."""
    import platform as _pf
    print(f"io_uring probe: kernel {_pf.release()}, python {_pf.python_version()}", flush=True)
    from kvstore.store.disk import DiskStore
    from kvstore.format.layout import Layout
    from kvstore.io.rank import RankIO
    from kvstore.io.staging import Staging
    lay = Layout(model="io-uring-probe", dtype="bfloat16", block_size=16, block_bytes=64 * KIB,
                 num_layers=1, num_kv_heads=8, head_dim=128, kv_layout="pages:NHD")
    ok = False
    for mode in ("direct", "page_cache"):
        tmp = tempfile.mkdtemp(prefix="kvstore-probe-", dir=directory)
        st = rio = staging = None
        try:
            st = DiskStore.create(os.path.join(tmp, "s"), lay, 4 * lay.slot_size, io_mode=mode)
            staging = Staging(2, lay.slot_size, lay.block_bytes)
            rio = RankIO(os.path.join(tmp, "s"), 0, layout=lay, io_mode=mode, staging=staging)
            staging.payload_view(0)[:] = 0xA5
            refs, _ = st.reserve([b"probe"])
            werr = rio.write_staged(refs, [0])
            rerr = rio.read_staged(refs, [1])
            same = bool((staging.payload_view(1) == 0xA5).all())
            good = not any(werr) and not any(rerr) and same
            print(f"   {mode}: {'ok' if good else 'FAILED'} (write {werr}, read {rerr}, bytes "
                  f"{'identical' if same else 'DIFFER'})", flush=True)
            ok |= good
            if good and mode == "direct":
                break
        except Exception as exc:
            print(f"   {mode}: FAILED: {type(exc).__name__}: {exc}", flush=True)
        finally:
            for o in (rio, staging, st):
                if o is not None:
                    o.close()
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    print("io_uring probe: " + ("PASS" if ok else "FAIL (kvstore cannot do I/O on this machine; "
                                "use an nvidia-h100-x1 machine, see docs/gpu.md)"), flush=True)
    return 0 if ok else 1


# -- sections ------------------------------------------------------------------------
def sec_env(rep: Report, ctx: Ctx, bundle: str):
    t = ctx.torch
    from kvstore import _cuda, _copy
    info = {"python": platform.python_version(), "torch": t.__version__, "numpy": __import__("numpy").__version__,
            "device": str(ctx.dev), "bundle": bundle, "kv_source": ctx.kv_source, "store_dir": ctx.tmp,
            "kvstore_ext": os.path.dirname(_copy.__file__)}
    if ctx.standin:
        info["driver"] = "stand-in " + os.path.join(os.environ.get("KVSTORE_CUDA_STANDIN", "?"), "libcuda.so.1")
        info.update(_cuda.driver_info())
    elif ctx.cuda:
        if not t.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device; run with --device cpu on a machine without one")
        info["gpu"] = t.cuda.get_device_name(ctx.dev)
        info["cuda_runtime"] = t.version.cuda
        info.update(_cuda.driver_info())
        if not info["batch_copy"]:
            rep.line("   note: the driver has no cuMemcpyBatchAsync: copies go one cuMemcpyAsync per segment")
    else:
        info["cuda_driver_loadable"] = _cuda.available()
    for k, v in info.items():
        rep.line(f"   {k}: {v}")
    return info


def sec_roundtrip(rep: Report, ctx: Ctx):
    t = ctx.torch
    from kvstore.vllm.transfer import KVTransfer
    cases = [(k, lay) for k in ("bf16", "fp8", "mla") for lay in ("LBNHC", "BLNHC")]
    if ctx.cuda:
        cases.append(("bf16", "LBNHC", False))   # per-segment cuMemcpyAsync fallback
    L, NB, n = 8, 96, 32
    results = []
    ok = True
    for case in cases:
        kind, layout = case[0], case[1]
        use_batch = case[2] if len(case) > 2 else True
        cfg, names, kv, page = ctx.build_kv(kind, layout, L, NB)
        ctx.randomize(kv, names)
        s = ctx.spec(kind)
        st, rio, staging, lay = ctx.store(f"rt-{kind}-{layout}", layout_kw(kind, names, page, heads=s["heads"],
                                                                          head=s["head"], layout=layout),
                                          n + 4, 2 * n)
        xfer = KVTransfer(kv, cfg, staging, use_batch=use_batch)
        try:
            before = {nm: kv[nm].view(t.uint8).clone() for nm in names}
            src = list(range(0, 2 * n, 2))               # even blocks ...
            dst = list(range(NB - 1, NB - 1 - 2 * n, -2))  # ... into odd blocks from the end
            refs, _ = st.reserve([b"%s-%d" % (kind.encode(), b) for b in src])
            t0 = time.perf_counter()
            xfer.wait(xfer.gather(src, list(range(n))))
            t_gather = time.perf_counter() - t0
            werr = rio.write_staged(refs, list(range(n)))
            st.commit([r for r, e in zip(refs, werr) if e is None])
            staging.numpy()[:] = 0
            rerr = rio.read_staged(refs, list(range(n, 2 * n)))
            t0 = time.perf_counter()
            xfer.wait(xfer.scatter(list(range(n, 2 * n)), dst, xfer.mark()))
            t_scatter = time.perf_counter() - t0
            ctx.sync()
            exact = all(t.equal(kv[nm].view(t.uint8)[dst], before[nm][src]) for nm in names)
            others = [b for b in range(NB) if b not in set(dst)]
            untouched = all(t.equal(kv[nm].view(t.uint8)[others], before[nm][others]) for nm in names)
            io_ok = not any(werr) and not any(rerr)
            case_ok = exact and untouched and io_ok
            ok &= case_ok
            nbytes = n * lay.block_bytes
            r = {"kind": kind, "layout": layout, "batch": xfer.engine.batch, "blocks": n,
                 "block_bytes": lay.block_bytes, "segments_per_block": xfer.engine.rows_per_block,
                 "byte_exact": exact, "others_untouched": untouched, "io_errors": [str(e) for e in werr + rerr if e],
                 "gather_GBps": round(nbytes / t_gather / 1e9, 2), "scatter_GBps": round(nbytes / t_scatter / 1e9, 2),
                 "pinned": staging.pinned, "io_mode": ctx.io_mode, "ok": case_ok}
            results.append(r)
            rep.line(f"   {kind:4s} {layout} {'batch' if r['batch'] else 'per-segment' if ctx.cuda else 'memcpy'}: "
                     f"{n} blocks x {lay.block_bytes // KIB} KiB, {r['segments_per_block']} seg/block: "
                     f"{'exact' if exact else 'MISMATCH'}, others {'untouched' if untouched else 'CHANGED'}, "
                     f"I/O {'ok' if io_ok else 'ERRORS'}; gather {r['gather_GBps']} GB/s, scatter {r['scatter_GBps']} GB/s")
        finally:
            xfer.close()
            rio.close()
            staging.close()
            st.close()
            del kv
    return {"ok": ok, "cases": results}



# -- hybrid models: full attention + sliding window + Mamba over one allocation -------
class OwnMambaSpec(SimpleNamespace):
    """The script's Mamba spec where vLLM is not installed (the lent GPU machine)."""


HYBRID_KINDS = ("mamba", "swa", "full")   # model layer i is HYBRID_KINDS[i % 3]


def hybrid_geometry(ctx):
    """A Mamba2-like hybrid, 12 layers interleaved mamba, sliding window, full: bf16
    attention pages of 64 KiB per layer (16 tokens x 8 heads x 128 x K,V) and a 44 KiB
    Mamba state per layer (conv (3, 2048) + SSM (16, 16, 64), fp16) padded to that page."""
    t = ctx.torch
    return dict(block_size=16, heads=8, head=128, dtype=t.bfloat16, window=128,
                mamba_shapes=((3, 2048), (16, 16, 64)), mamba_dtypes=(t.float16, t.float16),
                num_layers=12)


def _layer_name(i):
    return f"model.layers.{i}.{'mixer' if HYBRID_KINDS[i % 3] == 'mamba' else 'self_attn.attn'}"


def vllm_hybrid_kv(ctx, layout: str, num_blocks: int, geo: dict):
    """vLLM 0.33's own hybrid layout: `get_kv_cache_groups` and
    `get_kv_cache_config_from_groups` (hybrid KV cache manager on, Mamba in "align"
    mode, as the engine core plans a hybrid model) and `allocate_kv_cache`'s views.
    Returns (kv_cache_config, {name: view}, [group kind])."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache
    if getattr(ctx, "_hybrid_vllm_config", None) is None:
        # A VllmConfig as the engine core resolves it for a hybrid Mamba model (the test
        # harness builds exactly that; its own tiny model is not used).
        from kvstore.drivers.simulator import EngineHarness
        h = EngineHarness(num_layers=3, sliding_window=geo["window"], mamba=True,
                          num_gpu_blocks=num_blocks, layout=layout)
        ctx._hybrid_vllm_config = h.vllm_config
        h.shutdown()
    vc = ctx._hybrid_vllm_config
    vc.cache_config.kv_cache_layout = layout
    vc.cache_config.num_gpu_blocks_override = num_blocks
    bs = geo["block_size"]
    full = FullAttentionSpec(block_size=bs, num_kv_heads=geo["heads"], head_size=geo["head"], dtype=geo["dtype"])
    specs = {"full": full,
             "swa": SlidingWindowSpec(block_size=bs, num_kv_heads=geo["heads"], head_size=geo["head"],
                                      dtype=geo["dtype"], sliding_window=geo["window"]),
             "mamba": MambaSpec(block_size=bs, shapes=geo["mamba_shapes"], dtypes=geo["mamba_dtypes"],
                                page_size_padded=full.page_size_bytes, mamba_cache_mode="align")}
    per_layer = {_layer_name(i): specs[HYBRID_KINDS[i % 3]] for i in range(geo["num_layers"])}
    groups = get_kv_cache_groups(vc, per_layer)
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    cfg = get_kv_cache_config_from_groups(vc, groups, per_block * num_blocks)
    cfg.kv_cache_layout = layout
    kv = allocate_kv_cache(cfg, ctx.dev, KVCacheLayout[layout], [bs] * len(groups))
    kind = {FullAttentionSpec: "full", SlidingWindowSpec: "swa", MambaSpec: "mamba"}
    return cfg, kv, [kind[type(g.kv_cache_spec)] for g in cfg.kv_cache_groups]


def own_hybrid_kv(ctx, layout: str, num_blocks: int, geo: dict):
    """The same placement built here (no vLLM), as vLLM 0.33's planner lays a hybrid out:
    one KV cache group per kind, in the order the kinds first appear in the model, each
    with the same number of layers; one KVCacheTensor per group, all of them aliasing one
    allocation from byte 0 (layer-major: layer_stride = blocks x page, block_stride =
    page; block-major: layer_stride = page, block_stride = layers x page); the Mamba
    page padded to the attention page. Attention views are vLLM's [B, H, N, 2C] views,
    a Mamba layer's view is [B, 1, 1, state_bytes] int8 at its page's head."""
    t = ctx.torch
    bs, H, C, dt = geo["block_size"], geo["heads"], geo["head"], geo["dtype"]
    es = t.empty(0, dtype=dt).element_size()
    page = bs * H * 2 * C * es
    state = sum(_prod(s) * t.empty(0, dtype=d).element_size()
                for s, d in zip(geo["mamba_shapes"], geo["mamba_dtypes"]))
    assert state <= page, (state, page)
    order = []
    for i in range(geo["num_layers"]):
        if HYBRID_KINDS[i % 3] not in order:
            order.append(HYBRID_KINDS[i % 3])
    names = {k: [_layer_name(i) for i in range(geo["num_layers"]) if HYBRID_KINDS[i % 3] == k] for k in order}
    L = len(names[order[0]])
    assert all(len(v) == L for v in names.values())
    ls, bstride = (page, L * page) if layout.startswith("BL") else (num_blocks * page, page)
    size = num_blocks * L * page
    buf = t.zeros(size, dtype=t.int8, device=ctx.dev)
    kv, tensors, groups = {}, [], []
    for k in order:
        for l, n in enumerate(names[k]):
            if k == "mamba":
                kv[n] = buf.as_strided((num_blocks, 1, 1, state), (bstride, state, state, 1), l * ls)
            else:
                kv[n] = buf.view(dt).as_strided((num_blocks, H, bs, 2 * C), (bstride // es, 2 * C, H * 2 * C, 1),
                                                l * ls // es)
        tensors.append(SimpleNamespace(size=size, layers=names[k], layer_stride=ls, block_stride=bstride,
                                       offset=0))
        if k == "mamba":
            spec = OwnMambaSpec(block_size=bs, page_size_bytes=page, real_page_size_bytes=state,
                                page_size_padded=page)
        else:
            spec = SimpleNamespace(block_size=bs, page_size_bytes=page, num_kv_heads=H, head_size=C, dtype=dt)
        groups.append(SimpleNamespace(layer_names=names[k], kv_cache_spec=spec))
    cfg = SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups,
                          kv_cache_layout=layout, num_blocks_of=lambda _t: num_blocks)
    return cfg, kv, list(order)


def _prod(shape):
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _placement(cfg, kv, kinds):
    """What decides where every byte of a hybrid KV cache is: groups, tensors, views."""
    base = next(iter(kv.values())).untyped_storage().data_ptr()
    return {"num_blocks": int(cfg.num_blocks),
            "groups": [(k, list(g.layer_names)) for k, g in zip(kinds, cfg.kv_cache_groups)],
            "tensors": [(list(x.layers), int(x.size), int(x.offset), int(x.layer_stride), int(x.block_stride))
                        for x in cfg.kv_cache_tensors],
            "views": {n: (v.data_ptr() - base, tuple(v.shape), tuple(v.stride()), str(v.dtype))
                      for n, v in sorted(kv.items())}}


def hybrid_placement_matches_vllm(rep, ctx, layouts, num_blocks, geo):
    """Where vLLM imports: the placement built here is vLLM's, field for field."""
    try:
        import vllm.v1.worker.utils  # noqa: F401
    except Exception as exc:
        rep.line(f"   placement vs vLLM's planner: not checked here (vLLM does not import: "
                 f"{type(exc).__name__}); the --device cpu run checks it")
        return {"checked": False}
    out = {"checked": True, "ok": True}
    for layout in layouts:
        a = _placement(*own_hybrid_kv(ctx, layout, num_blocks, geo))
        b = _placement(*vllm_hybrid_kv(ctx, layout, num_blocks, geo))
        same = a == b
        out[layout] = same
        out["ok"] &= same
        diff = "" if same else "; differs: " + ", ".join(k for k in a if a[k] != b[k])
        rep.line(f"   placement {layout}: built here == vLLM's get_kv_cache_config_from_groups + "
                 f"allocate_kv_cache: {'yes' if same else 'NO'}{diff}")
        if not same:
            out[f"{layout}_here"], out[f"{layout}_vllm"] = a, b
    return out


def sec_hybrid(rep: Report, ctx: Ctx):
    """Byte-exact round trips of a hybrid model's blocks (full attention, sliding window
    and padded Mamba states overlaying one allocation) through the carrier group's
    views, exactly as the worker builds its transfer (`check_groups_alias`, then
    `KVTransfer(..., (carrier,))`)."""
    t = ctx.torch
    import random

    import numpy as np
    from kvstore.vllm import transfer as tr
    from kvstore.errors import ConfigError
    geo = hybrid_geometry(ctx)
    NB, per = 64, 8                 # 64 blocks; per group: 8 stored, 8 loaded into
    layouts = ("LBNHC", "BLNHC")
    cases = [(lay, True) for lay in layouts] + ([("LBNHC", False)] if ctx.cuda else [])
    out = {"placement": hybrid_placement_matches_vllm(rep, ctx, layouts, NB, geo), "cases": []}
    ok = out["placement"].get("ok", True)
    for layout, use_batch in cases:
        build = vllm_hybrid_kv if ctx.kv_source == "vllm" else own_hybrid_kv
        cfg, kv, kinds = build(ctx, layout, NB, geo)
        groups = cfg.kv_cache_groups
        if ctx.kv_source == "vllm":
            from kvstore.vllm.config import carrier_group
            carrier = carrier_group(groups)
        else:
            carrier = kinds.index("full")
        cnames = list(groups[carrier].layer_names)
        ct = next(x for x in cfg.kv_cache_tensors if list(x.layers) == cnames)
        page = int(groups[carrier].kv_cache_spec.page_size_bytes)
        mg = kinds.index("mamba")
        state = int(groups[mg].kv_cache_spec.real_page_size_bytes)
        L = len(cnames)
        storage = kv[cnames[0]].untyped_storage()
        raw = t.empty(0, dtype=t.uint8, device=ctx.dev).set_(storage, 0, (storage.nbytes(),), (1,))

        def at(l, b):               # byte offset of carrier layer l's page of block b
            return int(ct.offset) + l * int(ct.layer_stride) + b * int(ct.block_stride)

        # Which group owns which block (vLLM hands a block id to one group at a time);
        # block 0 is vLLM's null block, never loaded into.
        rng = random.Random(13)
        blocks = list(range(1, NB))
        rng.shuffle(blocks)
        src = {k: blocks[i * per:(i + 1) * per] for i, k in enumerate(kinds)}
        dst = {k: blocks[(3 + i) * per:(4 + i) * per] for i, k in enumerate(kinds)}
        pairs = [(k, src[k][j], dst[k][j]) for j in range(per) for k in kinds]   # groups interleaved
        s_all, d_all, n = [p[1] for p in pairs], [p[2] for p in pairs], len(pairs)
        g = t.Generator(device=ctx.dev).manual_seed(5)
        raw.copy_(t.randint(0, 256, raw.shape, dtype=t.uint8, device=ctx.dev, generator=g))
        ctx.sync()
        st, rio, staging, lay = ctx.store(f"hy-{layout}-{'b' if use_batch else 's'}",
                                          layout_kw("bf16", cnames, page, layout=layout), n + 4, 2 * n)
        patched = ctx.kv_source != "vllm"
        orig_is_mamba = tr._is_mamba
        if patched:     # no vLLM here: check_groups_alias learns the script's Mamba spec class
            tr._is_mamba = lambda spec: isinstance(spec, OwnMambaSpec) or orig_is_mamba(spec)
        xfer = None
        try:
            tr.check_groups_alias(kv, cfg, carrier)          # what the worker runs first
            # ... and refuses a Mamba view that is not at the head of the carrier's page
            mname = groups[mg].layer_names[0]
            bad = dict(kv)
            bad[mname] = raw.view(t.int8).as_strided(kv[mname].shape, kv[mname].stride(), at(0, 0) + page)
            try:
                tr.check_groups_alias(bad, cfg, carrier)
                refuses = False
            except ConfigError:
                refuses = True
            xfer = tr.KVTransfer(kv, cfg, staging, (carrier,), use_batch=use_batch)
            before = raw.clone()
            views_before = {nm: kv[nm].view(t.uint8)[s_all].clone()
                            for grp in groups for nm in grp.layer_names}
            refs, _ = st.reserve([b"hy-%s-%d-%d" % (k.encode(), s, d) for k, s, d in pairs])
            xfer.wait(xfer.gather(s_all, list(range(n))))    # a step's stores, all groups
            ctx.sync()
            gather_clean = t.equal(raw, before)              # a store reads only
            # The staging payload of block b is its carrier pages, layer after layer; a
            # Mamba block's page l starts with the state its Mamba layer l's view reads.
            pay = t.from_numpy(np.stack([staging.payload_view(j)[:L * page] for j in range(n)])).to(ctx.dev)
            want = t.stack([t.cat([before[at(l, b):at(l, b) + page] for l in range(L)]) for b in s_all])
            staged_pages = t.equal(pay, want)
            staged_states = all(
                t.equal(pay[j, l * page:l * page + state], kv[nm][b].reshape(-1).view(t.uint8))
                for j, (k, b, _) in enumerate(pairs) if k == "mamba"
                for l, nm in enumerate(groups[mg].layer_names))
            werr = rio.write_staged(refs, list(range(n)))
            st.commit([r for r, e in zip(refs, werr) if e is None])
            staging.numpy()[:] = 0
            rerr = rio.read_staged(refs, list(range(n, 2 * n)))
            xfer.wait(xfer.scatter(list(range(n, 2 * n)), d_all, xfer.mark()))
            ctx.sync()
            # 1. every byte: the loaded blocks' carrier pages are the stored blocks'
            #    pages, all other bytes of the allocation (every other block of every
            #    layer: free, stored, Mamba blocks not loaded) are as they were
            expect, mask = before.clone(), t.zeros_like(before, dtype=t.bool)
            for s, d in zip(s_all, d_all):
                for l in range(L):
                    expect[at(l, d):at(l, d) + page] = before[at(l, s):at(l, s) + page]
                    mask[at(l, d):at(l, d) + page] = True
            exact = t.equal(raw[mask], expect[mask])
            untouched = t.equal(raw[~mask], before[~mask])
            # 2. through each group's own views (what vLLM's kernels read): attention
            #    pages, Mamba states, and the page padding after each state (carried with
            #    the page, as a store keeps it)
            by_group = {}
            for gi, grp in enumerate(groups):
                k = kinds[gi]
                js = [j for j, p in enumerate(pairs) if p[0] == k]
                ds = [pairs[j][2] for j in js]
                by_group[k] = all(t.equal(kv[nm].view(t.uint8)[ds], views_before[nm][js]) for nm in grp.layer_names)
            mpairs = [(s, d) for k, s, d in pairs if k == "mamba"]
            padding = all(t.equal(raw[at(l, d) + state:at(l, d) + page], before[at(l, s) + state:at(l, s) + page])
                          for s, d in mpairs for l in range(L))
            io_ok = not any(werr) and not any(rerr)
            case_ok = (exact and untouched and gather_clean and staged_pages and staged_states
                       and all(by_group.values()) and padding and io_ok and refuses)
            ok &= case_ok
            r = {"layout": layout, "batch": xfer.engine.batch, "carrier_group": carrier, "groups": kinds,
                 "blocks": n, "page_bytes": page, "mamba_state_bytes": state, "block_bytes": lay.block_bytes,
                 "segments_per_block": xfer.engine.rows_per_block, "byte_exact": exact,
                 "others_untouched": untouched, "store_left_kv_unchanged": gather_clean,
                 "staged_carrier_pages": staged_pages, "staged_mamba_states": staged_states,
                 "views_exact": by_group, "mamba_padding_carried": padding,
                 "alias_check_refuses_misplaced_mamba": refuses, "alias_mamba_by_script": patched,
                 "io_errors": [str(e) for e in werr + rerr if e], "ok": case_ok}
            out["cases"].append(r)
            yn = lambda v, good="ok", badw="FAIL": good if v else badw  # noqa: E731
            rep.line(f"   {layout} {'batch' if r['batch'] else 'per-segment' if ctx.cuda else 'memcpy'}: "
                     f"groups {'+'.join(kinds)} (carrier {carrier}), {n} blocks "
                     f"({per} per group) x {L} layers x {page // KIB} KiB pages, Mamba state "
                     f"{state} B + {page - state} B padding: loaded pages {yn(exact, 'exact', 'MISMATCH')}, "
                     f"others {yn(untouched, 'untouched', 'CHANGED')}; views "
                     + ", ".join(f"{k} {yn(v, 'exact', 'MISMATCH')}" for k, v in by_group.items())
                     + f"; Mamba padding {yn(padding, 'carried', 'WRONG')}; staged "
                     f"{yn(staged_pages and staged_states, 'carrier pages, states at their heads', 'WRONG')}; "
                     f"store {yn(gather_clean, 'read-only', 'WROTE THE KV CACHE')}; misplaced Mamba view "
                     f"{yn(refuses, 'refused', 'ACCEPTED')}; I/O {yn(io_ok, 'ok', 'ERRORS')}")
        finally:
            tr._is_mamba = orig_is_mamba
            if xfer is not None:
                xfer.close()
            rio.close()
            staging.close()
            st.close()
            del kv, raw
    if ctx.kv_source != "vllm":
        rep.line("   (KV caches built by the script with vLLM's placement, not by vLLM; "
                 "check_groups_alias told the script's Mamba spec class)")
    out["ok"] = bool(ok)
    return out


def ordering_devices(rep, ctx) -> list[int]:
    if ctx.standin:
        return [0, 1]
    n = ctx.torch.cuda.device_count()
    if n < 2:
        rep.line("   (one GPU on this machine: the ordering on a device other than 0 is not checked)")
    return [0, 1] if n >= 2 else [0]


def sec_ordering(rep: Report, ctx: Ctx):
    if not ctx.streams:
        rep.line("   needs streams (CPU copies are synchronous): run --device cuda or --device standin")
        return {"ok": "n/a"}
    out, ok = {}, True
    for d in ordering_devices(rep, ctx):
        res = _ordering_on(rep, ctx, d)
        out[f"device{d}"] = res
        ok &= res["ok"]
    out["ok"] = ok
    return out


def _ordering_on(rep, ctx, device):
    t = ctx.torch
    from kvstore.io.staging import Staging
    dev = t.device("cuda", device) if ctx.cuda else ctx.dev
    compute = Compute(ctx, device)
    cfg, names, kv, page = ctx.build_kv("bf16", "LBNHC", 8, 64, dev=dev)
    ctx.randomize(kv, names)
    staging = Staging(4, 4096 + -(-page * 8 // 4096) * 4096, page * 8)
    xfer = ctx.transfer(kv, cfg, staging, compute)
    out = {}
    try:
        compute.sync()
        # a) The store of a block, issued (wait_for_save) behind a slow kernel that writes
        # the block; before the step ends, vLLM enqueues more writes of that block on the
        # compute stream (_update_states zeroing a block it hands out again, a
        # copy-on-write): the staged bytes must be what the first kernel wrote.
        staging.payload_view(0)[:] = 0
        opened = compute.hold()
        compute.fill(kv, names, 7, 0x5A)          # the forward writes block 7
        t0 = time.perf_counter()
        tk = xfer.gather([7], [0])                # wait_for_save
        issue_ms = (time.perf_counter() - t0) * 1e3
        compute.fill(kv, names, 7, 0x00)          # the next step's zeroing of block 7
        opened()
        xfer.wait(tk)
        compute.sync()
        staged = staging.payload_view(0)
        a_ok = bool((staged == 0x5A).all()) and bool((kv[names[0]][7].view(t.uint8) == 0).all())
        got = "the kernel's bytes" if a_ok else (
            "ZEROS (the later write)" if bool((staged == 0).all()) else "WRONG BYTES")
        out["store_before_later_writes"] = {"ok": a_ok, "issue_ms": round(issue_ms, 3)}
        rep.line(f"   device {device}: store behind a kernel writing the block, then a write of the "
                 f"block before the step ends: staged {got} (issue {issue_ms:.3f} ms)")
        # b) A write of a block behind a slow kernel, then the load of that block
        # (start_load_kv's mark, the I/O thread's scatter): the loaded bytes must win.
        staging.payload_view(1)[:] = 0xC3
        opened = compute.hold()
        compute.fill(kv, names, 9, 0x33)
        mk = xfer.mark()
        tl = xfer.scatter([1], [9], mk)
        opened()
        xfer.wait(tl)
        compute.sync()
        b_ok = all(bool((kv[nm][9].view(t.uint8) == 0xC3).all()) for nm in names)
        out["load_after_earlier_writes"] = {"ok": b_ok}
        rep.line(f"   device {device}: write of a block behind a kernel, then mark + scatter into it: "
                 f"{'the loaded bytes won' if b_ok else 'THE EARLIER WRITE WON'}")
        out["ok"] = a_ok and b_ok
        return out
    finally:
        compute.sync()
        xfer.close()
        staging.close()
        compute.close()


def sec_fail_closed(rep: Report, ctx: Ctx):
    """Failures of the driver that the real worker must close on (stand-in only)."""
    if not ctx.standin:
        rep.line("   needs the driver stand-in (--device standin), which injects driver failures")
        return {"ok": "n/a"}
    try:
        from kvstore.vllm.config import ConnectorConfig
        from kvstore.vllm.metadata import KVStoreMetadata, LoadJob, StoreJob
        from kvstore.vllm.worker import KVStoreWorker
    except Exception as exc:
        rep.line(f"   KVStoreWorker not importable here ({type(exc).__name__}: {exc})")
        return {"ok": False, "error": str(exc)}
    import ctypes
    from kvstore.store.disk import DiskStore
    from kvstore.format.layout import Layout, block_key
    t = ctx.torch
    lib = ctypes.CDLL("libcuda.so.1")
    compute = Compute(ctx, 0)
    cfg, names, kv, page = ctx.build_kv("bf16", "LBNHC", 8, 64)
    ctx.randomize(kv, names)
    lay = Layout(model="gpu-check-fail-closed", **layout_kw("bf16", names, page))
    path = ctx.path("fail-closed")
    cfg_c = ConnectorConfig(path=path, capacity=64 * lay.slot_size, staging_bytes=16 * lay.slot_size,
                            io_mode=ctx.io_mode)
    w = KVStoreWorker(cfg_c, lay, 0, kv, cfg)
    adopt_standin(w.transfer, compute)
    store = DiskStore(path, lay)
    out = {}
    try:
        def stored(job_id):
            deadline = time.time() + 60
            while time.time() < deadline:
                wm = w.build_worker_meta()
                if wm and job_id in wm.store_reports:
                    return wm.store_reports[job_id]
                time.sleep(0.005)
            raise AssertionError(f"store job {job_id} was never reported (waited 60 s)")

        # Blocks 0-7 stored for good (the load below reads them back).
        hashes = [b"fail-closed-%02d" % i for i in range(8)]
        refs, _ = store.reserve([block_key(h) for h in hashes])
        slots, gens = [r.slot for r in refs], [r.generation for r in refs]
        w.bind(KVStoreMetadata(stores=[StoreJob(0, list(range(8)), [block_key(h) for h in hashes],
                                                slots, gens)]))
        w.wait_for_save()
        if list(stored(0).failed):
            raise AssertionError(f"the good store failed: {stored(0)}")
        store.commit(refs)
        total = w.slots.free
        other = [b"fail-closed-x%02d" % i for i in range(8)]
        orefs, _ = store.reserve([block_key(h) for h in other])

        # 1) A store whose gather fails after part of it was queued (the driver refused
        # its 3rd segment) behind a busy compute stream: it is reported failed, and its
        # staging slots stay out of the free list until the queued part ran.
        opened = compute.hold()
        lib.standin_fail_copy_after(2)
        w.bind(KVStoreMetadata(stores=[StoreJob(1, list(range(8, 16)), [block_key(h) for h in other],
                                                [r.slot for r in orefs], [r.generation for r in orefs])]))
        w.wait_for_save()
        held = total - w.slots.free
        opened()
        deadline = time.time() + 60
        while w.slots.free < total and time.time() < deadline:
            time.sleep(0.005)
        back = w.slots.free == total
        failed_all = list(stored(1).failed) == list(range(8))
        s_ok = held == 8 and back and failed_all and w.staging_lost == 0
        out["failed_gather"] = {"ok": s_ok, "held_while_queued": held, "returned": back,
                                "reported_failed": failed_all}
        rep.line(f"   failed gather: {held} of 8 staging slots held while its queued part had not run "
                 f"(want 8), {'all back' if back else 'NOT BACK'} after it ran, store "
                 f"{'reported failed' if failed_all else 'NOT REPORTED FAILED'}")

        # 2) A load whose mark of the compute stream fails: not copied (it would be
        # unordered against the step's own writes), reported failed (vLLM recomputes).
        for nm in names:
            kv[nm][32:40].view(t.uint8).fill_(0x77)
        lib.standin_fail_event_record(0)
        w.bind(KVStoreMetadata(loads=[LoadJob(2, "r", list(range(32, 40)), hashes, [(0, 8)], slots, gens)]))
        w.start_load_kv()
        done, deadline = None, time.time() + 60
        while not done and time.time() < deadline:
            _, done = w.get_finished(set())
            time.sleep(0.002)
        bad = w.get_block_ids_with_load_errors()
        untouched = all(bool((kv[nm][32:40].view(t.uint8) == 0x77).all()) for nm in names)
        m_ok = bool(done) and "r" in done and bad == set(range(32, 40)) and untouched
        out["failed_mark"] = {"ok": m_ok, "reported": sorted(done or ()), "failed_blocks": sorted(bad),
                              "blocks_untouched": untouched}
        rep.line(f"   failed mark: load {'reported' if done else 'NOT REPORTED'}, "
                 f"{len(bad)} of 8 blocks to recompute, KV blocks "
                 f"{'untouched' if untouched else 'WRITTEN BY AN UNORDERED COPY'}")
        out["ok"] = s_ok and m_ok
        return out
    finally:
        lib.standin_fail_copy_after(-1)
        lib.standin_fail_event_record(-1)
        w.shutdown()
        store.close()
        compute.close()


def sec_store_cost(rep: Report, ctx: Ctx):
    """A prefill's store: 512 blocks of a 32-layer layer-major cache (16K segments)."""
    if not ctx.streams:
        rep.line("   needs streams: run --device cuda or --device standin")
        return {"ok": "n/a"}
    t = ctx.torch
    from kvstore.io.staging import Staging
    n, L, page = 512, 32, 2 * KIB
    compute = Compute(ctx, 0)
    cfg, names, kv, pg = ctx.build_kv("bf16", "LBNHC", L, n + 8, page=page)
    staging = Staging(n, 4096 + L * pg, L * pg)
    xfer = ctx.transfer(kv, cfg, staging, compute)
    out = {}
    try:
        segs = n * xfer.engine.rows_per_block
        issue = []
        for _ in range(5):
            compute.sync()
            opened = compute.hold()
            t0 = time.perf_counter()
            tk = xfer.gather(list(range(n)), list(range(n)))
            issue.append((time.perf_counter() - t0) * 1e3)
            opened()
            xfer.wait(tk)
        out["segments"] = segs
        out["issue_ms_p50"] = round(statistics.median(issue), 3)
        out["issue_ms_max"] = round(max(issue), 3)
        line = (f"   store of {n} blocks x {L} layers ({segs} segments): step-thread issue "
                f"p50 {out['issue_ms_p50']:.3f} ms, max {out['issue_ms_max']:.3f} ms")
        if ctx.cuda:
            # How long the store holds the next forward back: a 10 ms "forward", then
            # (or not) the store, then the next step's first kernel, timed on the stream.
            def step(with_store):
                e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
                e0.record()
                spin(ctx, 10)
                tk = xfer.gather(list(range(n)), list(range(n))) if with_store else 0
                spin(ctx, 0.01)
                e1.record()
                ctx.sync()
                xfer.wait(tk)
                return e0.elapsed_time(e1)
            alone = statistics.median([step(False) for _ in range(5)])
            stored = statistics.median([step(True) for _ in range(5)])
            out["forward_wait_ms"] = round(stored - alone, 3)
            out["step_ms_alone"], out["step_ms_with_store"] = round(alone, 3), round(stored, 3)
            line += (f"; the next forward starts {out['forward_wait_ms']:.3f} ms later "
                     f"({alone:.2f} -> {stored:.2f} ms per 10 ms step)")
        else:
            line += "; forward wait: n/a (the stand-in's timing says nothing about a GPU)"
        rep.line(line)
        out["target_issue_ms"] = 1.0
        out["ok"] = out["issue_ms_p50"] < 1.0
        return out
    finally:
        compute.sync()
        xfer.close()
        staging.close()
        compute.close()


def sec_step_thread(rep: Report, ctx: Ctx):
    """Host time of every call the step thread makes, behind a 300 ms kernel."""
    t = ctx.torch
    from kvstore.vllm.transfer import KVTransfer
    cfg, names, kv, page = ctx.build_kv("bf16", "LBNHC", 8, 128)
    ctx.randomize(kv, names)
    st, rio, staging, lay = ctx.store("step", layout_kw("bf16", names, page), 80, 72)
    xfer = KVTransfer(kv, cfg, staging)
    out = {}
    try:
        ctx.sync()
        if ctx.cuda:
            spin(ctx, 300)
        t0 = time.perf_counter()
        tk = xfer.gather(list(range(64)), list(range(64)))          # wait_for_save's work
        t1 = t2 = time.perf_counter()
        mk = xfer.mark()                                             # start_load_kv's work
        t3 = time.perf_counter()
        busy = not xfer.engine.done(tk)                              # get_finished's poll
        t4 = time.perf_counter()
        xfer.release(mk)
        xfer.wait(tk)
        prim = {"gather_ms": (t1 - t0) * 1e3, "mark_ms": (t3 - t2) * 1e3,
                "poll_ms": (t4 - t3) * 1e3, "copy_was_pending": busy}
        out["primitives"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in prim.items()}
        # On CPU the step thread does the memcpy itself (no device to hand it to): the
        # times are reported, the < 1 ms target is the GPU's.
        ok = True
        if ctx.cuda:
            ok = all(v < 1.0 for k, v in prim.items() if k.endswith("_ms"))
            ok &= busy   # else the kernel did not hold the copy back: the test proved nothing
        rep.line("   primitives behind the kernel: " + ", ".join(
            f"{k} {v:.3f}" for k, v in prim.items() if k.endswith("_ms")) + f" (copy pending: {busy})")
        out["worker"] = _worker_step_times(rep, ctx, kv, cfg, names, page)
        if out["worker"].get("ok") is False:
            ok = False
        out["ok"] = ok
        return out
    finally:
        xfer.close()
        rio.close()
        staging.close()
        st.close()


def _worker_step_times(rep, ctx, kv, cfg, names, page):
    """The real connector worker (needs vLLM): wait_for_save/get_finished host times."""
    try:
        from kvstore.vllm.config import ConnectorConfig
        from kvstore.vllm.metadata import KVStoreMetadata, LoadJob, StoreJob
        from kvstore.vllm.worker import KVStoreWorker
    except Exception as exc:
        rep.line(f"   KVStoreWorker: not importable here ({type(exc).__name__}: {exc}); primitives only")
        return {"skipped": str(exc)}
    from kvstore.store.disk import DiskStore
    from kvstore.format.layout import Layout, block_key
    lay = Layout(model="gpu-check-worker", **layout_kw("bf16", names, page))
    path = ctx.path("worker")
    cfg_c = ConnectorConfig(path=path, capacity=200 * lay.slot_size, staging_bytes=80 * lay.slot_size,
                            io_mode=ctx.io_mode)
    w = KVStoreWorker(cfg_c, lay, 0, kv, cfg)
    store = DiskStore(path, lay)
    try:
        hashes = [b"gpu-check-w%02d" % i for i in range(32)]    # as vLLM's block hashes
        keys = [block_key(h) for h in hashes]
        refs, _ = store.reserve(keys)
        meta = KVStoreMetadata(stores=[StoreJob(1, list(range(32)), keys, [r.slot for r in refs],
                                                [r.generation for r in refs])])
        w.bind(meta)
        if ctx.cuda:
            spin(ctx, 300)
        t0 = time.perf_counter()
        w.wait_for_save()
        t1 = time.perf_counter()
        w.get_finished(set())
        t2 = time.perf_counter()
        deadline = time.time() + 30
        while w.pending() and time.time() < deadline:
            time.sleep(0.005)
        wm = w.build_worker_meta()
        sr = wm.store_reports.get(1) if wm else None    # a StoreReport (ranks, failed)
        stored = sr is not None and (sr.ranks, list(sr.failed)) == (1, [])
        store.commit(refs)
        # a load of those blocks into other blocks, reported only once copied
        lmeta = KVStoreMetadata(loads=[LoadJob(2, "r", list(range(64, 96)), hashes, [(0, 32)],
                                               [r.slot for r in refs], [r.generation for r in refs])])
        w.bind(lmeta)
        w.start_load_kv()
        t3 = time.perf_counter()
        done = None
        polls = []
        while time.time() < deadline:
            p0 = time.perf_counter()
            _, done = w.get_finished(set())
            polls.append(time.perf_counter() - p0)
            if done:
                break
            time.sleep(0.002)
        ctx.sync()
        t_ = ctx.torch
        exact = all(t_.equal(kv[n].view(t_.uint8)[64:96], kv[n].view(t_.uint8)[0:32]) for n in names)
        res = {"wait_for_save_ms": round((t1 - t0) * 1e3, 4), "get_finished_ms": round((t2 - t1) * 1e3, 4),
               "load_poll_max_ms": round(max(polls) * 1e3, 4) if polls else None,
               "load_reported_after_s": round(time.perf_counter() - t3, 4), "stored": stored,
               "loaded_exact": bool(done) and exact}
        res["ok"] = stored and res["loaded_exact"] and (not ctx.cuda or (
            res["wait_for_save_ms"] < 1 and res["get_finished_ms"] < 1 and (res["load_poll_max_ms"] or 0) < 1))
        rep.line(f"   KVStoreWorker: wait_for_save {res['wait_for_save_ms']:.3f} ms, get_finished "
                 f"{res['get_finished_ms']:.3f} ms, load polls <= {res['load_poll_max_ms']} ms; store "
                 f"{'reported' if stored else 'NOT REPORTED'}, load {'exact' if res['loaded_exact'] else 'WRONG'}")
        return res
    finally:
        w.shutdown()
        store.close()


def sec_bandwidth(rep: Report, ctx: Ctx):
    t = ctx.torch
    import numpy as np
    from kvstore.io.staging import Staging
    from kvstore.vllm.transfer import KVTransfer
    top = ctx.args.max_blocks or (1024 if ctx.cuda else 64)
    counts = [c for c in (1, 4, 16, 64, 256, 1024) if c <= top]
    if counts[-1] != top:
        counts.append(top)
    targets = {64 * KIB: 0.5, 2560 * KIB: 0.8}
    rows, ok = [], True
    for bb in (64 * KIB, 512 * KIB, 2560 * KIB):
        for layout, L in (("BLNHC", 8), ("LBNHC", 32)):
            page = bb // L
            cfg, names, kv, pg = ctx.build_kv("bf16", layout, L, top, page=page)
            assert pg * L == bb, (pg, L, bb)
            staging = Staging(top, 4096 + bb, bb)
            xfer = KVTransfer(kv, cfg, staging)
            dev = kv[names[0]].untyped_storage()
            devbuf = t.empty(0, dtype=t.uint8, device=ctx.dev).set_(dev, 0, (dev.nbytes(),), (1,))
            if ctx.cuda:
                host = t.empty(top * bb, dtype=t.uint8, pin_memory=True)
            else:
                host = t.empty(top * bb, dtype=t.uint8)
            if not ctx.cuda:
                host_np, dev_np = host.numpy(), devbuf.numpy()
            try:
                for n in counts:
                    blocks = list(range(n))
                    slots = list(range(n))
                    g = timed(lambda: xfer.wait(xfer.gather(blocks, slots)))
                    s = timed(lambda: xfer.wait(xfer.scatter(slots, blocks)))
                    nbytes = n * bb

                    if ctx.cuda:
                        def ref_d2h():
                            host[:nbytes].copy_(devbuf[:nbytes], non_blocking=True)
                            ctx.sync()

                        def ref_h2d():
                            devbuf[:nbytes].copy_(host[:nbytes], non_blocking=True)
                            ctx.sync()
                    else:   # one plain memcpy (torch's CPU copy_ splits across threads)
                        def ref_d2h():
                            np.copyto(host_np[:nbytes], dev_np[:nbytes])

                        def ref_h2d():
                            np.copyto(dev_np[:nbytes], host_np[:nbytes])
                    rd, rh = timed(ref_d2h), timed(ref_h2d)
                    r = {"block_bytes": bb, "layout": layout, "layers": L, "blocks": n,
                         "segments": n * xfer.engine.rows_per_block,
                         "gather_GBps": round(nbytes / g / 1e9, 3), "scatter_GBps": round(nbytes / s / 1e9, 3),
                         "plain_d2h_GBps": round(nbytes / rd / 1e9, 3), "plain_h2d_GBps": round(nbytes / rh / 1e9, 3)}
                    r["gather_ratio"] = round(rd / g, 3)
                    r["scatter_ratio"] = round(rh / s, 3)
                    if not ctx.cuda and n == counts[-1]:
                        r["numpy_fancy_index_GBps"] = _numpy_reference(np, kv, names, staging, layout, L, pg, bb, n)
                    if n == counts[-1] and bb in targets and ctx.cuda:
                        r["target"] = targets[bb]
                        r["meets_target"] = r["gather_ratio"] >= targets[bb] and r["scatter_ratio"] >= targets[bb]
                        ok &= r["meets_target"]
                    rows.append(r)
                    extra = (f", old numpy path {r['numpy_fancy_index_GBps']} GB/s"
                             if "numpy_fancy_index_GBps" in r else "")
                    mark = "" if "meets_target" not in r else (
                        f"  [target {r['target']}x: {'met' if r['meets_target'] else 'MISSED'}]")
                    rep.line(f"   {bb // KIB:5d} KiB {layout} L={L:2d} x{n:5d}: gather {r['gather_GBps']:7.2f} GB/s "
                             f"({r['gather_ratio']:.2f}x plain {r['plain_d2h_GBps']:.2f}), scatter "
                             f"{r['scatter_GBps']:7.2f} GB/s ({r['scatter_ratio']:.2f}x plain "
                             f"{r['plain_h2d_GBps']:.2f}){extra}{mark}")
            finally:
                xfer.close()
                staging.close()
                del kv, devbuf, host
                host_np = dev_np = None
                if ctx.cuda:
                    t.cuda.empty_cache()
    if not ctx.cuda:
        rep.line("   (CPU: plain = one memcpy of the same bytes; targets apply to the GPU run)")
    return {"ok": ok, "rows": rows}


def _numpy_reference(np, kv, names, staging, layout, L, page, bb, n):
    """The copy path this engine replaced (numpy fancy-index row copies), for the report."""
    from numpy.lib.stride_tricks import as_strided
    st = kv[names[0]].untyped_storage()
    raw = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * st.nbytes()).from_address(st.data_ptr()))
    stage = staging.numpy()
    if layout.startswith("BL"):
        pairs = [(as_strided(raw, (n, bb), (bb, 1)), as_strided(stage[4096:], (n, bb), (staging.slot_size, 1)))]
    else:
        nb = st.nbytes() // bb
        pairs = [(as_strided(raw[l * nb * page:], (n, page), (page, 1)),
                  as_strided(stage[4096 + l * page:], (n, page), (staging.slot_size, 1))) for l in range(L)]
    idx = np.arange(n)

    def run():
        for d, s in pairs:
            s[idx] = d[idx]
    return round(n * bb / timed(run) / 1e9, 3)


def sec_compute(rep: Report, ctx: Ctx):
    if not ctx.cuda:
        rep.line("   needs a GPU (no compute stream on CPU)")
        return {"ok": "n/a"}
    t = ctx.torch
    from kvstore.io.staging import Staging
    from kvstore.vllm.transfer import KVTransfer
    bb, n = 2560 * KIB, 410                      # ~1 GiB each way
    cfg, names, kv, pg = ctx.build_kv("bf16", "BLNHC", 8, n, page=bb // 8)
    staging = Staging(n, 4096 + bb, bb)
    xfer = KVTransfer(kv, cfg, staging)
    a = t.randn(8192, 8192, device=ctx.dev, dtype=t.bfloat16)
    try:
        def loop():
            e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            e0.record()
            x = a
            for _ in range(20):
                x = (x @ a) * 1e-3
            e1.record()
            return e0, e1
        loop()
        ctx.sync()
        alone = []
        for _ in range(3):
            e0, e1 = loop()
            ctx.sync()
            alone.append(e0.elapsed_time(e1))
        moving = []
        for _ in range(3):
            tk = xfer.gather(list(range(n)), list(range(n)))
            tl = xfer.scatter(list(range(n)), list(range(n)))
            e0, e1 = loop()
            xfer.wait(tk)
            xfer.wait(tl)
            ctx.sync()
            moving.append(e0.elapsed_time(e1))
        slow = statistics.median(moving) / statistics.median(alone)
        rep.line(f"   matmul loop alone {statistics.median(alone):.1f} ms, with 1 GiB moving each way "
                 f"{statistics.median(moving):.1f} ms: slowdown {slow:.3f}x (copies on low-priority streams)")
        return {"ok": True, "alone_ms": alone, "moving_ms": moving, "slowdown": round(slow, 4)}
    finally:
        ctx.sync()
        xfer.close()
        staging.close()
        del kv, a
        t.cuda.empty_cache()


def sec_memory(rep: Report, ctx: Ctx):
    t = ctx.torch
    from kvstore.vllm.transfer import KVTransfer
    cfg, names, kv, page = ctx.build_kv("bf16", "LBNHC", 8, 64)
    ctx.randomize(kv, names)
    st, rio, staging, lay = ctx.store("mem", layout_kw("bf16", names, page), 40, 32)
    xfer = KVTransfer(kv, cfg, staging)
    refs, _ = st.reserve([b"m%d" % i for i in range(16)])

    def one_round():
        xfer.wait(xfer.gather(list(range(16)), list(range(16))))
        rio.write_staged(refs, list(range(16)), durable=False)
        rio.read_staged(refs, list(range(16, 32)))
        xfer.wait(xfer.scatter(list(range(16, 32)), list(range(32, 48)), xfer.mark()))

    def snap():
        ctx.sync()
        s = proc_status()
        if ctx.cuda:
            s["device_free"] = t.cuda.mem_get_info(ctx.dev)[0]
            s["torch_allocated"] = t.cuda.memory_allocated(ctx.dev)
        s["copy_events"] = xfer.engine.events_created
        return s
    try:
        for _ in range(5):
            one_round()
        a = snap()
        for _ in range(ctx.args.rounds):
            one_round()
        b = snap()
        growth = {k: b[k] - a[k] for k in a if k in b}
        # device memory: none at all; host: allocator noise only
        ok = (growth.get("device_free", 0) >= -2 * MIB and growth.get("torch_allocated", 0) <= 0
              and growth.get("VmLck", 0) <= 0 and growth.get("VmPin", 0) <= 0
              and growth.get("VmRSS", 0) <= 16 * MIB and growth["copy_events"] <= 0)
        rep.line(f"   {ctx.args.rounds} rounds: " + ", ".join(
            f"{k} {v / MIB:+.2f} MiB" if k != "copy_events" else f"{k} {v:+d}" for k, v in growth.items())
                 + f" (copy events in the pool: {b['copy_events']})")
        return {"ok": ok, "before": a, "after": b, "growth": growth}
    finally:
        xfer.close()
        rio.close()
        staging.close()
        st.close()


# (name, function, performance?)
SECTIONS = [("roundtrip", sec_roundtrip, False), ("hybrid", sec_hybrid, False),
            ("ordering", sec_ordering, False), ("fail_closed", sec_fail_closed, False),
            ("memory", sec_memory, False), ("step_thread", sec_step_thread, True),
            ("store_cost", sec_store_cost, True), ("bandwidth", sec_bandwidth, True),
            ("compute", sec_compute, True)]
# What the driver stand-in can show: the stream sections (the others need real memory
# copies between devices, or run on --device cpu already).
STANDIN_SECTIONS = {"ordering", "fail_closed", "store_cost"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "standin":
        use_standin(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    bundle = use_bundle(args.bundle)
    if args.probe:
        return io_uring_probe(args.dir)
    rep = Report()
    rep.line(f"kvstore gpu_check --device {args.device}  ({time.strftime('%Y-%m-%d %H:%M:%S %Z')})")
    ctx = Ctx(args)
    rep.data["args"] = vars(args)
    rep.section("env", sec_env, ctx, bundle)
    only = set(args.only.split(",")) if args.only else None
    unknown = sorted((only or set()) - {n for n, _, _ in SECTIONS} - {"env"})
    if unknown:
        sys.exit(f"gpu_check: --only names no section {', '.join(unknown)}; the sections: "
                 f"env, {', '.join(n for n, _, _ in SECTIONS)}")
    if rep.data["sections"]["env"]["ok"] is True:
        for name, fn, perf in SECTIONS:
            if ctx.standin and name not in STANDIN_SECTIONS:
                continue
            if only is None or name in only:
                rep.section(name, fn, ctx, perf=perf)
    rep.data["total_seconds"] = round(time.time() - t0, 1)
    rep.line(f"total {rep.data['total_seconds']} s")
    correct = [n for n, r in rep.data["sections"].items() if r.get("kind") == "correctness"]
    rep.line("RESULT: " + ("PASS" if rep.ok else "FAIL") + f" (correctness: {', '.join(correct)})")
    if rep.perf:
        rep.line("PERFORMANCE: " + ", ".join(
            f"{n} {'met' if ok is True else 'n/a' if ok == 'n/a' else 'MISSED'}" for n, ok in rep.perf.items())
            + " (targets in each section; not part of RESULT)")
    rep.write(args.out)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
