"""DiskStore: create/open, layout checks, locking, prefix/LRU/pins, verified loads, errors."""
import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore import CorruptIndex, KVStoreError, LayoutMismatch, StoreFull, StoreLocked
from kvstore.store.disk import DiskStore, SlotRef, slot_file_path
from kvstore.format.layout import Layout, parse_size

BB = 16 << 10
LAYOUT = Layout(model="tiny-llama", dtype="float16", block_size=16, block_bytes=BB, num_layers=2,
                num_kv_heads=2, head_dim=64, tp_size=2)


def payload(i, rank):
    return ((np.arange(BB, dtype=np.uint32) * (i + 3) + rank * 7 + i) % 251).astype(np.uint8)


def keys(n, prefix=b"k"):
    return [prefix + b"%05d" % i for i in range(n)]


def check_invariants(st):
    s = st.stats()
    assert s["used_slots"] + s["free_slots"] + s["reserved_slots"] == s["capacity_slots"]
    assert st.index.check_consistency() == []


@pytest.fixture
def store(tmp_path, fd_leak_check):
    st = DiskStore.create(str(tmp_path / "s"), LAYOUT, 40 * (BB + 4096) * 2, io=True)
    yield st
    st.close()


def test_parse_size():
    assert parse_size("500G") == 500 << 30 and parse_size("128K") == 128 << 10
    assert parse_size("2MiB") == 2 << 20 and parse_size(4096) == 4096
    with pytest.raises(KVStoreError, match="cannot parse size"):
        parse_size("lots")


def test_create_layout_permissions(store):
    p = store.path
    assert (os.stat(p).st_mode & 0o777) == 0o700
    for r in (0, 1):
        assert (os.stat(os.path.join(p, f"rank{r}")).st_mode & 0o777) == 0o700
        assert (os.stat(slot_file_path(p, r, 0)).st_mode & 0o777) == 0o600
    assert (os.stat(os.path.join(p, "kvstore.json")).st_mode & 0o777) == 0o600
    assert store.stats()["capacity_slots"] == 40


def test_put_get_round_trip_all_ranks(store):
    ks = keys(30)
    assert store.put(ks, payload) == ks
    got = store.get(ks)
    assert list(got) == ks
    for i, k in enumerate(ks):
        assert got[k][0] == payload(i, 0).tobytes() and got[k][1] == payload(i, 1).tobytes()
    assert store.put(ks, payload) == []  # already present: skipped
    check_invariants(store)


def test_rows_round_trip_without_copies_and_a_bad_block_ends_the_prefix(store):
    """`put(rows=)` writes every rank's row i as key i; `get_into` reads the cached prefix
    back into rows, stops at a damaged block and drops it, as `get` does."""
    from kvstore.store.disk import row_buffers
    ks = keys(8)
    src = row_buffers(LAYOUT, len(ks))
    assert [r.shape for r in src] == [(8, BB)] * 2 and all(r.ctypes.data % 4096 == 0 for r in src)
    for i in range(len(ks)):
        for rank in (0, 1):
            src[rank][i] = payload(i, rank)
    assert store.put(ks[:5], rows=[r[:5] for r in src]) == ks[:5]
    assert store.put(ks[5:], rows=[r[5:] for r in src]) == ks[5:]
    dst = row_buffers(LAYOUT, len(ks))
    assert store.get_into(ks, dst) == ks
    assert all(np.array_equal(dst[r], src[r]) for r in (0, 1))
    # a payload bit flip in block 3 (rank 1): the prefix ends before it, and it leaves
    e3 = store.lookup(ks[3])
    geo = store.geometry
    fd = os.open(slot_file_path(store.path, 1, 0), os.O_RDWR)
    off = (e3.slot % geo.slots_per_file) * geo.slot_size + 4096 + 7
    os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0x04]), off)
    os.close(fd)
    assert store.get_into(ks, row_buffers(LAYOUT, len(ks))) == ks[:3]
    assert store.lookup(ks[3]) is None and store.get(ks[:3]).keys() == set(ks[:3])
    with pytest.raises(TypeError, match="payloads or rows"):
        store.put(ks, payload, rows=src)
    # memory the ring would overrun is refused before any I/O
    with pytest.raises(ValueError, match="at least 8 rows"):
        store.get_into(ks, [r[:4] for r in dst])
    with pytest.raises(ValueError, match="one array per rank"):
        store.put(keys(2, b"x"), rows=src[:1])
    with pytest.raises(ValueError, match="contiguous bytes"):
        store.put(keys(2, b"x"), rows=[r[:, :100] for r in src])
    check_invariants(store)


def test_longest_prefix_with_holes(store):
    ks = keys(10)
    store.put(ks[:4] + ks[5:], lambda i, r: payload(i, r))
    entries = store.longest_prefix(ks)
    assert [e.key for e in entries] == ks[:4]
    assert store.longest_prefix([b"missing"] + ks) == []
    got = store.get(ks)
    assert list(got) == ks[:4]


def test_lru_eviction_and_pins(store):
    first = keys(40, b"a")
    store.put(first, payload)
    store.touch(first[:5])           # the first five are now the hottest
    pinned = store.longest_prefix(first[5:8])
    store.pin(e.slot for e in pinned)
    new = keys(10, b"b")
    store.put(new, payload)          # needs 10 evictions
    present = {e.key for e in store.index.iter_entries()}
    assert set(first[:5]) <= present           # hot entries survive
    assert set(first[5:8]) <= present          # pinned entries survive
    assert set(new) <= present
    assert store.stats()["evictions"] == 10
    store.unpin(e.slot for e in pinned)
    check_invariants(store)


def test_store_full_when_everything_pinned(store):
    ks = keys(40)
    store.put(ks, payload)
    store.pin(e.slot for e in store.longest_prefix(ks))
    before = store.stats()
    with pytest.raises(StoreFull):
        store.reserve([b"new"])
    after = store.stats()
    assert before["used_slots"] == after["used_slots"] and after["reserved_slots"] == 0


def test_bit_flips_caught_and_entry_dropped(store):
    ks = keys(6)
    store.put(ks, payload)
    e2 = store.lookup(ks[2])
    e4 = store.lookup(ks[4])
    geo = store.geometry
    f0 = slot_file_path(store.path, 0, 0)
    fd = os.open(f0, os.O_RDWR)
    # payload bit flip in block 4 (rank 0), header bit flip in block 2 (rank 0)
    off4 = (e4.slot % geo.slots_per_file) * geo.slot_size + 4096 + 100
    os.pwrite(fd, bytes([os.pread(fd, 1, off4)[0] ^ 0x01]), off4)
    off2 = (e2.slot % geo.slots_per_file) * geo.slot_size + 30
    os.pwrite(fd, bytes([os.pread(fd, 1, off2)[0] ^ 0x80]), off2)
    os.close(fd)
    got = store.get(ks)
    assert list(got) == ks[:2]                  # stops at the first bad block
    assert store.lookup(ks[2]) is None and store.lookup(ks[4]) is None  # both dropped
    assert store.lookup(ks[3]) is not None
    check_invariants(store)


def test_header_only_verify_misses_payload_flip_but_checksum_catches(store):
    ks = keys(2)
    store.put(ks, payload)
    e = store.lookup(ks[1])
    geo = store.geometry
    fd = os.open(slot_file_path(store.path, 1, 0), os.O_RDWR)
    off = (e.slot % geo.slots_per_file) * geo.slot_size + 4096 + 5
    os.pwrite(fd, b"\xff", off)
    os.close(fd)
    assert len(store.get(ks, verify="header", touch=False)) == 2
    assert list(store.get(ks, verify="checksum")) == ks[:1]


def test_layout_mismatch_names_field(store, tmp_path):
    p = store.path
    store.close()
    for field, value in [("dtype", "bfloat16"), ("tp_size", 4), ("model", "other"), ("block_size", 32)]:
        with pytest.raises(LayoutMismatch, match=field) as ei:
            DiskStore(p, dataclasses.replace(LAYOUT, **{field: value}))
        assert ei.value.field == field


def test_second_engine_attaches_and_exclusive_open_is_refused_with_pid(store):
    """Engine processes share a store: a second one attaches and reads what the
    first stored; an offline repair's exclusive open is refused, naming an engine's pid."""
    code = textwrap.dedent(f"""
        import sys
        from kvstore.store.disk import DiskStore
        from kvstore import StoreLocked
        st = DiskStore({store.path!r}, io=True)
        print("ATTACHED", len(st.get([b"k00000", b"k00001"])))
        st.put([b"other"], lambda i, r: bytes([7]) * {BB})
        st.close()
        try:
            DiskStore({store.path!r}, exclusive=True)
        except StoreLocked as e:
            print("LOCKED", e.pid)
        ro = DiskStore({store.path!r}, readonly=True, io=True)
        print("RO", ro.stats()["used_slots"], len(ro.get([b"k00000", b"k00001"])))
        ro.close()
    """)
    store.put(keys(2), payload)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert "ATTACHED 2" in out.stdout, out.stderr
    assert f"LOCKED {os.getpid()}" in out.stdout, out.stderr
    assert "RO 3 2" in out.stdout, out.stderr
    # what the other engine stored is found here too, and its reservations are gone
    assert store.get([b"other"])[b"other"][0] == bytes([7]) * BB
    assert store.index.owned_counts() == {}
    # In this process, a second handle is refused (LMDB allows one per process).
    with pytest.raises((StoreLocked, KVStoreError)):
        DiskStore(store.path)


def test_readonly_opener_sees_commits_while_writer_writes(store):
    store.put(keys(5), payload)
    code = textwrap.dedent(f"""
        import time
        from kvstore.store.disk import DiskStore
        ro = DiskStore({store.path!r}, readonly=True)
        seen = [ro.stats()["used_slots"]]
        time.sleep(1.0)
        seen.append(ro.stats()["used_slots"])
        print("SEEN", *seen)
        ro.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    import time
    time.sleep(0.5)
    store.put(keys(5, b"z"), payload)
    out, _ = proc.communicate(timeout=60)
    a, b = map(int, out.split()[1:3])
    assert a >= 5 and b == 10


def test_persistence_across_processes_keeps_lru(tmp_path):
    p = str(tmp_path / "s")
    st = DiskStore.create(p, LAYOUT, 20 * (BB + 4096) * 2, io=True)
    ks = keys(20)
    st.put(ks, payload)
    st.touch(ks[:3])
    st.close()
    code = textwrap.dedent(f"""
        import numpy as np
        from kvstore.store.disk import DiskStore
        from kvstore.format.layout import Layout
        st = DiskStore({p!r}, io=True)
        got = st.get([b"k%05d" % i for i in range(20)], touch=False)
        print("N", len(got))
        st.put([b"new%d" % i for i in range(3)], lambda i, r: np.zeros({BB}, np.uint8))
        print("LEFT", sorted(k.decode() for k in got if st.lookup(k) is None))
        st.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "N 20" in out.stdout, out.stderr
    # The three coldest were evicted; the touched ones (hot) were not.
    left = out.stdout.split("LEFT", 1)[1]
    assert "k00000" not in left and "k00001" not in left and "k00002" not in left
    assert left.count("k000") == 3, left


def test_truncated_slot_file_and_missing_index_clear_errors(tmp_path):
    p = str(tmp_path / "s")
    DiskStore.create(p, LAYOUT, "2M").close()
    os.truncate(slot_file_path(p, 1, 0), 4096)
    with pytest.raises(KVStoreError, match="truncated"):
        DiskStore(p, io=True)
    import shutil
    shutil.rmtree(os.path.join(p, "index"))
    with pytest.raises(CorruptIndex, match="fsck --rebuild-index"):
        DiskStore(p)


def test_capacity_larger_than_disk_refused_at_create(small_fs):
    with pytest.raises(KVStoreError, match="larger than the free space"):
        DiskStore.create(str(small_fs / "s"), LAYOUT, "1G")
    assert not os.path.exists(small_fs / "s" / "kvstore.json")


def test_symlinked_store_and_rank_dir_refused(tmp_path):
    p = tmp_path / "s"
    DiskStore.create(str(p), LAYOUT, "2M").close()
    os.symlink(p, tmp_path / "link")
    with pytest.raises(KVStoreError, match="symlink"):
        DiskStore(str(tmp_path / "link"))
    os.rename(p / "rank1", tmp_path / "r1")
    os.symlink(tmp_path / "r1", p / "rank1")
    with pytest.raises(KVStoreError, match="symlink"):
        DiskStore(str(p), io=True)


def test_not_a_store(tmp_path):
    from kvstore import StoreNotFound
    with pytest.raises(StoreNotFound, match="kvstore.json"):
        DiskStore(str(tmp_path))


def test_damaged_fingerprint(tmp_path):
    p = tmp_path / "s"
    DiskStore.create(str(p), LAYOUT, "2M").close()
    (p / "kvstore.json").write_text("{not json")
    with pytest.raises(KVStoreError, match="not valid JSON"):
        DiskStore(str(p))


def test_closed_store_raises(store):
    store.close()
    store.close()
    with pytest.raises(KVStoreError, match="closed"):
        store.longest_prefix([b"x"])


def test_abort_returns_slots(store):
    refs, _ = store.reserve([b"x", b"y"])
    assert store.stats()["reserved_slots"] == 2
    store.abort(refs)
    assert store.stats()["reserved_slots"] == 0
    check_invariants(store)


def test_write_errors_abort_not_commit(store):
    import errno
    rio = store.ranks[1]
    rio.ring.fault_injector = lambda op, fds, offs, lens: [(1, "error", errno.EIO)] if op == "write" else []
    stored = store.put(keys(3), payload)
    rio.ring.fault_injector = None
    assert stored == [keys(3)[0], keys(3)[2]]
    assert store.lookup(keys(3)[1]) is None
    check_invariants(store)
