"""Shared fixtures: real files, real mounts, and leak checks (open fds) after each test;
the suite's markers (pyproject.toml) applied where a test's place or fixtures say them; a
SIGTERM of the run turned into a clean teardown; the run's mounts in a mount namespace of
its own, so that no kill of the run can leave one behind. Under pytest-xdist (`make test`
runs the e2e and slow tests on two workers) each worker is a pytest process of its own
(mount namespace, SIGTERM handling); what several workers need once per run (a reference
server's outputs, a warm store, the test models) is made by the first that asks
(`run_once`, `make_model`), and the tests of a module with a module-scoped fixture run on
one worker (`pytest_xdist_make_scheduler`)."""
import contextlib
import ctypes
import fcntl
import json
import os
import re
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


# A module-scoped fixture defined in a test module (a model's reference server, a built wheel).
_MODULE_FIXTURE = re.compile(r"@pytest\.fixture\([^)]*scope\s*=\s*[\"']module[\"']")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` under pytest-xdist (`make test` runs the e2e and slow tests on
    two workers with it): the tests of a module that defines a module-scoped fixture run on
    one worker, which makes the fixture once; every other test is a work unit of its own,
    so the workers stay busy to the end. (The session fixtures that start servers are made
    once per run whichever worker asks first: `run_once`.) It takes the place of xdist's
    own loadgroup, whose `xdist_group` marks this suite does not use (and which pytest 9.2's
    node ids no longer carry to the scheduler)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling
    grouped: dict[str, bool] = {}

    def module_scoped(path: str) -> bool:
        if path not in grouped:
            try:
                grouped[path] = bool(_MODULE_FIXTURE.search((config.rootpath / path).read_text()))
            except OSError:
                grouped[path] = False
        return grouped[path]

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if module_scoped(path) else nodeid

    return ModuleFixtureScheduling(config, log)


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


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock on `path` (made if missing) held across processes (flock)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """A directory every test process of this run sees: pytest's base temp directory, or
    under pytest-xdist its parent (the workers' base temp directories are in it; the
    controller removes it at the end of a run that passed)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def run_once(run_dir):
    """`run_once(name, make, dump=None, load=None)`: make()'s value, made once per run by
    the first test process that asks for it (under pytest-xdist the other workers wait for
    it and read it back: `dump` turns it into JSON, `load` back). A make() that raises
    leaves nothing behind; the next process that asks makes it again (and fails on its own)."""
    def once(name, make, dump=None, load=None):
        out = run_dir / f"once-{name}.json"
        with _file_lock(run_dir / f"once-{name}.lock"):
            if out.exists():
                doc = json.loads(out.read_text())
                return load(doc) if load else doc
            value = make()
            tmp = out.with_suffix(".part")
            tmp.write_text(json.dumps(dump(value) if dump else value))
            tmp.rename(out)
            return value
    return once


@pytest.fixture(scope="session")
def engine():
    """(python, description) of the vLLM engine the real-server tests run (tests/e2e, the
    CLI's demo and bench cases); a missing engine fails loudly, never skips."""
    from kvstore.drivers.server import engine_python
    try:
        return engine_python()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"no vLLM engine for the real-engine tests: {exc}")


@pytest.fixture(scope="session")
def make_model():
    """`make_model(python, name)`: the directory of kvstore's model `name`
    (kvstore.drivers.models), made by `python` (which has torch and transformers) on first
    use. One process at a time makes it: the first to ask writes it, the others (pytest-xdist
    workers, a `kvstore` command a test starts afterwards) find it made."""
    def make(python: str, name: str) -> str:
        from kvstore.drivers.models import default_dir
        path = default_dir(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _file_lock(Path(os.path.dirname(path)) / f".{name}.lock"):
            r = subprocess.run([python, "-c", f"from kvstore.drivers.models import ensure_model; "
                                              f"ensure_model({name!r}, {path!r})"],
                               capture_output=True, text=True)
        assert r.returncode == 0, f"making the {name} model failed: {r.stderr[-3000:]}"
        return path
    return make


@pytest.fixture(scope="module")
def fleet_pool(tmp_path_factory):
    """A real Mooncake Store pool on loopback (`kvstore.tools.fleet`: its master and one
    standalone pool client) for a module's tests, which use keys of their own stores."""
    from kvstore.tools import fleet
    fl = fleet.up(str(tmp_path_factory.mktemp("fleet")), pool_size="256M")
    yield fl
    fleet.down(fl.dir)


@pytest.fixture
def own_fleet_pool(tmp_path):
    """A pool of the test's own, for tests that kill a part of it."""
    from kvstore.tools import fleet
    fl = fleet.up(str(tmp_path / "fleet"), pool_size="64M")
    yield fl
    fleet.down(fl.dir)


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
