"""Where kvstore's threads may run when vLLM's CPU build binds the step thread to the
forward's cores: the CPUs a thread may use (`usable_cpus`), a `thread_cpus` naming a core
outside the step thread's mask (in the real engine: tests/e2e/test_real_engine.py), and a
thread whose CPUs are gone."""
from __future__ import annotations

import os
import threading

import pytest

from kvstore.io.threads import make_thread, parse_cpus, usable_cpus

MINE = frozenset(os.sched_getaffinity(0))
TWO = pytest.mark.skipif(len(MINE) < 2, reason="needs two CPUs: one for the 'forward', one beside it")


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
    assert on_narrowed_thread(usable_cpus, {min(MINE)}) >= MINE
    assert os.sched_getaffinity(0) == MINE        # the probe changes no caller's mask


@TWO
def test_thread_cpus_may_name_a_cpu_outside_the_step_threads_mask():
    """An operator names the core vLLM reserved; the step thread (bound to the forward's
    cores) parses the config: that is a CPU kvstore's threads may use, not a refusal."""
    first, other = min(MINE), max(MINE)
    assert on_narrowed_thread(lambda: parse_cpus(str(other)), {first}) == {other}


def test_a_thread_whose_cpus_are_gone_runs_unpinned_with_a_warning(caplog):
    seen = []
    t = make_thread(lambda: seen.append(os.sched_getaffinity(0)), "kvstore-test", frozenset({10 ** 6}))
    with caplog.at_level("WARNING", logger="kvstore.io.threads"):
        t.start()
        t.join()
    assert seen == [MINE]
    assert any("cannot run on CPUs" in r.getMessage() for r in caplog.records)
