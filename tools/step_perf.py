#!/usr/bin/env python3
"""What vLLM's scheduler thread executes during the connector's slowest calls (issue 14).

    .venv/bin/python tools/step_perf.py [--index-entries 10000000] [--top 8] [-- BENCH ARGS]

Runs `kvstore bench connector` (no baseline) with Linux `perf record` attached to the
scheduler thread only (`-t`, cpu-clock at 10 kHz: a sample per 0.1 ms of its CPU, on
CLOCK_MONOTONIC), and every scheduler-side connector call's start and end recorded on that
clock. Then, per phase: the slowest calls with their wall and CPU time and the symbols
sampled inside them, and the calls by how many samples landed in the lookup table's C
walks (`_keytable`). A diagnostic, not a benchmark of record: perf costs the step thread
~40% (p50 0.09-0.14 -> 0.14-0.22 ms per step). Needs `perf` (Debian `linux-perf`) and
root or `kernel.perf_event_paranoid` <= 1.

What it showed at 10M entries (stop 32, docs/benchmarks.md): the rare steps of 1-3 ms of
CPU are the table walks themselves (samples 0.1 ms apart, all in `_hash_batch`'s bucket
fetches), clustered in the first ~1.5 s of a phase; a lookup that takes 50 us took 1.3 ms.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index-entries", type=int, default=10_000_000)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--freq", type=int, default=9999, help="perf samples per second of CPU")
    ap.add_argument("bench_args", nargs="*", help="more `kvstore bench connector` options")
    a = ap.parse_args()
    if shutil.which("perf") is None:
        sys.exit("step_perf: `perf` is not installed (Debian: apt-get install linux-perf)")
    tmp = tempfile.mkdtemp(prefix="kvstore-step-perf-")
    try:
        run(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(a, tmp: str) -> None:
    from kvstore.bench import connector_bench as cb
    from kvstore.cli import main as cli_main

    calls: list = []        # (phase, name, t0 ns, t1 ns, cpu ns), CLOCK_MONOTONIC
    procs: list = []
    state = {"phase": 0}
    orig_init, orig_result = cb._StepTimer.__init__, cb._StepTimer.result

    def init(self, h):
        orig_init(self, h)
        state["phase"] += 1
        out = os.path.join(tmp, f"phase{state['phase']}.data")
        procs.append(subprocess.Popen(
            ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-F", str(a.freq),
             "-t", str(threading.get_native_id()), "-o", out], stdout=subprocess.DEVNULL))
        time.sleep(1.0)     # perf attached before the phase's first step
        conn = h.scheduler_connector
        for name in cb.METHODS:
            f = getattr(conn, name, None)
            if f is None:
                continue

            def timed(*args, _f=f, _n=name, **kw):
                c = time.thread_time_ns()
                t = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                try:
                    return _f(*args, **kw)
                finally:
                    calls.append((state["phase"], _n, t, time.clock_gettime_ns(time.CLOCK_MONOTONIC),
                                  time.thread_time_ns() - c))
            setattr(conn, name, timed)

    def result(self):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait()
        return orig_result(self)

    cb._StepTimer.__init__, cb._StepTimer.result = init, result
    sys.argv = ["kvstore", "bench", "connector", "--index-entries", str(a.index_entries),
                "--no-baseline", "--json"] + a.bench_args
    import click
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            cli_main(standalone_mode=False)
    except click.ClickException as exc:     # a bad bench option: click's message, no trace
        sys.exit(f"step_perf: kvstore bench connector: {exc.format_message()}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = json.loads(buf.getvalue())["phases"]
    for ph, name in ((1, "store"), (2, "load")):
        r = res[name]
        print(f"bench {name} phase under perf: p50 {r['step_p50_ms']} / p99 {r['step_p99_ms']} / "
              f"max {r['step_max_ms']} ms per step, {r['steps']} steps")
        report(os.path.join(tmp, f"phase{ph}.data"), [c for c in calls if c[0] == ph], name, a.top)


def samples(path: str) -> list[tuple[int, str]]:
    txt = subprocess.run(["perf", "script", "-i", path, "-F", "time,ip,sym", "--ns"],
                         capture_output=True, text=True).stdout
    out = []
    for line in txt.splitlines():
        m = re.match(r"\s*(\d+)\.(\d+):\s+[0-9a-f]+\s+(\S+)", line)
        if m:
            out.append((int(m.group(1)) * 10**9 + int(m.group(2)),
                        re.sub(r"__pyx_[a-z]+_7kvstore_\d+_keytable_\d*", "keytable:", m.group(3))))
    out.sort()
    return out


def report(path: str, calls: list, phase: str, top: int) -> None:
    if not os.path.exists(path) or not calls:
        print(f"{phase}: no perf data")
        return
    samp = samples(path)
    ts = [s[0] for s in samp]

    def inside(c):
        return samp[bisect.bisect_left(ts, c[2]):bisect.bisect_right(ts, c[3])]

    t0 = calls[0][2]
    busy = [c for c in calls if c[1] != "has_pending_push_work"]   # (idle waits by design)
    print(f"{phase} phase: {len(busy)} connector calls, {len(samp)} samples of the step thread; "
          f"slowest calls (start s into the phase, wall / CPU ms, samples by symbol):")
    for c in sorted(busy, key=lambda c: c[2] - c[3])[:top]:
        syms = collections.Counter(s[1][:48] for s in inside(c))
        print(f"  {(c[2] - t0) / 1e9:6.2f}s {c[1]:<28} {(c[3] - c[2]) / 1e6:7.3f} / "
              f"{c[4] / 1e6:7.3f}  " + ", ".join(f"{k} {v}" for k, v in syms.most_common(5)))
    hist = collections.Counter()
    for c in busy:
        k = sum(1 for s in inside(c) if "keytable" in s[1] or "XXH" in s[1])
        if k:
            hist[min(k, 10)] += 1
    print(f"  calls by samples in the table's C walks (0.1 ms each; 10 = 10 or more): "
          + json.dumps(dict(sorted(hist.items()))))
    # Where each kind of call spends its CPU over the whole phase: a call is shorter than
    # a sample period, but hundreds of them add up to a profile. Calls of 20 us or more
    # only: the load phase's idle steps (hundreds of thousands of 5 us calls) would
    # drown the steps that do work.
    by_call: dict[str, collections.Counter] = {}
    for c in busy:
        if c[3] - c[2] >= 20_000:
            by_call.setdefault(c[1], collections.Counter()).update(s[1][:40] for s in inside(c))
    print("  samples inside each kind of call of 20 us or more over the phase (0.1 ms "
          "each), top symbols:")
    for name, syms in sorted(by_call.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(syms.values())
        if n:
            print(f"    {name:<28} {n:6d}  " + ", ".join(
                f"{k} {100 * v / n:.0f}%" for k, v in syms.most_common(top)))


if __name__ == "__main__":
    main()
