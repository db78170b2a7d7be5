"""Fault campaign, disk full. Slot files are preallocated at creation (a store larger
than the free space is refused up front: test_disk_store.py::
test_capacity_larger_than_disk_refused_at_create, test_ring.py::
test_slotfile_preallocation_enospc_is_clear), so while serving only the LMDB index can
need more disk. Here the store lives on a small tmpfs that another writer fills up
while vLLM serves: the index cannot grow, stores are dropped with one clear warning,
loads and outputs stay correct, and stores resume once space is freed.
"""
import errno
import os

import lmdb
import pytest

from connector_util import (
    conn_stats, drop_gpu_cache, kv_harness, keys_of, loads_ok, prompts, sched, settle, workers,
)
from fault_util import fsck_json
from kvstore.errors import KVStoreError
from kvstore.index.core import Index


def _fill(path) -> int:
    """Take every free byte of the filesystem at `path` (as another tenant would)."""
    n = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 512, 1):
            try:
                while True:
                    n += os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return n


@pytest.mark.parametrize("map_full", [False, True])
def test_index_write_on_a_full_disk_is_a_clear_kvstore_error(small_fs, map_full):
    """The index's LMDB commit fails with ENOSPC: a KVStoreError naming the index and
    the remedy (not an lmdb internal), nothing half-done, and the same Index works again
    once space is back. With `map_full`, the index is reopened with its map exactly as
    large as its file, so the write first hits MapFullError, Index._write doubles the
    map (which needs no disk) and the retried commit then meets the full disk."""
    path = str(small_fs / "index")
    ix = Index(path, 100_000, create=True)
    for i in range(50):
        ix.commit(ix.reserve([b"pre%06d" % (i * 8 + j) for j in range(8)])[0])
    if map_full:
        ix.close()
        ix = Index(path, 100_000, map_size=os.path.getsize(os.path.join(path, "data.mdb")))
    map0 = ix.stats()["map_size"]
    try:
        _fill(small_fs / "filler")
        with pytest.raises(KVStoreError) as ei:
            for i in range(10_000):
                items, _ = ix.reserve([b"key%08d" % (i * 8 + j) for j in range(8)])
                ix.commit(items)
        msg = str(ei.value)
        assert not isinstance(ei.value, lmdb.Error)
        assert "No space left on device" in msg and "filesystem is full" in msg
        assert path in msg
        assert ix.check_consistency() == []
        if map_full:
            assert ix.stats()["map_size"] > map0        # MapFullError grew the map first
        os.unlink(small_fs / "filler")
        items, _ = ix.reserve([b"after"])
        ix.commit(items)
        assert ix.lookup(b"after") is not None and ix.check_consistency() == []
    finally:
        ix.close()


def test_disk_fills_up_while_serving(small_fs, caplog):
    store = small_fs / "store"
    old = prompts(70, 4, 90)                              # 5 full blocks each
    # kv_harness's end-of-test checks (assert_quiescent: nothing pinned, reserved or in
    # flight, no stray open file) run on the store the full disk left behind.
    with kv_harness(store, extra={"capacity": "6M", "staging": "256K"}) as h:
        h.run(old, max_tokens=1)
        settle(h)
        committed = sched(h).store.stats()["used_slots"]
        assert committed == 20
        _fill(small_fs / "filler")
        caplog.clear()
        # Keep serving new prompts (their stores need new index rows) and the old ones
        # (disk hits) until the index runs out of room.
        s0 = conn_stats(h)
        before = dict(h.stats)
        for i in range(40):
            drop_gpu_cache(h)
            h.run(old[i % 4:i % 4 + 1] + prompts(100 + i, 4, 90), max_tokens=2)
            settle(h)
            if conn_stats(h).get("store_dropped_blocks", 0) > s0.get("store_dropped_blocks", 0):
                break
        st = h.stats
        s = conn_stats(h)
        assert s.get("store_dropped_blocks", 0) > s0.get("store_dropped_blocks", 0), \
            "the index never ran out of space"
        # Serving went on: every request finished with verified KV, disk hits included.
        assert st["requests_finished"] - before["requests_finished"] == 5 * (i + 1)
        assert st["blocks_mismatched"] == 0, h.mismatches
        assert st["blocks_loaded"] > before["blocks_loaded"]
        # LMDB says ENOSPC, or EIO when the disk filled in the middle of a page write; the
        # index names the cause either way.
        full = [r for r in caplog.records if "filesystem is full" in r.getMessage()]
        assert full, [r.getMessage() for r in caplog.records]
        assert "filesystem is full" in full[0].getMessage()
        assert len(full) <= 6, "one warning per kind of index write, not one per step"
        # Still full: a disk hit is served (its LRU touch cannot be written).
        drop_gpu_cache(h)
        before = dict(h.stats)
        loads_ok(h.run(old[:2], max_tokens=1))
        assert h.stats["blocks_loaded"] - before["blocks_loaded"] == 10
        # Space comes back: stores resume.
        os.unlink(small_fs / "filler")
        s1 = conn_stats(h)
        fresh = prompts(200, 3, 90)
        h.run(fresh, max_tokens=1)
        settle(h)
        assert conn_stats(h)["stored_blocks"] - s1["stored_blocks"] == 15
        drop_gpu_cache(h)
        before = dict(h.stats)
        loads_ok(h.run(fresh, max_tokens=1))
        assert h.stats["blocks_loaded"] - before["blocks_loaded"] == 15
        settle(h)
        h.assert_no_leaks()
        assert sched(h).store.pinned_slots == 0 and not sched(h).commits.inflight
        assert all(w.slots.free == w.slots.total for w in workers(h))
    code, doc = fsck_json(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_failed_index_commit_releases_its_reservations(tmp_path):
    """An index commit that fails (here: as on a full disk) drops the store: its blocks
    are counted as dropped and its slots go back to free, so a long disk-full episode
    does not eat the store's capacity."""
    store = tmp_path / "store"
    ps = prompts(80, 2, 70)                               # 4 full blocks each
    with kv_harness(store, check=False) as h:
        st = sched(h).store
        ix = st.index                 # the index thread commits through it

        def disk_full(items, **kw):
            raise KVStoreError(f"cannot write the index at {store}/index (committing a "
                               "transaction): mdb_txn_commit: No space left on device")
        ix.commit = disk_full
        try:
            h.run(ps, max_tokens=1)
            settle(h)
        finally:
            del ix.commit
        assert h.stats["blocks_mismatched"] == 0
        assert all(st.lookup(k) is None for p in ps for k in keys_of(h, p))
        assert conn_stats(h).get("store_dropped_blocks", 0) == 8, conn_stats(h)
        assert st.stats()["reserved_slots"] == len(sched(h).index.pooled()), st.stats()
