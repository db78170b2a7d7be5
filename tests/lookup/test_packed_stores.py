"""Eager stores are planned packed: the scheduler's walk makes no key per block.
The store job carries vLLM's block hashes and (group, blocks) runs; the worker's I/O
thread and the index thread make the keys. Real KeyTable, real vLLM scheduler, real store."""
from __future__ import annotations

import os
import random

import pytest

from connector_util import (conn_stats, drop_gpu_cache, keys_of, kv_harness, prompts,
                            record_dropped_counts, sched, settle, workers)
from kvstore._keytable import KeySet, KeyTable, make_keys
from kvstore.lookup.events import Committed
from kvstore.vllm.metadata import StoreJob, store_keys
from kvstore.vllm.sched_events import BlockOrigins
from kvstore.vllm.sched_store import StorePlan, split_runs

BS = 16


def _serving_index(tmp_path, pool: int):
    """A 64-slot store and its serving index (index thread running)."""
    from kvstore.store.disk import DiskStore
    from kvstore.format.layout import Layout
    from kvstore.lookup.table import ServingIndex
    layout = Layout(model="packed", dtype="float16", block_size=16, block_bytes=4096,
                    num_layers=1, num_kv_heads=1, head_dim=64, tp_size=1)
    st = DiskStore.create(str(tmp_path / "store"), layout, 64 * 8192)
    return st, ServingIndex(st, pool_target=pool)


def test_plan_new_packed_hands_back_vllms_hash_objects_and_claims_their_fingerprints():
    hashes = [os.urandom(32) for _ in range(300)]
    a, b = KeyTable(1000), KeyTable(1000)
    for t in (a, b):
        for i in range(0, 300, 4):              # every fourth block is stored already
            t.put(hashes[i] + (3).to_bytes(4, "big"), i, 1)
    sa, sb = KeySet(), KeySet()
    got, bids, idx = a.plan_new(hashes, 10, 250, list(range(1000, 1300)), sa, 100, 3, True)
    keys, bids2, idx2 = b.plan_new(hashes, 10, 250, list(range(1000, 1300)), sb, 100, 3)
    assert (bids, list(idx)) == (bids2, idx2) and len(idx) == 100
    assert idx.typecode == "I"      # no int object per planned block
    assert all(h is hashes[i] for h, i in zip(got, idx))     # vLLM's objects, no copy
    assert make_keys(got, [(3, len(got))]) == keys
    assert len(sa) == 100 and all(k in sa for k in keys)     # claimed as being stored
    # a second walk plans nothing of what the first one claimed
    again, _, idx3 = a.plan_new(hashes, 10, 250, list(range(1000, 1300)), sa, 1000, 3, True)
    assert not set(idx3) & set(idx)
    with pytest.raises(TypeError, match="KeySet"):
        a.plan_new(hashes, 0, 10, list(range(10)), set(), 10, 0, True)


def test_plan_new_reads_vllms_block_objects_like_ids_across_batches():
    """plan_new takes the request's KVCacheBlock objects (vLLM's, read ahead a batch at a
    time) or ints, mixed: the same plan, the block ids as ints, with a limit that stops
    mid-batch and with the walk starting and ending mid-batch."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    hashes = [os.urandom(32) for _ in range(300)]
    blocks = [KVCacheBlock(5000 + i) for i in range(300)]
    mixed = [b if i % 5 else b.block_id for i, b in enumerate(blocks)]
    for start, stop, limit in ((0, 300, 1000), (7, 291, 1000), (3, 250, 45), (40, 41, 10)):
        plans = []
        for ids in (mixed, blocks, [b.block_id for b in blocks]):
            t = KeyTable(1000)
            for i in range(0, 300, 4):
                t.put(hashes[i] + (0).to_bytes(4, "big"), i, 1)
            plans.append(t.plan_new(hashes, start, stop, ids, KeySet(), limit, 0, True)[1:])
        bids, idx = plans[0]
        assert plans[0] == plans[1] == plans[2], (start, stop, limit)
        assert bids == [5000 + i for i in idx] and all(type(x) is int for x in bids)
        want = [i for i in range(start, stop) if i % 4][:limit]
        assert list(idx) == want, (start, stop, limit)


def test_a_plan_cut_keeps_a_prefix_and_gives_back_the_keys_of_the_rest():
    hashes = [os.urandom(32) for _ in range(7)]
    made = [b"k" * 36, b"m" * 36]
    full_keys = made + make_keys(hashes[:3], [(0, 3)]) + make_keys(hashes[3:], [(2, 4)])
    for n in range(0, 10):
        p = StorePlan()
        p.keys += made
        p.bids += [1, 2]
        p.add_hashed(hashes[:2], [3, 4], 0)
        p.add_hashed(hashes[2:3], [5], 0)         # same group: one run
        p.add_hashed(hashes[3:], [6, 7, 8, 9], 2)
        assert p.runs == [(0, 3), (2, 4)] and p.count == 9
        p.origins = BlockOrigins(*([list(range(9)) for _ in range(6)]))
        dropped = p.cut(n)
        kept = p.keys + (make_keys(*p.hashed) if p.hashed else [])
        assert kept == full_keys[:n] and dropped == full_keys[n:], n
        assert p.bids + p.hashed_bids == list(range(1, 10))[:n]
        assert len(p.origins) == min(n, 9) and all(
            column == list(range(9))[:n] for column in (
                p.origins.tokens, p.origins.parents, p.origins.lora_ids,
                p.origins.lora_names, p.origins.extra_keys, p.origins.sessions))
    assert split_runs([(0, 3), (2, 4)], 5) == ([(0, 3), (2, 2)], [(2, 2)])
    assert split_runs([(0, 3)], 0) == ([], [(0, 3)])


def test_an_eager_store_job_carries_hashes_and_the_block_ids_vllm_made(tmp_path):
    """Through vLLM's real scheduler: a new request's store job has no keys, vLLM's own
    hash objects, one group run, and the block ids of vLLM's NewRequestData; what the
    workers write under the keys made from them is a hit after the commit."""
    p = prompts(71, 1, 6 * BS + 5)[0]
    with kv_harness(tmp_path / "store") as h:
        s = sched(h)
        seen = []
        orig = s.build_connector_meta

        walked = []     # vLLM block lists the connector asked for while planning
        km = s.stores._kv_cache_manager

        def spy(so):
            get_blocks = km.get_blocks
            km.get_blocks = lambda r: walked.append(r) or get_blocks(r)
            try:
                meta = orig(so)
            finally:
                km.get_blocks = get_blocks
            if meta.stores:
                seen.append((so, meta.stores, {r: list(q.block_hashes) for r, q in s.requests.items()}))
            return meta
        s.build_connector_meta = spy
        rid = h.add_request(p, max_tokens=1)
        h.step()
        assert rid not in walked    # a new request's ids come from its NewRequestData
        (so, (job,), hashes), = seen
        assert job.keys == [] and job.groups == [(0, 6)]
        assert all(a is b for a, b in zip(job.hashes, hashes[rid][:6]))
        new = {r.req_id: r for r in so.scheduled_new_reqs}
        assert job.block_ids == list(new[rid].block_ids[0][:6])
        assert store_keys(job) == keys_of(h, p)[:6]
        assert all(k in s.stores.storing for k in keys_of(h, p)[:6])
        settle(h)
        assert not s.stores.storing and not s.commits.inflight
        assert [s.store.lookup(k) is not None for k in keys_of(h, p)] == [True] * 6


def test_a_store_job_whose_keys_cannot_be_made_fails_alone(tmp_path):
    """A job whose group runs do not cover its hashes (malformed metadata): the worker
    writes none of it and reports every block failed; the scheduler gives the slots back
    and the next request's store is written as usual."""
    a, b = prompts(72, 2, 4 * BS + 3)
    with kv_harness(tmp_path / "store") as h:
        s = sched(h)
        orig = s.build_connector_meta
        broken = []

        def spy(so):
            meta = orig(so)
            for job in meta.stores:
                if not broken:      # the worker's copy only: the scheduler keeps its own
                    job.groups = [(0, len(job.hashes) - 1)]
                    broken.append(job.job_id)
            return meta
        s.build_connector_meta = spy
        h.run([a], max_tokens=1)
        settle(h)
        assert broken and [s.store.lookup(k) for k in keys_of(h, a)] == [None] * 4
        st = conn_stats(h)
        assert st.get("stored_blocks", 0) == 0 and st["store_dropped_blocks"] == 4
        h.run([b], max_tokens=1)
        settle(h)
        assert all(s.store.lookup(k) is not None for k in keys_of(h, b))
        assert conn_stats(h)["stored_blocks"] == 4
        assert not s.stores.storing and s.store.stats()["reserved_slots"] == len(s.index.pooled())
        assert all(w.slots.free == w.slots.total for w in workers(h))


def test_store_keys_of_a_job_with_made_keys_and_packed_blocks():
    hashes = [os.urandom(32) for _ in range(3)]
    job = StoreJob(1, [7, 8, 9, 10], [b"x" * 36], [1, 2, 3, 4], [1, 1, 1, 1], hashes, [(5, 3)])
    assert store_keys(job) == [b"x" * 36] + [h + (5).to_bytes(4, "big") for h in hashes]
    assert StoreJob(2, [1], [b"y" * 36], [1], [1]).hashed is None


@pytest.mark.parametrize("index_thread", [True, False])
def test_packed_stores_are_hits_after_a_restart_on_both_index_designs(tmp_path, monkeypatch,
                                                                      index_thread):
    """Stored (packed by the index thread, or by key on the step thread with the
    synchronous index the bench's baseline runs), committed, and after a restart every
    block loads and matches."""
    from kvstore.bench.sync_index import SyncServingIndex
    from kvstore.vllm.scheduler import KVStoreScheduler
    if not index_thread:
        monkeypatch.setattr(KVStoreScheduler, "index_class", SyncServingIndex)
    ps = prompts(73, 3, 5 * BS + 7)
    with kv_harness(tmp_path / "store") as h:
        ix = h.scheduler_connector.scheduler.index
        assert isinstance(ix, SyncServingIndex) != index_thread
        assert ix.packed_stores == index_thread
        h.run(ps, max_tokens=1)
        settle(h)
        assert conn_stats(h)["stored_blocks"] == 15
    with kv_harness(tmp_path / "store") as h:
        before = dict(h.stats)
        h.run(ps, max_tokens=1)
        settle(h)
        st = h.stats
        assert st["blocks_loaded"] - before["blocks_loaded"] == 15
        assert st["blocks_mismatched"] == 0, h.mismatches


@pytest.mark.parametrize("keys_back", [True, False])
def test_a_committed_event_gives_back_fingerprints_and_keys_only_when_asked(tmp_path, keys_back):
    """The index thread makes a packed job's keys, commits them, and hands back their
    fingerprints (the step thread clears its "being stored" set with them, hashing and
    freeing nothing); the keys and committed items come back only for KV events."""
    st, ix = _serving_index(tmp_path, 16)
    try:
        assert ix.wait_ready(10)
        hashes = [os.urandom(32) for _ in range(5)]
        storing = KeySet()
        got, _, _ = ix.plan_new(hashes, 0, 5, list(range(5)), storing, 10, 1, True)
        made = [b"z" * 36]
        storing.add(made[0])
        slots, gens = ix.take(made, (got, [(1, 5)]))
        assert len(slots) == 6 and len(storing) == 6
        ix.commit_blocks(made, slots, gens, {2}, tag="job", packed=(got, [(1, 5)]),
                         keys_back=keys_back)
        ix.flush()
        (ev,) = [e for e in ix.poll() if isinstance(e, Committed)]
        want = made + make_keys(hashes, [(1, 5)])
        assert ev.count == 5 and ev.failed == 1 and ev.tag == "job"
        assert ev.keys == (want if keys_back else [])
        assert [x[0] for x in ev.items] == ([k for i, k in enumerate(want) if i != 2]
                                            if keys_back else [])
        storing.discard_fingerprints(ev.fps)
        assert len(storing) == 0
        assert [ix.contains(k) for k in want] == [True, True, False, True, True, True]
        with pytest.raises(ValueError, match="whole fingerprints"):
            storing.discard_fingerprints(ev.fps[:-1])
    finally:
        ix.close()
        st.close()


@pytest.mark.parametrize("all_bad", [False, True])
def test_the_index_thread_releases_a_committed_jobs_keys_from_the_being_stored_set(
        tmp_path, all_bad):
    """With `release`, the index thread discards every key of the job (committed or
    failed) from the step thread's "being stored" set itself, after the good ones are in
    the table; the event says so and carries no fingerprints: the step thread does no
    per-block work for a commit. Keys of other jobs stay in the set."""
    st, ix = _serving_index(tmp_path, 16)
    try:
        assert ix.wait_ready(10)
        hashes = [os.urandom(32) for _ in range(5)]
        other = [os.urandom(32) for _ in range(2)]
        storing = KeySet()
        got, _, _ = ix.plan_new(hashes, 0, 5, list(range(5)), storing, 10, 0, True)
        ix.plan_new(other, 0, 2, [7, 8], storing, 10, 0, True)
        assert len(storing) == 7
        slots, gens = ix.take([], (got, [(0, 5)]))
        failed = set(range(5)) if all_bad else {1}
        ix.commit_blocks([], slots, gens, failed, tag="job", packed=(got, [(0, 5)]),
                         keys_back=False, release=storing)
        ix.flush()
        (ev,) = [e for e in ix.poll() if isinstance(e, Committed)]
        assert ev.released and ev.fps == b"" and ev.failed == len(failed)
        keys = make_keys(hashes, [(0, 5)])
        assert [k in storing for k in keys] == [False] * 5
        assert [k in storing for k in make_keys(other, [(0, 2)])] == [True, True]
        assert [ix.contains(k) for k in keys] == [i not in failed for i in range(5)]
    finally:
        ix.close()
        st.close()


def test_a_pool_that_runs_short_stores_a_prefix_and_releases_the_rest(tmp_path):
    """A slot pool of 3 for a 6-block prompt: the plan is cut inside its packed blocks;
    the first 3 are stored, the other 3 are dropped (counted) and leave the "being
    stored" set, so a later pass stores them."""
    p = prompts(74, 1, 6 * BS + 5)[0]
    with kv_harness(tmp_path / "store", extra={"slot_pool": 3}) as h:
        s = sched(h)
        jobs = []
        orig = s.build_connector_meta

        def spy(so):
            meta = orig(so)
            jobs.extend(meta.stores)
            return meta
        s.build_connector_meta = spy
        h.run([p], max_tokens=1)
        settle(h)
        (job,) = jobs
        assert job.keys == [] and job.groups == [(0, 3)] and len(job.block_ids) == 3
        assert [s.store.lookup(k) is not None for k in keys_of(h, p)] == [True] * 3 + [False] * 3
        assert conn_stats(h)["store_dropped_blocks"] == 3 and not s.stores.storing


def test_a_commit_whose_keys_cannot_be_made_reports_every_block_failed(tmp_path):
    """The index thread cannot make a job's keys (runs that do not cover its hashes): the
    step thread still gets the job's "committed" event (every block failed, the error),
    never waits for it, and the reservations go back."""
    st, ix = _serving_index(tmp_path, 8)
    try:
        assert ix.wait_ready(10)
        hashes = [os.urandom(32) for _ in range(4)]
        slots, gens = ix.take([], (hashes, [(0, 4)]))
        assert len(slots) == 4
        ix.commit_blocks([], slots, gens, (), tag="bad", packed=(hashes, [(0, 3)]),
                         keys_back=False)
        ix.flush()
        (ev,) = [e for e in ix.poll() if isinstance(e, Committed)]
        assert ev.tag == "bad" and ev.failed == 4 and ev.count == 0 and ev.error is not None
        assert ev.packed == (hashes, [(0, 3)]) and not ev.released   # for the step thread
        assert ix.pending_commits() == 0
        ix.flush()      # (a refill may follow the abort)
        # the job's slots were given back: what stays reserved is the pool, nothing else
        assert st.stats()["reserved_slots"] == len(ix.pooled())
        assert all(not ix.contains(h + b"\0\0\0\0") for h in hashes)
    finally:
        ix.close()
        st.close()


def test_count_new_counts_what_plan_new_would_plan_and_claims_nothing():
    hashes = [os.urandom(32) for _ in range(300)]
    t = KeyTable(1000)
    for i in range(0, 300, 3):                  # every third block is stored
        t.put(hashes[i] + (2).to_bytes(4, "big"), i, 1)
    storing = KeySet()
    for k in make_keys(hashes[1:40:2], [(2, 20)]):          # some being stored
        storing.add(k)
    before = len(storing)
    for a, b in ((0, 300), (5, 77), (290, 400), (-3, 10), (50, 50)):
        n = t.count_new(hashes, a, b, storing, 2)
        assert len(storing) == before           # only probed
        probe = KeySet()
        for k in make_keys(hashes[1:40:2], [(2, 20)]):
            probe.add(k)
        _, _, idx = t.plan_new(hashes, a, b, list(range(400)), probe, 10 ** 6, 2, True)
        assert n == len(idx), (a, b)
    assert t.count_new(hashes, 0, 300, KeySet(), 0) == 300      # another group: all new
    for bad in (None, set()):                   # a clear error, never a crash
        with pytest.raises(TypeError, match="skip"):
            t.count_new(hashes, 0, 10, bad, 2)


def test_a_short_pool_plans_only_what_it_can_take(tmp_path):
    """The walk stops where the pool's slots end: the plan is never cut (no key made for
    blocks then dropped), the rest is counted as dropped; a dry pool plans nothing, asks
    for a refill, and later stores go on."""
    ps = prompts(75, 2, 6 * BS + 5)
    with kv_harness(tmp_path / "store", extra={"slot_pool": 3}) as h:
        s = sched(h)
        cuts = []
        orig_cut = StorePlan.cut
        counts = record_dropped_counts(h)       # queued only when non-empty

        def cut(self, n):
            cuts.append(n)
            return orig_cut(self, n)
        StorePlan.cut = cut
        try:
            h.run(ps[:1], max_tokens=1)
            settle(h)
            assert cuts == [] and conn_stats(h)["store_dropped_blocks"] == 3
            assert [s.store.lookup(k) is not None for k in keys_of(h, ps[0])] == \
                [True] * 3 + [False] * 3
            held = [b"held-%032d" % i for i in range(3)]    # the pool taken: dry, as
            slots, gens = s.index.take(held)               # behind an index thread
            assert len(slots) == 3
            h.run(ps[1:], max_tokens=1)         # plans nothing, drops all 6 (counted)
            settle(h)
            assert cuts == [] and conn_stats(h)["store_dropped_blocks"] == 3 + 6
            assert counts and all(a < b for a, b in counts), counts
            assert not s.stores.storing
            s.index.flush()
            assert len(s.index.pooled()) == 3   # refilled on the dry pool's request
            s.index.abort(list(zip(held, slots, gens)))
            drop_gpu_cache(h)
            h.run(ps[1:], max_tokens=1)         # stored now (a prefix of 3)
            settle(h)
            assert [s.store.lookup(k) is not None for k in keys_of(h, ps[1])] == \
                [True] * 3 + [False] * 3
        finally:
            StorePlan.cut = orig_cut


def test_discard_fingerprints_across_batches_removes_exactly_the_keys_given():
    """A committed job's fingerprints leave the "being stored" set in batches of 32
    (fetched ahead, then discarded): over several batches, with keys absent from the set
    and keys whose probe runs collide, the set ends as a Python set would."""
    from kvstore._keytable import fingerprints
    rng = random.Random(5)
    keys = [os.urandom(36) for _ in range(3000)]
    ks, model = KeySet(16), set()
    for k in keys:
        ks.add(k)
        model.add(k)
    for n in (1, 31, 32, 33, 100, 517):
        gone = rng.sample(keys, n) + [os.urandom(36) for _ in range(3)]    # 3 never added
        ks.discard_fingerprints(fingerprints(gone))
        model.difference_update(gone)
        assert len(ks) == len(model), n
        assert all(k in ks for k in model) and not any(k in ks for k in gone), n
        keys = list(model)
