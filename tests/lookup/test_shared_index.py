"""Several engine processes on one store, at the serving-index level: real
LMDB, real shared maps, real processes (multiprocessing, spawn). What one engine stores,
another finds; a slot one engine has pinned is never evicted by another; a hit whose slot
another engine evicted is never served; a killed engine's reservations are reclaimed by
the survivors at once, never while it lives."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from kvstore.store import shared
from kvstore.store.disk import DiskStore
from kvstore.lookup.table import ServingIndex

from shared_util import k, make


def commit_keys(ix: ServingIndex, keys: list[bytes]) -> None:
    for i in range(0, len(keys), ix.pool_target):
        part = keys[i:i + ix.pool_target]
        slots, gens = ix.take(part)
        assert len(slots) == len(part)
        ix.commit(list(zip(part, slots, gens)))
        ix.flush()


def _engine(path, cmds, out):
    """A child engine: runs commands from `cmds`, answers on `out`."""
    st = DiskStore(path)
    ix = ServingIndex(st, pool_target=8)
    ix.wait_ready(30)
    out.put(("ready", os.getpid()))
    try:
        while True:
            cmd = cmds.get()
            op = cmd[0]
            if op == "stop":
                break
            if op == "commit":
                commit_keys(ix, cmd[1])
                out.put(("ok",))
            elif op == "lookup":
                slots, gens = ix.lookup_pin(cmd[1])
                out.put(("hit", slots, gens))
            elif op == "unpin":
                ix.unpin(cmd[1])
                out.put(("ok",))
            elif op == "take":          # reserve and never commit (killed mid-store)
                slots, gens = ix.take(cmd[1])
                ix.flush()
                out.put(("took", slots, gens))
            elif op == "pins":
                out.put(("pins", ix.pinned_slots))
            elif op == "present":       # hashes, group
                out.put(("present", ix.present(cmd[1], 0, len(cmd[1]), cmd[2])))
    finally:
        ix.close()
        st.close()
        out.put(("closed",))


@pytest.fixture
def child():
    ctx = mp.get_context("spawn")
    procs = []

    def start(path):
        cmds, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_engine, args=(path, cmds, out), daemon=True)
        p.start()
        assert out.get(timeout=60)[0] == "ready"
        procs.append(p)

        def call(*cmd, timeout=30):
            cmds.put(cmd)
            return out.get(timeout=timeout)
        call.proc = p
        return call
    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)


def test_what_one_engine_stores_the_other_finds(tmp_path, child):
    path = make(tmp_path, 256)
    b = child(path)
    with DiskStore(path) as st:
        ix = ServingIndex(st, pool_target=8)
        ix.wait_ready(30)
        assert ix._table.peer_count == 1 and ix._table.validating
        mine = [k(i) for i in range(20)]
        commit_keys(ix, mine)
        # the other engine's table never saw these: its miss goes to LMDB, then joins
        _, slots, gens = b("lookup", mine)
        assert len(slots) == 20
        assert b("unpin", slots) == ("ok",)
        theirs = [k(i, b"b") for i in range(20)]
        assert b("commit", theirs) == ("ok",)
        s2, g2 = ix.lookup_pin(theirs)
        assert len(s2) == 20 and ix.cross_hits == 20
        ix.unpin(s2)
        # the same block stored by both: one entry stands, and both tables agree on it
        both = [k(i, b"c") for i in range(4)]
        commit_keys(ix, both)
        assert b("commit", both) == ("ok",)
        _, s3, g3 = b("lookup", both)
        s4, g4 = ix.lookup_pin(both)
        assert (s3, g3) == (s4, g4)
        ix.unpin(s4)
        b("unpin", s3)
        ix.close()
        assert b("stop") == ("closed",)
        assert st.index.check_consistency() == []
        assert st.index.owned_counts() == {}


def test_a_failing_lookup_of_the_other_engines_blocks_is_a_miss_and_pins_nothing(
        tmp_path, child):
    path = make(tmp_path, 256)
    b = child(path)
    with DiskStore(path) as st:
        ix = ServingIndex(st, pool_target=8)
        ix.wait_ready(30)
        mine = [k(i) for i in range(6)]
        commit_keys(ix, mine)
        theirs = [k(i, b"b") for i in range(40)]
        assert b("commit", theirs) == ("ok",)
        calls = []
        real = ix.index.longest_prefix

        def failing(keys):      # found the first chunks, then no memory
            calls.append(len(keys))
            if len(calls) == 3:
                raise MemoryError("no memory for the records")
            return real(keys)
        ix.index.longest_prefix = failing
        slots, gens = ix.lookup_pin(mine + theirs)
        # its own hit stands (pinned), the other engine's part is a miss, not a leak
        assert len(calls) == 3 and len(slots) == 6
        assert ix.pinned_slots == 6
        ix.unpin(slots)
        assert ix.pinned_slots == 0
        ix.index.longest_prefix = real
        s2, _ = ix.lookup_pin(mine + theirs)
        assert len(s2) == 46
        ix.unpin(s2)
        ix.close()
        assert b("stop") == ("closed",)


def test_hybrid_presence_walks_find_the_other_engines_blocks(tmp_path, child):
    """Sliding-window and Mamba groups are looked up per block (`present`): blocks another
    engine stored are found too, holes stay holes."""
    from kvstore.format.layout import block_key
    path = make(tmp_path, 128)
    b = child(path)
    with DiskStore(path) as st:
        ix = ServingIndex(st, pool_target=8)
        ix.wait_ready(30)
        hashes = [bytes([i]) * 32 for i in range(12)]
        stored = [i for i in range(12) if i % 3 != 1]           # holes at 1, 4, 7, 10
        commit_keys(ix, [block_key(hashes[i], 2) for i in stored])
        _, flags = b("present", hashes, 2)
        assert [i for i, f in enumerate(flags) if f] == stored
        _, flags = b("present", hashes, 0)                      # another group: none
        assert flags == bytes(12)
        ix.close()
        b("stop")


def test_a_slot_pinned_by_another_engine_is_never_evicted(tmp_path, child):
    path = make(tmp_path, 64)
    b = child(path)
    with DiskStore(path) as st:
        ix = ServingIndex(st, pool_target=8)
        ix.wait_ready(30)
        old = [k(i) for i in range(40)]
        commit_keys(ix, old)
        _, pinned, pgens = b("lookup", old[:10])       # the other engine is loading these
        assert len(pinned) == 10
        # eviction pressure: far more new blocks than the store holds
        for r in range(6):
            commit_keys(ix, [k(i, b"n%d" % r) for i in range(40)])
        ents = {e.slot: e for e in st.index.iter_entries()}
        for s, g in zip(pinned, pgens):
            assert s in ents and ents[s].generation == g, "a slot pinned by another engine was evicted"
        b("unpin", pinned)
        # unpinned now: they go with the next pressure, and the other engine's table
        # entries for them are never served (their slots moved on)
        for r in range(6, 9):
            commit_keys(ix, [k(i, b"n%d" % r) for i in range(40)])
        _, slots, _ = b("lookup", old[:10])
        live = {e.key for e in st.index.iter_entries()}
        assert len(slots) == len([x for x in old[:10] if x in live][:len(slots)])
        assert all(old[j] in live for j in range(len(slots)))
        ix.close()
        b("stop")


def test_killed_engine_reservations_are_reclaimed_at_once_never_while_it_lives(tmp_path, child):
    path = make(tmp_path, 64)
    b = child(path)
    with DiskStore(path) as st:
        ix = ServingIndex(st, pool_target=8)
        ix.wait_ready(30)
        _, slots, gens = b("take", [k(i, b"x") for i in range(6)])
        assert len(slots) == 6
        owners = st.index.owned_counts()
        theirs = [o for o in owners if o != st.lease.owner]
        assert len(theirs) == 1 and owners[theirs[0]] >= 6     # its pool and its store
        engines = shared.engines(path, pins=True)
        assert sorted(e.pid for e in engines if e.alive) == sorted([os.getpid(), b.proc.pid])
        time.sleep(2 * 0.5 + 0.2)              # several upkeep rounds: it lives, nothing goes
        assert st.index.owned_counts().get(theirs[0], 0) >= 6
        os.kill(b.proc.pid, signal.SIGKILL)
        b.proc.join(10)
        deadline = time.monotonic() + 10
        while theirs[0] in st.index.owned_counts() and time.monotonic() < deadline:
            ix.flush()
            time.sleep(0.1)
        assert theirs[0] not in st.index.owned_counts()
        assert ix.reclaimed >= 6
        assert [e.pid for e in shared.engines(path)] == [os.getpid()]
        stats = st.index.stats()
        assert stats["reserved_slots"] == len(ix.pooled())
        ix.close()
        assert st.index.check_consistency() == []


def test_exclusive_open_waits_for_no_engine(tmp_path, child):
    path = make(tmp_path, 32)
    b = child(path)
    from kvstore.errors import StoreLocked
    with pytest.raises(StoreLocked, match=str(b.proc.pid)):
        DiskStore(path, exclusive=True)
    b("stop")
    b.proc.join(10)
    DiskStore(path, exclusive=True).close()


def _mapped(path, size):
    """A SharedMap of a new file of `size` bytes (the store's slots map or a lease's pins)."""
    from kvstore._sharedmap import SharedMap
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    m = SharedMap(fd, size, True)
    os.close(fd)
    return m


def test_sweep_drops_only_entries_whose_slot_moved_on_slice_by_slice(tmp_path):
    """The index thread's sweep (KeyTable.sweep over the shared generations), unit level."""
    from kvstore._keytable import KeyTable

    def mapped(name, size):
        return _mapped(tmp_path / name, size)
    n = 5000
    slots, pins = mapped("slots", 4096 + 8 * n), mapped("pins", 4096 + 4 * n)
    t = KeyTable(n)
    t.attach(slots, pins)
    keys = [k(i) for i in range(n)]
    t.put_many(keys, list(range(n)), [i + 1 for i in range(n)])
    slots.publish(list(range(n)), [i + 1 for i in range(n)])
    assert t.sweep() == (0, 0)                  # not valid yet: nothing is judged
    slots.store(shared.W_VALID, 1)
    moved = list(range(0, n, 7))
    slots.retract(moved[: len(moved) // 2])                     # evicted by another engine
    slots.publish(moved[len(moved) // 2:], [10 ** 9] * (len(moved) - len(moved) // 2))  # reused
    def one_pass():
        dropped, start, rounds = 0, 0, 0
        while True:                             # in slices, as the index thread does
            d, start = t.sweep(start, 1024)
            dropped += d
            rounds += 1
            if start == 0:
                return dropped, rounds
    first, rounds = one_pass()
    # a deletion shifts a later bucket back: one that crosses into a slice already swept
    # waits for the next pass
    second, _ = one_pass()
    assert rounds > 1 and first > 0.9 * len(moved)
    assert first + second == len(moved) == t.stale_dropped
    assert len(t) == n - len(moved)
    assert all(t.get(keys[i]) is None for i in moved)
    assert all(t.get(keys[i]) == (i, i + 1) for i in range(n) if i % 7)
    assert t.sweep() == (0, 0)


@pytest.mark.parametrize("attached", [False, True])
def test_the_packed_walk_is_the_list_walk_without_objects(tmp_path, attached):
    """`prefix_of(packed=True)` (the scheduler's lookup: slots and generations as arrays,
    no key made) against the list walk, over random tables, stale shared generations
    (attached: every engine validates its hits) and starts: the same hit, the same pins,
    the same stale entry dropped from the table."""
    import array
    import random

    from kvstore._keytable import KeyTable

    def mapped(name, size):
        return _mapped(tmp_path / name, size)
    rng = random.Random(5)
    n = 400
    hashes = [b"p%031d" % i for i in range(n)]
    tables = []
    for name in ("a", "b"):                 # one walked packed, the other as lists
        t = KeyTable(n)
        if attached:
            slots, pins = mapped(name + "slots", 4096 + 8 * n), mapped(name + "pins", 4096 + 4 * n)
            t.attach(slots, pins)
            slots.publish(list(range(n)), [i + 1 for i in range(n)])
            slots.store(shared.W_VALID, 1)
            tables.append((t, slots))
        else:
            tables.append((t, None))
    for rnd in range(60):
        present = [rng.random() < 0.9 for _ in range(n)]
        stale = [attached and rng.random() < 0.02 for _ in range(n)]
        for t, slots in tables:
            for i, h in enumerate(hashes):
                key = h + b"\x00\x00\x00\x00"
                t.remove(key)
                if present[i]:
                    t.put(key, i, i + 1)
            if slots is not None:
                slots.publish(list(range(n)), [i + 1 + (10 ** 6 if stale[i] else 0) for i in range(n)])
        start, stop, pin = rng.randrange(0, 50), rng.randrange(0, n + 20), rng.random() < 0.7
        (ta, _), (tb, _) = tables
        k, sa, ga = ta.prefix_of(hashes, start, stop, 0, pin, True)
        kb, sb, gb = tb.prefix_of(hashes, start, stop, 0, pin)
        assert k is None and isinstance(sa, array.array) and isinstance(ga, array.array)
        assert list(sa) == sb and list(ga) == gb, (rnd, start, stop)
        assert kb == [h + b"\x00\x00\x00\x00" for h in hashes[start:start + len(sb)]]
        assert ta.pins_dict() == tb.pins_dict() and len(ta) == len(tb)
        assert ta.stale_dropped == tb.stale_dropped
        ta.unpin(sa)
        tb.unpin(sb)
        assert ta.pinned_slots == 0 == tb.pinned_slots
    assert not attached or tables[0][0].stale_dropped > 0     # the stale path was walked
