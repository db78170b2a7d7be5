"""A device that fails costs only its blocks.

A store over three real, loop-mounted ext4 file systems served through vLLM's real
scheduler and two worker connectors (TP 2, `kvstore.drivers.simulator.EngineHarness`: every block
vLLM starts from is verified byte for byte). One device fails mid-serving: EIO through the
Ring's fault seam, or a real kernel EIO (ext4's shutdown ioctl, as xfstests' `godown`
does: every later read, write and fdatasync of that file system fails with EIO). The
worker reports the device, the scheduler fences it: its entries leave the lookups and
LMDB, its slots are never handed out again, stores land on the other devices, loads in
flight from it are recomputed, and nothing is left pinned or stuck. `mount -o remount,ro`
is refused by the kernel while a server holds its slot files open for writing (EBUSY), so
the read-only case is a remount between two runs. A restart with a device missing serves
from the others; `kvstore info` names the failed device; `kvstore fsck --repair` (or, for
a missing or read-only device, the next start) re-admits it once it is back.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from connector_util import (  # noqa: E402
    conn_stats, drop_gpu_cache, keys_of, kv_harness, prompts, sched, settle, workers,
)  # noqa: E402
from test_multidevice import _loop_ext4  # noqa: E402

from kvstore.tools.fsck import fsck  # noqa: E402
from kvstore.tools.info import gather  # noqa: E402

D = 3


@pytest.fixture
def disks(tmp_path):
    """Three loop-mounted ext4 file systems (24 MiB each), each with a data directory
    `kv`; yields (data dirs, mount points, images)."""
    mnts = []
    try:
        for i in range(D):
            mnts.append(_loop_ext4(tmp_path, f"nvme{i}", 24))
            (mnts[-1] / "kv").mkdir()
        yield ([str(m / "kv") for m in mnts], [str(m) for m in mnts],
               [str(tmp_path / f"nvme{i}.img") for i in range(D)])
    finally:
        for m in mnts:
            subprocess.run(["umount", "-l", str(m)], check=False, capture_output=True)


def _harness(store, dirs, **kw):
    return kv_harness(store, tp_size=2, extra={"data_dirs": dirs, "capacity": "12M"}, check=False, **kw)


def _entries_on(s, dev: int) -> list:
    return [e for e in s.store.index.iter_entries() if e.slot % D == dev]


def _eio_on(dev: int):
    """A fault injector failing every read, write and fdatasync with EIO (the device's
    ring, on every rank)."""
    def inj(op, fds, offs, lens):
        return [(i, "error", errno.EIO) for i in range(len(fds))]
    return inj


def _ext4_shutdown(mnt: str) -> None:
    """EXT4_IOC_SHUTDOWN (NOLOGFLUSH): the file system fails every later I/O with EIO."""
    fd = os.open(mnt, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x8004587D, struct.pack("I", 2))
    finally:
        os.close(fd)


def _umount(mnt: str) -> None:
    """umount, waiting for the kernel to let go of closed io_uring rings (their files are
    released by a work queue after the ring is closed)."""
    import time
    deadline = time.monotonic() + 10
    while subprocess.run(["umount", mnt], capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, f"{mnt} stays busy"
        time.sleep(0.1)


def _remount(mnt: str, mode: str) -> None:
    """mount -o remount,<mode> (retried while closed rings still hold files, see _umount)."""
    import time
    deadline = time.monotonic() + 10
    while subprocess.run(["mount", "-o", f"remount,{mode}", mnt], capture_output=True).returncode:
        assert time.monotonic() < deadline, f"cannot remount {mnt} {mode}"
        time.sleep(0.1)


def _quiet(h) -> None:
    """Nothing pinned, pending or stuck (the connector's and vLLM's own checks)."""
    settle(h)
    h.assert_no_leaks()
    s = sched(h)
    assert s.index.pinned_slots == 0, s.index.pin_counts()
    assert not s.lookups.candidates and not s.lookups.pending and not s.lookups.inflight
    assert not s.commits.inflight and not s.stores.storing
    assert not h.scheduler.requests
    for w in workers(h):
        assert w.pending() == 0 and not w._loads
        assert w.slots.free == w.slots.total


def _serve_through_a_failure(tmp_path, disks, fail, counters_readable: bool = True) -> None:
    dirs, mnts, _ = disks
    store = tmp_path / "store"
    ps = prompts(11, 6, 9 * 16 + 3)                  # 9 full blocks each: 54 blocks
    with _harness(store, dirs) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        s = sched(h)
        assert len(_entries_on(s, 1)) >= 15               # striped: every device holds some
        drop_gpu_cache(h)
        fail(h)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=2)                       # loads meet the failure
        assert st["blocks_mismatched"] == 0, h.mismatches[:2]
        assert st["requests_finished"] - before["requests_finished"] == len(ps)
        # Per-block failures (one KV group): vLLM recomputes from the failed block.
        assert st["invalid_block_ids"] > before["invalid_block_ids"]
        settle(h)
        # the device is fenced: nothing of it in the lookup table, in LMDB or the pool
        assert 1 in s.index.fences and s.index.fences[1][0] == "io_error"
        assert s.index._table.count_device(D, 1) == 0
        assert _entries_on(s, 1) == []
        assert all(slot % D != 1 for slot, _ in s.index.pooled())
        assert len(s.index._table) > 0                     # the other devices' entries stay
        for w in workers(h):
            assert 1 in w.io.failed
        # stats: the failed device by name (vllm:kvstore_device_failed{device=...})
        last = h.kv_connector_stats[-1] if h.kv_connector_stats else {}
        stats = [x for x in h.kv_connector_stats if x.get("failed_devices")]
        assert stats and stats[-1].get("device_failed:" + dirs[1]) == 1, last
        # the failed ops are counted on that device only (vllm:kvstore_device_io_errors)
        cs = conn_stats(h)
        errs = {d: cs.get("device_io_errors:" + d, 0) for d in dirs}
        assert errs[dirs[1]] > 0 and errs[dirs[0]] == errs[dirs[2]] == 0, errs
        # later stores land only on the other devices (what was lost is stored again
        # there), and every load is verified
        drop_gpu_cache(h)
        qs = prompts(12, 6, 7 * 16 + 1)
        before = dict(h.stats)
        st = h.run(ps + qs, max_tokens=1)
        assert st["blocks_mismatched"] == 0
        assert st["invalid_block_ids"] == before["invalid_block_ids"]    # never sent to it
        settle(h)
        assert _entries_on(s, 1) == []
        assert len(list(s.store.index.iter_entries())) == 6 * 9 + 6 * 7, conn_stats(h)
        drop_gpu_cache(h)
        before = dict(h.stats)
        st = h.run(ps + qs, max_tokens=2)
        assert st["blocks_mismatched"] == 0, h.mismatches[:2]
        # every stored block is a hit vLLM takes from the connector, and is loaded
        assert st["external_hit_tokens"] - before["external_hit_tokens"] == (6 * 9 + 6 * 7) * 16
        assert st["blocks_loaded"] - before["blocks_loaded"] == 6 * 9 + 6 * 7
        assert st["invalid_block_ids"] == before["invalid_block_ids"]    # nothing failed
        _quiet(h)
        assert s.store.index.check_consistency() == []
    # the fence outlives the server: info names the device, a restart does not use it
    info = gather(str(store))
    dv = info["devices"][1]
    assert dv["state"] == "failed" and dv["reason"] == "io_error" and dv["failed_since"] > 0
    assert [d["state"] for d in info["devices"]][::2] == ["ok", "ok"]
    assert info["failed_devices"] == [1]
    # the failed ops are counted on that device only, across the server's life (iostats;
    # a file system shut down cannot be read any more: not tracked then)
    assert [d["io_errors"] for d in info["devices"]][::2] == [0, 0]
    from kvstore.tools.info import format_text
    assert "FAILED (io_error" in format_text(info)
    if counters_readable:
        assert dv["io_errors"] > 0 and "failed I/O op" in format_text(info)
    else:
        assert dv["io_errors"] is None
    return store


def test_eio_through_the_seam_mid_serving_fences_the_device(tmp_path, disks):
    def fail(h):
        for w in workers(h):
            w.io.rings[1].fault_injector = _eio_on(1)
    store = _serve_through_a_failure(tmp_path, disks, fail)
    dirs, _, _ = disks
    # restart: the EIO fence stays (only fsck re-admits an I/O error), stores avoid it
    with _harness(store, dirs) as h:
        s = sched(h)
        assert 1 in s.index.fences
        h.run(prompts(13, 4, 5 * 16), max_tokens=1)
        settle(h)
        assert _entries_on(s, 1) == []
        _quiet(h)
    # fsck without --repair names it (uncorrected); --repair re-admits the healthy device
    rep = fsck(str(store))
    assert [f.kind for f in rep.findings] == ["device_fenced"] and rep.exit_code == 4
    rep = fsck(str(store), repair=True)
    assert rep.exit_code == 1 and rep.stats["readmitted_devices"] == [1], rep.findings
    assert gather(str(store))["devices"][1]["state"] == "ok"
    assert fsck(str(store), deep=True).exit_code == 0
    with _harness(store, dirs) as h:
        s = sched(h)
        assert s.index.fences == {}
        h.run(prompts(14, 6, 6 * 16), max_tokens=1)
        settle(h)
        assert len(_entries_on(s, 1)) >= 10            # its slots are handed out again
        drop_gpu_cache(h)
        st = h.run(prompts(14, 6, 6 * 16), max_tokens=2)
        assert st["blocks_mismatched"] == 0 and st["blocks_loaded"] > 0
        _quiet(h)


def test_real_kernel_eio_mid_serving_and_fsck_readmits_after_the_device_returns(tmp_path, disks, caplog):
    dirs, mnts, imgs = disks
    store = _serve_through_a_failure(tmp_path, disks, lambda h: _ext4_shutdown(mnts[1]),
                                     counters_readable=False)
    # every op of a batch got a real result while a device failed under it (a device
    # failed by another device's thread mid-batch once left ops with no result at all)
    assert not [r for r in caplog.records if "short count" in r.getMessage()]
    # a dead file system stays fenced: fsck --repair refuses to re-admit it
    rep = fsck(str(store), repair=True)
    fenced = [f for f in rep.findings if f.kind == "device_fenced"]
    assert fenced and not fenced[0].fixed and "still not usable" in fenced[0].detail
    assert gather(str(store))["devices"][1]["state"] == "failed"
    # the device comes back (unmounted and mounted again): fsck re-admits it
    _umount(mnts[1])
    subprocess.run(["mount", "-o", "loop", imgs[1], mnts[1]], check=True)
    rep = fsck(str(store), repair=True)
    assert rep.stats.get("readmitted_devices") == [1], [(f.kind, f.detail) for f in rep.findings]
    assert gather(str(store))["devices"][1]["state"] == "ok"
    with _harness(store, dirs) as h:
        ps = prompts(15, 6, 6 * 16)
        h.run(ps, max_tokens=1)
        settle(h)
        assert len(_entries_on(sched(h), 1)) >= 10
        drop_gpu_cache(h)
        st = h.run(ps, max_tokens=2)
        assert st["blocks_mismatched"] == 0 and st["blocks_loaded"] >= 30
        _quiet(h)


def test_restart_with_a_device_missing_then_read_only_then_back(tmp_path, disks):
    dirs, mnts, imgs = disks
    store = tmp_path / "store"
    ps = prompts(21, 6, 8 * 16 + 2)
    with _harness(store, dirs) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        _quiet(h)
    # device 2 is not mounted at the next start: the server starts, serves from the others
    _umount(mnts[2])
    assert not os.path.exists(dirs[2])
    with _harness(store, dirs) as h:
        s = sched(h)
        assert s.index.fences.get(2, ("",))[0] == "missing"
        assert _entries_on(s, 2) == []
        for w in workers(h):
            assert 2 in w.io.failed and w.io.failed[2].startswith("missing")
        st = h.run(ps, max_tokens=2)              # hits up to the first block of device 2
        assert st["blocks_mismatched"] == 0 and st["blocks_loaded"] > 0
        assert st["invalid_block_ids"] == 0        # never sent to the missing device
        settle(h)
        assert _entries_on(s, 2) == []             # re-stored on devices 0 and 1
        drop_gpu_cache(h)
        expect = sum(len(s.store.longest_prefix(keys_of(h, p))) for p in ps)
        assert expect >= 6 * 8 - 6                 # (what a recompute pass stores again)
        before, cs = dict(h.stats), conn_stats(h)
        st = h.run(ps, max_tokens=2)
        assert conn_stats(h)["loaded_blocks"] - cs["loaded_blocks"] == expect   # all of it
        assert st["blocks_loaded"] > before["blocks_loaded"]
        assert st["blocks_mismatched"] == 0
        _quiet(h)
    assert not os.path.exists(dirs[2])             # never recreated on the root file system
    info = gather(str(store))
    assert info["devices"][2]["state"] == "failed" and info["devices"][2]["reason"] == "missing"
    assert not info["devices"][2]["present"]
    # back, but read-only: still fenced (now as read-only), still serving
    subprocess.run(["mount", "-o", "loop", imgs[2], mnts[2]], check=True)
    _remount(mnts[2], "ro")
    with _harness(store, dirs) as h:
        s = sched(h)
        assert 2 in s.index.fences
        for w in workers(h):
            assert w.io.failed[2].startswith("readonly"), w.io.failed
        drop_gpu_cache(h)
        st = h.run(ps, max_tokens=2)
        assert st["blocks_mismatched"] == 0 and st["blocks_loaded"] >= expect
        assert st["invalid_block_ids"] == 0
        _quiet(h)
    # writable again: the next start re-admits it (its slots are free, nothing stale is read)
    _remount(mnts[2], "rw")
    with _harness(store, dirs) as h:
        s = sched(h)
        assert s.index.fences == {} and s.index.readmitted == [2]
        assert all(not w.io.failed for w in workers(h))
        qs = prompts(22, 6, 6 * 16)
        h.run(qs, max_tokens=1)
        settle(h)
        assert len(_entries_on(s, 2)) >= 10
        drop_gpu_cache(h)
        st = h.run(ps + qs, max_tokens=2)
        assert st["blocks_mismatched"] == 0
        _quiet(h)
    assert gather(str(store))["devices"][2]["state"] == "ok"
    assert fsck(str(store), deep=True).exit_code == 0


def _steps_until_fenced(h, dev: int, timeout: float = 15.0) -> tuple:
    """Empty engine steps (they carry the workers' reports) until the scheduler fenced
    device `dev` or `timeout` passed; returns its fence ((reason, time), or ("",))."""
    import time
    s = sched(h)
    deadline = time.monotonic() + timeout
    while dev not in s.index.fences and time.monotonic() < deadline:
        h.step()
        time.sleep(0.02)
    return s.index.fences.get(dev, ("",))


def test_unmounted_while_serving_is_found_by_the_marker_check(tmp_path, disks):
    """`umount -l` while serving: the open files keep working, but the data directory is
    gone (another device may be mounted there next): the worker's periodic marker check
    finds it and the device is fenced."""
    dirs, mnts, _ = disks
    store = tmp_path / "store"
    ps = prompts(31, 4, 6 * 16)
    with _harness(store, dirs) as h:
        for w in workers(h):
            w.DEVICE_CHECK_S = 0.05
        h.run(ps, max_tokens=1)
        settle(h)
        subprocess.run(["umount", "-l", mnts[0]], check=True)
        s = sched(h)
        assert _steps_until_fenced(h, 0, 10)[0] == "missing"
        settle(h)
        assert _entries_on(s, 0) == []
        drop_gpu_cache(h)
        st = h.run(ps, max_tokens=2)
        assert st["blocks_mismatched"] == 0
        _quiet(h)


def test_device_that_dies_idle_is_found_by_the_patrol_read(tmp_path, disks):
    """A device whose file system dies while no request touches it (ext4 shut down after
    the stores settled, then only empty steps): the worker's periodic check reads one
    header from every healthy device, the read fails with EIO, the probe fails, and the
    device is fenced with no block of it asked for. The other devices stay healthy."""
    dirs, mnts, _ = disks
    store = tmp_path / "store"
    ps = prompts(37, 4, 6 * 16)
    with _harness(store, dirs) as h:
        for w in workers(h):
            w.DEVICE_CHECK_S = 0.05
        h.run(ps, max_tokens=1)
        settle(h)
        s = sched(h)
        assert _entries_on(s, 2)
        import time
        for _ in range(5):          # healthy devices pass their patrols
            h.step()
            time.sleep(0.06)
        assert s.index.fences == {}
        _ext4_shutdown(mnts[2])
        assert _steps_until_fenced(h, 2)[0] == "io_error", s.index.fences
        why = [w.io.failed.get(2, "") for w in workers(h)]
        assert any("patrol read failed with EIO" in x for x in why), why
        assert set(s.index.fences) == {2}
        assert _entries_on(s, 2) == []
        drop_gpu_cache(h)
        st = h.run(ps, max_tokens=2)
        assert st["blocks_mismatched"] == 0 and st["blocks_loaded"] > 0
        _quiet(h)


def test_worker_meta_aggregates_failed_devices():
    from kvstore.vllm.metadata import KVStoreWorkerMeta
    a = KVStoreWorkerMeta(failed_devices={1: "io_error: read failed with EIO"})
    b = KVStoreWorkerMeta(bad_keys=[b"k"], failed_devices={1: "readonly: x", 2: "missing: y"})
    out = a.aggregate(b)
    assert out.failed_devices == {1: "io_error: read failed with EIO", 2: "missing: y"}
    assert out.bad_keys == [b"k"] and a.failed_devices == {1: "io_error: read failed with EIO"}


def test_keytable_remove_device():
    from kvstore._keytable import KeyTable
    t = KeyTable(3000)
    keys = [b"key%05d" % i for i in range(2000)]
    for i, k in enumerate(keys):
        t.put(k, i, i + 7)
    assert t.count_device(3, 1) == 667
    assert t.remove_device(3, 1) == 667
    assert len(t) == 2000 - 667 and t.count_device(3, 1) == 0
    for i, k in enumerate(keys):
        assert (t.get(k) is None) == (i % 3 == 1)
        if i % 3 != 1:
            assert t.get(k) == (i, i + 7)
    assert t.remove_device(3, 1) == 0
    with pytest.raises(ValueError):
        t.remove_device(3, 3)


def test_metrics_name_the_failed_device():
    from kvstore.vllm.metrics import DEVICE_FAILED, KVStoreStats
    a = KVStoreStats({"failed_devices": 1, DEVICE_FAILED + "/mnt/nvme1/kv": 1, "hit_blocks": 2})
    a.aggregate(KVStoreStats({"failed_devices": 1, DEVICE_FAILED + "/mnt/nvme1/kv": 1, "hit_blocks": 3}))
    r = a.reduce()
    assert r["failed_devices"] == 1 and r[DEVICE_FAILED + "/mnt/nvme1/kv"] == 1 and r["hit_blocks"] == 5
    json.dumps(r)


def test_hybrid_model_failed_device_fails_whole_requests_through_failed_recving(tmp_path, disks):
    """Several KV cache groups (full attention + sliding window): vLLM takes only
    whole-request load failures, so a load meeting the failed device is in
    `failed_recving`; the request recomputes and its tokens stay right."""
    dirs, _, _ = disks
    store = tmp_path / "store"
    ps = prompts(41, 4, 140)                          # 8 full blocks each, two groups
    with kv_harness(store, extra={"data_dirs": dirs, "capacity": "12M"}, check=False,
                    sliding_window=32, num_layers=2) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        s = sched(h)
        assert _entries_on(s, 0)
        drop_gpu_cache(h)
        for w in workers(h):
            w.io.rings[0].fault_injector = _eio_on(0)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=2)
        assert st["failed_recving"] > before["failed_recving"]
        assert st["invalid_block_ids"] == before["invalid_block_ids"]
        assert st["blocks_mismatched"] == 0
        settle(h)
        assert 0 in s.index.fences and _entries_on(s, 0) == []
        drop_gpu_cache(h)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=2)
        assert st["blocks_mismatched"] == 0
        assert st["failed_recving"] == before["failed_recving"]   # never sent to it again
        _quiet(h)


def test_rebuild_index_keeps_the_fence_and_never_adopts_fenced_slots(tmp_path, disks):
    from kvstore.store.disk import DiskStore
    from test_multidevice import LAYOUT, SLOT, keys, payload
    dirs, _, _ = disks
    with DiskStore.create(str(tmp_path / "store"), LAYOUT, 30 * SLOT * 2, data_dirs=dirs,
                          io=True, staging_bytes=1 << 20) as st:
        ks = keys(24)
        st.put(ks, payload)
        dropped = st.index.fence_device(2, D, "io_error")
        assert len(dropped) == 8 and all(e.slot % D == 2 for e in dropped)
        assert st.index.fenced_devices()[2][0] == "io_error"
        # a fenced device's slots are never reserved, free or not
        refs, _ = st.reserve(keys(10, b"new"))
        assert refs and all(r.slot % D != 2 for r in refs)
        st.abort(refs)
        store = st.path
    rep = fsck(store, rebuild_index=True)     # its slots still hold the dropped blocks
    assert rep.error is None, rep.error
    assert rep.stats["rebuilt_entries"] == 16      # none adopted from the fenced device
    # the fence outlived the rebuild: the repair pass after it found (and, the device
    # being healthy, re-admitted) it
    assert [(f.kind, f.fixed) for f in rep.findings] == [("device_fenced", True)]
    assert rep.stats["readmitted_devices"] == [2]
    with DiskStore(store, readonly=True) as st:
        assert st.index.fenced_devices() == {}
        assert all(e.slot % D != 2 for e in st.index.iter_entries())
        assert st.stats()["used_slots"] == 16


def test_erofs_on_writes_mid_serving_fences_the_device_as_readonly(tmp_path, disks):
    """A file system that turned read-only under a running server (ext4
    errors=remount-ro after a media error; `mount -o remount,ro` itself is refused while
    the slot files are open for writing) fails writes with EROFS: the device is fenced as
    `readonly` (reads still work, but nothing more is stored there)."""
    dirs, _, _ = disks
    store = tmp_path / "store"
    with _harness(store, dirs) as h:
        for w in workers(h):
            w.io.rings[2].fault_injector = lambda op, fds, offs, lens: (
                [(i, "error", errno.EROFS) for i in range(len(fds))] if op == "write" else [])
        ps = prompts(51, 4, 6 * 16)
        h.run(ps, max_tokens=1)
        settle(h)
        s = sched(h)
        assert s.index.fences.get(2, ("",))[0] == "readonly"
        assert conn_stats(h)["store_dropped_blocks"] > 0            # its blocks were not stored
        assert _entries_on(s, 2) == []
        drop_gpu_cache(h)
        h.run(ps, max_tokens=1)                                        # stored on the others now
        settle(h)
        assert _entries_on(s, 2) == [] and len(_entries_on(s, 0)) >= 8
        drop_gpu_cache(h)
        st = h.run(ps, max_tokens=2)
        assert st["blocks_mismatched"] == 0 and st["blocks_loaded"] > 0
        _quiet(h)
    assert gather(str(store))["devices"][2]["reason"] == "readonly"
