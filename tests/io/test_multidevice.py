"""One store over several devices: slots striped over data directories, each on
its own real, loop-mounted ext4 file system, one io_uring ring per device; the index,
fingerprint and lock stay in the store directory."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import time

import numpy as np
import pytest

from kvstore import KVStoreError, LayoutMismatch
from kvstore.store.disk import DiskStore, RankIO, SlotRef, ensure_store, slot_file_path
from kvstore.errors import StoreNotFound
from kvstore.format.layout import Layout, read_fingerprint

BB = 16 << 10
SLOT = BB + 4096
LAYOUT = Layout(model="tiny-llama", dtype="float16", block_size=16, block_bytes=BB, num_layers=2,
                num_kv_heads=2, head_dim=64, tp_size=2)
LAYOUT1 = Layout(model="tiny-llama", dtype="float16", block_size=16, block_bytes=BB, num_layers=2,
                 num_kv_heads=2, head_dim=64, tp_size=1)
from mount_util import loop_ext4


def _loop_ext4(tmp_path, name: str, mib: int):
    return loop_ext4(tmp_path, name, mib)


@pytest.fixture
def disks(tmp_path):
    """Three real, small ext4 file systems on loop devices (24 MiB each), each with an
    empty data directory `kv` (as an operator makes /mnt/nvmeN/kv)."""
    yield from _three_disks(tmp_path, 24)


def _three_disks(tmp_path, mib: int):
    mnts = []
    try:
        for i in range(3):
            mnts.append(_loop_ext4(tmp_path, f"nvme{i}", mib))
            (mnts[-1] / "kv").mkdir()
        yield [str(m / "kv") for m in mnts]
    finally:
        for m in mnts:
            subprocess.run(["umount", "-l", str(m)], check=False)


def payload(i, rank):
    return ((np.arange(BB, dtype=np.uint32) * (i + 3) + rank * 7 + i) % 251).astype(np.uint8)


def keys(n, prefix=b"k"):
    return [prefix + b"%05d" % i for i in range(n)]


def _create(tmp_path, dirs, nslots=40, layout=LAYOUT, **kw):
    return DiskStore.create(str(tmp_path / "store"), layout, nslots * SLOT * layout.tp_size,
                            data_dirs=dirs, io=True, staging_bytes=1 << 20, **kw)


def test_store_over_three_devices_round_trips_and_reads_every_device(tmp_path, disks, fd_leak_check):
    with _create(tmp_path, disks, nslots=40) as st:
        store = st.path
        fp = json.load(open(os.path.join(store, "kvstore.json")))
        assert fp["data_dirs"] == disks
        assert st.geometry.num_devices == 3
        # the slots are on the devices, not in the store directory (index, lock and
        # fingerprint are)
        assert not os.path.exists(os.path.join(store, "rank0"))
        assert os.path.isdir(os.path.join(store, "index"))
        for d, ddir in enumerate(disks):
            for r in (0, 1):
                n = st.geometry.device_slots(d)
                assert os.path.getsize(slot_file_path(ddir, r, 0)) == n * SLOT
            assert json.load(open(os.path.join(ddir, "kvstore-data.json"))) == {"store": store, "device": d, "complete": True}
        assert [st.geometry.device_slots(d) for d in range(3)] == [14, 13, 13]
        ks = keys(30)
        assert st.put(ks, payload) == ks
        for rio in st.ranks:
            assert len(rio.rings) == 3
            assert (rio.io_bytes[:, 1] > 0).all(), rio.io_bytes     # written to every device
        got = st.get(ks)
        assert len(got) == 30
        for i, k in enumerate(ks):
            for r in (0, 1):
                assert got[k][r] == payload(i, r).tobytes()
        for rio in st.ranks:
            assert (rio.io_bytes[:, 0] > 0).all(), rio.io_bytes     # read from every device
        # slot s really lives on device s % 3 at local slot s // 3
        e = st.lookup(ks[7])
        dev, local = e.slot % 3, e.slot // 3
        with open(slot_file_path(disks[dev], 1, 0), "rb") as f:
            f.seek(local * SLOT + 4096)
            assert f.read(BB) == payload(7, 1).tobytes()
        assert st.index.check_consistency() == []
    # restart: a fresh open reads the data dirs from kvstore.json
    with DiskStore(store, LAYOUT, io=True, staging_bytes=1 << 20) as st:
        got = st.get(ks)
        assert [got[k][0] for k in ks] == [payload(i, 0).tobytes() for i in range(30)]
    # a read-only opener too (tools)
    with DiskStore(store, readonly=True, io=True, staging_bytes=1 << 20) as st:
        assert len(st.get(ks, touch=False)) == 30


def test_devices_serve_in_parallel_with_their_own_queues(tmp_path, disks):
    """A batch is split by device and every device's part is in flight on its own ring
    at once (each at its own queue depth)."""
    with _create(tmp_path, disks, nslots=60, layout=LAYOUT1, queue_depth=4,
                 inflight_bytes=0) as st:     # the depth in slots alone
        rio = st.ranks[0]
        assert [r.queue_depth for r in rio.rings] == [4, 4, 4]
        seen = {}

        import threading
        threads = {}

        def spy(d):
            def inj(op, fds, offs, lens):
                seen.setdefault(d, []).append((op, len(fds)))
                threads.setdefault(d, set()).add(threading.current_thread().name)
                return []
            return inj
        for d, ring in enumerate(rio.rings):
            ring.fault_injector = spy(d)
        ks = keys(45)
        st.put(ks, payload)
        assert len(st.get(ks)) == 45
        for ring in rio.rings:
            ring.fault_injector = None
        # writes and reads of 45 slots: 15 per device, on that device's ring
        for d in range(3):
            assert sum(n for op, n in seen[d] if op == "write") == 15
            assert sum(n for op, n in seen[d] if op == "read") == 15
            assert ("fdatasync", 1) in seen[d]          # each device syncs its own file
            # each ring is only ever used by its own device thread
            assert len(threads[d]) == 1 and threads[d].pop().startswith(f"kvstore-dev{d}-")
        # a fault on one device fails only that device's blocks
        rio.rings[1].fault_injector = lambda op, fds, offs, lens: (
            [(i, "error", errno.EIO) for i in range(len(fds))] if op == "read" else [])
        refs = [SlotRef(e.key, e.slot, e.generation) for e in st.longest_prefix(ks)]
        got = []
        errs = rio.read_blocks(refs, lambda a, b, views, errors: got.extend(
            bytes(v) for v, e in zip(views, errors) if e is None))
        rio.rings[1].fault_injector = None
        bad = [refs[i].slot for i, e in enumerate(errs) if e is not None]
        assert bad and all(s % 3 == 1 for s in bad) and len(bad) == 15
        assert all(isinstance(errs[i], OSError) and errs[i].errno == errno.EIO
                   for i in range(len(refs)) if refs[i].slot % 3 == 1)


def test_caller_memory_and_headers_over_devices(tmp_path, disks):
    from kvstore import HostBuffer
    with _create(tmp_path, disks, nslots=30, layout=LAYOUT1) as st:
        rio = st.ranks[0]
        refs, _ = st.reserve(keys(20))
        src = HostBuffer(20 * BB)
        dst = HostBuffer(20 * BB)
        try:
            a = src.numpy().reshape(20, BB)
            for i in range(20):
                a[i] = payload(i, 0)
            assert rio.register_memory(src.numpy().reshape(20, BB), dst.numpy().reshape(20, BB))
            assert rio.write_from(refs, a) == [None] * 20
            b = dst.numpy().reshape(20, BB)
            assert rio.read_into(refs, b) == [None] * 20
            assert (a == b).all()
            hdrs = rio.read_headers([r.slot for r in refs])
            assert [h.generation for h in hdrs] == [r.generation for r in refs]
            rio.unregister_memory()
        finally:
            src.close()
            dst.close()
        st.commit(refs)


def test_single_directory_store_fingerprint_unchanged(tmp_path):
    st = DiskStore.create(str(tmp_path / "s"), LAYOUT1, 10 * SLOT)
    st.close()
    fp = json.load(open(tmp_path / "s" / "kvstore.json"))
    assert "data_dirs" not in fp
    assert read_fingerprint(str(tmp_path / "s"))[1].num_devices == 1
    assert os.path.isfile(slot_file_path(str(tmp_path / "s"), 0, 0))


def test_data_dirs_mismatch_refused_naming_the_field(tmp_path, disks):
    _create(tmp_path, disks[:2], nslots=20).close()
    store = str(tmp_path / "store")
    for wrong in (disks, disks[:1], [disks[1], disks[0]], [store]):
        with pytest.raises(LayoutMismatch) as ei:
            DiskStore(store, LAYOUT, data_dirs=wrong)
        assert ei.value.field == "data_dirs" and "data_dirs" in str(ei.value)
        with pytest.raises(LayoutMismatch) as ei:
            ensure_store(store, LAYOUT, data_dirs=wrong)
        assert ei.value.field == "data_dirs"
    ensure_store(store, LAYOUT, data_dirs=disks[:2])       # the same dirs: fine
    ensure_store(store, LAYOUT)                             # no opinion: fine
    DiskStore(store, LAYOUT, data_dirs=disks[:2]).close()
    # a single-directory store refuses data dirs it was not created with
    DiskStore.create(str(tmp_path / "one"), LAYOUT, 10 * SLOT * 2).close()
    with pytest.raises(LayoutMismatch, match="data_dirs"):
        ensure_store(str(tmp_path / "one"), LAYOUT, data_dirs=disks)


def test_unusable_data_dirs_refused_with_what_to_do(tmp_path, disks, ramfs, small_fs):
    store = str(tmp_path / "store")
    with pytest.raises(StoreNotFound, match=r"does not exist.*mkdir -p"):
        DiskStore.create(store, LAYOUT, 20 * SLOT * 2, data_dirs=[disks[0], disks[1] + "-nope"])
    link = str(tmp_path / "link")
    os.symlink(disks[1], link)
    with pytest.raises(KVStoreError, match="symlink; give its real path"):
        DiskStore.create(store, LAYOUT, 20 * SLOT * 2, data_dirs=[disks[0], link])
    with pytest.raises(KVStoreError, match=r"does not support O_DIRECT.*page_cache"):
        DiskStore.create(store, LAYOUT, 20 * SLOT * 2, data_dirs=[disks[0], str(ramfs)])
    with pytest.raises(KVStoreError, match="twice"):
        DiskStore.create(store, LAYOUT, 20 * SLOT * 2, data_dirs=[disks[0], disks[0] + "/"])
    assert not os.path.exists(os.path.join(store, "kvstore.json"))
    # page-cache mode takes a tmpfs directory
    DiskStore.create(store, LAYOUT, 20 * SLOT * 2, data_dirs=[disks[0], str(small_fs)],
                     io_mode="page_cache").close()
    with DiskStore(store, LAYOUT, io=True, io_mode="page_cache", staging_bytes=1 << 20) as st:
        assert st.put(keys(10), payload) == keys(10)
        assert len(st.get(keys(10))) == 10
    # a data directory of another store is refused
    with pytest.raises(KVStoreError, match="belongs to store"):
        DiskStore.create(str(tmp_path / "other"), LAYOUT, 20 * SLOT * 2, data_dirs=[disks[0]])


def _fill_fs(path) -> None:
    """Take every free byte of the filesystem at `path` (as another tenant would)."""
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_full_device_next_to_empty_ones(tmp_path, disks):
    """Capacity is checked per device at creation: a device without room for its share is
    refused by name even though the others are empty. Once created, a device filled up by
    another tenant still takes its (preallocated) slots: stores and loads work."""
    _fill_fs(os.path.dirname(disks[1]))
    with pytest.raises(KVStoreError) as ei:
        _create(tmp_path, disks, nslots=30)
    assert disks[1] in str(ei.value) and "free" in str(ei.value)
    assert disks[0] not in str(ei.value) and disks[2] not in str(ei.value)
    os.unlink(os.path.join(os.path.dirname(disks[1]), "filler"))
    with _create(tmp_path, disks, nslots=30) as st:
        for d in disks:
            _fill_fs(os.path.dirname(d))
        ks = keys(24)
        assert st.put(ks, payload) == ks
        got = st.get(ks)
        assert [got[k][1] for k in ks] == [payload(i, 1).tobytes() for i in range(24)]


def _flip(path, off):
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), off)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_info_lists_every_device(tmp_path, disks):
    from click.testing import CliRunner
    from kvstore.cli import main
    from kvstore.tools.info import format_text, gather
    with _create(tmp_path, disks, nslots=40) as st:
        ks = keys(20)
        st.put(ks, payload)
        st.get(ks[:9])
        st.drop([ks[3]])                 # slot 3 -> device 0 free
        refs, _ = st.reserve([b"inflight"])   # one reserved slot
        store = st.path
    r = CliRunner().invoke(main, ["info", "--json", store])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    devs = info["devices"]
    assert [d["path"] for d in devs] == disks and info["data_dirs"] == disks
    assert all(d["state"] == "ok" for d in devs)
    assert [d["capacity_slots"] for d in devs] == [14, 13, 13]
    # 19 used: slots 0..19 less the dropped slot 3 (device 0); the reservation took the
    # free slot 3 back (free slots go first), so device 0 holds 7 - 1 used
    assert sum(d["used_slots"] for d in devs) == info["used_slots"] == 19
    assert [d["used_slots"] for d in devs] == [6, 7, 6]
    # the in-flight reservation went back when the engine closed the store (with other
    # engines attached nobody else would reclaim it)
    assert info["reserved_slots"] == 0 and info["engines"] == []
    for d in devs:
        assert d["bytes_written"] >= 6 * SLOT * 2           # both ranks wrote there
        assert d["bytes_read"] >= 3 * SLOT * 2              # 9 blocks read, 3 per device
    # counters persist in the data directories (per rank)
    assert sum(d["bytes_written"] for d in devs) == 20 * SLOT * 2
    text = format_text(gather(store))
    for i, d in enumerate(disks):
        assert f"device{i}" in text and d in text
    # a missing device is named
    subprocess.run(["umount", "-l", os.path.dirname(disks[2])], check=True)
    info = gather(store)
    assert [d["state"] for d in info["devices"]] == ["ok", "ok", "missing"]
    assert "MISSING" in format_text(info)


def test_fsck_deep_checks_every_device(tmp_path, disks):
    from kvstore.tools.fsck import fsck
    with _create(tmp_path, disks, nslots=40) as st:
        ks = keys(30)
        st.put(ks, payload)
        bad = st.lookup(ks[11])            # slot 11: device 2, local 3
        store = st.path
    rep = fsck(store, deep=True)
    assert rep.exit_code == 0, [(f.kind, f.detail[-40:]) for f in rep.findings][:6]
    assert rep.stats["devices"] == 3
    # every device was read in full: 10 slots per device, 2 ranks
    assert rep.stats["device_bytes_read"] == [10 * SLOT * 2] * 3
    dev, local = bad.slot % 3, bad.slot // 3
    assert dev == 2
    _flip(slot_file_path(disks[dev], 1, 0), local * SLOT + 4096 + 77)
    rep = fsck(store, deep=True)
    assert [(f.kind, f.slot, f.rank) for f in rep.findings] == [("payload_corrupt", bad.slot, 1)]
    rep = fsck(store, deep=True, repair=True)
    assert rep.exit_code == 1
    assert fsck(store, deep=True).exit_code == 0
    with DiskStore(store, io=True, staging_bytes=1 << 20) as st:
        got = st.get(ks)
        assert len(got) == 11            # the prefix stops at the dropped block
    # a device whose directory is gone (not mounted) is reported, never recreated
    subprocess.run(["umount", "-l", os.path.dirname(disks[1])], check=True)
    rep = fsck(store, repair=True)
    missing = [f for f in rep.findings if f.kind == "slot_file_missing"]
    assert missing and not any(f.fixed for f in missing)
    assert "mount the device" in missing[0].detail
    assert not os.path.exists(disks[1])
    # its entries are reported and kept (valid again once the device is back)
    away = [f for f in rep.findings if f.kind == "slot_unreadable"]
    assert away and all(f.slot % 3 == 1 and not f.fixed and "is missing" in f.detail for f in away)
    assert rep.exit_code & 4
    with DiskStore(store, readonly=True) as st:
        assert st.stats()["used_slots"] == 29


@pytest.fixture
def big_disks(tmp_path):
    """Three 64 MiB loop-mounted ext4 file systems (a `kv` directory on each): room for a
    benchmark whose phases last long enough to sample each ring's queue."""
    yield from _three_disks(tmp_path, 64)


def test_bench_io_over_several_dirs(big_disks):
    """`kvstore bench io --dir A,B,C --json`: totals and a per_device row per directory,
    every block read back verified, each ring's queue seen in flight (16 MiB, four queue
    depths, per device: a loop device over the page cache moves that in a few ms, which
    the 0.5 ms queue sampler sees; 4 MiB per device is over before its first sample)."""
    from click.testing import CliRunner
    from kvstore.cli import main
    disks = big_disks
    r = CliRunner().invoke(main, ["bench", "io", "--dir", ",".join(disks), "--size", "48M",
                                  "--block-size", "128K", "--rounds", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["config"]["dirs"] == disks
    assert out["blocks_verified"] == 48 * 8
    rows = out["per_device"]
    assert [x["dir"] for x in rows] == disks
    for x in rows:
        assert x["write_gbps"] > 0 and x["read_gbps"] > 0
        assert 0 <= x["write_queue_occupancy"] <= 32 and 0 <= x["read_queue_occupancy"] <= 32
        assert x["fio_read_gbps"] > 0 and x["threads_read_gbps"] > 0
    # the sampler saw ops in flight (a sample needs the GIL, which the phase's fill and
    # drain callbacks hold at times: asked of all rings and phases together, not each)
    assert sum(x["write_queue_occupancy"] + x["read_queue_occupancy"] for x in rows) > 0
    tot = out["results"]["kvstore"]["read_gbps"]
    assert abs(sum(x["read_gbps"] for x in rows) - tot) < 1e-6 * max(1.0, tot) + 1e-9
    for d in disks:      # nothing left behind
        assert sorted(os.listdir(d)) == []


def test_connector_serves_from_a_store_over_three_devices(tmp_path, disks):
    """The real vLLM scheduler and two worker connectors (TP 2) over a store striped over
    three loop-mounted ext4 file systems (`data_dirs` in the connector config): prompts
    stored, the GPU cache dropped, the prefixes loaded back from every device and
    verified byte for byte by the harness; a restart serves them again."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from connector_util import drop_gpu_cache, kv_harness, loads_ok, prompts, settle, workers
    # The scheduler creates a store with its own call (no data_dirs yet): learn the
    # layout from a scratch store, then make the striped store first.
    scratch = tmp_path / "scratch"
    with kv_harness(scratch, tp_size=2) as h:
        pass
    layout, _, _ = read_fingerprint(str(scratch))
    store = tmp_path / "store"
    DiskStore.create(str(store), layout, "4M", data_dirs=disks).close()
    ps = prompts(7, 3, 8 * 16 + 5)
    with kv_harness(store, tp_size=2, extra={"data_dirs": disks}, check=False) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        st = h.run(ps, max_tokens=2)
        loads_ok(st)
        assert st["blocks_loaded"] == 3 * 8
        for w in workers(h):
            assert len(w.io.rings) == 3
            assert (w.io.io_bytes[:, 0] > 0).all() and (w.io.io_bytes[:, 1] > 0).all(), w.io.io_bytes
        settle(h)
    with kv_harness(store, tp_size=2, extra={"data_dirs": disks}, check=False) as h:
        st = h.run(ps, max_tokens=2)
        loads_ok(st)
        assert st["blocks_loaded"] == 3 * 8
    # a config naming other devices is refused at start, naming the field
    with pytest.raises(Exception, match="data_dirs"):
        with kv_harness(store, tp_size=2, extra={"data_dirs": disks[:2]}, check=False):
            pass


def test_rebuild_index_from_every_device(tmp_path, disks):
    import shutil
    from kvstore.tools.fsck import fsck
    with _create(tmp_path, disks, nslots=40) as st:
        ks = keys(25)
        st.put(ks, payload)
        store = st.path
    shutil.rmtree(os.path.join(store, "index"))
    rep = fsck(store, rebuild_index=True)
    assert rep.exit_code == 1 and rep.stats["rebuilt_entries"] == 25
    assert rep.stats["device_bytes_read"][0] >= 14 * SLOT * 2   # every slot of every device
    with DiskStore(store, LAYOUT, io=True, staging_bytes=1 << 20) as st:
        got = st.get(ks)
        assert [got[k][1] for k in ks] == [payload(i, 1).tobytes() for i in range(25)]


@pytest.mark.parametrize("bad", [["relative/dir"], [], "one/dir", ["/a", "/a"], [1]])
def test_damaged_data_dirs_field_is_refused(tmp_path, bad):
    from kvstore.tools.info import gather
    DiskStore.create(str(tmp_path / "s"), LAYOUT1, 10 * SLOT).close()
    fp = tmp_path / "s" / "kvstore.json"
    doc = json.loads(fp.read_text())
    doc["data_dirs"] = bad
    fp.write_text(json.dumps(doc))
    with pytest.raises(KVStoreError, match="data_dirs"):
        read_fingerprint(str(tmp_path / "s"))
    with pytest.raises(KVStoreError, match="damaged"):
        gather(str(tmp_path / "s"))


def _eio_first_read(op, fds, offs, lens):
    """Fail the first read of each batch with EIO (one bad sector per batch)."""
    return [(0, "error", errno.EIO)] if op == "read" and len(fds) else []


def test_a_few_eios_cost_their_blocks_and_the_limit_fences_the_device(tmp_path, disks, fd_leak_check):
    """A device is fenced on EIO only once `eio_limit` ops failed with it within the window
    (below that, only the failed blocks fail); EROFS fences at once."""
    with _create(tmp_path, disks, nslots=40, layout=LAYOUT1) as st:
        ks = keys(30)
        st.put(ks, payload)
        refs = [SlotRef(e.key, e.slot, e.generation) for e in st.longest_prefix(ks)]
        on1 = [r for r in refs if r.slot % 3 == 1]
        rio = st.ranks[0]
        rio.eio_limit = 4
        rio.rings[1].fault_injector = _eio_first_read
        try:
            for n in range(1, 4):
                errs = rio.read_blocks(on1[:1], lambda *a: None)
                assert isinstance(errs[0], OSError) and errs[0].errno == errno.EIO
                assert 1 not in rio.failed, f"fenced after {n} EIOs"
            # the other blocks of the device still read
            rio.rings[1].fault_injector = None
            assert rio.read_blocks(on1[1:], lambda *a: None) == [None] * (len(on1) - 1)
            rio.rings[1].fault_injector = _eio_first_read
            rio.read_blocks(on1[:1], lambda *a: None)       # the 4th EIO
            assert rio.failed[1].startswith("io_error") and "4 errors within" in rio.failed[1]
            assert rio.io_errors[1] == 4 and rio.io_errors[0] == rio.io_errors[2] == 0
            # EIOs spread wider than the window never add up (device 2)
            rio.eio_window_s = 0.05
            rio.rings[2].fault_injector = _eio_first_read
            on2 = [r for r in refs if r.slot % 3 == 2]
            for _ in range(6):
                rio.read_blocks(on2[:1], lambda *a: None)
                time.sleep(0.06)
            assert 2 not in rio.failed and rio.io_errors[2] == 6
            # a read-only remount fences at once
            rio.rings[0].fault_injector = lambda op, fds, offs, lens: (
                [(0, "error", errno.EROFS)] if op == "read" and len(fds) else [])
            on0 = [r for r in refs if r.slot % 3 == 0]
            rio.read_blocks(on0[:1], lambda *a: None)
            assert rio.failed[0].startswith("readonly")
        finally:
            for ring in rio.rings:
                ring.fault_injector = None


def test_an_eio_on_a_device_that_fails_its_probe_fences_it_at_once(tmp_path, disks, fd_leak_check):
    """Below the EIO limit a failed op probes its device (marker, a file written with
    O_DIRECT and read back): a device that fails the probe is fenced by that first EIO;
    one that passes it keeps serving (the probe runs at most once a second per device, on
    a thread of its own). A read-only opener (fsck) only counts."""
    with _create(tmp_path, disks, nslots=40, layout=LAYOUT1) as st:
        ks = keys(30)
        st.put(ks, payload)
        refs = [SlotRef(e.key, e.slot, e.generation) for e in st.longest_prefix(ks)]
        on1 = [r for r in refs if r.slot % 3 == 1]
        on2 = [r for r in refs if r.slot % 3 == 2]
        rio = st.ranks[0]
        try:
            rio.rings[2].fault_injector = _eio_first_read
            rio.read_blocks(on2[:1], lambda *a: None)
            rio.wait_probes()
            assert 2 not in rio.failed                      # probed healthy: only the block
            os.rename(os.path.join(disks[1], "kvstore-data.json"),
                      os.path.join(disks[1], "moved.json"))  # device 1 "unmounted"
            rio.rings[1].fault_injector = _eio_first_read
            errs = rio.read_blocks(on1[:2], lambda *a: None)   # the probe runs apart
            assert errs[0].errno == errno.EIO and errs[1] is None
            rio.wait_probes()
            # fenced as an I/O error (fsck re-admits it), the probe's verdict in the detail
            assert rio.failed[1].startswith("io_error") and "probe failed (missing" in rio.failed[1], \
                rio.failed
            assert not [n for n in os.listdir(disks[2]) if n.startswith(".kvstore-probe")]
        finally:
            for ring in rio.rings:
                ring.fault_injector = None
            if os.path.exists(os.path.join(disks[1], "moved.json")):
                os.rename(os.path.join(disks[1], "moved.json"),
                          os.path.join(disks[1], "kvstore-data.json"))


def test_the_probe_calls_a_full_device_healthy_and_a_readonly_opener_only_counts(tmp_path, disks):
    """No room for the probe's file (no inode left; its slots are preallocated) is not an
    I/O error; fsck's read-only opener never probes (it only counts the EIO)."""
    from kvstore.store.disk import probe_data_dir
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=4", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "kvstore-data.json").write_text(json.dumps({"store": "/s", "device": 0}))
        n = 0
        while True:             # use up every inode
            try:
                (mnt / f"f{n}").touch()
            except OSError:
                break
            n += 1
        assert probe_data_dir(str(mnt), "/s", 0, direct=False) is None
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    with _create(tmp_path, disks, nslots=40, layout=LAYOUT1) as st:
        ks = keys(6)
        st.put(ks, payload)
        refs = [SlotRef(e.key, e.slot, e.generation) for e in st.longest_prefix(ks)]
        path = st.path
    ro = RankIO(path, 0, readonly=True)
    try:
        os.rename(os.path.join(disks[1], "kvstore-data.json"), os.path.join(disks[1], "moved.json"))
        ro.rings[1].fault_injector = _eio_first_read
        ro.read_blocks([r for r in refs if r.slot % 3 == 1][:1], lambda *a: None)
        ro.wait_probes()
        assert not ro._probes and ro.io_errors[1] == 1 and 1 not in ro.failed
    finally:
        ro.rings[1].fault_injector = None
        ro.close()
