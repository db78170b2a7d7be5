"""Shared fixtures: real files, real mounts, and leak checks (open fds) after each test;
the suite's markers (pyproject.toml) applied where a test's place or fixtures say them; a
SIGTERM of the run turned into a clean teardown; the run's mounts in a mount namespace of
its own, so that no kill of the run can leave one behind."""
import contextlib
import ctypes
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from leak_util import open_fds

E2E_DIR = Path(__file__).resolve().parent / "e2e"
# Fixtures that mount a file system (tmpfs, ramfs, loop-mounted ext4): a test using one
# needs root. Tests that mount by themselves carry @pytest.mark.root explicitly.
MOUNT_FIXTURES = {"small_fs", "ramfs", "small_disk", "disks", "three_disks"}


def pytest_collection_modifyitems(config, items):
    """`e2e` for every test under tests/e2e/ (a new file there gets it too), `root` for
    every test that uses a mount fixture."""
    for item in items:
        if E2E_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
        if MOUNT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.root)


_PYTEST_PID = os.getpid()


def _sigterm(signum, frame):
    if os.getpid() != _PYTEST_PID:
        # A child forked by a test inherited this handler: it dies of SIGTERM as it would
        # have without it (tests look at their children's exit status).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    # As Ctrl-C: pytest stops the test in progress and still runs every fixture's
    # finalizer (servers stopped, mounts unmounted) before it exits.
    raise KeyboardInterrupt("SIGTERM")


_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000


def _private_mount_namespace() -> None:
    """Move the run (as root) into a mount namespace of its own whose mounts propagate
    nowhere. Every process the tests start (servers, `kvstore` commands, `mount` itself)
    inherits it, so the tests' tmpfs, ramfs and loop-mounted ext4 mounts exist only there
    and end with the last of those processes: a SIGKILLed run leaves none behind (the loop
    devices, attached with autoclear by `mount -o loop`, detach with them). The host does
    not see them; to look at a running suite's mounts: `nsenter -t <pytest pid> -m findmnt`.
    KVSTORE_TEST_HOST_MOUNTS=1 keeps the host's namespace (then a killed run's mounts stay,
    and .ci/run's clean-up removes them)."""
    if os.geteuid() != 0 or os.environ.get("KVSTORE_TEST_HOST_MOUNTS") == "1":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    # unshare moves only the calling thread (pytest's main thread, before any test runs);
    # every thread and process started from it later inherits the namespace.
    if libc.unshare(_CLONE_NEWNS) != 0:
        raise pytest.UsageError(f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}; "
                                "set KVSTORE_TEST_HOST_MOUNTS=1 to mount in the host's namespace")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise pytest.UsageError(f"making / private in the tests' mount namespace failed: "
                                f"{os.strerror(ctypes.get_errno())}")


def pytest_configure(config):
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _sigterm)
    _private_mount_namespace()


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
