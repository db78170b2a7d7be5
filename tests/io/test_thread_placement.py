"""Where kvstore's threads run when vLLM's CPU build binds the step thread to the forward's
cores: the CPUs a thread may use (`usable_cpus`), those left beside the forward
(`spare_cpus`), and the connector's default placement (`ConnectorConfig.placed`)."""
from __future__ import annotations

import os
import threading

import pytest

from kvstore.io.threads import parse_cpus, spare_cpus, usable_cpus

MINE = frozenset(os.sched_getaffinity(0))


def on_narrowed_thread(fn, cpus):
    """fn() run on a thread bound to `cpus`, as vLLM's CPU build binds its step thread to the
    forward's OpenMP cores (the caller's mask is untouched)."""
    out = []

    def body():
        os.sched_setaffinity(0, cpus)
        out.append(fn())
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert out, "the narrowed thread raised"
    return out[0]


def test_usable_cpus_reach_past_a_narrowed_thread_mask():
    assert usable_cpus() >= MINE
    first = {min(MINE)}
    assert on_narrowed_thread(usable_cpus, first) >= MINE
    assert os.sched_getaffinity(0) == MINE        # the probe changes no caller's mask


def test_spare_cpus_are_the_process_cpus_beside_the_forward():
    assert spare_cpus() is None                    # this thread has every CPU the process has
    first = {min(MINE)}
    spare = on_narrowed_thread(spare_cpus, first)
    if len(MINE) == 1:
        assert spare is None                       # nothing beside the forward: no placement
    else:
        assert spare == MINE - first


@pytest.mark.skipif(len(MINE) < 2, reason="needs two CPUs: one for the 'forward', one beside it")
def test_thread_cpus_may_name_a_cpu_outside_the_step_threads_mask():
    """An operator names the core vLLM reserved; the step thread (bound to the forward's
    cores) parses the config: that is a CPU kvstore's threads may use, not a refusal."""
    first, other = min(MINE), max(MINE)
    assert on_narrowed_thread(lambda: parse_cpus(str(other)), {first}) == {other}


def test_connector_places_its_threads_beside_the_forward_on_the_cpu_build(monkeypatch):
    from kvstore.vllm.config import ConnectorConfig
    first = {min(MINE)}
    cfg = ConnectorConfig.from_extra_config({"path": "/x"})
    assert cfg.placed() is cfg                     # GPU build: the forward is not on the host
    monkeypatch.setattr(ConnectorConfig, "forward_on_host", staticmethod(lambda: True))
    cpu_cfg = ConnectorConfig.from_extra_config({"path": "/x"})
    placed = on_narrowed_thread(cpu_cfg.placed, first)
    if len(MINE) == 1:
        assert placed is cpu_cfg
    else:
        assert placed.thread_cpus == MINE - first
        assert placed.io_thread_nice == cpu_cfg.io_thread_nice == 0
    assert cpu_cfg.placed() is cpu_cfg             # an unbound caller: nothing beside it
    own = ConnectorConfig.from_extra_config({"path": "/x", "thread_cpus": str(min(MINE))})
    assert on_narrowed_thread(own.placed, first) is own      # the operator's choice stands
