"""Fixtures of the real-engine tests: a real `vllm serve` (vLLM's CPU build from `make engine`,
or the CUDA build where a GPU is present) with a real model made here, driven through the
OpenAI API exactly as an application drives it.

Server starts dominate the run time (20-60 s each on two cores), so the reference outputs
(a server without kvstore) and a warm store are made once per session and copied by the
tests that damage them.
"""
from __future__ import annotations

import subprocess

import pytest

from e2e_util import MAX_TOKENS, Serve, assert_same, wait_stored
from kvstore.drivers.client import Client
from kvstore.drivers.models import TINY, default_dir
from kvstore.drivers.server import engine_python
from kvstore.drivers.workload import Workload


@pytest.fixture(scope="session")
def engine():
    """(python, description) of the engine; a missing engine fails loudly, never skips."""
    try:
        return engine_python()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"no vLLM engine for the real-engine tests: {exc}")


@pytest.fixture(scope="session")
def model_dir(engine):
    path = default_dir(TINY.name)
    r = subprocess.run([engine[0], "-c", f"from kvstore.drivers.models import ensure_model; "
                                         f"ensure_model({TINY.name!r}, {path!r})"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return path


@pytest.fixture(scope="session")
def workload():
    return Workload(TINY, documents=2, doc_tokens=640, questions=2, sessions=2, turns=2, system_tokens=200)


@pytest.fixture(scope="session")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture
def serve(engine, model_dir, logs, request):
    sv = Serve(engine, model_dir, logs, request.node.name.replace("/", "_")[:60])
    yield sv
    sv.close()


@pytest.fixture(scope="session")
def reference(engine, model_dir, workload, logs):
    """The workload's completions from a server without kvstore: what every test must match."""
    sv = Serve(engine, model_dir, logs, "reference")
    try:
        with sv.running() as s:
            return workload.replay(Client(s.url), max_tokens=MAX_TOKENS)
    finally:
        sv.close()


@pytest.fixture(scope="session")
def warm_store(engine, model_dir, workload, logs, tmp_path_factory, reference):
    """A store filled by serving the workload once (tests copy it before damaging it)."""
    store = tmp_path_factory.mktemp("warm") / "store"
    sv = Serve(engine, model_dir, logs, "warm-store")
    try:
        with sv.running(store) as s:
            comps = workload.replay(Client(s.url), max_tokens=MAX_TOKENS)
            assert_same(reference, comps, workload)
            wait_stored(s)
    finally:
        sv.close()
    return store




@pytest.fixture
def small_disk(tmp_path):
    """A real, small ext4 file system on a loop device (48 MiB): a disk that fills up."""
    img = tmp_path / "disk.img"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(48 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot loop-mount an ext4 image for the full-disk test (needs root): {r.stderr}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
