"""The io_uring Ring: round trips, batching, validation, errors, lifecycle, fd leaks."""
import errno
import os
import warnings

import numpy as np
import pytest

from kvstore import AlignmentError, KVStoreError
from kvstore._hostbuf import HostBuffer
from kvstore._ring import Ring
from kvstore._slotfile import SlotFile

BS = 64 << 10


def _setup(tmp_path, direct=True, nslots=64, depth=8, staging=64):
    f = SlotFile(str(tmp_path / "f.kvs"), BS, nslots, direct=direct, create=True)
    hb = HostBuffer(staging * BS)
    ring = Ring(depth)
    ring.register_buffers([hb])
    ring.register_files([f.fd], [f.path])
    return f, hb, ring


def _io(ring, f, hb, opcode, slots, stage_idx=None):
    n = len(slots)
    stage_idx = list(range(n)) if stage_idx is None else stage_idx
    offs = np.array(slots, dtype=np.uint64) * BS
    addrs = hb.address + np.array(stage_idx, dtype=np.uint64) * BS
    return ring.submit(opcode, [f.fd] * n, offs, addrs, [BS] * n)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_round_trip_both_modes(tmp_path, direct, fd_leak_check):
    f, hb, ring = _setup(tmp_path, direct=direct)
    a = hb.numpy()
    rng = np.random.default_rng(0)
    a[: 16 * BS] = rng.integers(0, 256, 16 * BS, dtype=np.uint8)
    expect = a[: 16 * BS].copy()
    slots = [3, 9, 0, 63, 17, 40, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15]
    res = _io(ring, f, hb, 1, slots)
    assert (res == BS).all()
    ring.fdatasync([f.fd])
    a[:] = 0
    res = _io(ring, f, hb, 0, slots)
    assert (res == BS).all()
    assert np.array_equal(a[: 16 * BS], expect)
    # Cross-check against the kernel's plain pread: the bytes are really in the file.
    raw = os.pread(os.open(f.path, os.O_RDONLY), BS, 63 * BS) if not direct else None
    if raw is not None:
        assert raw == expect[3 * BS: 4 * BS].tobytes()
    del a
    ring.close(); f.close(); hb.close()


def test_batch_larger_than_queue_depth(tmp_path, fd_leak_check):
    f, hb, ring = _setup(tmp_path, depth=4, nslots=64, staging=64)
    a = hb.numpy()
    for i in range(64):
        a[i * BS:(i + 1) * BS] = i
    res = _io(ring, f, hb, 1, list(range(64)))
    assert (res == BS).all()
    a[:] = 255
    res = _io(ring, f, hb, 0, list(range(64)))
    assert (res == BS).all()
    for i in range(64):
        assert (a[i * BS:(i + 1) * BS] == i).all()
    del a
    ring.close(); f.close(); hb.close()


def test_unregistered_buffers_fallback_still_works(tmp_path, fd_leak_check):
    f, hb, ring = _setup(tmp_path)
    hb2 = HostBuffer(4 * BS)
    ring2 = Ring(4)
    # Register, then drop the kernel registration by re-registering nothing: the
    # HostBuffer list is what validation checks, registration is only an optimisation.
    assert ring2.register_buffers([hb2]) in (True, False)
    ring2.register_files([f.fd])
    hb2.numpy()[:] = 42
    res = ring2.submit(1, [f.fd], [0], [hb2.address], [BS])
    assert res[0] == BS
    ring2.close(); hb2.close(); ring.close(); f.close(); hb.close()


@pytest.mark.parametrize("case", ["addr", "length", "offset", "outside", "zero"])
def test_misalignment_refused_with_numbers(tmp_path, case, fd_leak_check):
    f, hb, ring = _setup(tmp_path)
    addr, length, off = hb.address, BS, 0
    if case == "addr":
        addr += 512
    elif case == "length":
        length = BS - 100
    elif case == "offset":
        off = 4097
    elif case == "outside":
        addr = hb.address + hb.nbytes  # past the end of the staging buffer
    elif case == "zero":
        length = 0
    with pytest.raises(AlignmentError) as ei:
        ring.submit(0, [f.fd], [off], [addr], [length])
    msg = str(ei.value)
    assert "refused before submission" in msg
    assert f"0x{addr:x}" in msg or hex(addr) in msg
    ring.close(); f.close(); hb.close()


def test_negative_result_is_oserror_naming_op_file_offset(tmp_path, fd_leak_check):
    f, hb, ring = _setup(tmp_path, nslots=4)
    past_end = 10 * BS
    res = ring.submit(0, [f.fd], [past_end], [hb.address], [BS])
    assert res[0] == -errno.ENODATA  # read past EOF makes no progress: reported, not ignored
    with pytest.raises(OSError) as ei:
        ring.read([(f.fd, past_end, hb.address, BS)])
    assert ei.value.filename == f.path
    assert "read" in str(ei.value) and str(past_end) in str(ei.value)
    # A write to a read-only fd fails with EBADF from the kernel.
    ro = os.open(f.path, os.O_RDONLY)
    res = ring.submit(1, [ro], [0], [hb.address], [BS])
    assert res[0] == -errno.EBADF
    os.close(ro)
    ring.close(); f.close(); hb.close()


def test_short_transfers_are_completed(tmp_path, fd_leak_check):
    """A transfer that the kernel completes partially is resubmitted for its remainder."""
    f, hb, ring = _setup(tmp_path, direct=False)
    a = hb.numpy()
    a[:4 * BS] = np.arange(4 * BS, dtype=np.uint64).astype(np.uint8)
    ring.fault_injector = lambda op, fds, offs, lens: [(0, "short", 4096), (2, "short", 8192)]
    res = _io(ring, f, hb, 1, [0, 1, 2, 3])
    assert (res == BS).all()
    ring.fault_injector = None
    expect = a[:4 * BS].copy()
    a[:] = 0
    _io(ring, f, hb, 0, [0, 1, 2, 3])
    assert np.array_equal(a[:4 * BS], expect)
    del a
    ring.close(); f.close(); hb.close()


def test_injected_error_is_reported_per_op(tmp_path, fd_leak_check):
    f, hb, ring = _setup(tmp_path)
    ring.fault_injector = lambda op, fds, offs, lens: [(1, "error", errno.EIO)]
    res = _io(ring, f, hb, 1, [0, 1, 2])
    assert res[0] == BS and res[1] == -errno.EIO and res[2] == BS
    ring.close(); f.close(); hb.close()


def test_closed_ring_and_file_raise(tmp_path, fd_leak_check):
    f, hb, ring = _setup(tmp_path)
    ring.close()
    ring.close()  # idempotent
    assert ring.closed
    with pytest.raises(KVStoreError, match="closed Ring"):
        ring.submit(0, [f.fd], [0], [hb.address], [BS])
    with pytest.raises(KVStoreError):
        ring.fdatasync([f.fd])
    f.close()
    f.close()
    with pytest.raises(KVStoreError, match="closed"):
        f.fd
    hb.close()
    with pytest.raises(KVStoreError, match="closed"):
        hb.address


def test_hundred_rings_leak_no_fd(tmp_path, fd_leak_check):
    for _ in range(50):
        r = Ring(16)
        r.close()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(50):
            r = Ring(16)
            del r  # dropped while open: the safety net closes it and warns
        import gc
        gc.collect()
    assert any(issubclass(x.category, ResourceWarning) for x in w)


def test_invalid_queue_depth():
    with pytest.raises(ValueError):
        Ring(0)


def test_enospc_on_full_filesystem_is_an_error(small_fs, fd_leak_check):
    """Writing past the space of a real 8 MiB tmpfs reports ENOSPC; the ring stays usable."""
    path = str(small_fs / "big.kvs")
    hb = HostBuffer(BS)
    hb.numpy()[:] = 1
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # sparse: no preallocation
    ring = Ring(8)
    ring.register_buffers([hb])
    n = (16 << 20) // BS
    res = ring.submit(1, [fd] * n, np.arange(n, dtype=np.uint64) * BS, [hb.address] * n, [BS] * n)
    assert (res == -errno.ENOSPC).any(), res
    assert (res[:8] == BS).all()  # the first writes fit and succeeded
    with pytest.raises(OSError) as ei:
        ring.raise_for_results(1, res, [fd] * n, np.arange(n) * BS)
    assert ei.value.errno == errno.ENOSPC
    # Nothing else broke: the same ring still reads what was written.
    hb.numpy()[:] = 0
    assert ring.submit(0, [fd], [0], [hb.address], [BS])[0] == BS
    assert (hb.numpy() == 1).all()
    ring.close(); os.close(fd); hb.close()


def test_slotfile_preallocation_enospc_is_clear(small_fs, fd_leak_check):
    with pytest.raises(OSError) as ei:
        SlotFile(str(small_fs / "x.kvs"), BS, 1024, create=True)
    assert ei.value.errno == errno.ENOSPC and "lower the store capacity" in str(ei.value)
    assert not os.path.exists(small_fs / "x.kvs")  # nothing half-made left behind


def test_fault_injector_naming_a_missing_op_is_refused(tmp_path, fd_leak_check):
    """The test seam checks its indices (an out-of-range one once wrote past the batch)."""
    f, hb, ring = _setup(tmp_path)
    ring.fault_injector = lambda op, fds, offs, lens: [(len(fds), "short", 4096)]
    with pytest.raises(IndexError, match="op 3 of a write batch of 3"):
        _io(ring, f, hb, 1, [0, 1, 2])
    ring.fault_injector = None
    assert (_io(ring, f, hb, 1, [0, 1, 2]) == BS).all()   # the ring is still usable
    ring.close(); f.close(); hb.close()


def test_staging_over_1gib_is_registered_in_pieces_and_ops_across_a_seam_still_work(tmp_path, fd_leak_check):
    """The kernel registers at most 1 GiB per buffer: larger memory is registered in
    pieces, and an op that straddles two pieces goes unregistered instead of failing."""
    f = SlotFile(str(tmp_path / "f.kvs"), BS, 8, direct=True, create=True)
    hb = HostBuffer((1 << 30) + 4 * BS)
    ring = Ring(8)
    try:
        assert ring.register_buffers([hb]) is True and "buffers=2 registered" in repr(ring)
        a = hb.numpy()
        seam = (1 << 30) - BS // 2                   # this op crosses the 1 GiB seam
        spots = [0, seam, (1 << 30) + BS]
        for k, off in enumerate(spots):
            a[off:off + BS] = k + 1
        addrs = hb.address + np.array(spots, dtype=np.uint64)
        res = ring.submit(1, [f.fd] * 3, np.arange(3, dtype=np.uint64) * BS, addrs, [BS] * 3)
        assert (res == BS).all()
        for off in spots:
            a[off:off + BS] = 0
        res = ring.submit(0, [f.fd] * 3, np.arange(3, dtype=np.uint64) * BS, addrs, [BS] * 3)
        assert (res == BS).all()
        assert all((a[off:off + BS] == k + 1).all() for k, off in enumerate(spots))
        del a
    finally:
        ring.close(); f.close(); hb.close()


def test_fault_injector_rejects_faults_that_would_not_test_anything(tmp_path, fd_leak_check):
    f, hb, ring = _setup(tmp_path)
    for faults, match in [([(0, "error", errno.EIO), (0, "error", errno.EIO)], "twice"),
                          ([(0, "error", 0)], "non-zero"),
                          ([(0, "short", BS)], "must cut")]:
        ring.fault_injector = lambda op, fds, offs, lens, faults=faults: faults
        with pytest.raises(ValueError, match=match):
            _io(ring, f, hb, 1, [0, 1])
    ring.fault_injector = None
    assert (_io(ring, f, hb, 1, [0, 1]) == BS).all()
    ring.close(); f.close(); hb.close()
