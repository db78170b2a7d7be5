"""Fault campaign, permissions and paths: what a server refuses to open.

Covered elsewhere (not repeated here): modes 0700/0600 of the store, rank dirs, slot
files and kvstore.json (test_disk_store.py::test_create_layout_permissions); a symlinked
store path and rank dir at the engine level (test_disk_store.py::
test_symlinked_store_and_rank_dir_refused); a symlinked slot file at the SlotFile level
(test_slotfile.py::test_symlink_refused); a store of another num_kv_heads / dtype /
tp_size / num_layers / block_size refused by the connector before serving
(test_connector_scheduler.py::test_layout_mismatch_refuses_at_startup); tenants with
different cache_salt never hitting each other's blocks through the connector
(test_connector_scheduler.py::test_tenants_with_different_cache_salt_never_share_blocks).
"""
import hashlib
import os
import shutil

import pytest

from connector_util import kv_config, kv_harness, loads_ok, open_fds, prompts, settle
from fault_util import fsck_json
from kvstore import KVStoreError, LayoutMismatch
from kvstore.drivers.simulator import EngineHarness

# Every file and directory of a store a server opens, and which side opens it. Rank 0's
# files stand for every rank's (the same code opens them); a refusal on rank 1 would
# leave rank 0's already started worker connector running in this process, because
# EngineHarness does not shut down what it built when a later connector fails.
PLANTED = [
    ("LOCK", "scheduler"),
    ("kvstore.json", "scheduler"),
    ("index", "scheduler"),
    ("index/data.mdb", "scheduler"),
    ("index/lock.mdb", "scheduler"),
    ("rank0", "worker"),
    ("rank0/slots-0000.kvs", "worker"),
]


def _digest(path: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(p.encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def base_store(tmp_path_factory):
    """A store with committed blocks (2 TP ranks), written by a serving harness."""
    d = tmp_path_factory.mktemp("paths")
    store = d / "store"
    with kv_harness(store, tp_size=2) as h:
        h.run(prompts(90, 3, 70), max_tokens=1)
        settle(h)
    return store


def _model(base_store) -> str:
    """The model directory the base store was written for (its path is the model name)."""
    return str(base_store.parent / "model")


def _release_leaked_lock(store) -> None:
    """EngineHarness does not shut its scheduler connector down when a worker connector
    fails to start (kvstore/drivers/simulator.py), so the scheduler's writer lock stays open in this
    process. A real engine process exits; here, close that one fd so later steps can open
    the store."""
    lock = os.path.realpath(os.path.join(str(store), "LOCK"))
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == lock:
                os.close(int(fd))
        except OSError:
            pass


@pytest.mark.parametrize("rel, side", PLANTED)
def test_symlink_anywhere_in_the_store_is_refused(tmp_path, base_store, rel, side):
    """A symlink planted in place of any file or directory of a store (pointing at the
    real thing, so following it would work) stops the server at start with an error
    naming the path; the link's target is never written."""
    store = tmp_path / "store"
    shutil.copytree(base_store, store, symlinks=True)
    aside = tmp_path / "aside"
    aside.mkdir()
    real = store / rel
    target = aside / rel.replace("/", "_")
    os.rename(real, target)
    os.symlink(target, real)
    digest = _digest(str(target)) if target.is_dir() else hashlib.sha256(target.read_bytes()).hexdigest()
    before = open_fds()
    with pytest.raises(KVStoreError) as ei:
        EngineHarness(kv_transfer_config=kv_config(store), workdir=str(tmp_path), tp_size=2,
                      model_dir=_model(base_store))
    msg = str(ei.value)
    del ei      # its traceback holds the half-built harness (and its open files)
    assert str(real) in msg and ("symlink" in msg or "symbolic link" in msg), msg
    if side == "worker":
        _release_leaked_lock(store)
    import gc
    gc.collect()
    assert not {f for f in open_fds() - before if "pytest" not in f}
    if rel == "index":
        # The operator's tools see it the same way: fsck reports it, and
        # --rebuild-index (on a copy) replaces the link by a real index, target untouched.
        code, doc = fsck_json(store)
        assert code == 4 and [f["kind"] for f in doc["findings"]] == ["index_unreadable"], doc
        copy = tmp_path / "copy"
        shutil.copytree(store, copy, symlinks=True)
        code, doc = fsck_json(copy, "--rebuild-index")
        assert code == 1 and not os.path.islink(copy / "index"), doc
        assert fsck_json(copy)[0] == 0
    after = _digest(str(target)) if target.is_dir() else hashlib.sha256(target.read_bytes()).hexdigest()
    assert after == digest, "the symlink's target was modified"
    # The same store with the real file back in place serves (so the link was the cause).
    os.unlink(real)
    os.rename(target, real)
    with kv_harness(store, tp_size=2, model_dir=_model(base_store)) as h:
        loads_ok(h.run(prompts(90, 3, 70), max_tokens=1))


def test_planted_symlinks_at_creation_are_never_followed(tmp_path):
    """A directory prepared by someone else for a store that does not exist yet: links
    where the fingerprint's temporary file and a slot file will be created. Creation
    never writes through them (the victim files stay as they were)."""
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, store / "kvstore.json.tmp")
    with pytest.raises(KVStoreError) as ei:     # O_NOFOLLOW refusal (kvstore/format/layout.py)
        EngineHarness(kv_transfer_config=kv_config(store), workdir=str(tmp_path))
    assert "kvstore.json.tmp" in str(ei.value) and "symlink" in str(ei.value)
    assert victim.read_bytes() == b"precious"
    assert not (store / "kvstore.json").exists()
    os.unlink(store / "kvstore.json.tmp")
    (store / "rank0").mkdir(mode=0o700, exist_ok=True)   # the failed creation made it
    os.symlink(victim, store / "rank0" / "slots-0000.kvs")
    with kv_harness(store) as h:          # the link is replaced by a real slot file
        h.run(prompts(91, 2, 70), max_tokens=1)
        settle(h)
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(store / "rank0" / "slots-0000.kvs")


def test_store_files_are_private_even_with_umask_zero(tmp_path):
    """Created by a server whose umask is 0: nothing in the store is group/other
    accessible (KV bytes are the users' prompts)."""
    store = tmp_path / "store"
    old = os.umask(0)
    try:
        with kv_harness(store) as h:
            h.run(prompts(92, 1, 40), max_tokens=1)
            settle(h)
    finally:
        os.umask(old)
    bad = []
    for root, dirs, files in os.walk(store):
        for name in dirs + files:
            p = os.path.join(root, name)
            mode = os.lstat(p).st_mode & 0o777
            if mode & 0o077:
                bad.append((os.path.relpath(p, store), oct(mode)))
    assert (os.stat(store).st_mode & 0o777) == 0o700
    assert not bad, bad


@pytest.mark.parametrize("change, field", [
    ({"hash_algo": "sha256_cbor"}, "hash_algo"),
    ({"layout": "LBHNC"}, "kv_layout"),
    ("other_model_dir", "model"),
])
def test_store_of_another_configuration_refused_before_serving(tmp_path, change, field):
    """Beyond the shapes (test_layout_mismatch_refuses_at_startup): another model with
    identical shapes, another block-hash algorithm, another KV page layout are refused
    by the connector at engine start, naming the field, and the store is untouched."""
    store = tmp_path / "store"
    with kv_harness(store) as h:
        h.run(prompts(93, 1, 40), max_tokens=1)
        settle(h)
    digest = _digest(str(store / "rank0")) + _digest(str(store / "index"))
    kw = {}
    if change == "other_model_dir":
        from kvstore.drivers.simulator import write_model_dir
        kw["model_dir"] = write_model_dir(tmp_path / "other-model")
    else:
        kw.update(change)
    before = open_fds()
    with pytest.raises(LayoutMismatch) as ei:
        EngineHarness(kv_transfer_config=kv_config(store), workdir=str(tmp_path), **kw)
    assert ei.value.field == field, str(ei.value)
    assert "refusing" in str(ei.value)
    assert not open_fds() - before
    assert _digest(str(store / "rank0")) + _digest(str(store / "index")) == digest
