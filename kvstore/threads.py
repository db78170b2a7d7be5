"""kvstore's own threads, and the CPUs they may run on (`thread_cpus`, docs/CONFIG.md).

vLLM's step thread schedules every running request's next token; on a machine with few
cores, kvstore's index thread, I/O threads and device streams take turns on the same CPUs
and the kernel preempts the step thread mid-call (issue 14: run-queue delay, not code, was
most of the step thread's wall time over its own CPU time). `thread_cpus` confines
kvstore's threads to CPUs the operator sets aside, as storage engines take a core mask
(SPDK's `-m`, vLLM CPU's `VLLM_CPU_OMP_THREADS_BIND`). vLLM's own threads are never
touched: only a thread started here is pinned, by itself, as it starts.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Iterable

from kvstore.errors import ConfigError


def parse_cpus(value, allowed: Iterable[int] | None = None) -> frozenset[int] | None:
    """CPU ids from a Linux CPU list ("6", "2-5,8", as taskset -c and cgroups write it),
    a list of ints, or None (no pinning). Every CPU must be one this process may run on
    (`allowed`, default its affinity mask): a mask of CPUs it cannot use would leave
    kvstore's threads nowhere to run."""
    if value is None:
        return None
    cpus: set[int] = set()
    if isinstance(value, str):
        for part in value.replace(" ", "").split(","):
            lo, sep, hi = part.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
                raise ConfigError(
                    f"kvstore: thread_cpus={value!r} is not a CPU list; write it as taskset "
                    f"-c does, e.g. \"6\", \"6-7\" or \"2-5,8\"")
            cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    elif isinstance(value, (list, tuple)) and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value):
        cpus.update(value)
    else:
        raise ConfigError(f"kvstore: thread_cpus={value!r} must be a CPU list string "
                          f"(\"6-7\") or a list of CPU ids ([6, 7])")
    allowed = frozenset(os.sched_getaffinity(0) if allowed is None else allowed)
    where = (f"this process may run on {format_cpus(allowed)} (its affinity mask: taskset, "
             f"cgroup cpusets). Pick CPUs from those, or leave thread_cpus unset")
    if not cpus:
        raise ConfigError(f"kvstore: thread_cpus={value!r} names no CPU; {where}")
    if not cpus <= allowed:
        raise ConfigError(f"kvstore: thread_cpus={value!r} names CPUs this process may not "
                          f"run on ({format_cpus(cpus - allowed)}); {where}")
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """The Linux CPU list of `cpus`: {0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def make_thread(target: Callable, name: str, cpus: frozenset[int] | None = None,
                args: tuple = ()) -> threading.Thread:
    """A daemon thread (not started) running target(*args); with `cpus`, the thread first
    pins itself to them (a thread's mask is its own on Linux: the caller's is unchanged)."""
    def run():
        if cpus:
            os.sched_setaffinity(0, cpus)
        target(*args)
    return threading.Thread(target=run, name=name, daemon=True)
