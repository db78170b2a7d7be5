"""RankIO.write_from / read_into: slots moved straight between disk and caller memory
(one writev/readv of header + payload per slot, stamped and checked by the ring in C),
and the C slot codec itself against the Python one."""
import errno
import mmap

import numpy as np
import pytest

from kvstore import AlignmentError, CorruptSlot
from kvstore import _slotfile
from kvstore._hostbuf import HostBuffer
from kvstore._slotfile import HEADER_SIZE
from kvstore.store.disk import DiskStore, RankIO, SlotRef, slot_file_path
from kvstore.format.layout import Layout

BB = 32 << 10


def _layout(bb=BB):
    return Layout(model="caller-mem", dtype="float16", block_size=16, block_bytes=bb, num_layers=1,
                  num_kv_heads=1, head_dim=bb // 32)


def _rows(n, bb=BB, seed=0):
    """n payload rows in page-aligned anonymous memory (what O_DIRECT needs)."""
    m = mmap.mmap(-1, n * bb, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8).reshape(n, bb)
    a[:] = np.random.default_rng(seed).integers(0, 256, size=(n, bb), dtype=np.uint8)
    return m, a


@pytest.fixture(params=["direct", "page_cache"])
def rig(request, tmp_path, fd_leak_check):
    path = str(tmp_path / "s")
    st = DiskStore.create(path, _layout(), 64 * (BB + HEADER_SIZE), io_mode=request.param, io=True)
    yield st, st.ranks[0]
    st.close()


def _stored(st, rio, a, tag=b"k"):
    ks = [tag + b"%04d" % i for i in range(len(a))]
    refs, _ = st.reserve(ks)
    errs = rio.write_from(refs, a)
    assert errs == [None] * len(refs)
    st.commit(refs)
    return ks, refs


def test_round_trip_rows_and_buffers_interoperate_with_staged_reads(rig):
    st, rio = rig
    m, a = _rows(20)
    ks, refs = _stored(st, rio, a)
    # Into a 2-D array of rows.
    m2, b = _rows(20, seed=1)
    assert rio.read_into(refs, b) == [None] * 20
    assert np.array_equal(a, b)
    # Into a list of separate HostBuffers.
    bufs = [HostBuffer(BB) for _ in range(3)]
    try:
        assert rio.read_into(refs[5:8], [hb.numpy() for hb in bufs]) == [None] * 3
        for j, hb in enumerate(bufs):
            assert np.array_equal(hb.numpy(), a[5 + j])
    finally:
        for hb in bufs:
            hb.close()
    # The same slot format as the staging path: DiskStore.get reads them back.
    got = st.get(ks)
    assert all(got[k][0] == a[i].tobytes() for i, k in enumerate(ks))
    # And slots written through staging are read into caller memory.
    ks2 = [b"p%02d" % i for i in range(4)]
    st.put(ks2, lambda i, r: a[10 + i])
    entries = st.longest_prefix(ks2)
    m3, c = _rows(4, seed=2)
    assert rio.read_into([SlotRef(e.key, e.slot, e.generation) for e in entries], c) == [None] * 4
    assert np.array_equal(c, a[10:14])
    del b, c


def test_batches_larger_than_the_header_pool_and_the_queue(rig):
    st, rio = rig
    rio.HEADER_BATCH = 7          # several ring batches of headers
    m, a = _rows(50)
    ks, refs = _stored(st, rio, a)
    m2, b = _rows(50, seed=3)
    assert rio.read_into(refs, b) == [None] * 50
    assert np.array_equal(a, b)
    del b


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_payload_stale_generation_and_wrong_key_are_refused(rig):
    st, rio = rig
    m, a = _rows(6)
    ks, refs = _stored(st, rio, a)
    slot_size = rio.slot_size
    f = slot_file_path(st.path, 0, 0)
    spf = rio.geometry.slots_per_file
    assert all(r.slot < spf for r in refs)
    _flip(f, refs[1].slot * slot_size + HEADER_SIZE + 100)       # payload byte
    _flip(f, refs[2].slot * slot_size + 20)                       # header byte
    bad = list(refs)
    bad[3] = SlotRef(refs[3].key, refs[3].slot, refs[3].generation + 1)   # stale reference
    bad[4] = SlotRef(b"someone-else", refs[4].slot, refs[4].generation)
    m2, b = _rows(6, seed=4)
    errs = rio.read_into(bad, b)
    assert errs[0] is None and errs[5] is None
    assert np.array_equal(b[0], a[0]) and np.array_equal(b[5], a[5])
    assert isinstance(errs[1], CorruptSlot) and "payload checksum mismatch" in str(errs[1])
    assert isinstance(errs[2], CorruptSlot) and "header checksum" in str(errs[2])
    assert isinstance(errs[3], CorruptSlot) and "generation" in str(errs[3])
    assert isinstance(errs[4], CorruptSlot) and "holds key" in str(errs[4])
    # verify="header" skips the payload checksum, and only that.
    errs = rio.read_into(bad, b, verify="header")
    assert errs[1] is None and all(isinstance(e, CorruptSlot) for e in errs[2:5])
    del b


def test_misaligned_short_and_readonly_buffers_are_refused_before_any_io(tmp_path, fd_leak_check):
    path = str(tmp_path / "s")
    st = DiskStore.create(path, _layout(), 16 * (BB + HEADER_SIZE))
    rio = RankIO(path, 0, layout=_layout(), staging_bytes=4 * (BB + HEADER_SIZE))
    try:
        refs, _ = st.reserve([b"a", b"b"])
        raw = np.zeros(2 * BB + 4096 + 64, dtype=np.uint8)
        base = raw.__array_interface__["data"][0]
        off = (-base) % 4096 + 64                       # deliberately 64 bytes past a page
        rows = raw[off:off + 2 * BB].reshape(2, BB)
        with pytest.raises(AlignmentError, match="4096-aligned.*O_DIRECT"):
            rio.write_from(refs, rows)
        m, a = _rows(2)
        with pytest.raises(AlignmentError, match="hold 32768 bytes"):
            rio.write_from(refs, a[:, :BB - 4096])
        with pytest.raises(AlignmentError, match="buffer 1 must be contiguous and hold"):
            rio.write_from(refs, [a[0], a[1, :100]])
        with pytest.raises(ValueError, match="read-only"):
            rio.read_into(refs, [bytes(BB), bytes(BB)])
        with pytest.raises(ValueError, match="3 payload buffers for 2 blocks"):
            rio.write_from(refs, [a[0], a[1], a[1]])
        with pytest.raises(TypeError, match="Python objects"):
            rio.read_into(refs, np.empty((2, BB), dtype=object))
        with pytest.raises(AlignmentError, match="overlap"):
            rio.read_into(refs, np.lib.stride_tricks.as_strided(a, shape=(2, BB), strides=(0, 1)))
        st.abort(refs)
        assert st.stats()["reserved_slots"] == 0
    finally:
        rio.close()
        st.close()


def test_page_cache_mode_accepts_unaligned_memory(tmp_path, fd_leak_check):
    path = str(tmp_path / "s")
    st = DiskStore.create(path, _layout(), 16 * (BB + HEADER_SIZE), io_mode="page_cache")
    rio = RankIO(path, 0, layout=_layout(), io_mode="page_cache", staging_bytes=4 * (BB + HEADER_SIZE))
    try:
        raw = np.random.default_rng(5).integers(0, 256, 3 * BB + 64, dtype=np.uint8)
        rows = raw[64:64 + 3 * BB].reshape(3, BB)
        refs, _ = st.reserve([b"a", b"b", b"c"])
        assert rio.write_from(refs, rows) == [None] * 3
        st.commit(refs)
        out = np.zeros(3 * BB + 8, dtype=np.uint8)[8:].reshape(3, BB)
        assert rio.read_into(refs, out) == [None] * 3
        assert np.array_equal(out, rows)
    finally:
        rio.close()
        st.close()


def test_short_transfers_resume_and_errors_stay_per_block(rig):
    """The ring resumes a vectored transfer cut short anywhere (inside the header or the
    payload), and an I/O error fails only its own block."""
    st, rio = rig
    m, a = _rows(8)
    # 4096-multiples: O_DIRECT resumes at a sector boundary (4Kn devices refuse 512).
    cuts = {0: 2048, 1: HEADER_SIZE,
            2: HEADER_SIZE + 4096, 3: HEADER_SIZE + BB - 4096}
    if rio._direct:
        cuts[0] = 4096 + 8192     # inside the payload, after the header and two pages
    rio.ring.fault_injector = lambda op, fds, offs, lens: (
        [(i, "short", c) for i, c in cuts.items()] if op in ("read", "write") else [])
    try:
        ks, refs = _stored(st, rio, a)
        m2, b = _rows(8, seed=6)
        assert rio.read_into(refs, b) == [None] * 8
        assert np.array_equal(a, b)
        rio.ring.fault_injector = lambda op, fds, offs, lens: [(6, "error", errno.EIO)] if op == "read" else []
        b[:] = 0
        errs = rio.read_into(refs, b)
    finally:
        rio.ring.fault_injector = None
    assert isinstance(errs[6], OSError) and errs[6].errno == errno.EIO
    assert [e is None for e in errs] == [True] * 6 + [False, True]
    assert np.array_equal(np.delete(a, 6, axis=0), np.delete(b, 6, axis=0))
    del b


def test_c_codec_matches_the_python_codec():
    rng = np.random.default_rng(7)
    for plen in (4096, 5000, BB):
        p = rng.integers(0, 256, plen, dtype=np.uint8)
        key = bytes(rng.integers(0, 256, 36, dtype=np.uint8))
        h_py, h_c = bytearray(HEADER_SIZE), bytearray(HEADER_SIZE)
        _slotfile.encode_header(h_py, key, 11, 3, plen, _slotfile.payload_checksum(p))
        _slotfile.stamp_into(h_c, key, 11, 3, plen, p)
        assert h_py == h_c
        assert _slotfile.check_code(h_c, p, key, 11, 3, plen) == 0
        assert _slotfile.check_code(h_c, p, key, 12, 3, plen) != 0
        q = p.copy()
        q[-1] ^= 1
        assert _slotfile.check_code(h_c, q, key, 11, 3, plen) != 0
        assert _slotfile.check_code(h_c, q, key, 11, 3, plen, False) == 0
    assert _slotfile.check_code(bytes(HEADER_SIZE), p, key, 11, 3, plen) == 1   # never written


def test_registered_caller_memory_moves_as_fixed_buffer_ops(rig):
    """With the rows registered, each slot is two fixed-buffer ops (header, payload); the
    round trip, short transfers, per-slot errors and corruption checks behave the same."""
    st, rio = rig
    m, a = _rows(10)
    m2, b = _rows(10, seed=8)
    assert rio.register_memory(a, b)
    seen = []
    rio.ring.fault_injector = lambda op, fds, offs, lens: (seen.append((op, len(fds))), [])[1]
    ks, refs = _stored(st, rio, a)
    assert rio.read_into(refs, b) == [None] * 10 and np.array_equal(a, b)
    assert ("write", 20) in seen and ("read", 20) in seen          # 2 ops per slot
    # Short ops (op 2i is slot i's header, 2i+1 its payload) and an EIO on slot 4's
    # payload. O_DIRECT resumes only at 4096-byte boundaries: cut inside the header only
    # in page-cache mode.
    faults = [(3, "short", 8192), (5, "short", 3 * 4096), (9, "error", errno.EIO)]
    if not rio._direct:
        faults.append((0, "short", 2048))
    rio.ring.fault_injector = lambda op, fds, offs, lens: faults if op == "read" else []
    b[:] = 0
    errs = rio.read_into(refs, b)
    rio.ring.fault_injector = None
    assert isinstance(errs[4], OSError) and errs[4].errno == errno.EIO
    assert all(e is None for i, e in enumerate(errs) if i != 4)
    assert np.array_equal(np.delete(a, 4, axis=0), np.delete(b, 4, axis=0))
    # Corruption is caught in this mode too.
    _flip(slot_file_path(st.path, 0, 0), refs[7].slot * rio.slot_size + HEADER_SIZE + 5)
    errs = rio.read_into(refs, b)
    assert isinstance(errs[7], CorruptSlot) and "payload checksum" in str(errs[7])
    # Unregistered again: one readv per slot.
    rio.unregister_memory()
    seen.clear()
    rio.ring.fault_injector = lambda op, fds, offs, lens: (seen.append((op, len(fds))), [])[1]
    rio.read_into(refs[:3], b[:3])
    rio.ring.fault_injector = None
    assert seen == [("read", 3)]
    del b


def test_careless_payload_arguments_get_clear_errors_and_cpu_tensors_work(rig):
    """What a user might pass: flat arrays, None, torch tensors, read-only memory."""
    import torch
    st, rio = rig
    m, a = _rows(2)
    refs, _ = st.reserve([b"t0", b"t1"])
    for bad in (a.reshape(-1), a.reshape(2, 2, BB // 2), None, bytes(2 * BB)):
        with pytest.raises(ValueError, match="2-D array with one row per block"):
            rio.write_from(refs, bad)
    # CPU tensors share memory with numpy: written from a tensor, read into tensors.
    assert rio.write_from(refs, torch.from_numpy(a)) == [None, None]
    st.commit(refs)
    m2, b = _rows(2, seed=9)
    assert rio.read_into(refs, [torch.from_numpy(r) for r in b]) == [None, None]
    assert np.array_equal(a, b)
    with pytest.raises(TypeError, match="needs writable memory"):
        rio.register_memory(np.frombuffer(bytes(BB), np.uint8))
    with pytest.raises(TypeError, match="takes host memory"):
        rio.register_memory(None)
    assert rio.register_memory(torch.from_numpy(b))
    rio.unregister_memory()
    del b


def test_queue_depth_is_raised_to_keep_inflight_bytes_in_flight(tmp_path, fd_leak_check):
    """`inflight_bytes` sizes a ring's depth in bytes: small slots get more of them in
    flight (never fewer than `queue_depth`, at most MAX_DEPTH), 0 keeps `queue_depth`;
    the serving configuration's default reaches RankIO, and slots move at that depth."""
    from kvstore.io.rings import INFLIGHT_BYTES, MAX_DEPTH, ring_depth
    from kvstore.lookup.opening import open_rank_io
    from kvstore.store.config import StoreConfig
    slot = BB + HEADER_SIZE
    assert ring_depth(slot, 32, 0) == 32
    assert ring_depth(slot, 32, 1 << 20) == 32              # 32 slots hold more than 1 MiB
    assert ring_depth(slot, 4, 1 << 20) == -(-(1 << 20) // slot) == 29
    assert ring_depth(slot, 4, 1 << 30) == MAX_DEPTH
    assert ring_depth(8 << 20, 32, INFLIGHT_BYTES) == 32    # big slots: the queue depth
    path = str(tmp_path / "s")
    DiskStore.create(path, _layout(), 256 * slot).close()
    rio = RankIO(path, 0, layout=_layout(), queue_depth=4)
    assert rio.queue_depth == rio.ring.queue_depth == 4
    rio.close()
    cfg = StoreConfig(**StoreConfig.store_fields({"path": path}, forward_on_host=True))
    assert cfg.queue_depth == 32 and cfg.inflight_bytes == INFLIGHT_BYTES
    with DiskStore(path, _layout()) as st:
        rio = open_rank_io(cfg, _layout(), 0, staging_bytes=1 << 20)
        try:
            want = -(-INFLIGHT_BYTES // slot)
            assert rio.queue_depth == rio.ring.queue_depth == want > 32
            m, a = _rows(min(250, want * 2 + 3))     # more than a full queue
            ks, refs = _stored(st, rio, a)
            m2, b = _rows(len(a), seed=5)
            assert rio.read_into(refs, b) == [None] * len(a)
            assert np.array_equal(a, b)
            del a, b
        finally:
            rio.close()
