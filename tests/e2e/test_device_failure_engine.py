"""A failed device costs only its blocks, inside a real `vllm serve`.

One store over three loop-mounted ext4 file systems (`data_dirs`). The first server fills
it. Between the runs one device is remounted read-only (`mount -o remount,ro`: the kernel
refuses that while a server holds the slot files open for writing); the second server
fences it at start and serves from the other two, and mid-run a second device fails for
real (ext4's shutdown ioctl: every later read, write and fdatasync on it returns EIO).
Every run answers with the reference's greedy tokens; the metrics and `kvstore info` name
the failed devices. Two server starts (plus the session's reference server).
"""
from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import time

import pytest

from e2e_util import MAX_TOKENS, assert_same, info, wait_stored
from kvstore.drivers.client import Client
from mount_util import loop_ext4


def _loop_ext4(tmp_path, name: str, mib: int) -> str:
    return str(loop_ext4(tmp_path, name, mib))


@pytest.fixture
def three_disks(tmp_path):
    mnts = []
    try:
        for i in range(3):
            mnts.append(_loop_ext4(tmp_path, f"nvme{i}", 40))
            os.mkdir(os.path.join(mnts[-1], "kv"))
        yield mnts
    finally:
        for m in mnts:
            subprocess.run(["umount", "-l", m], check=False, capture_output=True)


def _remount_ro(mnt: str) -> None:
    deadline = time.monotonic() + 15     # closed io_uring rings let go of files a moment later
    while subprocess.run(["mount", "-o", "remount,ro", mnt], capture_output=True).returncode:
        assert time.monotonic() < deadline, f"cannot remount {mnt} read-only"
        time.sleep(0.2)


def _ext4_shutdown(mnt: str) -> None:
    fd = os.open(mnt, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, 0x8004587D, struct.pack("I", 2))   # EXT4_IOC_SHUTDOWN, NOLOGFLUSH
    finally:
        os.close(fd)


def _failed_devices(server) -> dict[str, float]:
    """{device: value} of vllm:kvstore_device_failed in /metrics."""
    import urllib.request
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:kvstore_device_failed{"):
            labels, _, value = line.rpartition(" ")
            dev = labels.split('device="', 1)[1].split('"', 1)[0]
            out[dev] = float(value)
    return out


def test_device_failures_keep_identical_tokens(serve, workload, reference, tmp_path, three_disks):
    dirs = [os.path.join(m, "kv") for m in three_disks]
    store = tmp_path / "store"
    extra = {"data_dirs": dirs, "capacity": "48M"}
    with serve.running(store, extra=extra) as s:
        assert_same(reference, workload.replay(Client(s.url), max_tokens=MAX_TOKENS), workload)
        wait_stored(s)
        assert s.metrics()["vllm:kvstore_stored_blocks_total"] > 0
    before = info(store)
    assert [d["state"] for d in before["devices"]] == ["ok", "ok", "ok"]
    assert all(d["used_slots"] > 0 for d in before["devices"])
    # between the runs device 1 goes read-only
    _remount_ro(three_disks[1])
    with serve.running(store, extra=extra) as s:
        m0 = s.metrics()
        half = len(workload.requests) // 2
        client = Client(s.url)
        seen = []

        def on_done(req, c):
            seen.append(req)
            if len(seen) == half:
                seen.append(_failed_devices(s))
                _ext4_shutdown(three_disks[2])      # device 2 dies mid-run
        assert_same(reference, workload.replay(client, max_tokens=MAX_TOKENS, on_done=on_done),
                    workload)
        assert seen[half] == {dirs[1]: 1.0}         # fenced at start, named by the metrics
        # a second pass: the rest still hits
        assert_same(reference, workload.replay(client, max_tokens=MAX_TOKENS), workload)
        m1 = s.metrics()
        # Device 2 is found whether or not a request touched it after the shutdown (the
        # worker's patrol read, every 2 s); the next engine step reports it. Short
        # requests (no block to store or load) drive steps until the metrics name it.
        deadline = time.monotonic() + 30
        while (failed := _failed_devices(s)) != {dirs[1]: 1.0, dirs[2]: 1.0} \
                and time.monotonic() < deadline:
            client.complete("ping", max_tokens=1)
            time.sleep(0.5)
    hit = m1.get("vllm:kvstore_hit_tokens_total", 0) - m0.get("vllm:kvstore_hit_tokens_total", 0)
    assert hit > 0, "nothing came from the healthy device"
    assert failed == {dirs[1]: 1.0, dirs[2]: 1.0}, failed
    after = info(store)
    states = [(d["state"], d.get("reason")) for d in after["devices"]]
    assert states == [("ok", None), ("failed", "readonly"), ("failed", "io_error")], states
