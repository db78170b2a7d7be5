"""Shared fixtures: real files, real mounts, and leak checks (open fds) after each test."""
import os
import subprocess
import uuid

import pytest


def open_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


@pytest.fixture
def fd_leak_check():
    """Fail the test if it leaves file descriptors open (io_uring rings, slot files)."""
    import gc
    gc.collect()
    before = open_fds()
    yield
    gc.collect()
    leaked = {f for f in open_fds() - before if "pytest" not in f}
    assert not leaked, f"leaked file descriptors: {sorted(leaked)}"


@pytest.fixture
def small_fs(tmp_path):
    """A real, tiny filesystem (tmpfs of 8 MiB) for ENOSPC tests; unmounted afterwards."""
    mnt = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount a small tmpfs for the ENOSPC test (needs root): {r.stderr}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def ramfs(tmp_path):
    """A real ramfs mount: a filesystem that refuses O_DIRECT."""
    mnt = tmp_path / f"ramfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount ramfs (needs root): {r.stderr}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
