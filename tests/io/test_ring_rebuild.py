"""A ring that closed itself (`Ring._abandon`, after an io_uring_enter error with requests
in flight) is rebuilt by RankIO at its next operation: same queue depth, same registered
buffers and slot files; the operation then moves the right bytes. A rebuild that fails
fails that operation only (KVStoreError), and the next one tries again."""
import logging
import mmap

import numpy as np
import pytest

from kvstore.errors import KVStoreError
from kvstore.format.layout import HEADER_SIZE, Layout
from kvstore.io import rings as rank_mod
from kvstore.store.disk import DiskStore

BB = 32 << 10
pytestmark = pytest.mark.timeout(120)


def _layout():
    return Layout(model="ring-rebuild", dtype="float16", block_size=16, block_bytes=BB,
                  num_layers=1, num_kv_heads=1, head_dim=BB // 32)


def _rows(n, seed=0):
    m = mmap.mmap(-1, n * BB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8).reshape(n, BB)
    a[:] = np.random.default_rng(seed).integers(0, 256, size=(n, BB), dtype=np.uint8)
    return m, a


def _addrs(a):
    base = a.__array_interface__["data"][0]
    return np.uint64(base) + np.arange(len(a), dtype=np.uint64) * np.uint64(a.strides[0])


@pytest.fixture(params=["direct", "page_cache"])
def rig(request, tmp_path, fd_leak_check):
    st = DiskStore.create(str(tmp_path / "s"), _layout(), 64 * (BB + HEADER_SIZE),
                          io_mode=request.param, io=True)
    rio = st.ranks[0]
    m, a = _rows(12)
    ks = [b"rb%04d" % i for i in range(len(a))]
    refs, _ = st.reserve(ks)
    assert rio.write_from(refs, a) == [None] * len(refs)
    st.commit(refs)
    yield st, rio, refs, a
    del a
    st.close()


def test_read_at_and_read_blocks_rebuild_a_closed_ring(rig, caplog):
    st, rio, refs, a = rig
    depth = rio.ring.queue_depth
    m2, b = _rows(len(a), seed=1)
    old = rio.ring
    files, bufs = old.files_registered, old.buffers_registered
    old.close()                         # as `_abandon` leaves it
    with caplog.at_level(logging.WARNING, logger="kvstore.io.rank"):
        assert rio.read_at(refs, _addrs(b)) == [None] * len(refs)
    assert np.array_equal(a, b)
    assert rio.ring is not old and not rio.ring.closed and rio.ring.queue_depth == depth
    assert (rio.ring.files_registered, rio.ring.buffers_registered) == (files, bufs)
    assert any("rebuilt" in r.getMessage() for r in caplog.records)

    # read_blocks runs on the device stream, which held the ring: it is made again
    got = np.zeros_like(a)

    def drain(start, stop, views, errs):
        for j, v in enumerate(views):
            assert errs[j] is None
            got[start + j] = v[:BB]
    assert rio.read_blocks(refs, drain) == [None] * len(refs)
    assert np.array_equal(a, got)
    rio.ring.close()
    got[:] = 0
    assert rio.read_blocks(refs, drain) == [None] * len(refs)
    assert np.array_equal(a, got)
    # and writes go on too
    m3, c = _rows(2, seed=2)
    rio.ring.close()
    assert rio.write_from(refs[:2], c) == [None, None]
    b[:] = 0
    assert rio.read_at(refs[:2], _addrs(b[:2])) == [None, None]
    assert np.array_equal(b[:2], c)
    del b, c, got


def test_registered_memory_is_registered_again(rig):
    st, rio, refs, a = rig
    m2, b = _rows(len(a), seed=3)
    registered = rio.register_memory(b)
    rio.ring.close()
    assert rio.read_at(refs, _addrs(b)) == [None] * len(refs)
    assert np.array_equal(a, b)
    assert rio.ring.buffers_registered == registered
    rio.unregister_memory()
    rio.ring.close()
    b[:] = 0
    assert rio.read_at(refs, _addrs(b)) == [None] * len(refs)
    assert np.array_equal(a, b)
    del b


def test_a_failed_rebuild_fails_the_call_and_the_next_one_retries(rig, monkeypatch):
    st, rio, refs, a = rig
    m2, b = _rows(len(a), seed=4)
    real = rank_mod.Ring

    def no_ring(depth):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(rank_mod, "Ring", no_ring)
    rio.ring.close()
    with pytest.raises(KVStoreError, match="could not be rebuilt"):
        rio.read_at(refs, _addrs(b))
    assert not rio.closed               # the RankIO itself stays usable
    monkeypatch.setattr(rank_mod, "Ring", real)
    assert rio.read_at(refs, _addrs(b)) == [None] * len(refs)
    assert np.array_equal(a, b)
    del b
