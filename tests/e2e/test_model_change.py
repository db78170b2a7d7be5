"""A model directory whose weights are replaced (same name, same shapes, other values)
between two `vllm serve` runs on one store: the second run never gets the old weights'
KV, through the connector and through the secondary tier. Its greedy tokens equal vLLM
alone's with the new weights, and the log says the store was re-initialised."""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import subprocess

import pytest

from e2e_util import MAX_TOKENS, Serve, assert_same, info, wait_cascaded, wait_stored
from kvstore.drivers.client import Client
from kvstore.drivers.models import TINY

RESET_LOG = "was written by another model (weights sha256:"


@pytest.fixture(scope="module")
def new_weights(engine, model_dir, tmp_path_factory):
    """The tiny model's weight files made again with another seed (same shapes and
    tokenizer)."""
    other = str(tmp_path_factory.mktemp("other-weights") / "model")
    spec = dataclasses.replace(TINY, seed=TINY.seed + 1)
    r = subprocess.run([engine[0], "-c", "import dataclasses; from kvstore.drivers.models import "
                        f"ensure_model, TINY; ensure_model(dataclasses.replace(TINY, seed={spec.seed}), "
                        f"{other!r})"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted(glob.glob(os.path.join(other, "*.safetensors")))


@pytest.fixture(scope="module")
def new_reference(engine, model_dir, new_weights, workload, logs, tmp_path_factory, reference):
    """vLLM alone's completions with the new weights."""
    d = str(tmp_path_factory.mktemp("new-ref") / "model")
    shutil.copytree(model_dir, d)
    swap(d, new_weights)
    sv = Serve(engine, d, logs, "new-weights-reference")
    try:
        with sv.running() as s:
            new_ref = workload.replay(Client(s.url), max_tokens=MAX_TOKENS)
    finally:
        sv.close()
    assert any(a.token_ids != b.token_ids for a, b in zip(reference, new_ref)), \
        "the new weights generate the same tokens as the old ones: the test would prove nothing"
    return new_ref


def swap(model: str, files: list[str]) -> None:
    """Write the weight files `files` over those of the directory `model` (same names)."""
    for f in files:
        shutil.copy(f, os.path.join(model, os.path.basename(f)))


def test_connector_never_serves_the_old_weights_kv(serve, workload, reference, new_weights,
                                                   new_reference, model_dir, tmp_path):
    model = str(tmp_path / "model")
    shutil.copytree(model_dir, model)
    store = str(tmp_path / "store")
    with serve.running(store, model=model) as s:
        assert_same(reference, workload.replay(Client(s.url), max_tokens=MAX_TOKENS), workload)
        wait_stored(s)
    before = info(store)
    assert before["used_slots"] > 0
    swap(model, new_weights)
    with serve.running(store, model=model) as s:
        got = workload.replay(Client(s.url), max_tokens=MAX_TOKENS)
    assert_same(new_reference, got, workload)
    log = s.log_text()
    assert RESET_LOG in log and "re-initialised it for this one" in log, log[-3000:]
    print(next(line for line in log.splitlines() if RESET_LOG in line))
    after = info(store)
    assert after["model_identity"]["weights"] != before["model_identity"]["weights"]


def test_tier_never_serves_the_old_weights_kv(serve, workload, reference, new_weights,
                                              new_reference, model_dir, tmp_path):
    model = str(tmp_path / "model")
    shutil.copytree(model_dir, model)
    store = str(tmp_path / "tier")
    s = serve.tier_server(store, model=model).start()
    try:
        assert_same(reference, workload.replay(Client(s.url), max_tokens=MAX_TOKENS), workload)
        wait_cascaded(s)
    finally:
        serve.stop_tier(s)
    before = info(store)
    assert before["used_slots"] > 0
    swap(model, new_weights)
    s = serve.tier_server(store, model=model).start()
    try:
        got = workload.replay(Client(s.url), max_tokens=MAX_TOKENS)
    finally:
        serve.stop_tier(s)
    assert_same(new_reference, got, workload)
    log = s.log_text()
    assert RESET_LOG in log and "re-initialised it for this one" in log, log[-3000:]
    assert info(store)["model_identity"]["weights"] != before["model_identity"]["weights"]
