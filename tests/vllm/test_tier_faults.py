"""The secondary tier's failure paths, through vLLM 0.33's real `TieringOffloadingManager`.

vLLM's contract for a `SecondaryTierManager`: each submitted job is reported exactly once
by `get_finished_jobs` (success or failure); a key that failed to load answers MISS to
`lookup` from then on (or the manager promotes it again at every step); `drain_jobs` and
`shutdown` return. Faults are injected into kvstore's own code only (a read that raises,
a ring that closed itself, a commit round that fails, a read that does not return), the
rest is real: vLLM's manager and primary tier, LMDB, io_uring, files. Each test also
checks the bytes a later load brings back (see tests/vllm/test_tier.py for the rig).
"""
from __future__ import annotations

import errno
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvstore.errors import KVStoreError
from kvstore.io import rings as rank_mod
from kvstore.io.rank import RankIO
from kvstore.lookup.table import ServingIndex
from kvstore.store.disk import DiskStore
from kvstore.vllm.tier import KVStoreTier

from test_tier import (ROW, SLOT, STEP, Engine, engines, key, make_config,  # noqa: F401
                       payload, tier_entry)

HIT, MISS = LookupResult.HIT, LookupResult.MISS
pytestmark = pytest.mark.timeout(180)


class Jobs:
    """Observes the calls vLLM's manager makes to the tier (the tier's own code runs):
    every job submitted and every result it took."""

    def __init__(self, tier: KVStoreTier):
        self.submitted: dict[int, TransferJob] = {}
        self.results: list = []
        real_store, real_load = tier.submit_store, tier.submit_load
        real_finished = tier.get_finished_jobs

        def store(job):
            self.submitted[job.job_id] = job
            real_store(job)

        def load(job):
            self.submitted[job.job_id] = job
            real_load(job)

        def finished():
            out = list(real_finished())
            self.results.extend(out)
            return out
        tier.submit_store, tier.submit_load, tier.get_finished_jobs = store, load, finished

    def loads(self) -> list[TransferJob]:
        return [j for j in self.submitted.values() if j.is_promotion]

    def outcome(self, job_id: int) -> bool:
        (res,) = [r for r in self.results if r.job_id == job_id]
        return res.success

    def check_each_once(self) -> None:
        ids = [r.job_id for r in self.results]
        assert len(ids) == len(set(ids)), f"a job was reported twice: {sorted(ids)}"
        assert set(ids) == set(self.submitted), (
            f"jobs never reported: {sorted(set(self.submitted) - set(ids))}")


def fail_first(monkeypatch, owner, name: str, exc: Exception, times: int = 1) -> list:
    """`owner.name` raises `exc` on its first `times` calls, then runs as it is."""
    real = getattr(owner, name)
    left = [times]

    def faulty(*a, **kw):
        if left[0] > 0:
            left[0] -= 1
            raise exc
        return real(*a, **kw)
    monkeypatch.setattr(owner, name, faulty)
    return left


def gate_reads(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Every `RankIO.read_at` waits for `gate` (a device that stopped answering) before
    it reads; `entered` is set once one waits."""
    gate, entered = threading.Event(), threading.Event()
    real = RankIO.read_at

    def stuck(self, *a, **kw):
        entered.set()
        gate.wait(60)
        return real(self, *a, **kw)
    monkeypatch.setattr(RankIO, "read_at", stuck)
    return gate, entered


def stored_and_evicted(e: Engine, keys: list[bytes], base: int = 10_000) -> None:
    """keys are in the tier only (stored, then pushed out of the primary)."""
    e.store(keys)
    e.evict_from_primary(keys, base=base)


def submit_promotions(e: Engine, keys: list[bytes]) -> None:
    """The scheduler looks keys up once: promotions are submitted, not waited for."""
    ctx = e.ctx()
    with e.m.lock:
        for k in keys:
            e.m.lookup(k, ctx)
        e.m.on_schedule_end(STEP)


def same_bytes(e: Engine, keys: list[bytes]) -> None:
    assert e.lookup(keys, timeout=20) == [HIT] * len(keys)
    for k, got in zip(keys, e.read(keys)):
        assert np.array_equal(got, payload(k))


def tier_misses(tier: KVStoreTier, keys: list[bytes]) -> list[bool]:
    ctx = ReqContext(req_id="probe")
    return [tier.lookup(k, ctx) is MISS for k in keys]


# ------------------------------------------------------------------------- loads that raise

def test_a_load_that_raises_reports_once_and_its_keys_miss(engines, tmp_path, monkeypatch):
    """The read of a promotion raises (not a checksum failure): the job fails once, its
    keys answer MISS from then on (vLLM does not promote them again), and the tier goes
    on serving the others with the right bytes."""
    e = engines(tier_entry("kvstore", tmp_path))
    jobs = Jobs(e.tier)
    bad, good = [key(i) for i in range(4)], [key(100 + i) for i in range(4)]
    stored_and_evicted(e, bad + good)
    left = fail_first(monkeypatch, RankIO, "read_at", OSError(errno.EIO, "injected"),
                      times=1_000_000)
    assert e.lookup(bad, timeout=20) == [MISS] * 4
    left[0] = 0                                         # reads work again
    assert all(tier_misses(e.tier, bad))
    assert e.lookup(bad, timeout=20) == [MISS] * 4          # and stays so: no retry
    assert [jobs.outcome(j.job_id) for j in jobs.loads()] == [False] * len(jobs.loads())
    n_loads = len(jobs.loads())
    same_bytes(e, good)
    assert len(jobs.loads()) > n_loads
    e.settle()
    jobs.check_each_once()


def test_a_staged_load_that_raises_drops_its_keys(tmp_path, monkeypatch):
    """The same through kvstore's staging memory (`RankIO.read_blocks`: primary memory
    O_DIRECT cannot use), with the tier driven as vLLM drives it."""
    spec = TieringOffloadingSpec(make_config({"cpu_bytes_to_use": 16 * ROW}))
    backing = np.zeros(8 * ROW + 8192, dtype=np.uint8)
    base = backing.__array_interface__["data"][0]
    start = (-base) % 4096 + 512
    prim = backing[start:start + 8 * ROW].reshape(8, ROW).view(np.int8)
    tier = KVStoreTier(spec, memoryview(prim), "KVStoreTier", path=str(tmp_path / "kv"),
                       capacity=32 * SLOT)
    try:
        assert tier.data_path == "staging"
        flat = prim.view(np.uint8).reshape(-1)
        keys = [key(i) for i in range(4)]
        for i, k in enumerate(keys):
            flat[i * ROW:(i + 1) * ROW] = payload(k)
        ctx = ReqContext(req_id="r")
        tier.submit_store(TransferJob(1, keys, np.arange(4), False, ctx))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, True)]
        fail_first(monkeypatch, RankIO, "read_blocks", OSError(errno.EIO, "injected"))
        tier.submit_load(TransferJob(2, keys[:2], np.array([6, 7]), True, ctx))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, False)]
        assert tier_misses(tier, keys) == [True, True, False, False]
        flat[:] = 0
        tier.submit_load(TransferJob(3, keys[2:], np.array([6, 7]), True, ctx))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(3, True)]
        for c, k in zip((6, 7), keys[2:]):
            assert np.array_equal(flat[c * ROW:(c + 1) * ROW], payload(k))
    finally:
        tier.shutdown()


# ------------------------------------------------------------------------- rings that closed

@pytest.mark.parametrize("which", ["load", "store"])
def test_a_ring_that_closed_itself_is_rebuilt(engines, tmp_path, which):
    """After an io_uring_enter error the ring closes itself; the next job of that
    thread rebuilds it and moves the right bytes (no job fails for it)."""
    e = engines(tier_entry("kvstore", tmp_path))
    jobs = Jobs(e.tier)
    keys = [key(i) for i in range(4)]
    if which == "store":
        e.tier._rio_store.ring.close()
    stored_and_evicted(e, keys)
    if which == "load":
        e.tier._rio_load.ring.close()
    same_bytes(e, keys)
    assert all(r.success for r in jobs.results)
    rio = e.tier._rio_load if which == "load" else e.tier._rio_store
    assert not rio.ring.closed
    e.settle()
    jobs.check_each_once()


def test_a_ring_that_cannot_be_rebuilt_fails_jobs_and_the_tier_goes_on(
        engines, tmp_path, monkeypatch):
    """The rebuild itself fails (no memory for a new ring): the promotion fails once and
    its keys miss; the tier keeps answering, and once a ring can be made again it
    serves the right bytes."""
    e = engines(tier_entry("kvstore", tmp_path))
    jobs = Jobs(e.tier)
    lost, later = [key(i) for i in range(3)], [key(200 + i) for i in range(3)]
    stored_and_evicted(e, lost + later)
    left = fail_first(monkeypatch, rank_mod, "Ring", OSError(errno.ENOMEM, "injected"),
                      times=1_000_000)
    e.tier._rio_load.ring.close()
    assert e.lookup(lost, timeout=20) == [MISS] * 3
    assert all(tier_misses(e.tier, lost))
    left[0] = 0                                  # rings can be made again
    same_bytes(e, later)
    e.settle()
    jobs.check_each_once()


# ------------------------------------------------------------------------- the sync thread

def test_a_failed_commit_round_fails_its_jobs_once_and_the_tier_goes_on(
        engines, tmp_path, monkeypatch):
    """The sync thread's round fails (here: handing the commit to the index thread):
    the batch's store jobs fail, once; its reserved slots go back; the thread goes on,
    later stores succeed and load back the right bytes; drain_jobs returns."""
    e = engines(tier_entry("kvstore", tmp_path))
    jobs = Jobs(e.tier)
    lost = [key(i) for i in range(4)]
    fail_first(monkeypatch, ServingIndex, "commit_blocks", KVStoreError("injected"))
    e.store(lost, settle=False)
    e.settle(timeout=20)
    assert [r.success for r in jobs.results] == [False]
    assert all(tier_misses(e.tier, lost))
    with e.m.lock:
        e.tier.drain_jobs()
    later = [key(300 + i) for i in range(4)]
    stored_and_evicted(e, later)
    same_bytes(e, later)
    # the failed chunks can be stored again (nothing of them is left "being stored")
    assert e.lookup(lost, timeout=20) == [MISS] * 4
    stored_and_evicted(e, lost, base=20_000)
    same_bytes(e, lost)
    e.settle()
    jobs.check_each_once()
    e.close()
    with DiskStore(str(tmp_path / "kvstore"), readonly=True) as st:
        assert st.index.stats()["reserved_slots"] == 0      # the failed batch's went back
        assert st.index.check_consistency() == []


# ------------------------------------------------------------------------- stuck devices

def test_drain_jobs_is_bounded_and_leaves_a_stuck_load_unreported(
        engines, tmp_path, monkeypatch):
    """A load whose read does not return: drain_jobs gives up after DRAIN_TIMEOUT_S
    without reporting it (it would still write into its primary chunk); once the read
    returns, the load is reported once, with the right bytes."""
    monkeypatch.setattr(KVStoreTier, "DRAIN_TIMEOUT_S", 0.5)
    e = engines(tier_entry("kvstore", tmp_path))
    jobs = Jobs(e.tier)
    keys = [key(i) for i in range(3)]
    stored_and_evicted(e, keys)
    gate, entered = gate_reads(monkeypatch)
    try:
        submit_promotions(e, keys)
        assert entered.wait(20)
        drain = threading.Thread(target=e.tier.drain_jobs, daemon=True)
        t0 = time.monotonic()
        drain.start()
        drain.join(10)
        assert not drain.is_alive(), "drain_jobs did not return"
        assert time.monotonic() - t0 < 5
        assert not e.tier._results and e.tier._outstanding == len(jobs.loads()) > 0
    finally:
        gate.set()
    same_bytes(e, keys)
    e.settle()
    assert all(jobs.outcome(j.job_id) for j in jobs.loads())
    jobs.check_each_once()


def test_shutdown_with_a_stuck_read_keeps_rings_store_and_memory(tmp_path, monkeypatch):
    """A read that does not return at shutdown: after SHUTDOWN_JOIN_S the tier leaves
    its rings, store and primary memory references alone (vLLM keeps the mapping while
    it is referenced) instead of freeing them under the I/O; the read then lands the
    right bytes, and a second shutdown closes everything."""
    monkeypatch.setattr(KVStoreTier, "SHUTDOWN_JOIN_S", 0.5)
    e = Engine(tier_entry("kvstore", tmp_path))
    tier = e.tier
    try:
        jobs = Jobs(tier)
        keys = [key(i) for i in range(3)]
        stored_and_evicted(e, keys)
        gate, entered = gate_reads(monkeypatch)
        # (the read is let go after 8 s whatever happens: a shutdown that waits for it
        # returns then, and fails the timing below)
        timer = threading.Timer(8.0, gate.set)
        timer.start()
        submit_promotions(e, keys)
        assert entered.wait(20)
        t0 = time.monotonic()
        e.close()
        assert time.monotonic() - t0 < 5, "shutdown waited for the stuck read"
        assert tier._rio_load is not None and not tier._rio_load.closed
        assert tier._store is not None and not tier._store.closed
        assert tier._flat is not None and tier._prim is not None
        gate.set()
        timer.cancel()
        for t in tier._threads:
            t.join(20)
            assert not t.is_alive()
        (load,) = jobs.loads()
        for k, c in zip(load.keys, load.chunk_ids.tolist()):
            assert np.array_equal(tier._prim[c * ROW:(c + 1) * ROW], payload(k))
    finally:
        gate.set()
        tier.shutdown()
    assert tier._rio_load is None and tier._flat is None and tier._store.closed


def test_shutdown_with_a_busy_index_thread_keeps_the_store_open(tmp_path, monkeypatch):
    """The index thread does not finish its last operations within its close wait: LMDB
    stays open under it (closing it would crash the process), the rest closes; once
    the thread ends, the store is whole."""
    monkeypatch.setattr(ServingIndex, "CLOSE_JOIN_S", 0.5)
    e = Engine(tier_entry("kvstore", tmp_path))
    tier = e.tier
    keys = [key(i) for i in range(2)]
    e.store(keys)
    sidx = tier._sidx
    gate = threading.Event()
    real_drop = sidx._writes.drop

    def stuck_drop(ks):
        gate.wait(60)
        real_drop(ks)
    sidx._writes.drop = stuck_drop
    try:
        sidx.drop([keys[0]])                # the index thread is busy applying it
        t0 = time.monotonic()
        e.close()
        assert time.monotonic() - t0 < 10
        assert not tier._store.closed
        assert tier._rio_load is None and tier._flat is None
    finally:
        gate.set()
    sidx._thread.join(20)
    assert not sidx._thread.is_alive()
    tier._store.close()
    with DiskStore(str(tmp_path / "kvstore"), readonly=True) as st:
        assert st.index.lookup(keys[0]) is None and st.index.lookup(keys[1]) is not None
        assert st.index.check_consistency() == []


# ------------------------------------------------------------------------- shared stores

def _attached_engine(path: str, cmds, out) -> None:
    """Another engine process attached to the store (its lease); it holds it until told."""
    st = DiskStore(path)
    try:
        out.put("ready")
        cmds.get(timeout=120)
    finally:
        st.close()
        out.put("closed")


def test_a_dropped_key_is_not_readmitted_from_lmdb_before_the_drop_is_applied(
        engines, tmp_path, monkeypatch):
    """In a store other engines are attached to, a lookup that misses in the table reads
    LMDB; a key whose load failed left the table, but LMDB keeps it until the index
    thread applies the drop: it must not come back from there meanwhile (vLLM would
    promote it again)."""
    e = engines(tier_entry("kvstore", tmp_path))
    jobs = Jobs(e.tier)
    keys = [key(i) for i in range(3)]
    stored_and_evicted(e, keys)
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_attached_engine, args=(str(tmp_path / "kvstore"), cmds, out),
                        daemon=True)
    child.start()
    sidx = e.tier._sidx
    applying = threading.Event()
    real_drop = sidx._writes.drop

    def slow_drop(ks):        # the index thread applies the drop only when let go
        applying.wait(60)
        real_drop(ks)
    sidx._writes.drop = slow_drop
    try:
        assert out.get(timeout=120) == "ready"
        assert sidx._shared_now()
        left = fail_first(monkeypatch, RankIO, "read_at", OSError(errno.EIO, "injected"),
                          times=1_000_000)
        assert e.lookup(keys, timeout=20) == [MISS] * 3
        left[0] = 0
        assert all(tier_misses(e.tier, keys))       # LMDB still has them: not re-admitted
        assert e.lookup(keys, timeout=20) == [MISS] * 3
        applying.set()
        sidx.flush()
        assert all(tier_misses(e.tier, keys))
        # stored again, they are hits again, with the right bytes
        stored_and_evicted(e, keys, base=20_000)
        same_bytes(e, keys)
        e.settle()
        jobs.check_each_once()
        cmds.put("stop")
        assert out.get(timeout=60) == "closed"
        child.join(30)
        assert child.exitcode == 0
    finally:
        applying.set()
        if child.is_alive():
            child.kill()
            child.join(10)
