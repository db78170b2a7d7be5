"""The scheduler's serving index (kvstore.lookup.table) and its lookup table (kvstore._keytable),
over real LMDB stores in tmp_path: the table follows LMDB, pinned slots are never handed
out, commits become hits only once durable, the pool is reclaimed after a crash."""
from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest

from kvstore._keytable import KeyTable
from kvstore.store.disk import DiskStore, SlotRef
from kvstore.format.layout import Layout
from kvstore.lookup.events import Committed, Counted, Evicted, Failed
from kvstore.bench.sync_index import SyncServingIndex
from kvstore.lookup.lookups import TableLookups
from kvstore.lookup.table import ServingIndex

BB = 4096
LAYOUT = Layout(model="serving", dtype="float16", block_size=16, block_bytes=BB, num_layers=1,
                num_kv_heads=1, head_dim=64, tp_size=1)


def k(i: int) -> bytes:
    return b"key-%06d" % i + b"\x00" * 26


def make(tmp_path, slots: int) -> DiskStore:
    return DiskStore.create(str(tmp_path / "store"), LAYOUT, slots * (BB + 4096))


def store_keys(ix: ServingIndex, keys: list[bytes]) -> list[SlotRef]:
    """Store keys as the scheduler does, a pool's worth per step (the refill in between)."""
    out = []
    for i in range(0, len(keys), ix.pool_target):
        part = keys[i:i + ix.pool_target]
        slots, gens = ix.take(part)
        assert len(slots) == len(part)
        items = list(zip(part, slots, gens))
        ix.commit(items)
        ix.flush()
        out += [SlotRef(*x) for x in items]
    return out


def hits(ix: ServingIndex, keys: list[bytes]) -> list[SlotRef]:
    slots, gens = ix.lookup_pin(keys)
    return [SlotRef(*x) for x in zip(keys, slots, gens)]


def test_keytable_matches_a_dict_under_random_operations():
    rng = random.Random(5)
    model: dict[bytes, tuple[int, int]] = {}
    t = KeyTable(1000)
    for step in range(100_000):
        key = b"x%d" % rng.randrange(1500)
        if rng.random() < 0.5 and (key in model or len(model) < 1000):
            v = (rng.randrange(1 << 32), rng.randrange(1 << 64))
            t.put(key, *v)
            model[key] = v
        else:
            assert t.remove(key) == (key in model)
            model.pop(key, None)
        if step % 5000 == 0:
            assert len(t) == len(model)
    assert all(t.get(x) == v for x, v in model.items())
    keys = list(model)
    slots, gens = t.prefix(keys + [b"absent"] + keys)
    assert slots == [model[x][0] for x in keys] and gens == [model[x][1] for x in keys]
    with pytest.raises(OverflowError, match="full"):
        full = KeyTable(2)
        for i in range(3):
            full.put(b"%d" % i, i, i)



def test_keytable_pins_counts_and_the_walk_that_pins():
    """Pins live in the table (a count per slot): a pinned walk pins its hit, claims never
    take a pinned slot, unpinning what is not pinned is a no-op, slots are range-checked."""
    t = KeyTable(64)
    hashes = [b"h%031d" % i for i in range(40)]
    for i, h in enumerate(hashes[:30]):
        t.put(h + b"\x00\x00\x00\x00", i, 100 + i)
    keys, slots, gens = t.prefix_of(hashes, 0, 40, 0, True)    # batches of 32 + a miss
    assert slots == list(range(30)) and gens == [100 + i for i in range(30)]
    assert keys == [h + b"\x00\x00\x00\x00" for h in hashes[:30]]
    assert t.pinned_slots == 30
    t.pin([3, 3, 31])
    assert t.pin_count(3) == 3 and t.pin_count(31) == 1 and t.pinned_slots == 31
    taken, removed = t.claim([(keys[3], 3), (keys[4], 4), (None, 31), (None, 40)])
    assert taken == {40} and removed == [] and len(t) == 30
    t.unpin(slots)
    t.unpin([5, 63])                   # not pinned (any more): ignored
    assert t.pins_dict() == {3: 2, 31: 1}
    taken, removed = t.claim([(keys[4], 4), (keys[3], 3)])
    assert taken == {4} and removed == [keys[4], 4, 104] and keys[4] not in t
    assert t.prefix_of(hashes, 0, 40, 0, False)[1] == [0, 1, 2, 3]   # 4 left: the walk stops
    assert t.pinned_slots == 2
    with pytest.raises(ValueError, match="outside"):
        t.pin([64])
    assert t.pinned_slots == 2

def test_a_pinned_walk_that_raises_leaves_no_pin():
    """A lookup that raises is a miss for the scheduler (it gets no slots to unpin), so the
    walk must not keep the pins it took before the error: not for a hash that cannot be a
    key two batches on (the pipelined walk hashes a batch ahead), not for an out-of-range
    slot; nor a `pin` list with a bad slot at its end."""
    t = KeyTable(128)
    hashes = [b"h%031d" % i for i in range(70)]
    for i, h in enumerate(hashes):
        t.put(h + b"\x00\x00\x00\x00", i, 7)
    with pytest.raises(TypeError):
        t.prefix_of(hashes[:64] + [123], 0, 65, 0, True)    # batches 0, 1 hit; 2 is bad
    assert t.pinned_slots == 0 and t.pins_dict() == {}
    small = KeyTable(8)
    small.put(b"a" * 32 + b"\x00" * 4, 1, 1)
    small.put(b"b" * 32 + b"\x00" * 4, 50, 1)                # a slot the table cannot pin
    with pytest.raises(ValueError, match="outside"):
        small.prefix_of([b"a" * 32, b"b" * 32], 0, 2, 0, True)
    assert small.pinned_slots == 0
    with pytest.raises(ValueError, match="outside"):
        t.pin([1, 2, 2, 128])
    assert t.pinned_slots == 0 and t.pins_dict() == {}


def test_a_miss_ends_the_walk_before_a_later_bad_hash():
    """The pipelined walk hashes the next batch before probing this one; a miss in this
    batch still ends the walk there, as it did unpipelined: a bad hash after the miss
    is never looked at."""
    t = KeyTable(128)
    hashes = [b"h%031d" % i for i in range(40)]
    for i, h in enumerate(hashes[:10]):
        t.put(h + b"\x00\x00\x00\x00", i, 7)
    walk = hashes[:36] + [None] + hashes[37:]               # the miss at 10, junk at 36
    keys, slots, gens = t.prefix_of(walk, 0, 40, 0, True)
    assert slots == list(range(10)) and t.pinned_slots == 10
    t.unpin(slots)
    for i, h in enumerate(hashes[:32]):
        t.put(h + b"\x00\x00\x00\x00", i, 7)
    with pytest.raises(TypeError):                          # reached (no miss before): raises
        t.prefix_of(walk, 0, 40, 0, True)
    assert t.pinned_slots == 0


def test_a_walk_whose_first_block_misses_is_answered_by_one_probe():
    """A prompt never seen (its first block not in the table) is a miss without the
    batched walk (`first_misses` counts these); a walk whose first block hits, and one
    whose first block is not a bytes hash, go on as before."""
    hashes = [b"m%031d" % i for i in range(100)]
    t = KeyTable(200)
    t.put_many([h + b"\x00\x00\x00\x00" for h in hashes[:40]], list(range(40)), [1] * 40)
    _, slots, _ = t.prefix_of(hashes, 0, 100, 0, False, True)
    assert list(slots) == list(range(40)) and t.first_misses == 0
    for packed in (True, False):
        keys, slots, gens = t.prefix_of(hashes, 40, 100, 0, True, packed)
        assert len(slots) == len(gens) == 0 and t.pinned_slots == 0
    assert t.first_misses == 2
    assert len(t.prefix_of(hashes, 0, 100, 1)[1]) == 0 and t.first_misses == 3  # group 1
    with pytest.raises(TypeError, match="bytes"):
        t.prefix_of([7] + hashes, 0, 10)
    assert t.first_misses == 3


def test_a_walk_that_follows_slot_runs_finds_what_the_table_holds():
    """A prefix stored in consecutive slots is walked by following the run (each block
    checked against the next slot's record, no bucket probed), and the records follow
    every change of the table: a key moved to another slot, removed, claimed, a slot
    taken over by another key, a device's entries removed, `clear`. Random operations
    against a dict; every walk (packed and as lists, pinned or not) is the model's."""
    rng = random.Random(11)
    n = 300
    hashes = [b"r%031d" % i for i in range(n)]
    key = [h + b"\x00\x00\x00\x00" for h in hashes]
    t = KeyTable(2 * n)
    model: dict[int, tuple[int, int]] = {}      # block -> (slot, generation)
    gen = 0

    def put(i, slot):
        nonlocal gen
        gen += 1
        t.put(key[i], slot, gen)
        model[i] = (slot, gen)

    def check(start, stop):
        want = []
        for i in range(start, min(stop, n)):
            if i not in model:
                break
            want.append(model[i])
        pin = rng.random() < 0.5
        _, sa, ga = t.prefix_of(hashes, start, stop, 0, pin, True)
        keys, sl, gl = t.prefix_of(hashes, start, stop, 0, False)
        assert list(zip(sa, ga)) == want == list(zip(sl, gl)), (start, stop)
        assert keys == key[start:start + len(want)]
        if pin:
            assert t.pinned_slots == len(set(sa))
            t.unpin(sa)
        assert t.pinned_slots == 0

    for i in range(n):                          # one run: block i in slot i
        put(i, i)
    before = t.run_follows
    check(0, n)
    assert t.run_follows - before >= n - 2 * 32  # the first batches probe, then it follows
    for rnd in range(400):
        op = rng.random()
        i = rng.randrange(n)
        if op < 0.25:                           # the key moves to another slot
            put(i, rng.randrange(2 * n))
        elif op < 0.4:
            if t.remove(key[i]):
                del model[i]
        elif op < 0.5 and i in model:           # an eviction's claim takes its slot
            slot = model[i][0]
            taken, removed = t.claim([(key[i], slot)])
            assert taken == {slot} and removed[0::3] == [key[i]]
            del model[i]
        elif op < 0.6 and i in model:           # another key takes the slot over
            j = rng.randrange(n)
            if j != i and j in model:
                put(j, model[i][0])
        elif op < 0.85:                         # a new run of consecutive slots
            base = rng.randrange(n)
            for m in range(i, min(n, i + rng.randrange(1, 80))):
                put(m, base + m - i)
        elif op < 0.9:
            dev = rng.randrange(4)
            t.remove_device(4, dev)
            model = {b: v for b, v in model.items() if v[0] % 4 != dev}
        elif op < 0.92:
            t.clear()
            model.clear()
        assert len(t) == len(model)
        check(rng.randrange(0, 40), rng.randrange(1, n + 20))
    assert t.nbytes >= 2 * n * 16               # the slot records are counted
    assert t.run_follows > before + n


@pytest.mark.parametrize("path", ["table", "lmdb", "sync"])
def test_plans_over_vllm_block_lists_give_block_ids_on_every_path(tmp_path, path):
    """The scheduler hands `plan_new` vLLM's KVCacheBlock list; every path returns block
    ids (ints), also the LMDB walk used while the table is built and by the synchronous
    index (the bench's baseline)."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    st = make(tmp_path, 32)
    ix = SyncServingIndex(st) if path == "sync" else ServingIndex(st, pool_target=4)
    try:
        if path != "sync":
            assert ix.wait_ready(10)
            ix._lookups.ready = path == "table"     # "lmdb": the walk before the table is ready
        hashes = [b"p%031d" % i for i in range(6)]
        blocks = [KVCacheBlock(block_id=100 + i) for i in range(6)]
        keys, bids, idx = ix.plan_new(hashes, 1, 5, blocks, set(), 10)
        assert bids == [101, 102, 103, 104] and all(type(b) is int for b in bids)
        assert idx == [1, 2, 3, 4] and len(keys) == 4
        assert ix.plan_new(hashes, 0, 6, list(range(6)), set(), 2)[1] == [0, 1]   # ints too
    finally:
        if path != "sync":
            ix._lookups.ready = True
        ix.close()
        st.close()


def test_commit_is_a_hit_only_once_applied_and_survives_reopen(tmp_path):
    st = make(tmp_path, 64)
    ix = ServingIndex(st, pool_target=8)
    assert ix.wait_ready(10)
    keys = [k(i) for i in range(5)]
    slots, gens = ix.take(keys)
    assert len(set(slots)) == 5
    refs = [SlotRef(*x) for x in zip(keys, slots, gens)]
    assert ix.lookup_pin(keys) == ([], [])    # reserved, not committed: no hit
    ix.commit(list(zip(keys, slots, gens)), tag="job")
    ix.flush()
    evs = [e for e in ix.poll() if isinstance(e, Committed)]
    assert evs and evs[0].tag == "job" and evs[0].failed == 0
    assert evs[0].items == list(zip(keys, slots, gens))
    hit = hits(ix, keys + [k(99)] + keys)
    assert hit == refs and ix.pinned_slots == 5
    ix.unpin(r.slot for r in hit)
    assert st.index.fsyncs_by_thread          # the commit was fsynced, on the index thread
    import threading
    assert threading.get_ident() not in st.index.fsyncs_by_thread
    ix.close()
    assert st.stats()["reserved_slots"] == 0  # the pool was given back
    st.close()
    with DiskStore(str(tmp_path / "store")) as st2:
        assert [st2.lookup(x).slot for x in keys] == [r.slot for r in refs]
        assert st2.index.check_consistency() == []


def test_pinned_slots_are_never_evicted_into_the_pool(tmp_path):
    st = make(tmp_path, 16)
    ix = ServingIndex(st, pool_target=4)
    ix.wait_ready(10)
    a = store_keys(ix, [k(i) for i in range(4)])
    b = store_keys(ix, [k(i) for i in range(4, 8)])
    c = store_keys(ix, [k(i) for i in range(8, 12)])       # full: 12 used + 4 in the pool
    assert st.stats()["free_slots"] == 0
    pinned = hits(ix, [r.key for r in a])                  # A is the LRU, but pinned
    assert len(pinned) == 4
    store_keys(ix, [k(i) for i in range(12, 16)])          # the refill must evict B, not A
    ix.flush()
    assert not {s for s, _ in ix.pooled()} & {r.slot for r in a}
    assert all(ix.contains(r.key) for r in a + c)
    assert not any(ix.contains(r.key) for r in b)
    assert all(st.lookup(r.key) is None for r in b)        # LMDB agrees with the table
    evs = [e for e in ix.poll() if isinstance(e, Evicted)]
    assert sorted(x for e in evs for x in e.keys) == sorted(r.key for r in b)
    assert [e.count for e in evs] == [len(e.keys) for e in evs]
    ix.unpin(r.slot for r in pinned)
    ix.close()
    assert st.index.check_consistency() == []
    st.close()


def test_evicted_events_carry_only_a_count_when_no_kv_events_need_the_keys(tmp_path):
    """Without KV events the step thread needs only how many entries were evicted: the
    index thread keeps (and frees) the keys, the event carries their count."""
    st = make(tmp_path, 8)
    ix = ServingIndex(st, pool_target=4, evicted_keys=False)
    ix.wait_ready(10)
    a = store_keys(ix, [k(i) for i in range(4)])
    store_keys(ix, [k(i) for i in range(4, 8)])         # full: the refill evicts A
    ix.flush()
    evs = [e for e in ix.poll() if isinstance(e, Evicted)]
    assert sum(e.count for e in evs) == 4 and all(e.keys == [] for e in evs)
    assert not any(ix.contains(r.key) for r in a)
    ix.close()
    st.close()


def test_touch_moves_a_prefix_out_of_eviction_order(tmp_path):
    st = make(tmp_path, 16)
    ix = ServingIndex(st, pool_target=4)
    ix.wait_ready(10)
    a = store_keys(ix, [k(i) for i in range(6)])
    b = store_keys(ix, [k(i) for i in range(6, 12)])
    ix.touch([r.key for r in a])                            # A is now the most recent
    store_keys(ix, [k(i) for i in range(12, 16)])
    ix.flush()
    assert all(ix.contains(r.key) for r in a)
    assert not all(ix.contains(r.key) for r in b)
    ix.close()
    st.close()


def test_drop_and_drop_all_leave_table_and_lmdb_in_step(tmp_path):
    st = make(tmp_path, 32)
    ix = ServingIndex(st, pool_target=4)
    ix.wait_ready(10)
    refs = store_keys(ix, [k(i) for i in range(8)])
    ix.drop([refs[2].key])
    assert not ix.contains(refs[2].key)                     # at once, for lookups
    ix.flush()
    assert st.lookup(refs[2].key) is None and st.lookup(refs[3].key) is not None
    assert hits(ix, [r.key for r in refs]) == refs[:2]
    ix.unpin(r.slot for r in refs[:2])
    ix.drop_all()
    ix.flush()
    assert st.stats()["used_slots"] == 0 and not hits(ix, [refs[0].key])
    ix.close()
    assert st.index.check_consistency() == []
    st.close()


def test_table_is_rebuilt_at_open_and_lookups_read_lmdb_until_then(tmp_path):
    st = make(tmp_path, 64)
    st.close()
    with DiskStore(str(tmp_path / "store"), io=True) as io_st:
        io_st.put([k(i) for i in range(20)], lambda i, r: bytes([i]) * BB)
    st = DiskStore(str(tmp_path / "store"))
    ix = ServingIndex(st, pool_target=4)
    first = hits(ix, [k(i) for i in range(20)])             # ready or not: the same answer
    assert [r.key for r in first] == [k(i) for i in range(20)]
    assert ix.wait_ready(10) and len(ix._table) == 20
    assert hits(ix, [k(i) for i in range(20)]) == first
    ix.unpin(r.slot for r in first + first)
    assert ix.pinned_slots == 0
    ix.close()
    st.close()


def test_pool_reservations_are_reclaimed_after_a_crash(tmp_path):
    path = str(tmp_path / "store")
    make(tmp_path, 64).close()
    code = ("import os, sys; from kvstore.store.disk import DiskStore; "
            "from kvstore.lookup.table import ServingIndex; "
            "st = DiskStore(sys.argv[1]); ix = ServingIndex(st, pool_target=16); ix.wait_ready(10); "
            "ix.flush(); print(st.stats()['reserved_slots'], flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         check=True).stdout
    assert int(out) == 16                                   # the pool was in LMDB ...
    with DiskStore(path) as st:                             # ... and is reclaimed at open
        assert st.stats()["reserved_slots"] == 0
        assert st.index.check_consistency() == []


@pytest.mark.parametrize("path", ["table", "lmdb", "sync"])
def test_a_dry_pools_drops_are_counted_off_the_step_thread(tmp_path, path):
    """`count_dropped` counts what `plan_new` would have planned of a range (not stored,
    not being stored) on the index thread, in slices, and reports it as one "counted"
    event; a count that fails still reports (0), so the scheduler never waits forever.
    The synchronous baseline counts on the caller's thread."""
    from kvstore._keytable import KeySet
    from kvstore.lookup.table import block_key
    st = make(tmp_path, 64)
    ix = SyncServingIndex(st) if path == "sync" else ServingIndex(st, pool_target=8)
    threads = []
    try:
        if path != "sync":
            assert ix.wait_ready(10)
            orig = ix._lookups.count_new

            def counting(*a):
                threads.append(threading.get_ident())
                return orig(*a)
            ix._lookups.count_new = counting
        hashes = [b"d%031d" % i for i in range(300)]
        stored = [block_key(hashes[i], 3) for i in (0, 5, 140, 299)]
        store_keys(ix, stored) if path != "sync" else ix.commit(list(zip(stored, *ix.take(stored))))
        ix.poll()
        storing = KeySet()
        for i in (6, 7, 200):
            storing.add(block_key(hashes[i], 3))
        if path == "lmdb":
            ix._lookups.ready = False       # the table could not be built: LMDB lookups
        ix.count_dropped(hashes, 2, 300, storing, 3)      # 298 blocks: 3 slices of 128
        ix.count_dropped(hashes, 0, 10, storing, 4)       # another group: all new
        bad = hashes[:3] + [None]                   # fails at block 3
        if path == "sync":                          # the caller's thread: its own error
            with pytest.raises(TypeError):
                ix.count_dropped(bad, 0, 4, storing, 3)
        else:
            ix.count_dropped(bad, 0, 4, storing, 3)
        if path != "sync":
            ix.flush()
            assert threads and all(t == ix._thread.ident for t in threads)
        evs = ix.poll()
        counted = [e.count for e in evs if isinstance(e, Counted)]
        assert counted == [298 - 3 - 3, 10] + ([] if path == "sync" else [0]), (path, counted)
        if path != "sync":
            assert [e.what for e in evs if isinstance(e, Failed)] == ["count_new"]
    finally:
        if path != "sync":
            ix._lookups.ready = True
        ix.close()
        st.close()


def test_the_pool_hands_out_slots_as_machine_words(tmp_path):
    """`take` slices the pool's arrays (no Python int per slot on the step thread), the
    part and the whole of it; what it hands out commits and is found as any slot is."""
    import array
    st = make(tmp_path, 32)
    ix = ServingIndex(st, pool_target=8)
    try:
        keys = [k(i) for i in range(12)]
        a = ix.take(keys[:3])                   # a part: sliced
        b = ix.take(keys[3:])                   # more than is left: the rest, whole
        for slots, gens in (a, b):
            assert isinstance(slots, array.array) and slots.typecode == "I"
            assert isinstance(gens, array.array) and gens.typecode == "Q"
        assert len(a[0]) == 3 and len(b[0]) == 5 and len(set(a[0]) | set(b[0])) == 8
        items = list(zip(keys[:8], list(a[0]) + list(b[0]), list(a[1]) + list(b[1])))
        ix.commit(items)
        ix.flush()
        assert [(s_, g) for s_, g in zip(*ix.lookup_pin(keys[:8]))] == [x[1:] for x in items]
        assert len(ix.pooled()) == 8            # refilled with fresh slots
    finally:
        ix.close()
        st.close()


def test_sync_baseline_has_the_same_interface(tmp_path):
    st = make(tmp_path, 32)
    ix = SyncServingIndex(st)
    keys = [k(i) for i in range(4)]
    slots, gens = ix.take(keys)
    items = list(zip(keys, slots, gens))
    ix.commit(items, tag=1)
    evs = ix.poll()
    assert [type(e) for e in evs] == [Committed] and evs[0].error is None and evs[0].items == items
    assert st.index.fsyncs_by_thread[threading.get_ident()] == 1   # the synchronous baseline fsyncs here
    assert ix.lookup_pin(keys) == (slots, gens)
    st.close()


@pytest.mark.slow
def test_the_connector_never_imports_the_maintenance_module():
    code = ("import sys; import kvstore.vllm.connector, kvstore.vllm.scheduler, "
            "kvstore.vllm.worker, kvstore.lookup.table; "
            "assert 'kvstore.index.maint' not in sys.modules, 'kvstore.index.maint imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_keyset_is_a_set_of_keys_and_plan_new_probes_it_in_c():
    """The keys being stored (`KeySet`: fingerprints in C, grown as it fills, deletion by
    backward shift) answer as a Python set of the same keys would, through adds, discards
    and difference updates in any order; `plan_new` given one plans exactly what it plans
    given a set, and leaves the same keys claimed."""
    import os
    import random

    from kvstore._keytable import KeySet
    rng = random.Random(1)
    ks, ref = KeySet(4), set()
    pool = [os.urandom(36) for _ in range(3000)]
    for step in range(100_000):
        key = rng.choice(pool)
        r = rng.random()
        if r < 0.5:
            ks.add(key)
            ref.add(key)
        elif r < 0.8:
            ks.discard(key)
            ref.discard(key)
        elif r < 0.81:
            sub = rng.sample(pool, 50)
            ks.difference_update(sub)
            ref.difference_update(sub)
        assert (key in ks) == (key in ref)
        if step % 10_000 == 0:
            assert len(ks) == len(ref) and all((p in ks) == (p in ref) for p in pool)
    assert bool(KeySet()) is False and 123 not in ks
    t1, t2 = KeyTable(5000), KeyTable(5000)
    hashes = [os.urandom(32) for _ in range(2000)]
    for i in range(0, 2000, 3):
        for t in (t1, t2):
            t.put(hashes[i] + b"\0\0\0\0", i, 1)
    a, b = KeySet(), set()
    for r in range(200):
        s0 = rng.randrange(0, 2000)
        s1, lim = s0 + rng.randrange(0, 300), rng.randrange(1, 400)
        got = t1.plan_new(hashes, s0, s1, list(range(2000)), a, lim)
        assert got == t2.plan_new(hashes, s0, s1, list(range(2000)), b, lim), r
        if rng.random() < 0.3:
            a.difference_update(got[0][::2])
            b.difference_update(got[0][::2])
        assert len(a) == len(b) and all(k in a for k in b)
    assert len(a) > 100


def test_a_malformed_record_of_another_engine_unpins_only_what_the_walk_pinned():
    """`TableLookups.peer_prefix` on a record whose slot is beyond the table (a malformed
    or foreign LMDB row): a miss, and the pins other requests hold stay (pin() undid its
    own)."""
    import types

    t = KeyTable(64)
    t.pin([3])                          # another request holds slot 3

    def rec(key, slot):
        return types.SimpleNamespace(key=key, slot=slot, generation=1)

    class Lmdb:
        def longest_prefix(self, part):
            if len(part) == 1:
                return [rec(b"z" * 36, 5)]
            return [rec(b"a" * 36, 3), rec(b"b" * 36, 1000)][:len(part)]
    lk = types.SimpleNamespace(table=t, index=Lmdb(), cross_hits=0, undropped=lambda e: e)
    out = TableLookups.peer_prefix(lk, lambda a, b: [b"k%d" % i for i in range(a, b)], 10)
    assert out == ([], [], [])
    assert t.pin_count(3) == 1 and t.pin_count(5) == 0 and t.pinned_slots == 1


def test_items_and_slotrefs_are_sequences_made_of_three_lists():
    """The index thread's commits (`Items`) and the I/O thread's blocks (`SlotRefs`)
    travel as three parallel lists, not an object per block (see `Index.reserve_pool`):
    they must still read as the (key, slot, generation) sequences their callers index,
    slice, reverse and iterate."""
    import array

    from kvstore.io.records import SlotRefs
    from kvstore.lookup.table import Items, split_failed
    keys = [k(i) for i in range(5)]
    slots = array.array("I", [10, 11, 12, 13, 14])
    gens = array.array("Q", [20, 21, 22, 23, 24])
    tuples = list(zip(keys, slots, gens))
    it = Items(keys, slots, gens)
    assert list(it) == tuples and list(reversed(it)) == tuples[::-1]
    assert it[2] == tuples[2] and list(it[1:3]) == tuples[1:3] and len(it) == 5
    assert it == tuples and tuples[0] in it and not Items([], [], [])
    good, bad = split_failed(keys, slots, gens, {1, 3})
    assert list(good) == [tuples[0], tuples[2], tuples[4]] and list(bad) == [tuples[1], tuples[3]]
    good, bad = split_failed(keys, slots, gens, ())
    assert list(good) == tuples and len(bad) == 0
    refs = SlotRefs(keys, slots, gens)
    assert list(refs) == [SlotRef(*t) for t in tuples] and refs[-1] == SlotRef(*tuples[-1])
    assert isinstance(refs[1:4], SlotRefs) and list(refs[1:4]) == [SlotRef(*t) for t in tuples[1:4]]
    with pytest.raises(ValueError, match="4 slots"):
        SlotRefs(keys, slots[:4], gens)
    with pytest.raises(ValueError, match="4 generations"):
        Items(keys, slots, gens[:4])


def test_lookup_counts_wait_for_the_steps_next_operation_and_are_never_lost(tmp_path):
    """count_hits does not wake the index thread (a queued operation would): the counts
    go with the next take, poll, flush or close, and every one reaches the store."""
    st = make(tmp_path, 16)
    ix = ServingIndex(st, pool_target=4)
    ix.wait_ready(10)
    ix.flush()
    before = st.index.stats()
    ix.count_hits(3, 1)
    ix.count_hits(2, 0)
    assert ix._ops.qsize() == 0             # nothing queued yet
    ix.poll()                               # a step's poll sends them
    ix.flush()
    st.index.flush()
    mid = st.index.stats()
    assert (mid["hits"] - before["hits"], mid["misses"] - before["misses"]) == (5, 1)
    ix.count_hits(0, 4)
    ix.take([k(0)])                         # a take sends them with its refill
    ix.count_hits(7, 0)
    ix.close()                              # and close sends what is left
    after = st.index.stats()
    assert (after["hits"] - mid["hits"], after["misses"] - mid["misses"]) == (7, 4)
    st.close()


def test_a_packed_lookups_pins_are_released_from_its_array(tmp_path):
    """The step thread unpins a load's slots as the lookup returned them (an array('I'),
    no int object per slot): every pin goes, and only those."""
    st = make(tmp_path, 16)
    ix = ServingIndex(st, pool_target=4)
    ix.wait_ready(10)
    hashes = [b"h%031d" % i for i in range(4)]
    refs = store_keys(ix, [h + b"\0\0\0\0" for h in hashes])
    _, slots, _ = ix.lookup_hashes(hashes, 0, 4, packed=True)
    _, again, _ = ix.lookup_hashes(hashes, 0, 2, packed=True)
    assert list(slots) == [r.slot for r in refs] and ix.pinned_slots == 4
    ix.unpin(slots)
    assert ix.pin_counts() == {refs[0].slot: 1, refs[1].slot: 1}
    ix.unpin(again)
    assert ix.pinned_slots == 0
    ix.close()
    st.close()
