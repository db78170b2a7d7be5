"""Several engines on one store: races between engine processes on the
shared slot generations, the LMDB map and readers, and leases across fork. Real processes
(spawn), real LMDB, real shared maps; nothing of the product is mocked."""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from kvstore.store import shared
from kvstore.store.disk import DiskStore
from kvstore.errors import StoreFull

from shared_util import k, make


def shared_agrees_with_lmdb(st: DiskStore) -> list[str]:
    """Every committed entry's slot holds its generation in the shared array, and a slot
    that holds no entry holds 0 (checked while no engine writes)."""
    sm = st.shared_slots
    bad = []
    used = {}
    for e in st.index.iter_entries():
        used[e.slot] = e.generation
    for s in range(st.geometry.num_slots):
        want = used.get(s, 0)
        if sm.generation(s) != want:
            bad.append(f"slot {s}: shared {sm.generation(s)}, index {want}")
    return bad


# -- child engines ------------------------------------------------------------------------

def _pinner(path, slots, out, go):
    """An engine that pins `slots` (as a load would) and holds them until told."""
    st = DiskStore(path)
    st.pin(slots)
    out.put(("pinned", os.getpid()))
    go.get(timeout=60)
    st.unpin(slots)
    st.close()
    out.put(("closed",))


def _evictor(path, rounds, out):
    """An engine storing into a one-slot store as fast as it can: each reservation takes
    the slot the other engine just committed. While it holds the reservation, the slot's
    shared generation must stay 0 (nobody else may publish into a slot it holds)."""
    st = DiskStore(path)
    out.put(("ready", os.getpid()))
    seen = []
    got = 0
    deadline = time.monotonic() + 60
    i = 0
    while got < rounds and time.monotonic() < deadline:
        i += 1
        try:
            refs, _ = st.reserve([k(i, b"b")])
        except StoreFull:
            time.sleep(0.0002)
            continue
        got += 1
        time.sleep(0.005)          # the other engine's commit is durable by now
        g = st.shared_slots.generation(refs[0].slot)
        if g != 0:
            seen.append(g)
        st.abort(refs)
        time.sleep(random.uniform(0.0002, 0.002))   # the other engine takes the slot
    st.close()
    out.put(("done", got, seen))


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    extra = []
    if target is _pinner:
        go = ctx.Queue()
        extra = [go]
    p = ctx.Process(target=target, args=(*args, out, *extra), daemon=True)
    p.start()
    return p, out, (extra[0] if extra else None)


@pytest.fixture
def procs():
    ps = []
    yield ps
    for p in ps:
        if p.is_alive():
            p.kill()
        p.join(10)


# -- the shared slot generations ---------------------------------------------------------

def test_a_reservation_refused_as_store_full_leaves_the_generations_it_cleared(tmp_path, procs):
    """Index.reserve clears the shared generation of each eviction candidate it takes
    (`_SharedClaim`); when the reservation then fails (StoreFull: the other engine pins
    the rest), the transaction is rolled back and the entries stay, so their generations
    must be back, or no engine ever hits them again."""
    path = make(tmp_path, 8)
    with DiskStore(path) as st:
        refs, _ = st.reserve([k(i) for i in range(8)])
        st.commit(refs)
        assert shared_agrees_with_lmdb(st) == []
        pinned = [r.slot for r in refs[4:]]
        p, out, go = _spawn(_pinner, path, pinned)
        procs.append(p)
        assert out.get(timeout=60)[0] == "pinned"
        with pytest.raises(StoreFull):
            st.reserve([k(i, b"n") for i in range(6)])      # 4 evictable, 4 pinned elsewhere
        assert shared_agrees_with_lmdb(st) == []
        # and the entries are still hits for this engine's checked lookups
        entries = st.longest_prefix([r.key for r in refs])
        assert len(entries) == 8
        st.pin(e.slot for e in entries)
        assert len(st._still_standing(entries)) == 8
        st.unpin(e.slot for e in entries)
        go.put("go")
        assert out.get(timeout=60)[0] == "closed"


def test_a_commit_is_published_before_another_engine_can_evict_its_slot(tmp_path, procs):
    """A commit published the slot's generation after its LMDB transaction (and fsync):
    in between, another engine could evict the entry and reserve the slot, and the late
    publish then made the evicted entry look valid while the slot was being rewritten."""
    path = make(tmp_path, 1)
    p, out, _ = _spawn(_evictor, path, 30)
    procs.append(p)
    with DiskStore(path) as st:
        assert out.get(timeout=60)[0] == "ready"
        i = 0
        deadline = time.monotonic() + 60
        while p.is_alive() and time.monotonic() < deadline and out.empty():
            i += 1
            try:
                refs, _ = st.reserve([k(i)])
            except StoreFull:
                time.sleep(0.0002)
                continue
            st.commit(refs)
        msg = out.get(timeout=60)
        assert msg[0] == "done" and msg[1] >= 10
        assert msg[2] == [], f"{len(msg[2])} reservations saw a generation published into their slot"
        assert shared_agrees_with_lmdb(st) == []


def test_a_plain_store_opened_first_makes_the_generations_valid(tmp_path, procs):
    """The slot generations were rebuilt (and marked valid) only by a ServingIndex's table
    build: a store opened first by a plain DiskStore (`kvstore warmup`, tools) left them
    zero and invalid, so every engine attaching while it lived served hits unchecked."""
    path = make(tmp_path, 16)
    with DiskStore(path) as st:
        refs, _ = st.reserve([k(i) for i in range(10)])
        st.commit(refs)
    with DiskStore(path, kind="warmup") as st:          # the first engine of this run
        assert st.lease.first
        assert st.shared_slots.load(shared.W_VALID) == 1
        assert shared_agrees_with_lmdb(st) == []
        # a second engine (a server) attaches while it lives: its hits are checked
        r = subprocess.run([sys.executable, "-c", _SERVER_PROBE, path], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[-1] == "validating=True"


_SERVER_PROBE = """
import sys
from kvstore.store.disk import DiskStore
from kvstore.lookup.table import ServingIndex
st = DiskStore(sys.argv[1])
ix = ServingIndex(st, pool_target=2)
ix.wait_ready(30)
print(f"validating={ix._table.validating}")
ix.close(); st.close()
"""


def test_an_eviction_claim_sees_an_engine_that_attached_since_its_peers_were_mapped(tmp_path, procs):
    """The serving index maps the other engines' pin arrays between rounds of its index
    thread (`PeerFollower.follow`); an engine that attached and pinned a slot before the next
    round was invisible to the eviction claim, which took the pinned slot. The claim now
    lists the engines again when one came or went (and a table whose list is stale takes
    nothing), without refusing what it may take: a refill right after an attach is not
    lost (refusing it left the pool empty for a round, and walked every never-used slot
    into the free list)."""
    from kvstore.lookup.table import ServingIndex
    path = make(tmp_path, 16)
    with DiskStore(path) as st:
        ix = ServingIndex(st, pool_target=2)
        assert ix.wait_ready(30)
        ix.commit([(k(0), *[x[0] for x in ix.take([k(0)])])])
        ix.flush()
        e = st.lookup(k(0))
        ix.close()                  # no index thread: nothing follows the peers any more
        assert ix._table.peer_count == 0
        p, out, go = _spawn(_pinner, path, [e.slot])
        procs.append(p)
        assert out.get(timeout=60)[0] == "pinned"
        assert ix._table.peers_stale
        free = next(s_ for s_ in st.index.iter_free() if s_ != e.slot)
        with ix._lock:              # the table alone, its peers as they were listed
            taken, _ = ix._table.claim([(k(0), e.slot)], True)
        assert e.slot not in taken, "a slot another engine pins was taken"
        assert st.shared_slots.generation(e.slot) == e.generation
        taken = ix._claim([])([(None, free), (k(0), e.slot)])  # the index thread's claim
        assert taken == {free}
        assert ix._table.peer_count == 1 and not ix._table.peers_stale
        assert st.shared_slots.generation(e.slot) == e.generation
        go.put("go")
        assert out.get(timeout=60)[0] == "closed"


# -- LMDB shared by several processes ----------------------------------------------------

def _grower(path, out, go):
    """Another engine's index: writes until its map has grown a few times."""
    from kvstore.index.core import Index
    ix = Index(path, map_size=1 << 20)
    out.put(("open",))
    go.get(timeout=60)
    first = ix._env.info()["map_size"]
    n = 0
    # Each round keeps 10 more keys of ~400 bytes: 8x a 1 MiB map is some 2,000 rounds'
    # worth; a map that has not grown after 100 times that many never will (a hang).
    while ix._env.info()["map_size"] < 8 * first:
        if n >= 50 * 200_000:
            out.put(("stuck", ix._env.info()["map_size"], first))
            return
        keys = [b"g%07d" % (n + i) + b"x" * 400 for i in range(50)]
        items, _ = ix.reserve(keys)
        ix.commit(items, sync=False)
        n += 50
        ix.drop(keys[:40])
    out.put(("grown", ix._env.info()["map_size"]))
    ix.close()


def test_index_writes_and_reads_go_on_while_another_process_grows_the_map(tmp_path, procs):
    """A map grown by another process makes LMDB refuse this process's next transaction
    (MDB_MAP_RESIZED): `_write` turned that into a failed write (commits lost), and the
    re-map `_read` did (set_mapsize) while another thread had a transaction open broke
    that thread's transactions."""
    import threading
    from kvstore.index.core import Index
    path = str(tmp_path / "ix")
    ix = Index(path, 1 << 16, create=True, map_size=1 << 20)
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_grower, args=(path, out, go), daemon=True)
    p.start()
    procs.append(p)
    assert out.get(timeout=60)[0] == "open"
    items, _ = ix.reserve([k(i) for i in range(20)])
    ix.commit(items)
    errors: list = []
    stop = threading.Event()

    def reader():               # the step thread's LMDB reads (another engine's blocks)
        keys = [k(i) for i in range(20)]
        while not stop.is_set():
            try:
                assert len(ix.longest_prefix(keys)) == 20
                ix.get_many(keys)
            except Exception as exc:    # noqa: BLE001
                errors.append(f"read: {type(exc).__name__}: {exc}")
    th = threading.Thread(target=reader)
    th.start()
    go.put("go")
    i = 100
    deadline = time.monotonic() + 600       # bounds a hang only
    try:
        while p.is_alive() and out.empty() and len(errors) < 20:
            assert time.monotonic() < deadline, "the other process did not grow the map in 600 s"
            try:
                got, _ = ix.reserve([k(i)])
                ix.commit(got, sync=False)
                ix.drop([k(i)])
            except Exception as exc:    # noqa: BLE001
                errors.append(f"write: {type(exc).__name__}: {exc}")
            i += 1
        msg = out.get(timeout=60)
        assert msg[0] == "grown", msg
        got, _ = ix.reserve([k(99999)])        # after the last growth too
        ix.commit(got)
    except Exception as exc:    # noqa: BLE001
        errors.append(f"write: {type(exc).__name__}: {exc}")
    finally:
        stop.set()
        th.join(300)                            # bounds a hang only
    assert not th.is_alive(), "the reader thread did not stop in 300 s"
    assert errors == []
    assert ix.check_consistency() == []
    ix.close()


def _reader_killed(path, out):
    from kvstore.index.maint import snapshot
    st = DiskStore(path)
    with snapshot(st.index) as snap:
        snap.count("keys")
        out.put(("reading", os.getpid()))
        time.sleep(120)


def _reader_pids(st) -> set[int]:
    """The pids in LMDB's reader table (`mdb_reader_list`: a header line, then one line
    per slot: pid, thread, txnid); parsed, not searched, as a pid can be a substring of a
    thread id."""
    rows = st.index._env.readers().splitlines()[1:]
    return {int(r.split()[0]) for r in rows if r.split()}


def test_a_killed_engines_lmdb_reader_slot_is_cleared_when_it_is_reaped(tmp_path, procs):
    """An engine killed inside a read transaction leaves its slot in LMDB's reader table:
    it pins that snapshot (no page freed since can be reused, so the index file grows with
    every write) and takes one of the 126 slots for good. LMDB clears such slots only when
    asked (mdb_reader_check); the survivors reaping the engine now ask."""
    path = make(tmp_path, 16)
    with DiskStore(path) as st:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_reader_killed, args=(path, out), daemon=True)
        p.start()
        procs.append(p)
        msg = out.get(timeout=60)
        assert msg[0] == "reading"
        assert msg[1] in _reader_pids(st)
        os.kill(p.pid, signal.SIGKILL)
        # the reap sees the engine dead once the kernel has released its locks, i.e. once
        # it has exited; under a loaded suite that can take longer than a moment (a killed
        # process finishes an uninterruptible I/O first), so wait for the exit itself
        p.join(120)
        assert p.exitcode == -signal.SIGKILL
        refs, _ = st.reserve([k(0)])               # reaps the dead engine first
        st.commit(refs)
        assert msg[1] not in _reader_pids(st)
        for i in range(1, 200):                     # churn: freed pages are reused
            refs, _ = st.reserve([k(i)])
            st.commit(refs)
            st.drop([k(i)])
        assert st.index._env.info()["last_pgno"] < 100


# -- leases across fork -------------------------------------------------------------------

def _forking_engine(path, out, go):
    """An engine that forks a child after attaching (a worker started with fork), then
    reserves slots and waits to be killed."""
    st = DiskStore(path)
    refs, _ = st.reserve([k(i, b"f") for i in range(3)])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        # fork() returned here: the store's after-fork handler (the lease's lock let go) ran.
        os.write(w, b"x")
        time.sleep(120)
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"x"        # not before the child is past its after-fork handler
    os.close(r)
    out.put(("forked", os.getpid(), pid))
    go.get(timeout=120)


def test_a_forked_child_does_not_keep_a_killed_engine_alive(tmp_path, procs):
    """The lease's flock belongs to its open file description, which fork shares: a child
    forked by an engine held the lease locked after the engine died, so its reservations
    were never reclaimed (O_CLOEXEC helps only across exec)."""
    path = make(tmp_path, 16)
    with DiskStore(path) as st:
        ctx = mp.get_context("spawn")
        out, go = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_forking_engine, args=(path, out, go), daemon=True)
        p.start()
        procs.append(p)
        msg = out.get(timeout=60)
        assert msg[0] == "forked"
        grandchild = msg[2]
        try:
            theirs = shared.owner_id(msg[1], shared.process_start_ticks(msg[1]))
            assert st.index.owned_counts().get(theirs) == 3
            os.kill(p.pid, signal.SIGKILL)
            # Its exit status, not join(): join waits for the end of the process's sentinel
            # pipe, which the forked grandchild holds open.
            deadline = time.monotonic() + 300      # bounds a hang only
            while p.exitcode is None:
                assert time.monotonic() < deadline, "the killed engine did not exit in 300 s"
                time.sleep(0.05)
            assert p.exitcode == -signal.SIGKILL, p.exitcode
            refs, _ = st.reserve([k(0)])           # reaps the dead engine first
            st.abort(refs)
            assert theirs not in st.index.owned_counts()
            assert [e.pid for e in shared.engines(path)] == [os.getpid()]
        finally:
            os.kill(grandchild, signal.SIGKILL)


def _fork_closer(path, out):
    """An engine whose forked child closes the store it inherited (as a child exiting
    through its own cleanup would), then reports what is left of its lease."""
    st = DiskStore(path)
    refs, _ = st.reserve([k(i, b"c") for i in range(2)])
    pid = os.fork()
    if pid == 0:
        try:
            st.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    alive = [e.pid for e in shared.engines(path) if e.alive]
    owned = st.index.owned_counts().get(st.lease.owner, 0)
    attached = st.lease.slots.load(shared.W_ATTACHED)
    st.commit(refs)
    out.put(("after", os.getpid() in alive, owned, attached))
    st.close()


def test_a_forked_child_closing_its_copy_leaves_the_engine_attached(tmp_path):
    """DiskStore.close in a forked child gave the parent's reservations back (while the
    parent writes them), deleted its lease (its pins invisible to the others) and used
    the parent's LMDB environment across fork."""
    path = make(tmp_path, 16)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_fork_closer, args=(path, out), daemon=True)
    p.start()
    msg = out.get(timeout=60)
    p.join(30)
    assert msg == ("after", True, 2, 1)
    with DiskStore(path) as st:
        assert st.index.check_consistency() == []
        assert len(st.longest_prefix([k(0, b"c"), k(1, b"c")])) == 2
