"""kvstore's own threads: the CPUs they may run on (`thread_cpus`) and the priority of the
I/O threads (`io_thread_nice`), docs/CONFIG.md.

`thread_cpus` confines kvstore's threads to CPUs the operator sets aside, as storage
engines take a core mask (SPDK's `-m`; vLLM's CPU build binds its OpenMP threads with
`VLLM_CPU_OMP_THREADS_BIND`), so they never take a CPU vLLM's engine is using. vLLM's own
threads are never touched: only a thread started here is pinned, by itself, as it starts.
Pinning alone does not shorten vLLM's steps (docs/benchmarks.md): the priority below
does.

`io_thread_nice` lowers the CPU priority of kvstore's I/O threads (each rank's I/O thread,
device streams, probes, patrols) below the index thread's, as RocksDB runs its background
threads at `CpuPriority::kLow` (nice 19). The index thread holds the GIL, which vLLM's step
thread needs; the I/O threads spend their CPU in C without it (checksums, copies, io_uring
waits). On a shared CPU the kernel would preempt the index thread in the middle of a GIL
hold to run an I/O thread, and vLLM's step thread then waits on the GIL until the index
thread runs again (0.3-2 ms measured). At nice 19 (a CFS weight of 15 against the index
thread's 1024) an I/O thread almost never preempts it; the I/O threads still get every CPU cycle
nobody else wants. That is the default, except where vLLM's forward pass itself runs on
the host's cores (its CPU build, `io_nice`).

Every thread started here names itself to the kernel ("kvs-index", "kvs-io-rank0"), so an
operator sees kvstore's threads and their priority in `top -H` or `ps -L`.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterable

from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.io.threads")


def parse_cpus(value, allowed: Iterable[int] | None = None) -> frozenset[int] | None:
    """CPU ids from a Linux CPU list ("6", "2-5,8", as taskset -c and cgroups write it),
    a CPU id, a list of them, or None (no pinning). Every CPU must be one this process may run on
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
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        cpus.add(value)             # "thread_cpus": 6, one CPU
    elif isinstance(value, (list, tuple)) and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value):
        cpus.update(value)
    else:
        raise ConfigError(f"kvstore: thread_cpus={value!r} must be a CPU list string "
                          f"(\"6-7\"), a CPU id (6) or a list of CPU ids ([6, 7])")
    allowed = frozenset(usable_cpus() if allowed is None else allowed)
    where = (f"this process may run on {format_cpus(allowed)} (the CPUs online in its cgroup "
             f"cpuset). Pick CPUs from those, or leave thread_cpus unset")
    if not cpus:
        raise ConfigError(f"kvstore: thread_cpus={value!r} names no CPU; {where}")
    if not cpus <= allowed:
        raise ConfigError(f"kvstore: thread_cpus={value!r} names CPUs this process may not "
                          f"run on ({format_cpus(cpus - allowed)}); {where}")
    return frozenset(cpus)


def usable_cpus() -> frozenset[int]:
    """The CPUs a thread of this process may be placed on: the online CPUs its cgroup
    cpuset allows. That can be more than the calling thread's affinity mask, which a
    runtime may have narrowed: vLLM's CPU build binds its step thread to the forward's
    OpenMP cores, and a thread started there inherits that mask. The kernel answers: a
    throwaway thread asks for every CPU and reads back what it was given (sched_setaffinity
    keeps the CPUs the cpuset allows)."""
    out: list[frozenset[int]] = []

    def probe():
        try:
            # every CPU id the kernel could have (configured, online or not); the
            # kernel keeps those the cpuset allows
            os.sched_setaffinity(0, range(os.sysconf("SC_NPROCESSORS_CONF")))
        except OSError:
            pass
        out.append(frozenset(os.sched_getaffinity(0)))
    t = threading.Thread(target=probe, name="kvstore-cpu-probe", daemon=True)
    t.start()
    t.join()
    return out[0] if out else frozenset(os.sched_getaffinity(0))


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
                args: tuple = (), nice: int = 0) -> threading.Thread:
    """A daemon thread (not started) running target(*args); with `cpus`, the thread first
    pins itself to them, and with `nice` > 0 lowers its own priority by that much (capped
    at 19). Both are the thread's own on Linux: the caller's mask and priority are unchanged.
    The thread also names itself to the kernel ("kvstore-io-rank0" as "kvs-io-rank0": a
    kernel name holds 15 bytes), so `top -H`, `ps -L` and /proc show which threads are
    kvstore's."""
    def run():
        _name_native(name)
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError as exc:      # (the cpuset shrank since the CPUs were chosen)
                log.warning("kvstore: thread %s cannot run on CPUs %s (%s); it runs where "
                            "the process may", name, format_cpus(cpus), exc)
        if nice > 0:
            _lower_priority(nice)
        target(*args)
    return threading.Thread(target=run, name=name, daemon=True)


def _name_native(name: str) -> None:
    """Set the calling thread's kernel name (`comm`, at most 15 bytes) with
    prctl(PR_SET_NAME); best effort. prctl opens no file: writing /proc/self/task/TID/comm
    would, and a thread starting while a caller lists the process's open files (the tests'
    fd-leak checks) would show it."""
    if name.startswith("kvstore-"):
        name = "kvs-" + name[len("kvstore-"):]
    global _prctl
    if _prctl is None:
        import ctypes
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    if _prctl:
        _prctl(_PR_SET_NAME, name.encode("utf-8", "replace")[:15], 0, 0, 0)


_PR_SET_NAME = 15          # <linux/prctl.h>
_prctl = None              # libc's prctl, looked up on first use (False: none here)


def _lower_priority(nice: int) -> None:
    """Add `nice` to the calling thread's nice value, at most 19 (on Linux a thread's nice
    value is its own: setpriority on its thread id). Lowering needs no privilege; a system
    that refuses it (a seccomp filter) leaves the thread as it was, with a warning."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        log.warning("kvstore: could not lower the priority of thread %s (%s); it runs at the "
                    "process's priority", threading.current_thread().name, exc)


def io_nice(thread_cpus: frozenset[int] | None, io_thread_nice: int | None,
            forward_on_host: bool) -> int:
    """The nice increment of kvstore's I/O threads: `io_thread_nice`, or when it is not set
    (None), 19 unless vLLM's forward pass runs on this host's CPUs (`forward_on_host`:
    vLLM's CPU build) on CPUs kvstore shares with it. With GPUs the forward leaves the CPUs
    alone, and what competes with the I/O threads for them is vLLM's step thread and
    kvstore's index thread, both of which must win. On CPUs set aside
    (`thread_cpus`) the I/O threads only compete with the index thread. On the CPU build's
    shared cores they compete with the forward's OpenMP threads, one per core at nice 0:
    at nice 19 a load's checksums and copies get a sliver of a core while a forward runs
    (a disk hit's TTFT with four requests decoding: 245 ms median at 0, 422-473 ms at 19,
    docs/benchmarks.md), so they stay at the process's priority there."""
    if io_thread_nice is not None:
        return io_thread_nice
    return 0 if forward_on_host and not thread_cpus else 19
