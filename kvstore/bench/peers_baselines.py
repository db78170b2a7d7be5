"""The baselines of `kvstore bench peers` next to kvstore and vLLM's fs tier: one
blocking thread (`OneThreadSystem`; `OneThreadPerDirSystem`, a thread per directory)
and fio (`FioCPU`, `MultiDirFioCPU`: io_bench's runs, keeping fio's CPU seconds)."""
from __future__ import annotations

import os

from kvstore.bench.io_bench import Fio, MultiDirFio, MultiDirThreads, OneThread
from kvstore.bench.peers_common import PeersContext, PrefixResult, prefix_samples


class OneThreadSystem:
    """Blocking pwritev/preadv, one block per call, one thread (io_bench.OneThread)."""

    name = "one_thread"

    def __init__(self, ctx: PeersContext):
        self.ctx = ctx
        self.direct = not ctx.page_cache

    def store_phase(self):
        ctx = self.ctx
        self.ot = OneThread(ctx.directory, ctx.nblocks * ctx.block, ctx.block, ctx.qd, self.direct)
        self.ot.write()

    def load_phase(self):
        self.ot.read()

    def prefix_test(self, samples) -> PrefixResult:
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
            return prefix_samples(load_once, bg_step, samples)
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

    def __init__(self, ctx: PeersContext):
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

    def prefix_test(self, samples) -> PrefixResult:
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
            return prefix_samples(lambda: list(fg_pool.map(load_part, range(n))), bg_step, samples)
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

    def _run(self, rw, extra=()):
        rate = super()._run(rw, extra)
        job = self.job
        self.cpu_s += (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1000.0
        return rate
