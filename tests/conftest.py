"""Shared fixtures: real files, real mounts, and leak checks (open fds) after each test."""
import contextlib
import os
import subprocess
import uuid

import pytest

from leak_util import open_fds


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


@contextlib.contextmanager
def _mounted(tmp_path, fstype: str, options: list[str], why: str):
    """Mount a real filesystem of `fstype` under tmp_path; lazily unmounted afterwards."""
    mnt = tmp_path / f"{fstype}-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", fstype, *options, fstype, str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount {fstype} for {why} (needs root): {r.stderr}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_fs(tmp_path):
    """A real, tiny filesystem (tmpfs of 8 MiB) for ENOSPC tests."""
    with _mounted(tmp_path, "tmpfs", ["-o", "size=8m,mode=0700"], "the ENOSPC tests") as mnt:
        yield mnt


@pytest.fixture
def ramfs(tmp_path):
    """A real ramfs mount: a filesystem that refuses O_DIRECT."""
    with _mounted(tmp_path, "ramfs", [], "the O_DIRECT refusal test") as mnt:
        yield mnt
