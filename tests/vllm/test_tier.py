"""kvstore as a secondary tier of vLLM 0.33's OffloadingConnector (kvstore.vllm.tier).

Every scenario runs through vLLM's real `TieringOffloadingManager`, built as
`TieringOffloadingSpec(config).get_manager()` builds it: a real CPU primary tier over a
`SharedOffloadRegion` in /dev/shm, the tier loaded by vLLM's `SecondaryTierFactory` from
its `secondary_tiers` entry. The test plays the GPU worker's part (it writes a chunk's
bytes into the primary memory between `prepare_store` and `complete_store`, and reads
them after `prepare_load`). Scenarios where vLLM's own `fs` tier has the feature run
against it too (`tier` parameter); where it has not, a test shows what it does instead.
"""
from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import struct
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from vllm.v1.kv_offload.base import (
    Locality, LookupResult, Medium, ReqContext, ScheduleEndContext, make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig, OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvstore.store.disk import DiskStore
from kvstore.errors import ConfigError, LayoutMismatch
from kvstore.format.layout import HEADER_SIZE
from kvstore.io.paths import slot_file_path
from kvstore.vllm.tier import KVStoreTier, TierMetrics

from mount_util import loop_ext4

ROW = 64 << 10            # primary chunk bytes of the tests' layout (page-aligned)
SLOT = ROW + HEADER_SIZE  # kvstore slot of one chunk
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
TIERS = ["kvstore", "fs"]


def make_config(extra: dict, *, row: int = ROW, events: bool = False, blocks_per_chunk: int = 1,
                layers: int = 2, world: int = 1, agnostic: bool = False) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16,
                                      layer_names=tuple(f"layer.{i}" for i in range(layers)),
                                      group_id=0),),
        worker_kv_bytes_per_block=row // blocks_per_chunk // world,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=f"kvstore-tier-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="test/tier-model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=agnostic),
    )


def tier_entry(kind: str, root, **kw) -> dict:
    if kind == "kvstore":
        d = {"type": "KVStoreTier", "module_path": "kvstore.vllm.tier",
             "path": str(root / "kvstore"), "capacity": 256 * SLOT}
    else:
        d = {"type": "fs", "root_dir": str(root / "fs"), "n_read_threads": 2,
             "n_write_threads": 2}
    d.update(kw)
    return d


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(8, "big") * 4, group)


def payload(k: bytes, row: int = ROW) -> np.ndarray:
    seed = int.from_bytes(k[:8], "big") ^ int.from_bytes(k[-4:], "big")
    return np.random.default_rng(seed).integers(0, 256, row, dtype=np.uint8)


class Engine:
    """vLLM's manager for one engine's life, driven as its scheduler and workers drive
    it; the worker's GPU <-> primary copies are byte copies into the primary memory."""

    def __init__(self, tier: dict, *, chunks: int = 16, row: int = ROW, events: bool = False,
                 **cfg):
        self.row = row
        self.spec = TieringOffloadingSpec(make_config(
            {"cpu_bytes_to_use": chunks * row, "secondary_tiers": [tier]}, row=row,
            events=events, **cfg))
        self.m = self.spec.get_manager()
        self.tier = self.m.secondary_tiers[0]
        self.primary = self.m.primary_tier
        self._req = 0
        self.closed = False

    def _flat(self) -> np.ndarray:
        return np.frombuffer(self.primary.get_kv_memoryview().cast("B"), dtype=np.uint8)

    def ctx(self) -> ReqContext:
        self._req += 1
        ctx = ReqContext(req_id=f"req-{self._req}")
        with self.m.lock:
            self.m.on_new_request(ctx)
        return ctx

    def store(self, keys: list[bytes], *, settle: bool = True) -> None:
        """A request computes `keys` (GPU -> primary) and finishes; the manager cascades
        them to the tier."""
        ctx = self.ctx()
        flat = self._flat()
        with self.m.lock:
            out = self.m.prepare_store(keys, ctx)
            assert out is not None, "the primary tier could not take the chunks"
            for k, c in zip(out.keys_to_store, out.store_spec.block_ids):
                flat[c * self.row:(c + 1) * self.row] = payload(k, self.row)
            self.m.complete_store(out.keys_to_store, ctx)
            self.m.on_request_finished(ctx)
            self.m.on_schedule_end(STEP)
        del flat
        if settle:
            self.settle()

    def settle(self, timeout: float = 60.0) -> None:
        """Step until no transfer is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            with self.m.lock:
                self.m.on_schedule_end(STEP)
                if not self.m.has_pending_work():
                    return
            assert time.monotonic() < deadline, "tier jobs did not finish"
            time.sleep(0.002)

    def lookup(self, keys: list[bytes], timeout: float = 60.0) -> list[LookupResult]:
        """Look keys up as the scheduler does, step after step, until each is a HIT in
        the primary tier (promoted) or a MISS."""
        ctx = self.ctx()
        deadline = time.monotonic() + timeout
        while True:
            with self.m.lock:
                res = [self.m.lookup(k, ctx) for k in keys]
                self.m.on_schedule_end(STEP)
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
                with self.m.lock:
                    self.m.on_request_finished(ctx)
                return res
            assert time.monotonic() < deadline, f"lookups never settled: {res}"
            time.sleep(0.002)

    def read(self, keys: list[bytes]) -> list[np.ndarray]:
        """The primary's bytes of keys (all HIT), as the worker's primary -> GPU load."""
        ctx = self.ctx()
        flat = self._flat()
        with self.m.lock:
            spec = self.m.prepare_load(keys, ctx)
            out = [flat[c * self.row:(c + 1) * self.row].copy() for c in spec.block_ids]
            self.m.complete_load(keys, ctx)
            self.m.on_request_finished(ctx)
        del flat
        return out

    def in_primary(self, k: bytes) -> bool:
        with self.m.lock:
            return self.primary.lookup(k, ReqContext(req_id="probe")) is LookupResult.HIT

    def evict_from_primary(self, keys: list[bytes], base: int = 10_000) -> None:
        """Fill the primary with other chunks until none of keys is there."""
        n = self.primary._num_chunks
        self.store([key(base + i) for i in range(n)])
        assert not any(self.in_primary(k) for k in keys)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.m.shutdown()


@pytest.fixture
def engines():
    made = []

    def make(*a, **kw) -> Engine:
        e = Engine(*a, **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def _kv_slot_payload_offset(path: str, k: bytes) -> tuple[str, int]:
    """(slot file, byte offset of the payload) of key k in a kvstore tier store."""
    with DiskStore(path, readonly=True) as st:
        e = st.lookup(k)
        assert e is not None
        fi, off = st.geometry.locate(e.slot)
        return slot_file_path(st.data_dirs[st.geometry.device_of(e.slot)], 0, fi), off + HEADER_SIZE


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _fs_file(engine: Engine, k: bytes) -> str:
    return engine.tier.file_mapper.get_file_name(k)


def _du(path) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(d, f)).st_blocks * 512
    return total


# ------------------------------------------------------------------------- scenarios

@pytest.mark.parametrize("tier", TIERS)
def test_store_evict_from_primary_promote_identical_bytes(engines, tmp_path, tier):
    e = engines(tier_entry(tier, tmp_path))
    keys = [key(i) for i in range(6)]
    e.store(keys)
    e.evict_from_primary(keys)
    assert e.lookup(keys) == [LookupResult.HIT] * len(keys)     # promoted from the tier
    for k, got in zip(keys, e.read(keys)):
        assert np.array_equal(got, payload(k))


def test_kvstore_tier_loads_in_vllm_factory(engines, tmp_path):
    e = engines(tier_entry("kvstore", tmp_path, locality="LOCAL"))
    assert isinstance(e.tier, KVStoreTier)
    assert e.tier.locality is Locality.LOCAL and e.tier.medium is Medium.STORAGE
    # vLLM's SharedOffloadRegion is an mmap with page-padded chunks: no staging copy
    assert e.tier.data_path == "direct", e.tier.data_path_reason


@pytest.mark.parametrize("tier", TIERS)
def test_restart_persistence(engines, tmp_path, tier):
    keys = [key(i) for i in range(8)]
    first = engines(tier_entry(tier, tmp_path))
    first.store(keys)
    first.close()
    second = engines(tier_entry(tier, tmp_path))    # a new engine (new primary) on the same path
    assert not any(second.in_primary(k) for k in keys)
    assert second.lookup(keys) == [LookupResult.HIT] * len(keys)
    for k, got in zip(keys, second.read(keys)):
        assert np.array_equal(got, payload(k))


def test_kvstore_bit_flips_never_served(engines, tmp_path):
    keys = [key(i) for i in range(6)]
    first = engines(tier_entry("kvstore", tmp_path))
    first.store(keys)
    first.close()
    path = str(tmp_path / "kvstore")
    for k, where in ((keys[1], 0), (keys[4], ROW - 1)):     # payload's first and last byte
        f, off = _kv_slot_payload_offset(path, k)
        _flip(f, off + where)
    e = engines(tier_entry("kvstore", tmp_path))
    res = e.lookup(keys)
    # the flipped chunks fail verification: left out of the load, dropped, MISS
    assert [r is LookupResult.HIT for r in res] == [True, False, True, True, False, True]
    good = [k for k, r in zip(keys, res) if r is LookupResult.HIT]
    for k, got in zip(good, e.read(good)):
        assert np.array_equal(got, payload(k))
    assert not e.in_primary(keys[1]) and not e.in_primary(keys[4])
    with e.m.lock:
        assert e.tier.lookup(keys[1], ReqContext(req_id="x")) is LookupResult.MISS
    # the dropped entries leave the index too
    e.settle()
    e.tier._sidx.flush()
    assert e.lookup([keys[1]]) == [LookupResult.MISS]
    stats = e.tier.get_stats()
    assert stats is not None
    assert stats.reduce()[TierMetrics.VERIFY_FAILURES] == 2


def test_fs_tier_serves_flipped_bytes(engines, tmp_path):
    """vLLM's fs tier has no checksum: the same flip reaches the primary tier (what the
    kvstore tier's verified loads prevent)."""
    keys = [key(i) for i in range(3)]
    first = engines(tier_entry("fs", tmp_path))
    first.store(keys)
    path = _fs_file(first, keys[1])
    first.close()
    _flip(path, 0)
    e = engines(tier_entry("fs", tmp_path))
    assert e.lookup(keys) == [LookupResult.HIT] * 3
    got = e.read(keys)
    assert np.array_equal(got[0], payload(keys[0]))
    assert not np.array_equal(got[1], payload(keys[1]))     # wrong bytes served


def test_kvstore_capacity_bound_under_pressure(engines, tmp_path):
    cap_slots = 24
    e = engines(tier_entry("kvstore", tmp_path, capacity=cap_slots * SLOT), chunks=8)
    path = tmp_path / "kvstore"
    disk0 = _du(path)
    for wave in range(12):
        keys = [key(1000 + wave * 8 + i) for i in range(8)]
        e.store(keys)
        e.tier._sidx.flush()
        assert e.tier.used_bytes() <= e.tier.capacity_bytes
        assert _du(path) <= disk0 + (1 << 20)        # slot files preallocated: no growth
    # the most recent chunks hit, the oldest were evicted
    recent = [key(1000 + 11 * 8 + i) for i in range(8)]
    e.evict_from_primary(recent)
    assert e.lookup(recent) == [LookupResult.HIT] * 8
    for k, got in zip(recent, e.read(recent)):
        assert np.array_equal(got, payload(k))
    oldest = [key(1000 + i) for i in range(8)]
    with e.m.lock:
        assert [e.tier.lookup(k, ReqContext(req_id="x")) for k in oldest] == [LookupResult.MISS] * 8
    stats = e.tier.get_stats().reduce()
    assert stats[TierMetrics.CAPACITY_BYTES] == cap_slots * SLOT
    assert 0 < stats[TierMetrics.USED_BYTES] <= cap_slots * SLOT
    assert stats[TierMetrics.EVICTED_CHUNKS] >= 96 - cap_slots


def test_fs_tier_grows_without_bound(engines, tmp_path):
    """The same pressure on vLLM's fs tier: it keeps every chunk (no capacity)."""
    e = engines(tier_entry("fs", tmp_path), chunks=8)
    for wave in range(12):
        e.store([key(1000 + wave * 8 + i) for i in range(8)])
    assert _du(tmp_path / "fs") >= 96 * ROW > 24 * SLOT


@pytest.mark.parametrize("tier", TIERS)
def test_many_jobs_then_drain_each_reported_once(engines, tmp_path, tier):
    e = engines(tier_entry(tier, tmp_path), chunks=64)
    submitted: list[int] = []
    seen: list[int] = []
    real_submit, real_finished = e.tier.submit_store, e.tier.get_finished_jobs

    def submit(job):            # (observes the calls vLLM makes; the tier's own code runs)
        submitted.append(job.job_id)
        real_submit(job)

    def finished():
        out = list(real_finished())
        seen.extend(r.job_id for r in out)
        return out
    e.tier.submit_store, e.tier.get_finished_jobs = submit, finished
    for r in range(16):         # 16 requests of 4 chunks: 16 store jobs in flight
        e.store([key(r * 4 + i) for i in range(4)], settle=False)
    assert len(submitted) == 16
    with e.m.lock:
        e.tier.drain_jobs()
        e.m.reset_cache()       # drains again, processes every result, asserts none left
        assert not e.m._jobs
    assert sorted(seen) == sorted(submitted)        # each job exactly once
    with e.m.lock:
        e.m.on_reset_flushed()
    keys = [key(i) for i in range(64)]
    assert e.lookup(keys) == [LookupResult.HIT] * 64
    for k, got in zip(keys, e.read(keys)):
        assert np.array_equal(got, payload(k))


@pytest.mark.parametrize("tier", TIERS)
def test_reset_cache_keeps_the_tier(engines, tmp_path, tier):
    e = engines(tier_entry(tier, tmp_path))
    keys = [key(i) for i in range(5)]
    e.store(keys)
    with e.m.lock:
        e.m.reset_cache()
    assert not any(e.in_primary(k) for k in keys)
    # promotions are held until the workers flushed the reset
    assert e.lookup(keys) == [LookupResult.MISS] * 5
    with e.m.lock:
        e.m.on_reset_flushed()
    assert e.lookup(keys) == [LookupResult.HIT] * 5
    for k, got in zip(keys, e.read(keys)):
        assert np.array_equal(got, payload(k))


@pytest.mark.parametrize("tier", TIERS)
def test_shutdown_with_jobs_in_flight(tmp_path, tier, fd_leak_check):
    e = Engine(tier_entry(tier, tmp_path), chunks=64)
    old = [key(i) for i in range(8)]
    e.store(old)
    e.evict_from_primary(old, base=500)
    ctx = e.ctx()
    with e.m.lock:
        for k in old:
            e.m.lookup(k, ctx)      # promotions queued ...
        e.m.on_schedule_end(STEP)   # ... and submitted
    for r in range(8):
        e.store([key(100 + r * 4 + i) for i in range(4)], settle=False)
    region = f"/dev/shm/vllm_offload_{e.spec._engine_id}.mmap"
    e.close()                       # jobs still in flight
    assert not os.path.exists(region)
    if tier == "kvstore":
        # whatever the store kept is whole: every entry reads back verified and right
        with DiskStore(str(tmp_path / "kvstore"), io=True) as st:
            every = old + [key(100 + i) for i in range(32)]
            for k in every:
                got = st.get([k], touch=False)
                if got:
                    assert np.array_equal(np.frombuffer(got[k][0], dtype=np.uint8), payload(k))


def test_kvstore_tier_events(engines, tmp_path):
    entry = tier_entry("kvstore", tmp_path, enable_kv_events=True, locality="LOCAL",
                       capacity=16 * SLOT)
    e = engines(entry, events=True, chunks=8)
    keys = [key(i) for i in range(6)]
    e.store(keys)
    with e.m.lock:
        evs = [ev for ev in e.m.take_events() if ev.ownership is None and ev.medium is Medium.STORAGE]
    stored = [k for ev in evs if not ev.removed for k in ev.keys]
    assert sorted(stored) == sorted(keys)
    assert all(ev.locality is Locality.LOCAL for ev in evs)
    # pressure: evictions are BlockRemoved of STORAGE
    for w in range(4):
        e.store([key(100 + w * 8 + i) for i in range(8)])
    e.tier._sidx.flush()
    e.settle()
    time.sleep(0.1)
    with e.m.lock:
        evs = list(e.m.take_events())
    removed = {k for ev in evs if ev.medium is Medium.STORAGE and ev.removed for k in ev.keys}
    assert set(keys) <= removed
    e.close()
    # a restart announces what the store holds
    with DiskStore(str(tmp_path / "kvstore"), readonly=True) as st:
        on_disk = {x.key for x in st.index.iter_entries()}
    e2 = engines(entry, events=True, chunks=8)
    deadline = time.monotonic() + 30
    announced: set = set()
    while announced != on_disk and time.monotonic() < deadline:
        with e2.m.lock:
            e2.m.on_schedule_end(STEP)
            announced |= {k for ev in e2.m.take_events()
                          if ev.medium is Medium.STORAGE and not ev.removed for k in ev.keys}
        time.sleep(0.01)
    assert on_disk and announced == on_disk


def test_fs_tier_events(engines, tmp_path):
    entry = tier_entry("fs", tmp_path, enable_kv_events=True, locality="LOCAL")
    e = engines(entry, events=True)
    keys = [key(i) for i in range(6)]
    e.store(keys)
    with e.m.lock:
        evs = [ev for ev in e.m.take_events() if ev.medium is Medium.STORAGE]
    assert sorted(k for ev in evs for k in ev.keys) == sorted(keys)


# ------------------------------------------------------------------------- configuration

def test_unknown_key_refused_naming_it(tmp_path):
    entry = tier_entry("kvstore", tmp_path, n_read_threads=4)
    spec = TieringOffloadingSpec(make_config({"cpu_bytes_to_use": 16 * ROW,
                                              "secondary_tiers": [entry]}))
    with pytest.raises(ConfigError, match="n_read_threads"):
        spec.get_manager()
    assert not os.path.exists(f"/dev/shm/vllm_offload_{spec._engine_id}.mmap")


def test_missing_capacity_for_a_new_store(tmp_path):
    entry = tier_entry("kvstore", tmp_path)
    del entry["capacity"]
    spec = TieringOffloadingSpec(make_config({"cpu_bytes_to_use": 16 * ROW,
                                              "secondary_tiers": [entry]}))
    with pytest.raises(ConfigError, match="capacity"):
        spec.get_manager()


@pytest.mark.parametrize("change, field", [
    (dict(row=2 * ROW), "kv_layout.worker_block_bytes"),
    (dict(world=2), "kv_layout.parallel"),
    (dict(blocks_per_chunk=2), "block_size"),
    (dict(layers=3), "num_layers"),
])
def test_store_of_another_geometry_refused(engines, tmp_path, change, field):
    e = engines(tier_entry("kvstore", tmp_path, capacity=256 * SLOT))
    e.store([key(1)])
    e.close()
    spec = TieringOffloadingSpec(make_config(
        {"cpu_bytes_to_use": 16 * change.get("row", ROW),
         "secondary_tiers": [tier_entry("kvstore", tmp_path)]}, **change))
    with pytest.raises(LayoutMismatch) as info:
        spec.get_manager()
    assert info.value.field == field
    assert field.split(".")[-1] in str(info.value)


def test_metric_definitions_reach_vllm():
    entry = {"type": "KVStoreTier", "module_path": "kvstore.vllm.tier", "path": "/x"}
    defs = TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": [entry]})
    for name in (TierMetrics.CAPACITY_BYTES, TierMetrics.USED_BYTES, TierMetrics.HITS,
                 TierMetrics.READ_BYTES, TierMetrics.WRITTEN_BYTES, TierMetrics.VERIFY_FAILURES):
        assert name in defs


def test_metrics_count_hits_and_bytes(engines, tmp_path):
    e = engines(tier_entry("kvstore", tmp_path))
    keys = [key(i) for i in range(4)]
    e.store(keys)
    e.evict_from_primary(keys)
    e.tier.get_stats()      # counts so far
    assert e.lookup(keys) == [LookupResult.HIT] * 4
    s = e.tier.get_stats().reduce()
    assert s[TierMetrics.HITS] == 4
    assert s[TierMetrics.LOADED_CHUNKS] == 4
    assert s[TierMetrics.READ_BYTES] == 4 * ROW


# ------------------------------------------------------------------------- staging path

def test_unaligned_primary_goes_through_staging(tmp_path):
    """Primary memory that O_DIRECT cannot use directly (here: not 4096-aligned) moves
    through kvstore's staging memory, with the same bytes and the same verification."""
    spec = TieringOffloadingSpec(make_config({"cpu_bytes_to_use": 16 * ROW}))
    backing = np.zeros(8 * ROW + 8192, dtype=np.uint8)
    base = backing.__array_interface__["data"][0]
    start = (-base) % 4096 + 512                     # 512 bytes past a page boundary
    prim = backing[start:start + 8 * ROW].reshape(8, ROW).view(np.int8)
    tier = KVStoreTier(spec, memoryview(prim), "KVStoreTier", path=str(tmp_path / "kv"),
                       capacity=32 * SLOT)
    try:
        assert tier.data_path == "staging" and "aligned" in tier.data_path_reason
        keys = [key(i) for i in range(4)]
        flat = prim.view(np.uint8).reshape(-1)
        for i, k in enumerate(keys):
            flat[i * ROW:(i + 1) * ROW] = payload(k)
        ctx = ReqContext(req_id="r")
        tier.submit_store(TransferJob(1, keys, np.arange(4), False, ctx))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
        flat[:] = 0
        tier.submit_load(TransferJob(2, keys, np.array([7, 6, 5, 4]), True, ctx))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, True)]
        for i, k in enumerate(keys):
            c = 7 - i
            assert np.array_equal(flat[c * ROW:(c + 1) * ROW], payload(k))
    finally:
        tier.shutdown()


def test_partial_load_reports_successful_keys(tmp_path):
    """A load job with a chunk the tier lacks: the others load, `successful_keys` names
    them, and the missing one is a MISS (vLLM recomputes it instead of retrying)."""
    spec = TieringOffloadingSpec(make_config({"cpu_bytes_to_use": 16 * ROW}))
    region = np.zeros(8 * ROW + 4096, dtype=np.uint8)
    base = region.__array_interface__["data"][0]
    start = (-base) % 4096
    prim = region[start:start + 8 * ROW].reshape(8, ROW).view(np.int8)
    tier = KVStoreTier(spec, memoryview(prim), "KVStoreTier", path=str(tmp_path / "kv"),
                       capacity=32 * SLOT)
    try:
        flat = prim.view(np.uint8).reshape(-1)
        keys = [key(i) for i in range(3)]
        for i, k in enumerate(keys):
            flat[i * ROW:(i + 1) * ROW] = payload(k)
        ctx = ReqContext(req_id="r")
        tier.submit_store(TransferJob(1, keys[:2], np.arange(2), False, ctx))
        tier.drain_jobs()
        assert all(r.success for r in tier.get_finished_jobs())
        tier.submit_load(TransferJob(2, keys, np.array([5, 6, 7]), True, ctx))
        tier.drain_jobs()
        (res,) = tier.get_finished_jobs()
        assert not res.success and set(res.successful_keys) == set(keys[:2])
        assert np.array_equal(flat[5 * ROW:6 * ROW], payload(keys[0]))
        assert tier.lookup(keys[2], ctx) is LookupResult.MISS
    finally:
        tier.shutdown()


def test_kvstore_tools_read_a_tier_store(engines, tmp_path):
    """`kvstore info` and `kvstore fsck --deep` work on a tier's store: clean after
    stores, and a flipped payload byte is found (the slot the tier would refuse)."""
    import json

    from click.testing import CliRunner

    from kvstore.cli import main
    keys = [key(i) for i in range(5)]
    e = engines(tier_entry("kvstore", tmp_path))
    e.store(keys)
    e.close()
    path = str(tmp_path / "kvstore")
    r = CliRunner().invoke(main, ["info", path])
    assert r.exit_code == 0 and "tier-chunk;" in r.output and "used 5 " in r.output
    r = CliRunner().invoke(main, ["fsck", "--json", "--deep", "-q", path])
    assert r.exit_code == 0, r.output
    f, off = _kv_slot_payload_offset(path, keys[2])
    _flip(f, off + 7)
    r = CliRunner().invoke(main, ["fsck", "--json", "--deep", "-q", path])
    assert r.exit_code != 0
    doc = json.loads(r.output)
    assert not doc["clean"] and doc["findings"], r.output


# ------------------------------------------------------------------------- several devices

@pytest.fixture
def disks(tmp_path):
    """Three loop-mounted ext4 file systems (24 MiB each), a data directory `kv` on each;
    yields (data dirs, mount points)."""
    mnts = []
    try:
        for i in range(3):
            mnts.append(loop_ext4(tmp_path, f"nvme{i}", 24))
            (mnts[-1] / "kv").mkdir()
        yield [str(m / "kv") for m in mnts], [str(m) for m in mnts]
    finally:
        for m in mnts:
            subprocess.run(["umount", "-l", str(m)], check=False, capture_output=True)


def _ext4_shutdown(mnt: str) -> None:
    """EXT4_IOC_SHUTDOWN (NOLOGFLUSH): the file system fails every later I/O with EIO."""
    fd = os.open(mnt, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x8004587D, struct.pack("I", 2))
    finally:
        os.close(fd)


def _devices(e: Engine) -> dict[bytes, int]:
    """Key -> device of every committed entry of a kvstore tier."""
    e.tier._sidx.flush()
    st = e.tier._store
    return {x.key: st.geometry.device_of(x.slot) for x in st.index.iter_entries()}


def test_kvstore_data_dirs_spread_and_a_failed_device_is_fenced(engines, tmp_path, disks):
    """Chunks spread over every data directory; when one device fails (a real kernel EIO:
    ext4's shutdown ioctl), its chunks answer MISS, the others still hit with their
    bytes, later stores land on the devices left, and no wrong byte reaches the primary."""
    dirs, mnts = disks
    e = engines(tier_entry("kvstore", tmp_path, data_dirs=dirs, capacity=120 * SLOT,
                           device_eio_limit=1), chunks=32)
    keys = [key(i) for i in range(24)]
    e.store(keys)
    dev = _devices(e)
    assert set(dev) == set(keys)
    assert sorted(set(dev.values())) == [0, 1, 2]          # striped over the three
    e.evict_from_primary(keys)
    _ext4_shutdown(mnts[1])
    res = e.lookup(keys)
    assert [r is LookupResult.HIT for r in res] == [dev[k] != 1 for k in keys]
    good = [k for k in keys if dev[k] != 1]
    for k, got in zip(good, e.read(good)):
        assert np.array_equal(got, payload(k))
    assert 1 in e.tier._fenced
    with e.m.lock:
        assert all(e.tier.lookup(k, ReqContext(req_id="x")) is LookupResult.MISS
                   for k in keys if dev[k] == 1)
    # the fenced device takes no new chunk; what is stored now hits from the others
    new = [key(500 + i) for i in range(12)]
    e.store(new)
    dev = _devices(e)
    assert all(k in dev and dev[k] != 1 for k in new)
    assert not any(d == 1 for d in dev.values())            # its entries left the index
    e.evict_from_primary(new, base=20_000)
    assert e.lookup(new) == [LookupResult.HIT] * len(new)
    for k, got in zip(new, e.read(new)):
        assert np.array_equal(got, payload(k))
    # a restart with the device still failed serves from the others
    e.close()
    e2 = engines(tier_entry("kvstore", tmp_path, data_dirs=dirs, device_eio_limit=1), chunks=32)
    lost = [k for k in keys if dev.get(k) is None]
    assert e2.lookup(new + lost[:4]) == [LookupResult.HIT] * len(new) + [LookupResult.MISS] * 4
    for k, got in zip(new, e2.read(new)):
        assert np.array_equal(got, payload(k))


# ------------------------------------------------------------------------- several engines

def _engine_child(root: str, cmds, out) -> None:
    """A second engine (its own process, its own vLLM manager and primary) on the same
    tier store, driven by (command, chunk numbers) messages."""
    e = None
    try:
        e = Engine(tier_entry("kvstore", Path(root)))
        out.put(("ready",))
        while True:
            cmd, arg = cmds.get()
            if cmd == "stop":
                break
            ks = [key(i) for i in arg]
            if cmd == "store":
                e.store(ks)
                e.tier._sidx.flush()
                out.put(("stored",))
            elif cmd == "load":
                res = e.lookup(ks)
                hits = [k for k, r in zip(ks, res) if r is LookupResult.HIT]
                same = [bool(np.array_equal(g, payload(k))) for k, g in zip(hits, e.read(hits))] \
                    if hits else []
                out.put(([r is LookupResult.HIT for r in res], same))
    except BaseException as exc:       # the parent reads what went wrong
        out.put(("error", repr(exc)))
    finally:
        if e is not None:
            e.close()
        out.put(("closed",))


def test_two_engines_on_one_tier_store(engines, tmp_path):
    """Two engines (two processes, two vLLM managers) serve from one tier store at once:
    what one stores, the other finds (it is in LMDB only, not in that engine's table) and
    loads with identical bytes, both ways; a chunk both store is one entry."""
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    a = engines(tier_entry("kvstore", tmp_path))      # creates the store
    child = ctx.Process(target=_engine_child, args=(str(tmp_path), cmds, out), daemon=True)
    child.start()
    try:
        assert out.get(timeout=180) == ("ready",)
        mine = [key(i) for i in range(8)]
        a.store(mine)
        a.tier._sidx.flush()
        cmds.put(("load", list(range(8))))
        hit, same = out.get(timeout=120)
        assert hit == [True] * 8 and same == [True] * 8
        cmds.put(("store", list(range(100, 108)) + [0, 1]))
        assert out.get(timeout=120) == ("stored",)
        theirs = [key(100 + i) for i in range(8)]
        assert a.lookup(theirs) == [LookupResult.HIT] * 8
        for k, got in zip(theirs, a.read(theirs)):
            assert np.array_equal(got, payload(k))
        both = [key(300 + i) for i in range(4)]
        a.store(both)
        cmds.put(("store", list(range(300, 304))))
        assert out.get(timeout=120) == ("stored",)
        cmds.put(("stop", []))
        assert out.get(timeout=120) == ("closed",)
        child.join(30)
        assert child.exitcode == 0
        a.close()
        with DiskStore(str(tmp_path / "kvstore"), readonly=True) as st:
            entries = [x.key for x in st.index.iter_entries()]
            assert sorted(entries) == sorted(set(mine + theirs + both))    # one entry each
            assert st.index.check_consistency() == []
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)


# ------------------------------------------------------------------------- warmup

def test_warmup_copies_a_tier_store_and_refuses_prompts(engines, tmp_path):
    """`kvstore warmup --from-store SRC --all` seeds a new tier store (block keys are
    copied, not computed), which a tier then serves with identical bytes; prompts (and
    --model) are refused for a tier store, saying why: its keys are vLLM's offload
    chunk keys, which warmup cannot compute from tokens."""
    from click.testing import CliRunner

    from kvstore.cli import main
    keys = [key(i) for i in range(6)]
    (tmp_path / "a").mkdir()
    src = engines(tier_entry("kvstore", tmp_path / "a"))
    src.store(keys)
    src.close()
    a, b = str(tmp_path / "a" / "kvstore"), str(tmp_path / "b" / "kvstore")
    (tmp_path / "b").mkdir()
    r = CliRunner().invoke(main, ["warmup", b, "--from-store", a, "--all", "--json", "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["blocks_written"] == len(keys)
    e = engines(tier_entry("kvstore", tmp_path / "b"))
    assert e.lookup(keys) == [LookupResult.HIT] * len(keys)
    for k, got in zip(keys, e.read(keys)):
        assert np.array_equal(got, payload(k))
    e.close()
    prompts = tmp_path / "p.txt"
    prompts.write_text("[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]\n")
    for args in (["warmup", b, str(prompts), "--from-store", a, "--format", "tokens"],
                 ["warmup", b, str(prompts), "--model", "some/model", "--format", "tokens"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code != 0
        assert "secondary tier" in r.output and "--all" in r.output, r.output
