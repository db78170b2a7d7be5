"""`kvstore bench tier`: kvstore as a vLLM secondary tier vs vLLM's own fs tier vs fio.

Both tiers run behind vLLM's real `TieringOffloadingManager`, built as
`TieringOffloadingSpec(config).get_manager()` builds it in `vllm serve`: the same CPU
primary tier (a `SharedOffloadRegion` of `--primary` bytes in /dev/shm), the same
directory, the same chunk layout. The benchmark plays vLLM's scheduler and workers: a
"request" stores `--job-tokens` tokens of chunks (prepare_store, the worker's GPU ->
primary copy as already done, complete_store: the manager cascades the chunks to the
tier), one request per step with `--step-ms` of "forward" between steps.

Per chunk size (128 KiB, 2 MiB and 8 MiB by default). Chunks of a multiple of 2 MiB are
16-token multiples of a 7B-class layout (32 layers, 8 KV heads of 128, bf16: 128 KiB per
token; 16 tokens, 2 MiB, is vLLM's default chunk); a smaller chunk is one 16-token block of
the same heads over fewer layers (4 KiB per layer and token: 128 KiB is 2 layers):

- store GB/s: `--size` bytes of chunks (2x the kvstore tier's capacity) stored through
  the manager, from the first prepare_store until every cascade job has finished (for
  kvstore: written, fdatasynced and committed to its index; the fs tier never syncs);
- store GB/s synced (`store_synced_gbps`): the same bytes over the store phase plus a
  syncfs(2) of the tier's file system right after it, i.e. until they are on the device
  (the fs tier's chunks sit in the page cache when its jobs finish; kvstore's are
  already there, O_DIRECT and fdatasynced);
- disk bytes after storing them (the files under the tier's directory: kvstore's slot
  files are preallocated at its capacity; the fs tier keeps a file per chunk);
- load GB/s: the primary tier is reset (vLLM's `reset_cache`), the page cache dropped,
  then the most recent `--primary` bytes of chunks are looked up, all requests at once, one
  request per `--job-tokens`, and promoted into the primary tier (from the first lookup
  until every chunk is a primary hit);
- CPU s/GB: CPU seconds the tier spent over the store and load phases, per GB moved:
  every thread of the process but the benchmark's own scheduler thread (which runs vLLM's
  manager, the same for both tiers), plus that thread's time inside the tier's calls
  (`process_cpu_s_per_gb`: every thread, the benchmark's scheduler included);
- call p99: the scheduler-thread time of each tier method call (lookup, submit_store,
  submit_load, get_finished_jobs, take_events, touch, on_schedule_end, ...), p99 over
  both phases; the whole manager call's p99 is given next to it (`manager_call_p99_us`);
- fio: io_uring, one job, O_DIRECT, registered buffers and files, queue depth 32, block =
  chunk bytes, `--size` written, then the last `--primary` bytes of it read (the bytes a
  load phase promotes; the device's practical limit);
- fio-slots: the same with kvstore's own access pattern: block = a slot (the chunk and
  its 4096-byte header), the same number of slots in flight as kvstore's rings
  (`--queue-depth`, raised to hold the store's default `inflight_bytes`; `ring_depth` in
  the JSON), in order; GB/s of chunk payload, as kvstore's figures. kvstore is
  judged against this one: its header per chunk is part of its format, not of its code.

kvstore's slot files are written once before timing (zeros), as `kvstore bench peers`
does: a store in service has been written, while a fresh one pays the file system's
conversion of preallocated extents on its first writes. The fs tier's files are new ones
either way (a file per chunk). GB = 1e9 bytes of chunk payload.
"""
from __future__ import annotations

import os
import resource
import shutil
import statistics
import tempfile
import time
import types
import uuid

import numpy as np

from kvstore.bench.io_bench import drop_page_cache
from kvstore.bench.plotting import size_panels
from kvstore.errors import ConfigError, KVStoreError, MissingDependency
from kvstore.format.layout import HEADER_SIZE, format_size, parse_size
from kvstore.io.rings import INFLIGHT_BYTES, ring_depth

# 7B-class layout (Llama-3-8B / Mistral-7B: 32 layers, 8 KV heads, head dim 128, bf16):
# K and V of every layer, per token
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 32, 8, 128, 2
LAYER_TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES      # 4096
TOKEN_BYTES = LAYERS * LAYER_TOKEN_BYTES                        # 131072
BLOCK_TOKENS = 16                                               # vLLM's GPU block
DEFAULT_CHUNKS = ("128K", "2M", "8M")

TIER_CALLS = ("lookup", "touch", "submit_store", "submit_load", "get_finished_jobs",
              "take_events", "on_schedule_end", "on_new_request", "on_request_finished",
              "get_stats", "has_pending_work")
SYSTEMS = ("kvstore", "fs", "fio", "fio-slots")


def chunk_geometry(chunk: int) -> tuple[int, int]:
    """(tokens per chunk, layers) of a chunk of `chunk` bytes: a multiple of 2 MiB is that
    many 16-token blocks of the 7B-class layout; below it, one 16-token block of fewer
    layers (a multiple of 64 KiB)."""
    if chunk > 0 and chunk % (BLOCK_TOKENS * TOKEN_BYTES) == 0:
        return chunk // TOKEN_BYTES, LAYERS
    if 0 < chunk < BLOCK_TOKENS * TOKEN_BYTES and chunk % (BLOCK_TOKENS * LAYER_TOKEN_BYTES) == 0:
        return BLOCK_TOKENS, chunk // (BLOCK_TOKENS * LAYER_TOKEN_BYTES)
    raise ConfigError(f"chunk size {chunk} bytes: give a multiple of 2 MiB (16-token blocks of "
                      "the 7B-class layout) or a multiple of 64 KiB below 2 MiB (one 16-token "
                      "block of fewer layers), e.g. 128K,2M,8M")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name of this process (Linux /proc)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        fields = st[st.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_split(before: dict, after: dict) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 3) for k in after
            if after[k] - before.get(k, 0.0) > 0.005}


def _syncfs(path: str) -> float:
    """syncfs(2) of the file system holding `path`; seconds it took."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        if libc.syncfs(fd) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"syncfs({path}): {os.strerror(e)}")
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _p99(xs) -> float:
    if not xs:
        return float("nan")
    return float(np.percentile(np.asarray(xs, dtype=np.float64), 99))


class _Timed:
    """Times every call of one tier method (scheduler-thread time, in microseconds)."""

    def __init__(self, fn, out: list):
        self.fn, self.out = fn, out

    def __call__(self, *a, **kw):
        t = time.perf_counter_ns()
        try:
            r = self.fn(*a, **kw)
            if isinstance(r, types.GeneratorType):
                return list(r)      # a generator's work is the call's work
            return r
        finally:
            self.out.append((time.perf_counter_ns() - t) / 1e3)


class TierRun:
    """One tier behind vLLM's TieringOffloadingManager for one chunk size."""

    def __init__(self, system: str, directory: str, chunk_tokens: int, primary: int,
                 capacity: int, queue_depth: int, durability: str = "fdatasync",
                 layers: int = LAYERS):
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
            OffloadingModelConfig, OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
        self.system = system
        self.root = os.path.join(directory, f"tier-bench-{system}")
        shutil.rmtree(self.root, ignore_errors=True)
        os.mkdir(self.root, 0o700)
        if system == "kvstore":
            tier = {"type": "KVStoreTier", "module_path": "kvstore.vllm.tier",
                    "path": os.path.join(self.root, "store"), "capacity": capacity,
                    "queue_depth": queue_depth, "durability": durability}
        else:   # vLLM's defaults: 16 read + 16 write threads
            tier = {"type": "fs", "root_dir": self.root}
        bpc = chunk_tokens // BLOCK_TOKENS
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, group_id=0,
                                          layer_names=tuple(f"model.layers.{i}.self_attn"
                                                            for i in range(layers))),),
            worker_kv_bytes_per_block=BLOCK_TOKENS * layers * LAYER_TOKEN_BYTES,
            enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": primary, "secondary_tiers": [tier]},
            engine_id=f"kvstore-tier-bench-{uuid.uuid4().hex[:12]}",
            model=OffloadingModelConfig(name="bench/7b-class", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=bpc),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=False),
        )
        self.spec = TieringOffloadingSpec(config)
        self.m = self.spec.get_manager()
        self.tier = self.m.secondary_tiers[0]
        self.row = self.m.primary_tier.get_kv_memoryview().strides[0]
        self.chunks = self.m.primary_tier._num_chunks
        # the "KV" in the primary: random bytes (their content costs nothing to either tier)
        flat = np.frombuffer(self.m.primary_tier.get_kv_memoryview().cast("B"), dtype=np.uint8)
        pattern = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        for off in range(0, len(flat), len(pattern)):
            n = min(len(pattern), len(flat) - off)
            flat[off:off + n] = pattern[:n]
        del flat
        if system == "kvstore":
            self._prewrite(os.path.join(self.root, "store"))
        self.tier_us: list[float] = []
        self.process_cpu = 0.0          # every thread's CPU s over the timed phases
        self.manager_us: list[float] = []
        for name in TIER_CALLS:
            fn = getattr(self.tier, name, None)
            if fn is not None:
                setattr(self.tier, name, _Timed(fn, self.tier_us))

    @staticmethod
    def _prewrite(store: str) -> None:
        """Write the new store's slot files once, before timing (zeros: empty slots), as
        `bench peers` does: a store in service has been written, while a fresh one pays
        the file system's conversion of preallocated (unwritten) extents on first writes."""
        import glob
        buf = np.zeros(8 << 20, dtype=np.uint8)
        for path in glob.glob(os.path.join(store, "rank*", "slots-*.kvs")):
            fd = os.open(path, os.O_WRONLY)
            try:
                size = os.fstat(fd).st_size
                for off in range(0, size, len(buf)):
                    os.pwrite(fd, memoryview(buf)[:min(len(buf), size - off)], off)
                os.fsync(fd)
            finally:
                os.close(fd)

    def _call(self, fn, *a):
        t = time.perf_counter_ns()
        with self.m.lock:
            r = fn(*a)
        self.manager_us.append((time.perf_counter_ns() - t) / 1e3)
        return r

    @staticmethod
    def key(i: int) -> bytes:
        from vllm.v1.kv_offload.base import make_offload_key
        return make_offload_key(i.to_bytes(8, "big") + b"kvstore-tier-bench-key!!", 0)

    def _step(self):
        from vllm.v1.kv_offload.base import ScheduleEndContext
        self._call(self.m.on_schedule_end, ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, step_s: float, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._step()
            with self.m.lock:
                if not self.m.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise KVStoreError(f"{self.system} tier: jobs did not finish within {timeout:.0f}s")
            time.sleep(step_s)

    def store(self, nchunks: int, job: int, step_s: float) -> tuple[float, float]:
        """Store chunks 0..nchunks, a request of `job` chunks per step. (wall s, cpu s)"""
        from vllm.v1.kv_offload.base import ReqContext
        t0, c0 = time.perf_counter(), self._tier_cpu()
        pc0 = _cpu()
        i = req = 0
        stuck = time.monotonic() + 120.0
        while i < nchunks:
            keys = [self.key(j) for j in range(i, min(nchunks, i + job))]
            req += 1
            ctx = ReqContext(req_id=f"store-{req}")
            self._call(self.m.on_new_request, ctx)
            out = self._call(self.m.prepare_store, keys, ctx)
            if out is not None:
                # (the worker's GPU -> primary copy happens here in vLLM)
                self._call(self.m.complete_store, out.keys_to_store, ctx)
                i += len(keys)
                stuck = time.monotonic() + 120.0
            elif time.monotonic() > stuck:
                raise KVStoreError(f"{self.system} tier: the primary tier took no chunk for 120 s")
            self._call(self.m.on_request_finished, ctx)
            self._step()
            time.sleep(step_s)
        self.settle(step_s)
        self.process_cpu += _cpu() - pc0
        return time.perf_counter() - t0, self._tier_cpu() - c0

    def _tier_cpu(self) -> float:
        """CPU seconds the tier spent: every thread but this one (the benchmark's
        scheduler, vLLM's manager), plus this thread's time inside the tier's calls."""
        return _cpu() - time.thread_time() + sum(self.tier_us) / 1e6

    def load(self, first: int, nchunks: int, job: int, step_s: float) -> tuple[float, float, int]:
        """Promote chunks first..first+nchunks into the (reset) primary, every request
        at once. (wall s, cpu s, chunks that missed)"""
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        self._call(self.m.reset_cache)
        self._call(self.m.on_reset_flushed)
        drop_page_cache()
        reqs = []
        for r, s in enumerate(range(first, first + nchunks, job)):
            ctx = ReqContext(req_id=f"load-{r}")
            self._call(self.m.on_new_request, ctx)
            reqs.append((ctx, [self.key(j) for j in range(s, min(first + nchunks, s + job))]))
        t0, c0 = time.perf_counter(), self._tier_cpu()
        pc0 = _cpu()
        pending = dict(enumerate(reqs))
        missed = 0
        while pending:
            for r, (ctx, keys) in list(pending.items()):
                res = [self._call(self.m.lookup, k, ctx) for k in keys]
                if all(x is LookupResult.HIT for x in res):
                    del pending[r]
                elif all(x in (LookupResult.HIT, LookupResult.MISS) for x in res):
                    missed += sum(1 for x in res if x is LookupResult.MISS)
                    del pending[r]
            self._step()
            if pending:
                time.sleep(step_s)
        wall, cpu = time.perf_counter() - t0, self._tier_cpu() - c0
        self.process_cpu += _cpu() - pc0
        for ctx, _ in reqs:
            self._call(self.m.on_request_finished, ctx)
        self.settle(step_s)
        return wall, cpu, missed

    def close(self) -> None:
        try:
            self.m.shutdown()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _fio(directory: str, nblocks: int, nload: int, block: int, qd: int) -> dict:
    """fio writes `nblocks` blocks, then reads back the last `nload` of them: the tier's
    load phase promotes the most recent chunks, and a read of another length would
    compare unlike runs (a short one pays its ramp, a long one averages the device's
    slow and fast stretches)."""
    from kvstore.bench.peers_bench import FioCPU
    f = FioCPU(directory, nblocks * block, block, qd, True)
    try:
        w = f.write()
        drop_page_cache()
        r = f.read(offset=(nblocks - nload) * block, size=nload * block)
    finally:
        f.close()
    return {"store_gbps": w / 1e9, "load_gbps": r / 1e9}


def _fio_slots(directory: str, nchunks: int, nload: int, chunk: int, qd: int) -> dict:
    """`_fio` over kvstore slots (the chunk and its header) with as many slots in flight
    as the tier's rings keep (`qd`, raised to hold `inflight_bytes`); rates in GB/s of
    chunk payload."""
    slot = chunk + HEADER_SIZE
    r = _fio(directory, nchunks, nload, slot, ring_depth(slot, qd, INFLIGHT_BYTES))
    return {k: v * chunk / slot for k, v in r.items()}


def run(directory: str | None = None, chunk_sizes=DEFAULT_CHUNKS, size="1G", capacity=None,
        primary="256M", job_tokens: int = 1024, step_ms: float = 1.0, queue_depth: int = 32,
        rounds: int = 1, systems=SYSTEMS, log=None, durability: str = "fdatasync") -> dict:
    """Run the benchmark over `chunk_sizes` (bytes or sizes like "128K"); returns
    {"results": {chunk bytes: {system: {...}}}, "config", "targets"}."""
    import vllm
    if log is None:
        def log(msg):
            pass
    size_b, primary_b = parse_size(size), parse_size(primary)
    capacity_b = parse_size(capacity) if capacity is not None else size_b // 2
    chunks = [parse_size(c) for c in chunk_sizes]
    geometry = {c: chunk_geometry(c) for c in chunks}
    if {"fio", "fio-slots"} & set(systems) and shutil.which("fio") is None:
        raise MissingDependency("fio is not installed (Debian: apt-get install fio)")
    tmp = None
    if directory is None:
        tmp = directory = tempfile.mkdtemp(prefix="kvstore-tier-bench-", dir="/var/tmp")
    elif not os.path.isdir(directory):
        raise ConfigError(f"--dir {directory} is not a directory")
    step_s = step_ms / 1000.0
    results: dict = {}
    try:
        for chunk in chunks:
            tokens, layers = geometry[chunk]
            if primary_b < 2 * chunk or capacity_b < 4 * chunk:
                raise ConfigError(f"--primary {format_size(primary_b)} and --capacity "
                                   f"{format_size(capacity_b)} must hold a few {tokens}-token "
                                   f"chunks ({format_size(chunk)} each)")
            nchunks = size_b // chunk
            # a request's chunks must fit the primary with room for the ones in flight
            job = max(1, min(job_tokens // tokens, primary_b // chunk // 4))
            samples: dict = {s: [] for s in systems}
            fio_load = min(primary_b // chunk, nchunks)   # what a load phase promotes
            for rnd in range(rounds):
                for s in systems:
                    log(f"{tokens}-token chunks ({format_size(chunk)}), round {rnd + 1}/{rounds}: {s}")
                    if s == "fio":
                        samples[s].append(_fio(directory, nchunks, fio_load, chunk, queue_depth))
                        continue
                    if s == "fio-slots":
                        samples[s].append(_fio_slots(directory, nchunks, fio_load, chunk,
                                                     queue_depth))
                        continue
                    run_ = TierRun(s, directory, tokens, primary_b, capacity_b, queue_depth,
                                   durability, layers)
                    try:
                        th0 = _thread_cpu()
                        tw, cw = run_.store(nchunks, job, step_s)
                        tsync = _syncfs(run_.root)
                        disk = _du(run_.root)
                        nload = min(run_.chunks, nchunks)
                        tr, cr, missed = run_.load(nchunks - nload, nload, job, step_s)
                        samples[s].append({
                            "store_gbps": nchunks * chunk / tw / 1e9,
                            "store_synced_gbps": nchunks * chunk / (tw + tsync) / 1e9,
                            "load_gbps": (nload - missed) * chunk / tr / 1e9,
                            "cpu_s_per_gb": (cw + cr) / ((nchunks + nload - missed) * chunk / 1e9),
                            "process_cpu_s_per_gb": run_.process_cpu / (
                                (nchunks + nload - missed) * chunk / 1e9),
                            "call_p99_us": _p99(run_.tier_us),
                            "disk_bytes_after_2x": disk,
                            "manager_call_p99_us": _p99(run_.manager_us),
                            "load_misses": missed,
                            "data_path": getattr(run_.tier, "data_path", None),
                            "registered": getattr(run_.tier, "registered", None),
                            # CPU s by thread over both phases (the main thread is the
                            # benchmark's scheduler: vLLM's manager and the tier's calls)
                            "cpu_s_by_thread": _cpu_split(th0, _thread_cpu()),
                        })
                    finally:
                        run_.close()
            per = {}
            for s, xs in samples.items():
                if not xs:
                    continue
                out = {}
                for k in xs[0]:
                    vals = [x[k] for x in xs]
                    out[k] = statistics.median(vals) if isinstance(vals[0], (int, float)) \
                        and not isinstance(vals[0], bool) else vals[0]
                per[s] = out
            results[str(chunk)] = per
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "results": results,
        "config": {"dir": directory if tmp is None else "(a temporary directory under /var/tmp)",
                   "chunk_sizes": chunks,
                   "chunk_geometry": {str(c): f"{t} tokens x {n} layers"
                                      for c, (t, n) in geometry.items()},
                   "layout": f"{KV_HEADS} KV heads x {HEAD_DIM} x bf16 (K+V) per layer and token"
                             f" ({LAYERS} layers: 7B-class; fewer below 2 MiB chunks)",
                   "size": size_b, "kvstore_capacity": capacity_b, "primary": primary_b,
                   "job_tokens": job_tokens, "step_ms": step_ms, "queue_depth": queue_depth,
                   "ring_depth": {str(c): ring_depth(c + HEADER_SIZE, queue_depth, INFLIGHT_BYTES)
                                  for c in chunks},
                   "rounds": rounds, "kvstore_durability": durability,
                   "vllm_version": vllm.__version__},
        "targets": targets(results),
    }


def targets(results: dict) -> list[dict]:
    """The targets: loads >= 1.3x and stores >= 1.5x the fs tier's GB/s, >= 2x less CPU
    per GB, scheduler-thread time per tier call p99 < 100 us; and loads and stores >=
    0.95x fio on kvstore's own pattern (fio-slots)."""
    out = []
    for chunk, r in results.items():
        k, f = r.get("kvstore"), r.get("fs")
        if not k:
            continue
        lbl = format_size(int(chunk))
        ref = r.get("fio-slots")
        if ref:
            for what in ("load_gbps", "store_gbps"):
                q = k[what] / ref[what] if ref[what] else float("inf")
                out.append({"target": f"{lbl}: {what} >= 0.95x fio on kvstore's slots",
                            "met": q >= 0.95, "detail": f"{q:.2f}x"})
        if f:
            for what, need in (("load_gbps", 1.3), ("store_gbps", 1.5)):
                q = k[what] / f[what] if f[what] else float("inf")
                detail = f"{q:.2f}x"
                if what == "store_gbps" and f.get("store_synced_gbps"):
                    qs = k["store_synced_gbps"] / f["store_synced_gbps"]
                    detail += f" ({qs:.2f}x with both synced to the device)"
                out.append({"target": f"{lbl}: {what} >= {need}x fs", "met": q >= need,
                            "detail": detail})
            q = f["cpu_s_per_gb"] / k["cpu_s_per_gb"] if k["cpu_s_per_gb"] else float("inf")
            out.append({"target": f"{lbl}: cpu_s_per_gb >= 2x less than fs", "met": q >= 2,
                        "detail": f"{q:.2f}x"})
        out.append({"target": f"{lbl}: tier call p99 < 100 us", "met": k["call_p99_us"] < 100,
                    "detail": f"{k['call_p99_us']:.1f} us"})
    return out


def format_table(out: dict) -> str:
    c = out["config"]
    lines = [f"kvstore tier vs vLLM {c['vllm_version']} fs tier vs fio, behind vLLM's "
             f"TieringOffloadingManager ({c['layout']}; primary {format_size(c['primary'])}, "
             f"kvstore capacity {format_size(c['kvstore_capacity'])}, "
             f"{format_size(c['size'])} stored per system)", ""]
    hdr = (f"{'chunk':>9} {'system':>9} {'store GB/s':>10} {'+syncfs':>8} {'load GB/s':>9} "
           f"{'CPU s/GB':>9} "
           f"{'call p99 us':>11} {'mgr p99 us':>10} {'disk after 2x':>13}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for chunk, per in out["results"].items():
        for s in SYSTEMS:
            r = per.get(s)
            if r is None:
                continue

            def f(k, fmt):
                v = r.get(k)
                return format(v, fmt) if isinstance(v, (int, float)) else "-"
            disk = format_size(r["disk_bytes_after_2x"]) if "disk_bytes_after_2x" in r else "-"
            lines.append(f"{format_size(int(chunk)):>9} {s:>9} {f('store_gbps', '.2f'):>10} "
                         f"{f('store_synced_gbps', '.2f'):>8} {f('load_gbps', '.2f'):>9} {f('cpu_s_per_gb', '.2f'):>9} "
                         f"{f('call_p99_us', '.1f'):>11} {f('manager_call_p99_us', '.1f'):>10} "
                         f"{disk:>13}")
    lines.append("")
    for t in out["targets"]:
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['detail']}")
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    """Store and load GB/s per chunk size for kvstore, the fs tier and fio (grouped bars,
    one panel each), saved as PNG (matplotlib)."""
    sizes = list(out["results"])
    c = out["config"]
    durable = "fdatasync'd" if c["kvstore_durability"] != "none" else "not synced"
    size_panels(
        path, sizes, [s for s in SYSTEMS if any(s in out["results"][b] for b in sizes)],
        lambda b, s, field: out["results"][b].get(s, {}).get(field),
        [("store_gbps", "store GB/s"), ("load_gbps", "load GB/s")],
        {"kvstore": "kvstore tier", "fs": "vLLM fs tier", "fio": "fio (device)",
         "fio-slots": "fio, kvstore's slots"},
        {"kvstore": "#1f77b4", "fs": "#ff7f0e", "fio": "#2ca02c", "fio-slots": "#98df8a"},
        f"kvstore tier ({durable}) vs vLLM {c['vllm_version']} fs tier (never synced) "
        f"vs fio, behind TieringOffloadingManager ({format_size(c['size'])} stored, "
        f"{format_size(c['primary'])} promoted)",
        figsize=(10, 3.8), title_size=9, legend_room=0.08, bar_values=True, xlabel="chunk")
