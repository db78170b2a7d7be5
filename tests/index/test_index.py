"""Tests of kvstore.index.core.Index against a real LMDB environment in tmp_path."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import lmdb
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import ConfigError, CorruptIndex, KVStoreError, StoreFull
from kvstore.index.core import Entry, Index
from kvstore.index.maint import bulk_load

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def k(i: int) -> bytes:
    return b"blk-%06d" % i + b"\x00" * 4   # opaque, includes NUL bytes on purpose


def check(ix: Index) -> None:
    """The invariants every test ends with."""
    assert ix.check_consistency() == []
    s = ix.stats()
    assert s["used_slots"] + s["free_slots"] + s["reserved_slots"] == s["capacity_slots"]
    assert s["lru_rows"] == s["used_slots"]
    entries = list(ix.iter_entries())
    assert len({e.slot for e in entries}) == len(entries)
    assert len(list(ix.iter_lru())) == len(entries)
    free = list(ix.iter_free())
    reserved = [r[0] for r in ix.iter_reserved()]
    everything = [e.slot for e in entries] + free + reserved
    assert sorted(everything) == list(range(s["capacity_slots"]))


@pytest.fixture
def make(tmp_path):
    opened: list[Index] = []

    def _make(cap: int = 8, **kw) -> Index:
        kw.setdefault("create", True)
        ix = Index(str(tmp_path / "index"), cap if kw["create"] else None, **kw)
        opened.append(ix)
        return ix

    yield _make
    for ix in opened:
        if not ix.closed and not ix.readonly:
            check(ix)
        ix.close()


def store(ix: Index, keys, pinned=()):
    items, evicted = ix.reserve(keys, pinned)
    assert ix.commit(items) == []
    return items, evicted


def run_py(code: str, *args: str, input: str | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], input=input,
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


# ---------------------------------------------------------------------- basics


def test_create_requires_capacity_and_open_requires_existing(tmp_path):
    with pytest.raises(ConfigError):
        Index(str(tmp_path / "a"), None, create=True)
    with pytest.raises(CorruptIndex, match="fsck --rebuild-index"):
        Index(str(tmp_path / "missing"))
    with pytest.raises(CorruptIndex, match="fsck --rebuild-index"):
        Index(str(tmp_path / "missing"), readonly=True)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data.mdb").write_bytes(b"not lmdb" * 1000)
    with pytest.raises(CorruptIndex):
        Index(str(tmp_path / "junk"))


def test_reopen_with_other_capacity_refused(make, tmp_path):
    make(8).close()
    with pytest.raises(ConfigError, match="capacity_slots=8"):
        Index(str(tmp_path / "index"), 9, create=True)
    ix = Index(str(tmp_path / "index"), 8, create=True)   # same capacity: just opens
    assert ix.capacity_slots == 8
    ix.close()


def test_create_is_constant_time_for_huge_capacity(tmp_path):
    ix = Index(str(tmp_path / "big"), 10_000_000, create=True)
    s = ix.stats()
    assert s["free_slots"] == 10_000_000 and s["used_slots"] == 0
    assert os.path.getsize(tmp_path / "big" / "data.mdb") < 1 << 20
    ix.close()


def test_longest_prefix_with_holes(make):
    ix = make(32)
    store(ix, [k(i) for i in range(10)])
    ix.drop([k(4)])
    chain = [k(i) for i in range(10)]
    got = ix.longest_prefix(chain)
    assert [e.key for e in got] == chain[:4]
    assert all(isinstance(e, Entry) for e in got)
    assert ix.longest_prefix([k(99)] + chain) == []
    assert ix.longest_prefix([]) == []
    assert [e.key for e in ix.longest_prefix(chain[5:])] == chain[5:]
    e = ix.lookup(k(3))
    assert got[3] == e and e.slot == 3
    assert ix.lookup(k(4)) is None


def test_longest_prefix_long_chain_crosses_chunks(make):
    n = 1500
    ix = make(2048)
    store(ix, [k(i) for i in range(n)])
    chain = [k(i) for i in range(n)]
    assert len(ix.longest_prefix(chain)) == n
    for hole in (0, 1, 63, 64, 65, 319, 320, 321, 1343, 1344, 1499):
        assert len(ix.longest_prefix(chain[:hole] + [b"nope"] + chain[hole:])) == hole
    # a repeated key after a miss must not be mistaken for a hit
    assert len(ix.longest_prefix([k(0), b"nope", k(0)])) == 1


def test_reserve_skips_present_and_repeated_keys(make):
    ix = make(8)
    store(ix, [k(0), k(1)])
    items, evicted = ix.reserve([k(1), k(2), k(2), k(3)])
    assert [x[0] for x in items] == [k(2), k(3)] and evicted == []
    gens = [x[2] for x in items]
    assert len(set(gens)) == 2 and min(gens) > 2
    ix.commit(items)


def test_generations_strictly_increase_per_reservation(make):
    ix = make(2)
    seen = []
    for i in range(6):
        items, _ = store(ix, [k(i)])
        seen.append(items[0][2])
    assert seen == sorted(set(seen))


def test_bad_keys_rejected(make):
    ix = make(4)
    with pytest.raises(KVStoreError):
        ix.reserve([b""])
    with pytest.raises(KVStoreError):
        ix.reserve([b"x" * 600])


# ---------------------------------------------------------------------- LRU / eviction


def test_lru_tail_of_touched_chain_goes_first(make):
    ix = make(6)
    store(ix, [k(i) for i in range(3)])          # chain A: 0 1 2
    store(ix, [k(i) for i in range(10, 13)])     # chain B: 10 11 12 (newer)
    ix.touch([k(0), k(1), k(2)])                 # A hit: now hottest, head hottest of all
    order = [e.key for e in ix.iter_lru()]
    assert order == [k(12), k(11), k(10), k(2), k(1), k(0)]
    assert [e.key for e in ix.iter_lru(hottest_first=True)] == order[::-1]
    _, evicted = store(ix, [k(20), k(21), k(22), k(23)])
    assert [e.key for e in evicted] == [k(12), k(11), k(10), k(2)]
    assert ix.stats()["evictions"] == 4
    assert [e.key for e in ix.longest_prefix([k(0), k(1), k(2)])] == [k(0), k(1)]
    assert ix.oldest_tick() == ix.lookup(k(1)).tick


def test_commit_gives_head_most_recent_tick(make):
    ix = make(4)
    store(ix, [k(0), k(1), k(2)])
    ticks = [ix.lookup(k(i)).tick for i in range(3)]
    assert ticks[0] > ticks[1] > ticks[2]


def test_touch_ignores_unknown_and_repeated_keys(make):
    ix = make(4)
    store(ix, [k(0), k(1)])
    ix.touch([k(1), b"nope", k(1), k(0)])
    assert [e.key for e in ix.iter_lru(hottest_first=True)] == [k(1), k(0)]


def test_pins_respected(make):
    ix = make(4)
    items, _ = store(ix, [k(i) for i in range(4)])
    slot = {key: s for key, s, _ in items}
    pinned = {slot[k(3)], slot[k(2)]}                # the two coldest
    got, evicted = ix.reserve([k(10), k(11)], pinned=pinned)
    assert {e.key for e in evicted} == {k(1), k(0)}
    assert not {s for _, s, _ in got} & pinned
    ix.commit(got)
    assert ix.lookup(k(3)) and ix.lookup(k(2))


def test_pinned_free_slots_are_not_handed_out(make):
    ix = make(4)
    items, _ = ix.reserve([k(0), k(1)], pinned=[0])
    assert {s for _, s, _ in items} == {1, 2}
    ix.commit(items)
    items, _ = ix.reserve([k(2)], pinned=[3])
    assert items[0][1] == 0                         # from free list (0 was skipped before)
    ix.commit(items)


def test_store_full_when_all_pinned_changes_nothing(make, tmp_path):
    ix = make(4)
    items, _ = store(ix, [k(i) for i in range(3)])
    pend, _ = ix.reserve([k(3)])                     # 1 reserved, in flight
    before = (ix.stats(), list(ix.iter_lru()), list(ix.iter_reserved()), list(ix.iter_free()))
    data_before = (tmp_path / "index" / "data.mdb").read_bytes()
    with pytest.raises(StoreFull) as ei:
        ix.reserve([k(10), k(11)], pinned=[s for _, s, _ in items][:2])
    msg = str(ei.value)
    assert "2 slot(s)" in msg and "capacity 4" in msg and "2 pinned" in msg
    assert "1 reserved" in msg
    after = (ix.stats(), list(ix.iter_lru()), list(ix.iter_reserved()), list(ix.iter_free()))
    assert before == after
    assert (tmp_path / "index" / "data.mdb").read_bytes() == data_before
    # one is still possible: evicts the one unpinned entry
    got, ev = ix.reserve([k(10)], pinned=[s for _, s, _ in items][:2])
    assert [e.key for e in ev] == [k(2)]
    ix.commit(got + pend)


def test_a_pool_refill_evicts_lru_and_allocates_no_gc_tracked_object_per_slot(make):
    """reserve_pool runs on the index thread, thousands of slots a call. A tuple per
    slot and an Entry per eviction made it the thread that triggered most of the
    process's garbage collections (each holding the GIL while vLLM's step thread waits);
    slots and generations now come as arrays, evicted keys as bytes."""
    n = 4096
    ix = make(n)
    keys = [k(i) for i in range(n)]
    for i in range(0, n, 512):
        store(ix, keys[i:i + 512])          # full: the refill evicts, oldest first
    asked = []          # the candidates' keys, in order (not the tuples: counted too)

    def claim(cands):
        asked.extend([key for key, s_ in cands if s_ != 7])
        return {s_ for _, s_ in cands if s_ != 7}      # slot 7 is "pinned"

    gc.disable()
    try:
        gc.collect(0)
        c0 = gc.get_count()[0]
        slots, gens, evicted = ix.reserve_pool(3000, claim)
        grown = gc.get_count()[0] - c0
    finally:
        gc.enable()
    assert (slots.typecode, gens.typecode) == ("I", "Q")
    assert len(slots) == len(gens) == len(evicted) == 3000
    assert 7 not in slots and keys[7] not in evicted
    assert evicted == asked
    assert len(set(slots)) == 3000
    assert list(gens) == list(range(gens[0], gens[0] + 3000))
    assert ix.lookup(evicted[0]) is None and ix.lookup(keys[7]) is not None
    assert grown < 300, f"{grown} GC-tracked objects left allocated for 3000 slots"
    ix.abort(list(slots))


# ---------------------------------------------------------------------- commit / abort / reclaim


def test_commit_skips_stale_reservations(make):
    ix = make(4)
    items, _ = ix.reserve([k(0), k(1), k(2)])
    a, b, c = items
    assert ix.abort([b]) == 1
    wrong_gen = (c[0], c[1], c[2] + 100)
    wrong_key = (b"other", a[1], a[2])
    skipped = ix.commit([a, b, wrong_gen, wrong_key])
    assert skipped == [b, wrong_gen, wrong_key]
    assert ix.lookup(k(0)).slot == a[1]
    assert ix.lookup(k(1)) is None and ix.lookup(k(2)) is None
    assert ix.stats()["stale_commits"] == 3
    assert ix.commit([c]) == [] and ix.lookup(k(2)).slot == c[1]
    assert ix.commit([a]) == [a]                     # re-commit: reservation gone, skipped
    assert ix.lookup(k(0)).slot == a[1]


def test_duplicate_store_keeps_existing_frees_new(make):
    ix = make(4)
    r1, _ = ix.reserve([k(0)])
    r2, _ = ix.reserve([k(0)])                       # second store of the same block in flight
    assert r1[0][1] != r2[0][1]
    ix.commit(r1)
    assert ix.commit(r2) == []
    e = ix.lookup(k(0))
    assert e.slot == r1[0][1] and e.generation == r1[0][2]
    assert r2[0][1] in set(ix.iter_free())
    assert ix.stats()["duplicates"] == 1


def test_abort_by_slot_and_by_item(make):
    ix = make(4)
    items, _ = ix.reserve([k(0), k(1), k(2)])
    assert ix.abort([items[0][1], 3]) == 1            # 3 was never reserved
    assert ix.abort([(items[1][0], items[1][1], items[1][2] + 1)]) == 0
    assert ix.abort([items[1]]) == 1
    assert ix.stats()["reserved_slots"] == 1
    ix.commit([items[2]])


def test_reclaim_reserved_after_crash(make, tmp_path):
    ix = make(8)
    store(ix, [k(0)])
    ix.reserve([k(1), k(2), k(3)])
    ix.close()                                        # "crash": reservations left behind
    ix = make(create=False)
    assert ix.stats()["reserved_slots"] == 3
    assert ix.reclaim_reserved() == 3
    assert ix.reclaim_reserved() == 0
    s = ix.stats()
    assert s["reserved_slots"] == 0 and s["free_slots"] == 7 and s["used_slots"] == 1


def test_drop_returns_entries_and_frees(make):
    ix = make(4)
    store(ix, [k(0), k(1)])
    dropped = ix.drop([k(0), b"nope"])
    assert [e.key for e in dropped] == [k(0)]
    assert dropped[0].slot in set(ix.iter_free())
    assert ix.lookup(k(0)) is None


def test_counters(make, tmp_path):
    ix = make(4)
    ix.count_hits(3, 1)
    ix.count_hits(2, 0)
    assert ix.stats()["hits"] == 5 and ix.stats()["misses"] == 1
    ix.close()
    ix = make(create=False)
    assert ix.stats()["hits"] == 5
    ix.count_hits(1, 1)
    store(ix, [k(0)])                                 # flushed with any write txn
    with pytest.raises(KVStoreError, match="already open in this process"):
        Index(str(tmp_path / "index"), readonly=True)
    out = run_py("""
        import sys
        from kvstore.index.core import Index
        s = Index(sys.argv[1], readonly=True).stats()
        print(s["hits"], s["misses"])
    """, str(tmp_path / "index"))
    assert out.split() == ["6", "2"]


# ---------------------------------------------------------------------- lifecycle / processes


def test_closed_index_raises(make):
    ix = make(4)
    ix.close()
    ix.close()                                        # idempotent
    calls = [
        lambda: ix.lookup(k(0)), lambda: ix.longest_prefix([k(0)]), lambda: ix.reserve([k(0)]),
        lambda: ix.commit([(k(0), 0, 1)]), lambda: ix.abort([0]), ix.reclaim_reserved,
        lambda: ix.touch([k(0)]), lambda: ix.drop([k(0)]), lambda: ix.count_hits(1, 0),
        ix.stats, lambda: list(ix.iter_entries()), lambda: list(ix.iter_lru()),
        lambda: list(ix.iter_reserved()), lambda: list(ix.iter_free()), ix.oldest_tick,
        lambda: ix.capacity_slots,
    ]
    for call in calls:
        with pytest.raises(KVStoreError, match="index is closed"):
            call()


def test_readonly_refuses_writes(make, tmp_path):
    make(4).close()
    ro = Index(str(tmp_path / "index"), readonly=True)
    assert ro.readonly and ro.stats()["readonly"]
    with pytest.raises(KVStoreError, match="read-only"):
        ro.reserve([k(0)])
    with pytest.raises(KVStoreError, match="read-only"):
        ro.touch([k(0)])
    ro.close()


def test_persistence_across_processes_keeps_lru(make, tmp_path):
    ix = make(16)
    store(ix, [k(i) for i in range(5)])
    store(ix, [k(i) for i in range(5, 10)])
    ix.touch([k(7), k(8)])
    expected = [e.key.hex() for e in ix.iter_lru()]
    ix.close()
    out = run_py("""
        import sys
        from kvstore.index.core import Index
        ix = Index(sys.argv[1])
        print(" ".join(e.key.hex() for e in ix.iter_lru()))
        items, ev = ix.reserve([b"new"])
        ix.commit(items)
        ix.close()
    """, str(tmp_path / "index"))
    assert out.split() == expected
    ix = make(create=False)
    assert [e.key.hex() for e in ix.iter_lru()] == expected + [b"new".hex()]
    assert ix.lookup(b"new") is not None


def test_readonly_reader_in_other_process_while_writer_commits(make, tmp_path):
    # tiny map: the writer grows it several times while the reader stays open
    ix = make(5000, map_size=64 * 1024)
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys
            from kvstore.index.core import Index
            ro = Index(sys.argv[1], readonly=True)
            for line in sys.stdin:
                n = int(line)
                chain = [b"blk-%06d" % i + b"\\x00" * 4 for i in range(n + 1)]
                print(ro.stats()["used_slots"], len(ro.longest_prefix(chain)), flush=True)
            ro.close()
        """), str(tmp_path / "index")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=REPO))
    try:
        n = 0
        for _ in range(8):
            store(ix, [k(i) for i in range(n, n + 500)])
            n += 500
            reader.stdin.write(f"{n}\n")
            reader.stdin.flush()
            used, prefix = map(int, reader.stdout.readline().split())
            assert used == n and prefix == n
        assert ix.stats()["map_size"] > 64 * 1024
    finally:
        reader.stdin.close()
        assert reader.wait(timeout=30) == 0


def test_map_full_grows_transparently(make):
    ix = make(20_000, map_size=32 * 1024)
    start = ix.stats()["map_size"]
    for base in range(0, 6000, 2000):
        store(ix, [b"%032d" % i for i in range(base, base + 2000)])
    ix.touch([b"%032d" % i for i in range(6000)])
    assert ix.stats()["map_size"] > start
    assert ix.stats()["used_slots"] == 6000


def test_check_consistency_detects_damage(make, tmp_path):
    ix = make(8)
    store(ix, [k(0), k(1)])
    ix.close()
    env = lmdb.open(str(tmp_path / "index"), max_dbs=8)
    slots = env.open_db(b"slots")
    free = env.open_db(b"free")
    with env.begin(write=True) as txn:
        txn.put((0).to_bytes(4, "big"), b"someone-else", db=slots)
        txn.put((1).to_bytes(4, "big"), b"", db=free)
    env.close()
    ix = Index(str(tmp_path / "index"))
    problems = ix.check_consistency()
    ix.close()
    assert any("does not point back" in p for p in problems)
    assert any("slot 1 is both" in p for p in problems)


def test_bulk_load(make):
    ix = make(10)
    n = bulk_load(ix, [(k(i), s, 100 + i) for i, s in enumerate([0, 1, 2, 5, 7])],
                     keys_sorted=True, batch=2)
    assert n == 5
    s = ix.stats()
    assert s["used_slots"] == 5 and s["free_slots"] == 5 and s["generation"] == 104
    assert [e.key for e in ix.iter_lru()] == [k(i) for i in range(5)]
    with pytest.raises(KVStoreError, match="not empty"):
        bulk_load(ix, [(k(9), 9, 1)])
    store(ix, [k(50), k(51)])                          # goes to holes 3, 4 first
    assert {ix.lookup(k(50)).slot, ix.lookup(k(51)).slot} == {3, 4}


# ---------------------------------------------------------------------- random operations


class IndexMachine(RuleBasedStateMachine):
    """Random operations against a model; invariants checked after every step."""

    CAP = 6

    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="kvidx-")
        self.ix = Index(os.path.join(self.dir, "index"), self.CAP, create=True, map_size=64 << 10)
        self.order: list[bytes] = []          # committed keys, coldest first
        self.slot: dict[bytes, int] = {}
        self.pending: list[tuple[bytes, int, int]] = []
        self.stale: list[tuple[bytes, int, int]] = []

    def teardown(self):
        self.ix.close()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)

    keys = st.lists(st.integers(0, 12).map(k), min_size=1, max_size=5)

    @rule(keys=keys, pin_some=st.integers(0, 3))
    def reserve(self, keys, pin_some):
        pinned = {self.slot[x] for x in self.order[:pin_some]}
        reserved = len(self.pending)
        want = [x for x in dict.fromkeys(keys) if x not in self.slot]
        try:
            items, evicted = self.ix.reserve(keys, pinned)
        except StoreFull:
            assert len(want) > self.CAP - reserved - len(pinned)
            return
        assert [x for x, _, _ in items] == want
        victims = [x for x in self.order if self.slot[x] not in pinned]
        assert [e.key for e in evicted] == victims[:len(evicted)]
        for e in evicted:
            self.order.remove(e.key)
            del self.slot[e.key]
        new_slots = [s for _, s, _ in items]
        assert not set(new_slots) & pinned
        assert not set(new_slots) & set(self.slot.values())
        assert not set(new_slots) & {s for _, s, _ in self.pending}
        self.pending += items

    @precondition(lambda self: self.pending or self.stale)
    @rule(data=st.data())
    def commit(self, data):
        pool = self.pending + self.stale
        items = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=4))
        skipped = self.ix.commit(items)
        expect_skip = []
        for it in reversed(items):
            if it not in self.pending:
                expect_skip.append(it)
                continue
            self.pending.remove(it)
            self.stale.append(it)
            key, slot, _ = it
            if key in self.slot:
                self.order.remove(key)
            else:
                self.slot[key] = slot
            self.order.append(key)
        assert skipped == expect_skip[::-1]

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort(self, data):
        items = data.draw(st.lists(st.sampled_from(self.pending), unique=True, max_size=3))
        assert self.ix.abort(items) == len(items)
        for it in items:
            self.pending.remove(it)
            self.stale.append(it)

    @rule(keys=keys)
    def touch(self, keys):
        self.ix.touch(keys)
        for x in reversed(keys):
            if x in self.slot:
                self.order.remove(x)
                self.order.append(x)

    @rule(keys=keys)
    def drop(self, keys):
        got = self.ix.drop(keys)
        expect = [x for x in dict.fromkeys(keys) if x in self.slot]
        assert [e.key for e in got] == expect
        for x in expect:
            self.order.remove(x)
            del self.slot[x]

    @rule()
    def reopen_and_reclaim(self):
        self.ix.close()
        self.ix = Index(os.path.join(self.dir, "index"))
        assert self.ix.reclaim_reserved() == len(self.pending)
        self.stale += self.pending
        self.pending = []

    @rule(keys=keys)
    def prefix(self, keys):
        got = self.ix.longest_prefix(keys)
        n = 0
        while n < len(keys) and keys[n] in self.slot:
            n += 1
        assert [e.key for e in got] == keys[:n]
        assert [e.slot for e in got] == [self.slot[x] for x in keys[:n]]

    @invariant()
    def consistent(self):
        check(self.ix)
        assert [e.key for e in self.ix.iter_lru()] == self.order
        assert self.ix.stats()["reserved_slots"] == len(self.pending)


IndexMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_random_operations = IndexMachine.TestCase
