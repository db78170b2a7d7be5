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
- fio: io_uring, one job, same block size and depth (the device's practical limit).

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
"""
from __future__ import annotations

import mmap
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import numpy as np

from kvstore.bench.io_bench import (Fio, MultiDirFio, MultiDirThreads, OneThread, parse_dirs,
                                     drop_page_cache)
from kvstore.bench.plotting import size_panels
from kvstore.errors import BenchmarkFailed, ConfigError, MissingDependency
from kvstore.format.layout import format_size, parse_size

SYSTEMS = ("kvstore", "vllm_fs", "one_thread", "fio")
LABELS = {"kvstore": "kvstore", "vllm_fs": "vLLM fs tier", "one_thread": "1 thread", "fio": "fio io_uring"}
BW_FIELDS = ("store_gbps", "load_gbps")
ALL_FIELDS = ("store_gbps", "load_gbps", "cpu_s_per_gb", "prefix_load_p50_ms", "prefix_load_p99_ms")


def _cpu() -> float:
    """CPU seconds (user + system) of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _keys(tag: str, first: int, n: int) -> list[bytes]:
    """n distinct 32-byte keys (hash-like: tag + index, then filler)."""
    head = tag.encode()[:8].ljust(8, b"_")
    return [head + i.to_bytes(8, "big") + bytes(16) for i in range(first, first + n)]


def _anon(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (what O_DIRECT needs; vLLM's primary tier is an mmap)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class _Background:
    """Runs `step()` in a thread until stopped; counts the bytes it reports."""

    def __init__(self, step):
        self.step = step
        self.stop = threading.Event()
        self.bytes = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="peers-bg-store", daemon=True)

    def _run(self):
        try:
            while not self.stop.is_set():
                self.bytes += self.step()
        except BaseException as exc:  # surfaced by join()
            self.error = exc

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.seconds = time.perf_counter() - self.t0
        if self.error is not None and exc[0] is None:
            raise self.error

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else float("nan")


PREFIX_TEST_MAX_S = 10.0  # per system per round: a slow system gets fewer (at least 5) samples


def _prefix_samples(load_once, bg_step, samples: int, warmup_s: float = 0.3):
    """Time `load_once()` `samples` times while `bg_step` stores in a background thread."""
    lat = []
    with _Background(bg_step) as bg:
        time.sleep(warmup_s)  # let the background stores reach steady state
        t_end = time.perf_counter() + PREFIX_TEST_MAX_S
        for i in range(samples):
            if i >= 5 and time.perf_counter() > t_end:
                break
            t = time.perf_counter()
            load_once()
            lat.append((time.perf_counter() - t) * 1e3)
    return lat, bg.gbps


# --------------------------------------------------------------------------- systems
class KVStoreSystem:
    """The kvstore engine: DiskStore (index) + RankIO (data path), index work included."""

    name = "kvstore"

    def __init__(self, ctx):
        from kvstore.store.disk import DiskStore, RankIO
        from kvstore.format.layout import Layout
        self.ctx = ctx
        self.block = ctx.block
        self.layout = Layout(model="bench-peers", dtype="bfloat16", block_size=16,
                             block_bytes=ctx.block, num_layers=1, num_kv_heads=1, head_dim=1,
                             kv_layout="bench")
        slot = self.layout.slot_size
        self.staging_slots = max(1, ctx.staging_bytes // slot)
        # Room for the bulk blocks plus a few background batches: background stores evict
        # LRU blocks, never the hot prefix (touched before every background store and on
        # every load, pinned while it loads).
        capacity = (ctx.nblocks + 4 * self.staging_slots + ctx.prefix) * slot
        self.path = os.path.join(ctx.directory, f"kvstore-peers-{ctx.block}")
        # Several directories: one store striped over all of them (a data directory on each,
        # the store directory with the index on the first), as `kvstore bench io` does.
        self.data = ([os.path.join(d, f"kvstore-peers-data-{ctx.block}") for d in ctx.dirs]
                     if len(ctx.dirs) > 1 else None)
        for p in [self.path] + (self.data or []):
            shutil.rmtree(p, ignore_errors=True)
        for p in self.data or []:
            os.mkdir(p, 0o700)
        io_mode = "page_cache" if ctx.page_cache else "direct"
        self.store = DiskStore.create(self.path, self.layout, capacity, io_mode=io_mode,
                                      data_dirs=self.data)
        kw = dict(layout=self.layout, io_mode=io_mode, queue_depth=ctx.qd,
                  staging_bytes=ctx.staging_bytes)
        self.rio = RankIO(self.path, 0, **kw)
        self.bg_rio = RankIO(self.path, 0, **kw)  # a second worker stream for background stores
        # The source/destination rows are kvstore's pinned host memory here, registered
        # with the ring as the connector registers its staging (fixed-buffer I/O).
        for r in (self.rio, self.bg_rio):
            if not r.register_memory(ctx.src, ctx.dst):
                print("warning: kvstore could not register the bench rows (fixed buffers off)",
                      file=sys.stderr)
        self.lock = threading.Lock()  # the Index has one owner at a time (the scheduler)
        self.round = 0
        self._dev = {}
        self._prefill()

    def _prefill(self):
        """Write every slot file once, untimed, and make it durable (see the module doc)."""
        zeros = bytes(64 << 20)
        for path in [f.path for f in self.rio.files]:  # every device's slot files
            size = os.path.getsize(path)
            with open(path, "r+b", buffering=0) as f:
                for off in range(0, size, len(zeros)):
                    f.write(zeros[:min(len(zeros), size - off)])
                os.fsync(f.fileno())

    def _src_rows(self, first_block, n):
        """Rows of the source region for blocks first_block.. (wrapping round it)."""
        src, nb = self.ctx.src, self.ctx.nblocks
        first = first_block % nb
        if first + n <= nb:
            return src[first:first + n]
        return [src[(first + j) % nb] for j in range(n)]

    def _store(self, rio, keys, first_block):
        with self.lock:
            refs, _ = self.store.reserve(keys)
        try:
            errs = rio.write_from(refs, self._src_rows(first_block, len(refs)))
        except BaseException:
            with self.lock:
                self.store.abort(refs)
            raise
        if any(e is not None for e in errs):
            raise BenchmarkFailed(f"kvstore write failed: {next(e for e in errs if e is not None)}")
        with self.lock:
            self.store.commit(refs)

    def _load(self, rio, requests, dst_first):
        """Load the prefixes of `requests` (lists of keys) as kvstore's worker does: every
        load queued at the time shares one ring pass, straight into the destination rows."""
        from kvstore.store.disk import SlotRef
        refs = []
        with self.lock:
            for keys in requests:
                entries = self.store.longest_prefix(keys)
                if len(entries) != len(keys):
                    raise BenchmarkFailed(f"kvstore found {len(entries)} of {len(keys)} blocks")
                self.store.pin(e.slot for e in entries)
                refs += [SlotRef(e.key, e.slot, e.generation) for e in entries]
        try:
            errs = rio.read_into(refs, self.ctx.dst[dst_first:dst_first + len(refs)], verify="checksum")
        finally:
            with self.lock:
                self.store.unpin(r.slot for r in refs)
        if any(e is not None for e in errs):
            raise BenchmarkFailed(f"kvstore read failed verification: {next(e for e in errs if e is not None)}")
        with self.lock:
            for keys in requests:
                self.store.touch(keys)

    def store_phase(self):
        ctx = self.ctx
        self.round += 1
        self.keys = _keys(f"k{self.round}", 0, ctx.nblocks)
        self.rio.io_bytes[:] = 0
        for first in range(0, ctx.nblocks, self.staging_slots):
            self._store(self.rio, self.keys[first:first + self.staging_slots], first)
        self._dev["store"] = self.rio.io_bytes[:, 1].copy()

    def load_phase(self):
        ctx = self.ctx
        # One request per prefix, all arriving together (the fs tier gets them as jobs
        # submitted at once to its pool; kvstore's I/O thread batches queued loads).
        self.rio.io_bytes[:] = 0
        self._load(self.rio, [self.keys[f:f + ctx.prefix] for f in range(0, ctx.nblocks, ctx.prefix)], 0)
        self._dev["load"] = self.rio.io_bytes[:, 0].copy()
        got = ctx.dst[:ctx.nblocks]
        if not np.array_equal(got[:, :64], ctx.src[:ctx.nblocks, :64]):
            raise BenchmarkFailed("kvstore loaded bytes that differ from what it stored")

    def dev_bytes(self, phase):
        """Payload bytes of the last `phase` ("store"/"load") on each directory: the
        phase's payload split as the ring bytes kvstore moved on each device."""
        moved = self._dev[phase]
        total = int(moved.sum())
        size = self.ctx.nblocks * self.block
        return [size * int(b) / total if total else 0.0 for b in moved]

    def prefix_test(self, samples):
        ctx = self.ctx
        prefix_keys = self.keys[:ctx.prefix]
        state = {"next": 0}
        batch = self.staging_slots
        with self.lock:
            self.store.touch(prefix_keys)  # the hot prefix is recently used, as it would be

        def bg_step():
            n = state["next"]
            state["next"] += batch
            # The prefix stays hot while the background stores evict: the requests that
            # share it keep hitting it. Touched before every background reserve, it is
            # never the LRU victim however fast the stores run (the 0.3 s warm-up of a
            # fast disk wrote far more than the spare room, and evicted it before the
            # first timed load).
            with self.lock:
                self.store.touch(prefix_keys)
            self._store(self.bg_rio, _keys(f"b{self.round}", n, batch), n)
            return batch * self.block

        return _prefix_samples(lambda: self._load(self.rio, [prefix_keys], 0), bg_step, samples)

    def end_round(self):
        with self.lock:
            idx = self.store.index
            self.store.drop([e.key for e in idx.iter_entries()])

    def close(self):
        for r in (self.rio, self.bg_rio):
            r.close()
        self.store.close()
        for p in [self.path] + (self.data or []):
            shutil.rmtree(p, ignore_errors=True)


class VllmFsSystem:
    """vLLM 0.33's FileSystemTierManager, called as its tiering manager calls it."""

    name = "vllm_fs"

    def __init__(self, ctx):
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
        self.keys = [self.make_key(k, 0) for k in _keys(f"v{self.round}", 0, ctx.nblocks)]
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

    def prefix_test(self, samples):
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
            keys = [self.make_key(k, 0) for k in _keys(f"w{self.round}", n, jb)]
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

        lat, bg = _prefix_samples(load_once, bg_step, samples)
        self.load_tier.drain_jobs()
        with self.lock:
            self._poll(self.load_tier)
            self.finished.clear()
        return lat, bg

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


class OneThreadSystem:
    """Blocking pwritev/preadv, one block per call, one thread (io_bench.OneThread)."""

    name = "one_thread"

    def __init__(self, ctx):
        self.ctx = ctx
        self.direct = not ctx.page_cache

    def store_phase(self):
        ctx = self.ctx
        self.ot = OneThread(ctx.directory, ctx.nblocks * ctx.block, ctx.block, ctx.qd, self.direct)
        self.ot.write()

    def load_phase(self):
        self.ot.read()

    def prefix_test(self, samples):
        ctx = self.ctx
        # OneThread names its file after its purpose: the background writer gets its own dir.
        bg_dir = os.path.join(ctx.directory, "one-thread-bg")
        os.makedirs(bg_dir, exist_ok=True)
        bg = OneThread(bg_dir, ctx.nblocks * ctx.block, ctx.block, ctx.qd, self.direct)
        state = {"i": 0}
        per_step = max(1, (ctx.staging_bytes // ctx.block))

        def bg_step():
            for _ in range(per_step):
                i = state["i"] % bg.nblocks
                state["i"] += 1
                if os.pwritev(bg.fd, [bg.mv], i * bg.block) != bg.block:
                    raise OSError("short write in baseline")
            os.fdatasync(bg.fd)
            return per_step * ctx.block

        fg = self.ot

        def load_once():
            for i in range(ctx.prefix):
                if os.preadv(fg.fd, [fg.mv], i * fg.block) != fg.block:
                    raise OSError("short read in baseline")
        try:
            return _prefix_samples(load_once, bg_step, samples)
        finally:
            bg.close()
            os.rmdir(bg_dir)

    def end_round(self):
        self.ot.close()

    def close(self):
        pass


class OneThreadPerDirSystem:
    """Several directories: the one_thread pattern once per directory, each thread on its
    own file with 1/D of the blocks (io_bench.MultiDirThreads); block j of a prefix is
    block j // D of directory j % D."""

    name = "one_thread"

    def __init__(self, ctx):
        self.ctx = ctx
        self.direct = not ctx.page_cache
        self.ndirs = len(ctx.dirs)

    def store_phase(self):
        ctx = self.ctx
        self.ot = MultiDirThreads(ctx.dirs, ctx.nblocks * ctx.block, ctx.block, ctx.qd, self.direct)
        self.ot.write()

    def load_phase(self):
        self.ot.read()

    def dev_bytes(self, phase):
        return [p.nblocks * p.block for p in self.ot.parts]

    def prefix_test(self, samples):
        from concurrent.futures import ThreadPoolExecutor
        ctx, n = self.ctx, self.ndirs
        parts = self.ot.parts
        bg_dirs = [os.path.join(d, "one-thread-bg") for d in ctx.dirs]
        for d in bg_dirs:
            os.makedirs(d, exist_ok=True)
        bgs = [OneThread(d, parts[0].nblocks * ctx.block, ctx.block, ctx.qd, self.direct) for d in bg_dirs]
        per_dir = max(1, (ctx.staging_bytes // ctx.block) // n)
        state = [0] * n

        def bg_part(k):
            bg = bgs[k]
            for _ in range(per_dir):
                i = state[k] % bg.nblocks
                state[k] += 1
                if os.pwritev(bg.fd, [bg.mv], i * bg.block) != bg.block:
                    raise OSError("short write in baseline")
            os.fdatasync(bg.fd)

        def load_part(k):
            fg = parts[k]
            for j in range(k, ctx.prefix, n):
                if os.preadv(fg.fd, [fg.mv], (j // n) * fg.block) != fg.block:
                    raise OSError("short read in baseline")

        fg_pool = ThreadPoolExecutor(n, thread_name_prefix="peers-1t-load")
        bg_pool = ThreadPoolExecutor(n, thread_name_prefix="peers-1t-store")

        def bg_step():
            list(bg_pool.map(bg_part, range(n)))
            return per_dir * n * ctx.block

        try:
            return _prefix_samples(lambda: list(fg_pool.map(load_part, range(n))), bg_step, samples)
        finally:
            fg_pool.shutdown()
            bg_pool.shutdown()
            for bg, d in zip(bgs, bg_dirs):
                bg.close()
                os.rmdir(d)

    def end_round(self):
        self.ot.close()

    def close(self):
        pass


class MultiDirFioCPU(MultiDirFio):
    """io_bench.MultiDirFio (a job per directory, all at once), also keeping the usr+sys
    CPU seconds fio reports for every job."""

    def __init__(self, *a):
        super().__init__(*a)
        self.cpu_s = 0.0

    def _run(self, rw):
        rate = super()._run(rw)
        self.cpu_s += sum((j["usr_cpu"] + j["sys_cpu"]) / 100.0 * j["job_runtime"] / 1000.0
                          for j in self.jobs)
        return rate


class FioCPU(Fio):
    """io_bench.Fio, also keeping fio's reported usr+sys CPU seconds of each run."""

    def __init__(self, *a):
        super().__init__(*a)
        self.cpu_s = 0.0

    def _run(self, rw):
        rate = super()._run(rw)
        job = self.job
        self.cpu_s += (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1000.0
        return rate


# --------------------------------------------------------------------------- driver
def _timed(fn):
    c, t = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t, _cpu() - c


def _one_size(ctx, systems, rounds, samples, log):
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
                if s == "fio":
                    if multi:  # a job per directory, all at once
                        f = MultiDirFioCPU(ctx.dirs, size, ctx.block, ctx.qd, not ctx.page_cache)
                    else:
                        f = FioCPU(ctx.directory, size, ctx.block, ctx.qd, not ctx.page_cache)
                    try:
                        w = f.write()
                        drop_page_cache()
                        r = f.read()
                    finally:
                        f.close()
                    samp[s]["store"].append(w / 1e9)
                    samp[s]["load"].append(r / 1e9)
                    samp[s]["cpu"].append(f.cpu_s / (2 * size / 1e9))
                    if multi:
                        nan = [float("nan")] * len(ctx.dirs)
                        samp[s]["dev_store"].append(f.dev_gbps.get("write", nan))
                        samp[s]["dev_load"].append(f.dev_gbps.get("read", nan))
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
                    lat, bg = o.prefix_test(samples)
                finally:
                    o.end_round()
                samp[s]["store"].append(size / tw / 1e9)
                samp[s]["load"].append(size / tr / 1e9)
                samp[s]["cpu"].append((cw + cr) / (2 * size / 1e9))
                samp[s]["lat"].extend(lat)
                samp[s]["bg"].append(bg)
    finally:
        for o in objs.values():
            o.close()
    res, det = {}, {}
    for s, v in samp.items():
        r = {"store_gbps": statistics.median(v["store"]), "load_gbps": statistics.median(v["load"])}
        if s != "fio":
            r["cpu_s_per_gb"] = statistics.median(v["cpu"])
            r["prefix_load_p50_ms"] = _pct(v["lat"], 50)
            r["prefix_load_p99_ms"] = _pct(v["lat"], 99)
        else:
            r["fio_cpu_s_per_gb"] = statistics.median(v["cpu"])
        res[s] = {k: r[k] for k in ALL_FIELDS if k in r}
        det[s] = {"store_gbps_samples": v["store"], "load_gbps_samples": v["load"],
                  "cpu_s_per_gb_samples": v["cpu"]}
        if s == "fio":
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
    return res, det, rows


def targets(results: dict) -> list[dict]:
    """The peer targets (docs/benchmarks.md), each with the numbers it was judged on."""
    out = []

    def add(name, ok, detail):
        out.append({"target": name, "met": bool(ok), "detail": detail})

    for bs, r in results.items():
        k, v, f = r.get("kvstore"), r.get("vllm_fs"), r.get("fio")
        b = int(bs)
        lbl = format_size(b)
        if k and v and b == 128 << 10:
            add(f"{lbl}: store >= 2x vLLM fs", k["store_gbps"] >= 2 * v["store_gbps"],
                f"{k['store_gbps'] / v['store_gbps']:.2f}x")
            add(f"{lbl}: load >= vLLM fs", k["load_gbps"] >= v["load_gbps"],
                f"{k['load_gbps'] / v['load_gbps']:.2f}x")
        if k and f and b == 128 << 10:
            for d in ("store", "load"):
                q = k[f"{d}_gbps"] / f[f"{d}_gbps"]
                add(f"{lbl}: {d} >= 0.8x fio", q >= 0.8, f"{q:.2f}x")
        if k and f and b == 2 << 20:
            for d in ("store", "load"):
                q = k[f"{d}_gbps"] / f[f"{d}_gbps"]
                add(f"{lbl}: {d} >= 0.9x fio", q >= 0.9, f"{q:.2f}x")
        if k and v and b == 2 << 20:
            for d in ("store", "load"):
                q = k[f"{d}_gbps"] / v[f"{d}_gbps"]
                add(f"{lbl}: {d} >= vLLM fs", q >= 1.0, f"{q:.2f}x")
        if k and v:
            q = v["cpu_s_per_gb"] / k["cpu_s_per_gb"]
            add(f"{lbl}: CPU/GB <= 1/3 of vLLM fs", q >= 3.0, f"vLLM uses {q:.2f}x kvstore's")
        if k:
            q = k["prefix_load_p99_ms"] / k["prefix_load_p50_ms"]
            add(f"{lbl}: prefix p99 <= 1.5x p50", q <= 1.5, f"{q:.2f}x")
    return out


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
    if "fio" in systems and shutil.which("fio") is None:
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
            src_mem, dst_mem = _anon(nblocks * b), _anon(nblocks * b)
            src = np.frombuffer(src_mem, np.uint8).reshape(nblocks, b)
            dst = np.frombuffer(dst_mem, np.uint8).reshape(nblocks, b)
            rng = np.random.default_rng(b)
            src[:] = rng.integers(0, 256, size=b, dtype=np.uint8)  # incompressible-ish payloads
            src[:, :8] = np.arange(nblocks, dtype="<u8").view(np.uint8).reshape(nblocks, 8)
            ctx = SimpleNamespace(directory=directory, dirs=dirs, block=b, nblocks=nblocks, qd=queue_depth,
                                  page_cache=page_cache, staging_bytes=staging_b, prefix=prefix,
                                  vllm_job_blocks=vllm_job_blocks, src=src, dst=dst,
                                  src_mem=src_mem, dst_mem=dst_mem)
            prefixes[str(b)] = prefix
            log(f"block {format_size(b)}: {nblocks} blocks ({format_size(nblocks * b)}) per system, "
                f"prefix {prefix} blocks")
            try:
                res, det, rows = _one_size(ctx, systems, rounds, samples, log)
            finally:
                del src, dst, ctx
                for m in (src_mem, dst_mem):
                    try:
                        m.close()
                    except BufferError:  # a view is still alive (an error path): leave it to GC
                        pass
            results[str(b)] = res
            details[str(b)] = det
            if rows is not None:
                per_device[str(b)] = rows
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
            "kvstore_dirs": dirs, "fio_dirs": dirs, "one_thread_dirs": dirs,
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


def format_table(out: dict) -> str:
    c = out["config"]
    dirs = c.get("dirs") or [c["dir"]]
    multi = len(dirs) > 1
    over = f" over {len(dirs)} directories" if multi else ""
    labels = dict(LABELS, **({"vllm_fs": "vLLM fs tier*", "one_thread": "1 thread/dir"} if multi else {}))
    lines = [f"kvstore bench peers: {format_size(c['size'])} per system per block size{over}, queue depth "
             f"{c['queue_depth']}{' per directory' if multi else ''}, "
             f"{'O_DIRECT' if c['o_direct'] else 'page cache'}, median of "
             f"{c['rounds']} alternating rounds; vLLM {c['vllm_version']} fs tier "
             f"(16+16 threads, fs_io_C={'yes' if c['vllm_fs_io_C'] else 'no'})",
             f"prefix load: p50/p99 over {c['rounds']}x{c['prefix_samples_per_round']} loads of one "
             "prefix while a background thread stores new blocks"]
    if multi:
        lines.append(f"directories: {', '.join(dirs)}; kvstore: one store striped over all, a ring per "
                     "directory; fio: a job per directory at once; 1 thread/dir: a blocking thread per directory")
        lines.append(f"*vLLM fs tier: {dirs[0]} only (it takes one root_dir; several fs tiers would each "
                     "store a copy of every block, not a share)")
    head = (f"{'block':>7} {'system':<13} {'store GB/s':>10} {'load GB/s':>10} {'CPU s/GB':>9} "
            f"{'prefix':>7} {'p50 ms':>8} {'p99 ms':>8} {'bg GB/s':>8}")
    lines.append(head)
    for bs, res in out["results"].items():
        for s, r in res.items():
            d = out.get("details", {}).get(bs, {}).get(s, {})
            cpu = r.get("cpu_s_per_gb", d.get("cpu_s_per_gb"))
            p50 = r.get("prefix_load_p50_ms")
            p99 = r.get("prefix_load_p99_ms")
            bg = d.get("background_store_gbps")
            pre = c["prefix_blocks"][bs] if p50 is not None else None
            lines.append(
                f"{format_size(int(bs)):>7} {labels.get(s, s):<13} {r['store_gbps']:>10.2f} "
                f"{r['load_gbps']:>10.2f} {cpu if cpu is not None else float('nan'):>9.3f} "
                f"{pre if pre is not None else '-':>7} "
                f"{p50 if p50 is not None else float('nan'):>8.1f} "
                f"{p99 if p99 is not None else float('nan'):>8.1f} "
                f"{bg if bg is not None else float('nan'):>8.2f}")
    scaled = [f"{format_size(int(b))}: {p}" for b, p in c["prefix_blocks"].items() if p != 1000]
    if scaled:
        lines.append("prefix scaled down from 1000 blocks (cap 128 MiB / a quarter of --size): "
                     + ", ".join(scaled))
    lines.append("fio CPU s/GB is fio's own usr+sys; bg GB/s = background store rate during the prefix test")
    if multi and out.get("per_device"):
        lines.extend(_per_device_lines(out["per_device"], labels))
    lines.append("targets:")
    for t in out.get("targets", []):
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['detail']}")
    return "\n".join(lines)


def _per_device_lines(per_device: dict, labels: dict) -> list[str]:
    """Per directory and block size: each system's store / load GB/s there."""
    first = next(iter(per_device.values()))
    systems = [s for s in first[0] if s != "dir"]
    width = max(9, max(len(r["dir"]) for rows in per_device.values() for r in rows))
    lines = ["per directory, store / load GB/s (a system's rows add up to its total):",
             f"{'block':>7} {'directory':<{width}} " + " ".join(f"{labels.get(s, s):>15}" for s in systems)]
    for bs, rows in per_device.items():
        for r in rows:
            cells = [f"{r[s]['store_gbps']:>7.2f} /{r[s]['load_gbps']:>6.2f}" for s in systems]
            lines.append(f"{format_size(int(bs)):>7} {r['dir']:<{width}} " + " ".join(cells))
    return lines


def plot(out: dict, path: str) -> None:
    """Bar charts (one panel per metric, grouped by block size) saved as PNG."""
    def value(b, s, field):
        v = out["results"][b].get(s, {}).get(field)
        if v is None and field == "cpu_s_per_gb":
            v = out.get("details", {}).get(b, {}).get(s, {}).get("cpu_s_per_gb")
        return v

    sizes = list(out["results"])
    c = out["config"]
    size_panels(
        path, sizes, [s for s in SYSTEMS if any(s in out["results"][b] for b in sizes)], value,
        [("store_gbps", "store GB/s"), ("load_gbps", "load GB/s"),
         ("cpu_s_per_gb", "CPU s per GB moved"), ("prefix_load_p99_ms", "prefix load p99 ms\n(under stores)")],
        LABELS, {"kvstore": "#1f77b4", "vllm_fs": "#ff7f0e", "one_thread": "#7f7f7f", "fio": "#2ca02c"},
        f"kvstore vs vLLM {c['vllm_version']} fs tier vs 1 thread vs fio "
        f"({'O_DIRECT' if c['o_direct'] else 'page cache'}, QD {c['queue_depth']}, "
        f"{format_size(c['size'])} per system)",
        figsize=(14, 3.6))
