#!/usr/bin/env python3
"""Where the connector's time on vLLM's scheduler thread goes, per step.

    .venv/bin/python tools/step_profile.py [--index-entries 10000000] [--requests 96] [--top 6]

Runs `kvstore bench connector` (its store and load phases, no baseline) with the
scheduler connector's calls and the serving index's walks wrapped, and adds up each
call's thread CPU time (`time.thread_time_ns`: no GIL or lock waits) per scheduler step.
Prints, per phase, the CPU p50/p99 per busy step, how many steps went over 0.5 ms, and
the slowest steps broken down: connector calls by name (`n_<call>`: how many), and inside
them (`~<part>`) the serving index's lookup walk, pins, store planning (`plan_new`, a short pool's `count_dropped` (queued),
`take`) and hit counting; then each part's CPU time per call (p50/p99, all steps), and
the long lookups' (> 256 blocks) CPU time and how many of their blocks were found by
following a run of consecutive slots (`KeyTable.run_follows`). A diagnostic for issue 14, not a benchmark of record (the bench
itself reports the per-step figures).
"""
from __future__ import annotations

import argparse
import collections
import resource
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index-entries", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()

    import kvstore.serving_index as si
    import kvstore.testing as testing
    import kvstore.vllm.scheduler as sc
    from kvstore.bench import connector_bench
    from vllm.v1.core.sched.scheduler import Scheduler

    steps: list = []            # (phase, busy, Counter of us per call/part)
    calls = collections.defaultdict(list)   # (phase, label) -> us of each call
    cur: dict = {"d": None, "phase": "store"}

    orig_schedule = Scheduler.schedule

    def schedule(self, *args, **kw):
        cur["d"] = d = collections.Counter()
        so = orig_schedule(self, *args, **kw)
        steps.append((cur["phase"], so.total_num_scheduled_tokens > 0, d))
        return so
    Scheduler.schedule = schedule

    def wrap(cls, name, label, count):
        orig = getattr(cls, name)

        def timed(*args, **kw):
            f = resource.getrusage(resource.RUSAGE_THREAD) if count else None
            c = time.thread_time_ns()
            try:
                return orig(*args, **kw)
            finally:
                d = cur["d"]
                if d is not None:
                    us = (time.thread_time_ns() - c) / 1e3
                    d[label] += us
                    calls[(cur["phase"], label)].append(us)
                    if count:   # page faults taken in the call (minor + major)
                        g = resource.getrusage(resource.RUSAGE_THREAD)
                        d["n_" + label] += 1
                        d["flt_" + label] += (g.ru_minflt - f.ru_minflt) + (g.ru_majflt - f.ru_majflt)
        setattr(cls, name, timed)

    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished", "take_events", "get_stats"):
        wrap(sc.KVStoreScheduler, name, name, True)
    for cls, name in ((si.ServingIndex, "lookup_hashes"), (si.ServingIndex, "count_hits"),
                      (si.ServingIndex, "pin"), (si.ServingIndex, "unpin"),
                      (si.ServingIndex, "plan_new"), (si.ServingIndex, "count_dropped"),
                      (si.ServingIndex, "take"),
                      (sc.KVStoreScheduler, "_release_candidate"),
                      (sc.KVStoreScheduler, "_plan_stores"), (sc.KVStoreScheduler, "_plan_eager"),
                      (sc.KVStoreScheduler, "_index_events"), (sc._Plan, "cut"),
                      (sc._Plan, "add_packed"), (sc.KVStoreScheduler, "_plan_range")):
        if not hasattr(cls, name):
            continue
        wrap(cls, name, "~" + name.lstrip("_"), False)

    # long lookups (an 8k-token prompt's ~511 blocks): their CPU time, and how many of
    # their blocks the walk found by following a run of consecutive slots
    longs = collections.defaultdict(list)
    orig_lookup = si.ServingIndex.lookup_hashes

    def lookup_hashes(self, hashes, start, stop, *args, **kw):
        table = self._table if self._ready else None
        f = getattr(table, "run_follows", 0)
        c = time.thread_time_ns()
        out = orig_lookup(self, hashes, start, stop, *args, **kw)
        us = (time.thread_time_ns() - c) / 1e3
        if len(out[1]) > 256:
            longs[cur["phase"]].append((us, len(out[1]), getattr(table, "run_follows", 0) - f))
        return out
    si.ServingIndex.lookup_hashes = lookup_hashes

    drains = {"n": 0}
    orig_drain = testing.EngineHarness.drain

    def drain(self, *args, **kw):       # the bench drains once per phase
        cur["phase"] = "store" if drains["n"] == 0 else "load"
        drains["n"] += 1
        return orig_drain(self, *args, **kw)
    testing.EngineHarness.drain = drain

    connector_bench.run(index_entries=a.index_entries, requests=a.requests, baseline=False)
    for phase in ("store", "load"):
        rows = [(sum(v for k, v in d.items() if not k.startswith(("n_", "~", "flt_"))), d)
                for p, busy, d in steps if p == phase and busy]
        if not rows:
            continue
        tot = sorted(r[0] for r in rows)
        print(f"{phase}: {len(rows)} steps, connector CPU per step p50 {_pct(tot, 50):.0f} us, "
              f"p99 {_pct(tot, 99):.0f} us, "
              f"{sum(1 for t in tot if t > 500)} over 500 us")
        for t, d in sorted(rows, key=lambda r: -r[0])[:a.top]:
            parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(d.items()) if v)
            print(f"  {t:.0f} us: {parts}")
        per = []
        for (p, label), xs in sorted(calls.items()):
            if p == phase and label.startswith("~"):
                xs = sorted(xs)
                per.append(f"{label[1:]} {_pct(xs, 50):.0f}/{_pct(xs, 99):.0f} ({len(xs)})")
        print("  per call, CPU us p50/p99 (calls): " + ", ".join(per))
        if longs[phase]:
            us = sorted(x[0] for x in longs[phase])
            print(f"  lookups of > 256 blocks: {len(us)}, CPU us p50 {_pct(us, 50):.0f}, "
                  f"p90 {_pct(us, 90):.0f}; blocks found by following slot runs: "
                  f"{sum(x[2] for x in longs[phase])} of {sum(x[1] for x in longs[phase])}")


def _pct(xs: list, p: float) -> float:
    """The p-th percentile of sorted xs (nearest rank below)."""
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))]


if __name__ == "__main__":
    main()
