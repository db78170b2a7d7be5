"""Fixtures of the real-engine tests: a real `vllm serve` (vLLM's CPU build from `make engine`,
or the CUDA build where a GPU is present) with a real model made here, driven through the
OpenAI API exactly as an application drives it.

Server starts dominate the run time (20-60 s each on two cores), so the reference outputs
(one server without kvstore answers the workload, the load tests' pool and the preemption
prompts) and a warm store are made once per run, by the first test process that needs
them (pytest-xdist workers share them, `run_once`), and copied by the tests that damage
them.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from e2e_util import (
    MAX_TOKENS, PREEMPT_OUT, PREEMPT_PROMPTS, PREEMPT_TOKENS, Serve, assert_same, wait_stored,
)
from kvstore.drivers.client import Client, Completion
from kvstore.drivers.models import TINY, words
from kvstore.drivers.workload import Workload


@pytest.fixture(scope="session")
def model_dir(engine, make_model):
    return make_model(engine[0], TINY.name)


@pytest.fixture(scope="session")
def async_scheduling_kept(engine, model_dir, run_once):
    """Whether the engine serves with async scheduling when `--async-scheduling` asks for it:
    the config vLLM builds from those arguments. vLLM's CPU build turns it off whatever the
    command line says (its platform hook, `CpuPlatform.check_and_update_config`, has the
    last word)."""
    def make():
        code = ("from vllm.engine.arg_utils import EngineArgs\n"
                f"c = EngineArgs(model={model_dir!r}, async_scheduling=True, enforce_eager=True, "
                "block_size=32, dtype='float32').create_engine_config()\n"
                "print('ASYNC_SCHEDULING', c.scheduler_config.async_scheduling)\n")
        r = subprocess.run([engine[0], "-c", code], capture_output=True, text=True,
                           env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
        said = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("ASYNC_SCHEDULING ")]
        assert r.returncode == 0 and said, r.stdout[-2000:] + r.stderr[-3000:]
        return said[-1] == "True"
    return run_once("async-scheduling-kept", make)


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
def preempt_prompts(workload):
    rng = random.Random(5)
    vocab = workload.system.split()
    return [" ".join(rng.choice(vocab) for _ in range(PREEMPT_TOKENS)) for _ in range(PREEMPT_PROMPTS)]


@pytest.fixture(scope="session")
def pool():
    """Prompts of the load tests' concurrent traffic (test_serving_load.py): 4 questions
    over each of 16 shared documents of 600 tokens."""
    rng = random.Random(2024)
    docs = [words(TINY, 600, rng) for _ in range(16)]
    return [f"{d} {words(TINY, rng.randint(8, 24), rng)}" for d in docs for _ in range(4)]


@pytest.fixture(scope="session")
def references(engine, model_dir, workload, pool, preempt_prompts, logs, run_once):
    """What a server without kvstore answers, every prompt sent alone, greedy: {"workload":
    the workload's completions, "pool": each pool prompt's (MAX_TOKENS tokens), "preempt":
    each preemption prompt's (PREEMPT_OUT tokens)}. One server for all three: in float32 a
    greedy completion does not depend on the KV cache's size or on which part of the prompt
    came from a cache (kvstore.drivers.models.SERVE_DTYPE)."""
    def make():
        sv = Serve(engine, model_dir, logs, "reference")
        try:
            with sv.running() as s:
                c = Client(s.url)
                return {"workload": workload.replay(c, max_tokens=MAX_TOKENS),
                        "pool": [c.complete(p, max_tokens=MAX_TOKENS) for p in pool],
                        "preempt": [c.complete(p, max_tokens=PREEMPT_OUT) for p in preempt_prompts]}
        finally:
            sv.close()
    return run_once("references", make,
                    dump=lambda r: {k: [dataclasses.asdict(c) for c in v] for k, v in r.items()},
                    load=lambda d: {k: [Completion(**c) for c in v] for k, v in d.items()})


@pytest.fixture(scope="session")
def reference(references):
    """The workload's completions from a server without kvstore: what every test must match."""
    return references["workload"]


@pytest.fixture(scope="session")
def warm_store(engine, model_dir, workload, logs, run_dir, run_once, reference):
    """A store filled by serving the workload once (tests copy it before damaging it)."""
    def make():
        store = run_dir / "warm" / "store"
        shutil.rmtree(store.parent, ignore_errors=True)     # what a failed make left
        store.parent.mkdir()
        sv = Serve(engine, model_dir, logs, "warm-store")
        try:
            with sv.running(store) as s:
                comps = workload.replay(Client(s.url), max_tokens=MAX_TOKENS)
                assert_same(reference, comps, workload)
                wait_stored(s)
        finally:
            sv.close()
        return store
    return run_once("warm-store", make, dump=str, load=Path)


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
