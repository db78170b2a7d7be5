"""`kvstore bench peers`: kvstore against vLLM's own fs tier, one blocking thread and fio.

On one directory, with one block size, block count, queue depth and O_DIRECT setting, and
with the page cache dropped before every read phase, it measures for each system:

- kvstore: the engine with its index work: store = DiskStore.reserve -> RankIO.write_from
  (headers stamped with XXH3 payload checksums by the ring, each slot written straight
  from the source rows, batched fdatasync) -> commit; load = longest_prefix -> pin ->
  RankIO.read_into (each slot read straight into the destination rows and checked by the
  ring as it completes) -> unpin -> touch. Loads queued together share one ring pass, as
  the connector's I/O thread batches them. The source/destination rows play the pinned
  host memory both kvstore and the fs tier DMA to and from the GPU (the fs tier's primary
  tier): neither system copies through extra host memory. kvstore registers the rows with
  its rings (RankIO.register_memory), as the connector registers its staging, so slots
  move as fixed-buffer I/O. Its slot files are written once before timing (a store in
  service has been written; a fresh one pays ext4's unwritten-extent conversion on first
  writes, which is not what serving looks like). The index (LMDB) is driven from one
  owner thread, as the scheduler would.
- vllm_fs: vLLM's own FileSystemTierManager (vllm/v1/kv_offload/tiering/fs/: one file per
  block, a DualQueueThreadPool of 16 read + 16 write threads, the vllm.fs_io_C helper when
  present), driven the way its TieringOffloadingManager drives it: one store job per
  request-step (`vllm_job_blocks` blocks), one load job per request (a whole prefix in one
  job, run by one pool thread), and lookups through the tier's own batch_lookup.
- one_thread: blocking pwritev/preadv from one thread, one block at a time (the pattern of
  vLLM's SimpleCPUOffload disk mode); io_bench.OneThread for the bulk phases.
- fio: io_uring, one job, same block size and depth, registered buffers and files as
  kvstore's rings (the device's practical limit), sequential at the block size.
- fio_slots: the same with kvstore's own access pattern: block = a slot (the block and its
  4096-byte header), as many slots in flight as kvstore's ring, in the order kvstore's store
  places them (slot after slot); GB/s of block payload, as kvstore's figures. kvstore is
  judged against this one: its header per block is part of its format, not of its code.

Per system: store and load GB/s (payload bytes, GB = 1e9), CPU seconds per GB moved
(getrusage of this process, every thread included; fio: its reported usr+sys), and the
p50/p99 time to load one prefix of `prefix_blocks` blocks while another thread stores new
blocks as fast as the system takes them (what a request waiting on the disk tier feels as
TTFT). Rounds alternate between systems (A B C D A B C D ...); bandwidth and CPU are medians
over rounds, prefix latencies are percentiles over the samples of every round.

Several directories (`--dir A,B,C`, one per device; as `kvstore bench io`): `--size` is the
total per system, split evenly over the directories, and each system uses them the closest
fair way it allows:

- kvstore: one store over all of them (`DiskStore.create(..., data_dirs=[...])`: slot s on
  directory s % D, one io_uring ring per directory; the store directory, with the index,
  is on the first).
- fio: one job per directory, all at once in one fio process (io_bench.MultiDirFio, with
  its registered buffers and files); CPU is the usr+sys of every job.
- one_thread: one blocking thread per directory, each on its own file with 1/D of the
  blocks (io_bench.MultiDirThreads); a prefix's blocks alternate over the directories and
  its load is one thread per directory reading its share; the background stores are one
  thread per directory too.
- vllm_fs: the first directory only. FileSystemTierManager takes one `root_dir`, and
  vLLM has no way to stripe one tier's blocks over several: listing several fs tiers in
  `secondary_tiers` makes TieringOffloadingManager cascade every stored block to every tier
  (a copy per directory, not a share) and load from the first tier that has it. A vLLM
  user with several devices therefore configures one fs tier on one of them (or puts the
  root on an md/LVM stripe below the file system, which is no longer this benchmark's
  directories); the table and JSON say so (`config.vllm_fs_dirs`).

With several directories the result also has `per_device` (per block size, a row per
directory: each system's store and load GB/s there; their sum over the rows is the
system's total).

The systems live in their own modules: `peers_kvstore.py` (`KVStoreSystem`),
`peers_baselines.py` (the one-thread and fio baselines), vLLM's fs tier here
(`VllmFsSystem`); `peers_common.py` holds what they share (`PeersContext`, the
prefix-load test) and `peers_report.py` the targets, the table and the figure.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from kvstore.bench.io_bench import drop_page_cache, parse_dirs
from kvstore.bench.peers_baselines import FioCPU, MultiDirFioCPU, OneThreadPerDirSystem, OneThreadSystem
from kvstore.bench.peers_common import (ALL_FIELDS, BW_FIELDS, FIO_SYSTEMS, LABELS, SYSTEMS, PeersContext, PrefixResult,
                                        anon_memory, bench_keys, cpu_seconds, percentile, prefix_samples)
from kvstore.bench.peers_kvstore import KVStoreSystem
from kvstore.bench.peers_report import format_table, plot, targets
from kvstore.errors import BenchmarkFailed, ConfigError, MissingDependency
from kvstore.format.layout import format_size, parse_size

__all__ = ["SYSTEMS", "LABELS", "BW_FIELDS", "ALL_FIELDS", "KVStoreSystem", "VllmFsSystem",
           "OneThreadSystem", "OneThreadPerDirSystem", "FioCPU", "MultiDirFioCPU", "PeersContext",
           "SizeResult", "run", "targets", "format_table", "plot"]


# --------------------------------------------------------------------------- vLLM's fs tier
class VllmFsSystem:
    """vLLM 0.33's FileSystemTierManager, called as its tiering manager calls it."""

    name = "vllm_fs"

    def __init__(self, ctx: PeersContext):
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.fs import io as fs_io
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
        self.ctx = ctx
        self.block = ctx.block
        self.TransferJob, self.make_key = TransferJob, make_offload_key
        self.req = ReqContext(req_id="bench")
        self.has_c_helper = bool(fs_io._HAS_FSIO_C)
        # The primary (CPU) tier: chunk c is view[c]; the same memory kvstore copies from.
        self.view = memoryview(ctx.src_mem).cast("B", shape=[ctx.nblocks, ctx.block])
        self.dst_view = memoryview(ctx.dst_mem).cast("B", shape=[ctx.nblocks, ctx.block])
        self.root = os.path.join(ctx.directory, f"vllm-fs-{ctx.block}")
        shutil.rmtree(self.root, ignore_errors=True)
        self.spec = _offloading_spec(ctx.block)
        self.FileSystemTierManager = FileSystemTierManager
        self.lock = threading.Lock()  # the tiering manager's lock: tier methods never run concurrently
        self.finished: dict[int, bool] = {}
        self.next_job = 0
        self.round = 0
        self.tier = None
        self.load_tier = None

    def _new_tier(self, view):
        tier = self.FileSystemTierManager(self.spec, view, "fs", self.root)  # defaults: 16 + 16 threads
        if self.ctx.page_cache:
            tier._use_o_direct = False  # same O_DIRECT setting as the other systems
        return tier

    def _job(self, keys, first_chunk):
        self.next_job += 1
        return self.TransferJob(job_id=self.next_job, keys=keys,
                                chunk_ids=np.arange(first_chunk, first_chunk + len(keys), dtype=np.int32),
                                is_promotion=False, req_context=self.req)

    def _poll(self, tier):
        """Collect finished jobs (caller holds self.lock), as the manager does each step."""
        for r in tier.get_finished_jobs():
            self.finished[r.job_id] = r.success

    def _wait(self, tier, job_ids):
        pending = set(job_ids)
        while pending:
            with self.lock:
                self._poll(tier)
                done = [j for j in pending if j in self.finished]
                for j in done:
                    if not self.finished.pop(j):
                        raise BenchmarkFailed(f"vLLM fs tier job {j} failed")
            pending.difference_update(done)
            if pending:
                time.sleep(0.0002)

    def store_phase(self):
        ctx = self.ctx
        self.round += 1
        shutil.rmtree(self.root, ignore_errors=True)
        self.tier = self._new_tier(self.view)
        self.keys = [self.make_key(k, 0) for k in bench_keys(f"v{self.round}", 0, ctx.nblocks)]
        jobs = []
        with self.lock:
            for first in range(0, ctx.nblocks, ctx.vllm_job_blocks):
                job = self._job(self.keys[first:first + ctx.vllm_job_blocks], first)
                self.tier.submit_store(job)
                jobs.append(job.job_id)
        self._wait(self.tier, jobs)

    def _load_request(self, tier, keys, first_chunk):
        """One request's hit: the tier's own batch lookup, then one batched load job."""
        with self.lock:
            hits = list(tier._lookup_manager.batch_lookup(keys, self.req))
            if not all(hits):
                raise BenchmarkFailed(f"vLLM fs tier found {sum(hits)} of {len(keys)} blocks")
            job = self._job(keys, first_chunk)
            job.is_promotion = True
            tier.submit_load(job)
        return job.job_id

    def load_phase(self):
        ctx = self.ctx
        # Loads land in a separate primary region, so the check below means something.
        self.load_tier = self._new_tier(self.dst_view)
        jobs = [self._load_request(self.load_tier, self.keys[f:f + ctx.prefix], f)
                for f in range(0, ctx.nblocks, ctx.prefix)]  # one job per request, as the manager batches
        self._wait(self.load_tier, jobs)
        if not np.array_equal(ctx.dst[:ctx.nblocks, :64], ctx.src[:ctx.nblocks, :64]):
            raise BenchmarkFailed("vLLM fs tier loaded bytes that differ from what it stored")

    def prefix_test(self, samples) -> PrefixResult:
        ctx = self.ctx
        prefix_keys = self.keys[:ctx.prefix]
        state = {"next": 0, "inflight": []}
        nthreads = 16
        jb = ctx.vllm_job_blocks
        # Background stores go through the same tier (one pool, as in vLLM); they read
        # primary chunks outside the region the prefix loads into.
        lo = ctx.prefix
        span = max(jb, (ctx.nblocks - lo) // jb * jb)

        def bg_step():
            inflight = state["inflight"]
            with self.lock:
                self._poll(self.load_tier)
                inflight[:] = [j for j in inflight if j not in self.finished]
            if len(inflight) >= 2 * nthreads:  # keep the write queue full, not unbounded
                time.sleep(0.0005)
                return 0
            n = state["next"]
            state["next"] += jb
            # The fs tier has no eviction: reuse a bounded key space (1 x --size) and remove a
            # key's old file before storing it again (else the store would be skipped as a hit
            # and the disk would fill).
            n %= max(jb, ctx.nblocks // jb * jb)
            keys = [self.make_key(k, 0) for k in bench_keys(f"w{self.round}", n, jb)]
            if state["next"] > ctx.nblocks:
                for k in keys:
                    try:
                        os.unlink(self.load_tier.file_mapper.get_file_name(k))
                    except FileNotFoundError:
                        pass
            with self.lock:
                job = self._job(keys, lo + n % span)
                self.load_tier.submit_store(job)
            inflight.append(job.job_id)
            return jb * self.block

        def load_once():
            self._wait(self.load_tier, [self._load_request(self.load_tier, prefix_keys, 0)])

        res = prefix_samples(load_once, bg_step, samples)
        self.load_tier.drain_jobs()
        with self.lock:
            self._poll(self.load_tier)
            self.finished.clear()
        return res

    def end_round(self):
        for t in (self.tier, self.load_tier):
            if t is not None:
                t.shutdown()
        self.tier = self.load_tier = None
        self.finished.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def dev_bytes(self, phase):
        """Everything on the first directory (its one root_dir; see the module doc)."""
        return [self.ctx.nblocks * self.block] + [0] * (len(self.ctx.dirs) - 1)

    def close(self):
        self.end_round()
        self.view.release()
        self.dst_view.release()


def _offloading_spec(block_bytes: int):
    """The fields of an OffloadingSpec that FileSystemTierManager and its FileMapper read."""
    cfg = SimpleNamespace(
        groups=(SimpleNamespace(tokens_per_block=16, layer_names=("bench",)),),
        parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                                 is_parallelism_agnostic=True),
        model=SimpleNamespace(name="bench-peers", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        canonical_layout=False, replicated_layout=False, kv_cache_layout=None,
        worker_kv_bytes_per_block=block_bytes, enable_kv_cache_events=False, extra_config={})
    return SimpleNamespace(config=cfg, blocks_per_chunk=1, extra_config={},
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=False))


# --------------------------------------------------------------------------- driver
def _timed(fn):
    c, t = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t, cpu_seconds() - c


@dataclass(slots=True)
class SizeResult:
    """One block size's outcome: per system its medians (``results``), its samples
    (``details``) and, with several directories, a row per directory (``per_device``)."""
    results: dict
    details: dict
    per_device: list | None


def _fio_round(ctx: PeersContext, system: str, samp: dict) -> None:
    """One fio round of `system` (fio: blocks; fio_slots: kvstore's slots, a block and its
    header each), a job per directory at once; rates and CPU per GB of block payload."""
    from kvstore.format.layout import HEADER_SIZE
    unit = ctx.block + (HEADER_SIZE if system == "fio_slots" else 0)
    size = ctx.nblocks * unit
    payload = ctx.block / unit
    if len(ctx.dirs) > 1:
        f = MultiDirFioCPU(ctx.dirs, size, unit, ctx.qd, not ctx.page_cache)
    else:
        f = FioCPU(ctx.directory, size, unit, ctx.qd, not ctx.page_cache)
    try:
        w = f.write()
        drop_page_cache()
        r = f.read()
    finally:
        f.close()
    samp["store"].append(w * payload / 1e9)
    samp["load"].append(r * payload / 1e9)
    samp["cpu"].append(f.cpu_s / (2 * size * payload / 1e9))
    if len(ctx.dirs) > 1:
        nan = [float("nan")] * len(ctx.dirs)
        samp["dev_store"].append([x * payload for x in f.dev_gbps.get("write", nan)])
        samp["dev_load"].append([x * payload for x in f.dev_gbps.get("read", nan)])


def _one_size(ctx: PeersContext, systems, rounds, samples, log) -> SizeResult:
    size = ctx.nblocks * ctx.block
    multi = len(ctx.dirs) > 1
    samp = {s: {"store": [], "load": [], "cpu": [], "lat": [], "bg": [], "dev_store": [], "dev_load": []}
            for s in systems}
    objs = {}
    try:
        for s in systems:
            if s == "kvstore":
                objs[s] = KVStoreSystem(ctx)
            elif s == "vllm_fs":
                objs[s] = VllmFsSystem(ctx)
            elif s == "one_thread":
                objs[s] = OneThreadPerDirSystem(ctx) if multi else OneThreadSystem(ctx)
        for rnd in range(rounds):
            for s in systems:
                log(f"  {format_size(ctx.block)} round {rnd + 1}/{rounds}: {s}")
                if s in FIO_SYSTEMS:
                    _fio_round(ctx, s, samp[s])
                    continue
                o = objs[s]
                ctx.dst[:] = 0
                try:
                    tw, cw = _timed(o.store_phase)
                    if multi:
                        samp[s]["dev_store"].append([b / tw / 1e9 for b in o.dev_bytes("store")])
                    drop_page_cache()
                    tr, cr = _timed(o.load_phase)
                    if multi:
                        samp[s]["dev_load"].append([b / tr / 1e9 for b in o.dev_bytes("load")])
                    drop_page_cache()
                    pre = o.prefix_test(samples)
                finally:
                    o.end_round()
                samp[s]["store"].append(size / tw / 1e9)
                samp[s]["load"].append(size / tr / 1e9)
                samp[s]["cpu"].append((cw + cr) / (2 * size / 1e9))
                samp[s]["lat"].extend(pre.latencies_ms)
                samp[s]["bg"].append(pre.background_gbps)
    finally:
        for o in objs.values():
            o.close()
    res, det = {}, {}
    for s, v in samp.items():
        r = {"store_gbps": statistics.median(v["store"]), "load_gbps": statistics.median(v["load"])}
        if s not in FIO_SYSTEMS:
            r["cpu_s_per_gb"] = statistics.median(v["cpu"])
            r["prefix_load_p50_ms"] = percentile(v["lat"], 50)
            r["prefix_load_p99_ms"] = percentile(v["lat"], 99)
        else:
            r["fio_cpu_s_per_gb"] = statistics.median(v["cpu"])
        res[s] = {k: r[k] for k in ALL_FIELDS if k in r}
        det[s] = {"store_gbps_samples": v["store"], "load_gbps_samples": v["load"],
                  "cpu_s_per_gb_samples": v["cpu"]}
        if s in FIO_SYSTEMS:
            det[s]["cpu_s_per_gb"] = r["fio_cpu_s_per_gb"]
        else:
            det[s]["prefix_samples"] = len(v["lat"])
            det[s]["background_store_gbps"] = statistics.median(v["bg"]) if v["bg"] else None
    rows = None
    if multi:  # per directory: each system's median store/load rate there
        rows = []
        for i, d in enumerate(ctx.dirs):
            row = {"dir": d}
            for s, v in samp.items():
                row[s] = {"store_gbps": statistics.median(x[i] for x in v["dev_store"]),
                          "load_gbps": statistics.median(x[i] for x in v["dev_load"])}
            rows.append(row)
    return SizeResult(res, det, rows)

def run(directory: str | None = None, size="1G", block_sizes="128K,512K,2M", queue_depth: int = 32,
        page_cache: bool = False, rounds: int = 3, prefix_blocks: int = 1000,
        prefix_max_bytes="128M", samples: int = 20, staging_bytes="256M",
        vllm_job_blocks: int = 16, systems=SYSTEMS, log=None) -> dict:
    """Run the comparison; returns the JSON-able result dict.

    `directory`: one directory, or several as "A,B,C" (or a list), one per device: see the
    module doc for how each system uses them; `size` is then the total per system."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    sizes = [parse_size(x.strip()) for x in str(block_sizes).split(",") if x.strip()]
    for b in sizes:
        if b % 4096:
            raise ConfigError(f"block size {b} must be a multiple of 4096")
    size_b = parse_size(size)
    staging_b = parse_size(staging_bytes)
    pmax = parse_size(prefix_max_bytes)
    if set(FIO_SYSTEMS) & set(systems) and shutil.which("fio") is None:
        raise MissingDependency("fio is not installed (Debian: apt-get install fio)")
    own_dir = directory is None
    dirs = parse_dirs(directory)
    if dirs is not None and len(dirs) > 1:
        directory = dirs[0]
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        _check_free_multi(dirs, size_b, staging_b, "vllm_fs" in systems)
    else:
        directory = tempfile.mkdtemp(prefix="kvstore-peers-") if own_dir else dirs[0]
        os.makedirs(directory, exist_ok=True)
        free = shutil.disk_usage(directory).free
        need = size_b * 3 + 5 * staging_b  # kvstore store + one-thread files + background batches
        if need > free:
            raise ConfigError(f"--size {format_size(size_b)} needs about {format_size(need)} free in "
                               f"{directory}, which has {format_size(free)}; lower --size")
        dirs = [directory]
    ndirs = len(dirs)
    if not drop_page_cache():
        log("warning: cannot drop the page cache (needs root); reads may be served from memory")
    results, details, prefixes, per_device = {}, {}, {}, {}
    c_helper = None
    try:
        for b in sizes:
            nblocks = size_b // b // ndirs * ndirs  # several directories: an equal share each
            prefix = max(1, min(prefix_blocks, pmax // b, nblocks // 4))
            if nblocks < 8:
                raise ConfigError(f"--size {size} holds fewer than 8 blocks of {format_size(b)}")
            src_mem, dst_mem = anon_memory(nblocks * b), anon_memory(nblocks * b)
            src = np.frombuffer(src_mem, np.uint8).reshape(nblocks, b)
            dst = np.frombuffer(dst_mem, np.uint8).reshape(nblocks, b)
            rng = np.random.default_rng(b)
            src[:] = rng.integers(0, 256, size=b, dtype=np.uint8)  # incompressible-ish payloads
            src[:, :8] = np.arange(nblocks, dtype="<u8").view(np.uint8).reshape(nblocks, 8)
            ctx = PeersContext(directory=directory, dirs=dirs, block=b, nblocks=nblocks, qd=queue_depth,
                               page_cache=page_cache, staging_bytes=staging_b, prefix=prefix,
                               vllm_job_blocks=vllm_job_blocks, src=src, dst=dst,
                               src_mem=src_mem, dst_mem=dst_mem)
            prefixes[str(b)] = prefix
            log(f"block {format_size(b)}: {nblocks} blocks ({format_size(nblocks * b)}) per system, "
                f"prefix {prefix} blocks")
            try:
                sr = _one_size(ctx, systems, rounds, samples, log)
            finally:
                del src, dst, ctx
                for m in (src_mem, dst_mem):
                    try:
                        m.close()
                    except BufferError:  # a view is still alive (an error path): leave it to GC
                        pass
            results[str(b)] = sr.results
            details[str(b)] = sr.details
            if sr.per_device is not None:
                per_device[str(b)] = sr.per_device
        if "vllm_fs" in systems:
            from vllm.v1.kv_offload.tiering.fs import io as fs_io
            c_helper = bool(fs_io._HAS_FSIO_C)
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)
    import vllm
    out = {
        "config": {"dir": directory, "size": size_b, "block_sizes": sizes, "queue_depth": queue_depth,
                   "o_direct": not page_cache, "rounds": rounds, "prefix_blocks": prefixes,
                   "prefix_samples_per_round": samples, "staging_bytes": staging_b,
                   "vllm_store_job_blocks": vllm_job_blocks, "vllm_version": vllm.__version__,
                   "vllm_fs_io_C": c_helper, "nproc": os.cpu_count()},
        "results": results,
        "details": details,
        "targets": targets(results),
    }
    if ndirs > 1:
        out["config"].update({
            "dir": ",".join(dirs), "dirs": dirs,
            "size_per_dir": size_b // ndirs,
            "kvstore_dirs": dirs, "fio_dirs": dirs, "fio_slots_dirs": dirs, "one_thread_dirs": dirs,
            "vllm_fs_dirs": dirs[:1],
            "multi_dir": {
                "kvstore": "one store striped over every directory (data_dirs), a ring per directory",
                "fio": "one io_uring job per directory, all at once (one fio process, "
                       "--fixedbufs --registerfiles)",
                "one_thread": "one blocking thread per directory, each on its own file with 1/D of the blocks",
                "vllm_fs": "first directory only: FileSystemTierManager takes one root_dir, and "
                           "several fs tiers in secondary_tiers would each get a copy of every "
                           "block (vLLM cascades stores to all tiers), not a share"}})
        out["per_device"] = per_device
    return out


def _check_free_multi(dirs, size_b, staging_b, vllm_fs):
    """Room for each directory's share (kvstore's store, the threads' and their background
    files), and on the first for vLLM's fs tier's whole copy; directories on one file
    system add up."""
    n = len(dirs)
    by_fs: dict = {}
    for i, d in enumerate(dirs):
        need = (size_b * 3 + 5 * staging_b) // n + (2 * size_b if vllm_fs and i == 0 else 0)
        ent = by_fs.setdefault(os.stat(d).st_dev, [0, []])
        ent[0] += need
        ent[1].append(d)
    for need, same in by_fs.values():
        free = shutil.disk_usage(same[0]).free
        if need > free:
            raise ConfigError(f"--size {format_size(size_b)} needs about {format_size(need)} free in "
                               f"{', '.join(same)}, which has {format_size(free)}; lower --size")

