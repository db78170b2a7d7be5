"""Stores over several devices at their edges: a ring never driven by two threads, the
store directory as a data directory, unmounted devices and mount points left alone by
fsck and by creation, the patrol read's error rules (real loop-mounted ext4, real rings,
LMDB and files)."""
from __future__ import annotations

import os
import subprocess
import threading
import time

import numpy as np
import pytest

from kvstore.store.disk import DiskStore, SlotRef, probe_data_dir
from kvstore.format.layout import Layout
from kvstore.tools.fsck import fsck
from test_multidevice import _loop_ext4, disks  # noqa: F401  (the fixture)

BB = 16 << 10
SLOT = BB + 4096
LAYOUT1 = Layout(model="tiny-llama", dtype="float16", block_size=16, block_bytes=BB, num_layers=2,
                 num_kv_heads=2, head_dim=64, tp_size=1)


def test_single_device_chunks_never_share_a_ring_between_threads(tmp_path, disks):  # noqa: F811
    """With several devices the double buffer runs two ring ops at once; a chunk whose
    slots all live on one device (a store with the other devices fenced, or an LRU that
    happens to hand out one device's slots) runs on that device's own thread too. Two
    threads driving one io_uring at once would reap completions into the wrong batch
    (writes reported done while in flight, "short counts" of 61440 of 20480 bytes) and
    hang."""
    with DiskStore.create(str(tmp_path / "store"), LAYOUT1, 300 * SLOT, data_dirs=disks, io=True,
                          staging_bytes=16 * SLOT) as st:
        rio = st.ranks[0]
        users: dict[int, set] = {}
        active: dict[int, int] = {}
        overlap = []
        lock = threading.Lock()

        def spy(d):
            def inj(op, fds, offs, lens):
                with lock:
                    active[d] = active.get(d, 0) + 1
                    users.setdefault(d, set()).add(threading.current_thread().name)
                    if active[d] > 1:
                        overlap.append((d, op))
                time.sleep(0.02)
                with lock:
                    active[d] -= 1
                return []
            return inj
        for d, ring in enumerate(rio.rings):
            ring.fault_injector = spy(d)
        refs = [SlotRef(b"k%05d" % i, 3 * i, 1) for i in range(60)]   # all on device 0

        def fill(a, b, views):
            for j, v in enumerate(views):
                v[:] = (a + j) % 251
        out = {}

        def work():
            out["w"] = rio.write_blocks(refs, fill)
            wrong = []

            def drain(a, b, views, errors):
                wrong.extend(a + j for j, (v, e) in enumerate(zip(views, errors))
                             if e is None and not (np.asarray(v) == (a + j) % 251).all())
            out["r"] = rio.read_blocks(refs, drain)
            out["wrong"] = wrong
        t = threading.Thread(target=work, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the striped I/O hung"
        for ring in rio.rings:
            ring.fault_injector = None
        assert users[0] == {"kvstore-dev0-r0"}, users     # device 0's ring: its thread only
        assert not overlap
        assert out["w"] == [None] * 60 and out["r"] == [None] * 60 and out["wrong"] == []


def test_store_directory_as_a_data_directory_probes_usable(tmp_path, disks):  # noqa: F811
    """FORMAT: "a data directory can be the store directory itself"; creation writes no
    marker there, and the start-up probe must not take it for a missing device (an empty
    mount point): that would fence device 0 and drop its entries at every start."""
    store = tmp_path / "store"
    store.mkdir()
    dirs = [str(store), *disks[:2]]
    with DiskStore.create(str(store), LAYOUT1, 30 * SLOT, data_dirs=dirs, io=True,
                          staging_bytes=1 << 20) as st:
        assert [probe_data_dir(d, st.path, i) for i, d in enumerate(st.data_dirs)] == [None] * 3
        from kvstore.lookup.table import ServingIndex
        si = ServingIndex(st, probe_devices="direct")
        try:
            assert si.fences == {}
        finally:
            si.close()


@pytest.mark.root
def test_fsck_repair_leaves_an_empty_mount_point_alone(tmp_path):
    """A device unmounted with data_dirs naming its mount point leaves an empty directory:
    fsck --repair treats it as a missing device, never as one whose rank directory was
    deleted (recreating the slot files on the root file system under the mount point and
    dropping every entry on the device, valid again once it is mounted)."""
    mnts = [str(_loop_ext4(tmp_path, f"m{i}", 24)) for i in range(3)]
    try:
        store = str(tmp_path / "store")
        with DiskStore.create(store, LAYOUT1, 30 * SLOT, data_dirs=mnts, io=True,
                              staging_bytes=1 << 20) as st:
            ks = [b"k%03d" % i for i in range(12)]
            st.put(ks, lambda i, r: np.full(BB, i, np.uint8))
        subprocess.run(["umount", "-l", mnts[1]], check=True)
        assert os.path.isdir(mnts[1]) and os.listdir(mnts[1]) == []
        rep = fsck(store, repair=True)
        assert os.listdir(mnts[1]) == [], "fsck created files under the empty mount point"
        missing = [f for f in rep.findings if f.kind == "slot_file_missing"]
        assert missing and not any(f.fixed for f in missing)
        with DiskStore(store, readonly=True) as st:
            assert all(st.lookup(k) is not None for k in ks)   # entries kept
    finally:
        for m in mnts:
            subprocess.run(["umount", "-l", m], check=False)


def test_engine_start_with_the_store_directory_unmounted_keeps_every_device(tmp_path, disks):  # noqa: F811
    """The store directory on its own device, not mounted at start: ensure_store finds no
    kvstore.json, and creation must refuse (naming the data directories' markers of the
    same store path) instead of taking them for the leftovers of an interrupted creation
    and deleting every device's slot files."""
    import pytest

    from kvstore import KVStoreError
    from kvstore.store.disk import ensure_store
    meta = tmp_path / "meta"              # the store directory's own device
    meta.mkdir()
    store = str(meta / "store")
    ks = [b"k%03d" % i for i in range(12)]
    with DiskStore.create(store, LAYOUT1, 30 * SLOT, data_dirs=disks, io=True,
                          staging_bytes=1 << 20) as st:
        st.put(ks, lambda i, r: np.full(BB, i + 1, np.uint8))
    os.rename(meta, tmp_path / "meta-away")   # not mounted: an empty mount point
    meta.mkdir()
    with pytest.raises(KVStoreError, match="kvstore.json is missing"):
        ensure_store(store, LAYOUT1, 30 * SLOT, data_dirs=disks)
    subprocess.run(["rm", "-rf", str(meta)], check=True)   # what the refused start left there
    os.rename(tmp_path / "meta-away", meta)   # mounted again
    with DiskStore(store, LAYOUT1, io=True, staging_bytes=1 << 20) as st:
        got = st.get(ks)
        assert [got[k][0] for k in ks] == [np.full(BB, i + 1, np.uint8).tobytes() for i in range(12)]


def test_interrupted_creation_over_devices_is_cleaned_up(tmp_path, disks):  # noqa: F811
    """What a creation killed before its kvstore.json left on the devices (incomplete
    markers, slot files) is removed by the next creation."""
    import json
    store = str(tmp_path / "store")
    st = DiskStore.create(store, LAYOUT1, 30 * SLOT, data_dirs=disks, io=True, staging_bytes=1 << 20)
    st.close()
    subprocess.run(["rm", "-rf", store], check=True)      # as if killed before kvstore.json
    for d, ddir in enumerate(disks):
        with open(os.path.join(ddir, "kvstore-data.json"), "w") as f:
            json.dump({"store": store, "device": d, "complete": False}, f)
    with DiskStore.create(store, LAYOUT1, 30 * SLOT, data_dirs=disks, io=True, staging_bytes=1 << 20) as st:
        assert st.get([b"x"]) == {}
    for d, ddir in enumerate(disks):
        assert json.load(open(os.path.join(ddir, "kvstore-data.json")))["complete"] is True


@pytest.mark.root
def test_fsck_repair_leaves_the_empty_mount_point_of_a_single_data_dir_alone(tmp_path):
    """data_dirs with one entry (the slots on one device apart from the store directory):
    the missing-device check covers it too, so --repair never recreates the files of an
    unmounted device on the root file system under its mount point."""
    mnt = str(_loop_ext4(tmp_path, "m0", 24))
    try:
        store = str(tmp_path / "store")
        ks = [b"k%03d" % i for i in range(6)]
        with DiskStore.create(store, LAYOUT1, 20 * SLOT, data_dirs=[mnt], io=True,
                              staging_bytes=1 << 20) as st:
            st.put(ks, lambda i, r: np.full(BB, i, np.uint8))
        subprocess.run(["umount", "-l", mnt], check=True)
        fsck(store, repair=True)
        assert os.listdir(mnt) == [], "fsck created files under the empty mount point"
        with DiskStore(store, readonly=True) as st:
            assert all(st.lookup(k) is not None for k in ks)
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)


def _patrol_store(tmp_path):
    from test_multidevice import LAYOUT1, SLOT
    from kvstore.store.disk import DiskStore
    dirs = [str(tmp_path / f"dev{i}") for i in range(3)]
    for d in dirs:
        os.mkdir(d)
    return DiskStore.create(str(tmp_path / "store"), LAYOUT1, 30 * SLOT, data_dirs=dirs, io=True,
                            staging_bytes=1 << 20)


def _patrol(rio, d):
    rio._patrol(d)
    rio.wait_probes()


def test_patrol_eio_on_one_bad_sector_never_fences_a_healthy_device(tmp_path, monkeypatch, caplog):
    """The patrol rereads one sector every check: an EIO there forever (a bad sector) is
    one counted error and probes that pass, never the EIO limit and a fence."""
    import errno as _errno
    import kvstore.io.health as rankio
    with _patrol_store(tmp_path) as st:
        rio = st.ranks[0]
        real = os.preadv
        bad_fd = {}

        def preadv(fd, bufs, off):
            if os.fstat(fd).st_ino == bad_fd.get("ino"):
                raise OSError(_errno.EIO, "Input/output error")
            return real(fd, bufs, off)
        bad_fd["ino"] = os.fstat(int(rio._fd_table[1, 0])).st_ino
        monkeypatch.setattr(rankio.os, "preadv", preadv)
        monkeypatch.setattr(rankio, "PROBE_EVERY_S", 0.0)
        for _ in range(3 * rio.eio_limit):
            _patrol(rio, 1)
        assert rio.failed == {}
        assert int(rio.io_errors[1]) == 1          # one run of failing patrols, one error
        assert sum("patrol read of its first slot failed" in r.getMessage() for r in caplog.records) == 1
        _patrol(rio, 0)                              # other devices read fine
        assert int(rio.io_errors[0]) == 0
        bad_fd["ino"] = None                         # the sector reads again
        _patrol(rio, 1)
        assert 1 not in rio._patrol_failing


def test_patrol_eio_then_failed_probe_fences_and_enxio_fences_at_once(tmp_path, monkeypatch):
    import errno as _errno
    import kvstore.store.disk as engine
    import kvstore.io.health as rankio
    with _patrol_store(tmp_path) as st:
        rio = st.ranks[0]
        real = os.preadv
        errs = {int(rio._fd_table[1, 0]): _errno.EIO, int(rio._fd_table[2, 0]): _errno.ENXIO}
        inos = {os.fstat(fd).st_ino: e for fd, e in errs.items()}

        def preadv(fd, bufs, off):
            e = inos.get(os.fstat(fd).st_ino)
            if e:
                raise OSError(e, os.strerror(e))
            return real(fd, bufs, off)
        monkeypatch.setattr(rankio.os, "preadv", preadv)
        monkeypatch.setattr(rankio, "probe_data_dir", lambda *a, **k: ("io_error", "probe write: EIO"))
        _patrol(rio, 2)
        assert rio.failed[2].startswith("io_error: patrol read failed with ENXIO")
        _patrol(rio, 1)
        assert rio.failed[1].startswith("io_error: patrol read failed with EIO, then the device's probe failed")
        assert 0 not in rio.failed
        rio.check_devices()                          # failed devices get no more patrols
        assert set(rio._patrols) <= {0, 1, 2}
        for t in list(rio._patrols.values()):
            t.join(5)
        assert 0 not in rio.failed


def test_patrol_after_close_does_nothing(tmp_path):
    st = _patrol_store(tmp_path)
    rio = st.ranks[0]
    st.close()
    rio._patrol(1)          # no fd, no counters: returns quietly
    assert rio.failed == {}
