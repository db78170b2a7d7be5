"""kvstore's side of `kvstore bench peers`: `KVStoreSystem`, the engine with its index
work (DiskStore + RankIO, one store striped over every directory), its store and load
phases, its per-directory bytes and its prefix-load test (see `peers_bench` for what is
measured and how)."""
from __future__ import annotations

import os
import shutil
import sys
import threading

import numpy as np

from kvstore.bench.peers_common import PeersContext, PrefixResult, bench_keys, prefix_samples
from kvstore.errors import BenchmarkFailed


class KVStoreSystem:
    """The kvstore engine: DiskStore (index) + RankIO (data path), index work included."""

    name = "kvstore"

    def __init__(self, ctx: PeersContext):
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
        self.keys = bench_keys(f"k{self.round}", 0, ctx.nblocks)
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

    def prefix_test(self, samples) -> PrefixResult:
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
            self._store(self.bg_rio, bench_keys(f"b{self.round}", n, batch), n)
            return batch * self.block

        return prefix_samples(lambda: self._load(self.rio, [prefix_keys], 0), bg_step, samples)

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
