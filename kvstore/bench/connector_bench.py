"""`kvstore bench connector`: the connector's time on vLLM's scheduler thread, per step.

Runs the real vLLM `Scheduler` with the kvstore connector (`kvstore.drivers.simulator.EngineHarness`,
CPU KV tensors) over a store whose index is prefilled with `index_entries` entries (the
store is full: every store evicts), in two phases:

- **store**: new prompts of `prompt_tokens` tokens, one step's token budget each (eager
  policy, 8k tokens per step by default): every step plans, reserves and commits a full
  step's worth of blocks;
- **load**: the engine restarts (empty GPU cache, the store kept) and replays those
  prompts: every request looks its prefix up, loads it from disk and touches it.

Every scheduler-side connector call is timed; a step's connector time is the sum of its
calls. Reported per phase: p50/p99/max per step, steps, and the index fsyncs done on the
scheduler thread (`Index.fsyncs_by_thread`; the target is zero). With `baseline`, the same
phases run again over the synchronous baseline index (`kvstore.bench.sync_index`: every
index operation, commit fsyncs included, on the scheduler thread), on the same store.

The harness has no model: each step that computed tokens is followed by `forward_ms` of
sleep standing in for the model's forward (10 ms by default; an 8k-token prefill takes
far longer on any GPU), during which the step thread holds no GIL, as a real engine's
waits on the GPU. Without it (`forward_ms=0`) the harness steps
as fast as it can, the index thread cannot refill the slot pool between steps, and most
store steps plan only the few blocks the pool holds: their p50 is then the cost of a
step that stores little, not of the store-heavy step the phase is meant to measure.

The prefilled entries are synthetic (random keys over sparse slot files: they are never
read), so a 10M-entry store costs index space only.

With `engines` > 1, that many engine processes run the phases at once on the one
store, each its own prompts in the store phase, and in the load phase engine i replays
engine i+1's prompts (cross-engine hits: it never computed them); a barrier starts each
phase together. Each engine's numbers are reported.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time

# The worker connector's per-step calls: with TP=1 and vLLM's single-process executor they
# run on the same thread as the scheduler's (the model runner's step), so they are timed too
# and reported apart (the 0.5 ms p99 target is the scheduler side's).
WORKER_METHODS = ("bind_connector_metadata", "handle_preemptions", "start_load_kv",
                  "wait_for_save", "get_finished", "get_transfer_results",
                  "get_block_ids_with_load_errors", "build_connector_worker_meta",
                  "get_kv_connector_stats")

METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
           "update_connector_output", "request_finished", "request_finished_all_groups",
           "take_events", "has_pending_push_work", "get_kv_connector_stats", "on_new_request")

BLOCK_SIZE = 16


def _pct(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _prefill(store: str, entries: int, seed: int = 7) -> dict:
    """Replace the (just created) store at `store` by one of `entries` slots, every slot
    holding a synthetic committed entry: same layout, sparse slot files, bulk-loaded
    index. Returns timings."""
    import numpy as np

    from kvstore.store.disk import rank_dir, slot_file_path
    from kvstore.index.core import Index
    from kvstore.index.maint import bulk_load
    from kvstore.format.layout import (
        StoreGeometry, read_fingerprint, stored_identity, write_fingerprint,
    )

    # the engine's model identity is kept: without it the engine would re-initialise the
    # store at its next start (a store of another model) and the phases would run on an
    # empty index
    layout, _, doc = read_fingerprint(store)
    identity = stored_identity(doc)
    capacity = entries * layout.slot_size * layout.tp_size
    geo = StoreGeometry.for_capacity(capacity, layout)
    shutil.rmtree(store)
    os.mkdir(store, 0o700)
    for r in range(layout.tp_size):
        os.mkdir(rank_dir(store, r), 0o700)
        for i in range(geo.num_files):
            with open(slot_file_path(store, r, i), "wb") as f:
                f.truncate(geo.file_slots(i) * geo.slot_size)   # sparse: never read
    t0 = time.perf_counter()
    n = geo.num_slots
    keys = np.random.default_rng(seed).integers(0, 256, size=(n, 36), dtype=np.uint8)
    keys[:, :8] = np.arange(n, dtype=">u8").view(np.uint8).reshape(n, 8)
    keys[:, 8] = 0xFF        # never a vLLM block hash of the bench's prompts
    buf = keys.tobytes()
    ix = Index(os.path.join(store, "index"), n, create=True, sync=False,
               map_size=max(1 << 30, n * 600))
    bulk_load(ix, ((buf[i * 36:(i + 1) * 36], i, i + 1) for i in range(n)),
              keys_sorted=True, batch=500_000)
    ix.close()
    write_fingerprint(store, layout, geo, capacity, identity=identity)
    return {"prefill_s": round(time.perf_counter() - t0, 1), "capacity_slots": n}


class _StepTimer:
    """Times the scheduler connector's calls and groups them by step (a step starts at
    `Scheduler.schedule`). Per call it takes the wall clock, the step thread's own CPU time
    (`time.thread_time_ns`: wall minus CPU is time spent waiting for the GIL or a lock
    held by another thread), and the garbage collections that ran inside it (process-wide
    pauses that any thread's allocations may trigger)."""

    def __init__(self, h):
        import gc
        self.h = h
        # The step thread's time waiting for a CPU (runnable, not running: the kernel's
        # run-queue delay, /proc/thread-self/schedstat), per step: on a machine with fewer
        # cores than busy threads, part of "wall minus CPU" is the OS, not the GIL.
        try:
            self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._schedstat = None
        self.runq: list[float] = []
        self.steps: list[float] = []
        self.cpu: list[float] = []
        self.gc: list[float] = []
        self.detail: list = []      # (step ms, [(call, ms) over 0.05 ms])
        self.vllm: list[float] = []   # vLLM's own scheduler time per step (ms)
        self.idle: list[float] = []
        self.calls: dict[str, list[float]] = {}
        self._cur = None
        self._thread = threading.get_ident()
        self.index = h.scheduler_connector.scheduler.store.index
        self._fsyncs0 = self.index.fsyncs_by_thread[self._thread]
        self._gc_ns = 0
        self._gc_t0 = 0
        # every collection of the phase, by the thread that triggered it (CPython runs it
        # on the thread whose allocation crossed the threshold, holding the GIL): kvstore's
        # own threads ("kvstore-*") should trigger none; [count, longest wall ns]
        self._in_call = 0
        self._gc_by: dict[str, list[int]] = {}
        self._gc_local = threading.local()
        self._gc_cb = self._on_gc
        gc.callbacks.append(self._gc_cb)
        conn = h.scheduler_connector
        for name in METHODS:
            orig = getattr(conn, name, None)
            if orig is None:
                continue

            def timed(*a, _orig=orig, _name=name, **kw):
                g0 = self._gc_ns
                c = time.thread_time_ns()
                t = time.perf_counter_ns()
                self._in_call += 1
                try:
                    return _orig(*a, **kw)
                finally:
                    self._in_call -= 1
                    dt = time.perf_counter_ns() - t
                    dc = time.thread_time_ns() - c
                    self.calls.setdefault(_name, []).append(dt / 1e6)
                    if self._cur is not None:
                        self._cur[0] += dt
                        self._cur[2] += dc
                        self._cur[3] += self._gc_ns - g0
                        if dt > 50_000:
                            self._cur[4].append((_name, round(dt / 1e6, 3)))
            setattr(conn, name, timed)
        self.worker: list[float] = []
        if len(h.worker_connectors) == 1:
            wconn = h.worker_connectors[0]
            for name in WORKER_METHODS:
                if getattr(wconn, name, None) is not None:
                    self._add_wall(wconn, name, 7)
        sched = h.scheduler
        orig_schedule = sched.schedule

        # vLLM's own scheduler work per step, for scale: the wall time of
        # Scheduler.schedule and update_from_output less the connector calls inside them.
        def schedule(*a, **kw):
            self._close()
            self._cur = [0, False, 0, 0, [], 0, self._runq_ns(), 0]
            t = time.perf_counter_ns()
            so = orig_schedule(*a, **kw)
            self._cur[5] += time.perf_counter_ns() - t
            self._cur[1] = so.total_num_scheduled_tokens > 0
            return so
        sched.schedule = schedule
        self._add_wall(sched, "update_from_output", 5)

    def _add_wall(self, obj, name: str, field: int) -> None:
        """Wrap obj.name so its wall time adds to the current step's `field`."""
        orig = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter_ns()
            try:
                return orig(*a, **kw)
            finally:
                if self._cur is not None:
                    self._cur[field] += time.perf_counter_ns() - t
        setattr(obj, name, timed)

    def _on_gc(self, phase, info):
        if threading.get_ident() != self._thread:
            loc = self._gc_local
            if phase == "start":
                loc.t0 = time.perf_counter_ns()
            else:
                name = threading.current_thread().name
                self._count_gc("kvstore_threads" if name.startswith("kvstore-") else
                               "other_threads", time.perf_counter_ns() - loc.t0)
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        else:
            dt = time.perf_counter_ns() - self._gc_t0
            self._gc_ns += dt
            self._count_gc("step_thread_in_connector" if self._in_call else
                           "step_thread_elsewhere", dt)

    def _count_gc(self, where: str, ns: int) -> None:
        c = self._gc_by.setdefault(where, [0, 0])
        c[0] += 1
        c[1] = max(c[1], ns)

    def _runq_ns(self) -> int:
        if self._schedstat is None:
            return 0
        return int(os.pread(self._schedstat, 128, 0).split()[1])

    def _close(self):
        if self._cur is not None:
            if self._cur[1]:
                self.runq.append((self._runq_ns() - self._cur[6]) / 1e6)
                self.worker.append(self._cur[7] / 1e6)
                self.steps.append(self._cur[0] / 1e6)
                self.cpu.append(self._cur[2] / 1e6)
                self.gc.append(self._cur[3] / 1e6)
                self.detail.append((self._cur[0] / 1e6, self._cur[4], self.runq[-1],
                                    self._cur[2] / 1e6))
                self.vllm.append(max(0, self._cur[5] - self._cur[0]) / 1e6)
            else:
                self.idle.append(self._cur[0] / 1e6)
            self._cur = None

    def result(self) -> dict:
        import gc
        self._close()
        if self._gc_cb in gc.callbacks:
            gc.callbacks.remove(self._gc_cb)
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None
        s, c = self.steps, self.cpu
        return {"steps": len(s), "idle_steps": len(self.idle),
                "idle_step_max_ms": round(max(self.idle, default=0), 4),
                "call_max_ms": {k: round(max(v), 3) for k, v in self.calls.items()},
                "step_p50_ms": round(_pct(s, 0.5), 4),
                "step_p99_ms": round(_pct(s, 0.99), 4), "step_max_ms": round(max(s, default=0), 4),
                "step_mean_ms": round(sum(s) / max(1, len(s)), 4),
                # the step thread's own CPU in the connector (no GIL or lock waits)
                "step_cpu_p50_ms": round(_pct(c, 0.5), 4),
                "step_cpu_p99_ms": round(_pct(c, 0.99), 4),
                "step_cpu_max_ms": round(max(c, default=0), 4),
                # garbage collections inside the connector's calls (process-wide pauses)
                "steps_with_gc": sum(1 for g in self.gc if g > 0),
                "step_gc_max_ms": round(max(self.gc, default=0), 4),
                # every collection of the phase by where it ran (count, longest ms)
                "gc_collections": {k: {"count": v[0], "max_ms": round(v[1] / 1e6, 3)}
                                   for k, v in sorted(self._gc_by.items())},
                "step_thread_fsyncs": self.index.fsyncs_by_thread[self._thread] - self._fsyncs0,
                # vLLM's own scheduler work per step (schedule + update_from_output,
                # connector calls excluded), for scale
                "vllm_scheduler_p50_ms": round(_pct(self.vllm, 0.5), 4),
                "vllm_scheduler_p99_ms": round(_pct(self.vllm, 0.99), 4),
                # the worker connector's calls per step (TP=1: the same thread in vLLM's
                # single-process executor), not part of the step_* figures above
                "worker_step_p50_ms": round(_pct(self.worker, 0.5), 4),
                "worker_step_p99_ms": round(_pct(self.worker, 0.99), 4),
                "worker_step_max_ms": round(max(self.worker, default=0), 4),
                # every step, for plots: connector wall, its CPU, the run-queue delay
                "per_step": {"wall_ms": [round(x, 4) for x in s], "cpu_ms": [round(x, 4) for x in c],
                             "runq_ms": [round(x, 4) for x in self.runq]},
                # the step thread's run-queue delay per step (whole step, vLLM's work
                # included): waiting for a CPU, which no code of the process can cause
                "step_runq_p99_ms": round(_pct(self.runq, 0.99), 4),
                "steps_with_runq_over_0_5ms": sum(1 for r in self.runq if r > 0.5),
                # what the three slowest steps spent their time in (calls over 0.05 ms)
                "slowest_steps": [{"ms": round(ms, 3), "cpu_ms": round(cpu, 3),
                                   "calls": calls, "runq_ms": round(rq, 3)}
                                  for ms, calls, rq, cpu in
                                  sorted(self.detail, key=lambda d: -d[0])[:3]]}


def _freeze_heap() -> None:
    """As vLLM's EngineCore does after start-up (`freeze_gc_heap`): the start-up heap is
    left out of garbage collections, so a full collection does not walk it mid-step."""
    from vllm.utils.gc_utils import freeze_gc_heap
    freeze_gc_heap()


def _pace(h, timer: _StepTimer, forward_s: float) -> None:
    """After each step that computed tokens, `forward_s` of sleep: the model's forward
    the harness does not run (the GIL is free meanwhile, as while a real engine waits on
    the GPU; kvstore's threads refill the slot pool and apply commits then)."""
    if forward_s <= 0:
        return
    orig = h.step

    def step(*a, **kw):
        out = orig(*a, **kw)
        if timer._cur is not None and timer._cur[1]:
            time.sleep(forward_s)
        return out
    h.step = step


def _phases(common: dict, prompts: list, index_thread: bool, load_prompts: list | None = None,
            barrier=None, forward_s: float = 0.0) -> dict:
    """The store and load phases; without `index_thread`, over the synchronous baseline
    index (`kvstore.bench.sync_index`)."""
    if index_thread:
        return _run_phases(common, prompts, load_prompts, barrier, forward_s)
    from kvstore.bench.sync_index import baseline_index
    from kvstore.vllm.scheduler import KVStoreScheduler
    with baseline_index(KVStoreScheduler):
        return _run_phases(common, prompts, load_prompts, barrier, forward_s)


def _run_phases(common: dict, prompts: list, load_prompts: list | None, barrier,
                forward_s: float, load_common: dict | None = None) -> dict:
    import gc

    from kvstore.drivers.simulator import EngineHarness
    out = {}
    t0 = time.perf_counter()
    with EngineHarness(**common) as h:
        open_s = time.perf_counter() - t0
        ix = h.scheduler_connector.scheduler.index
        ix.wait_ready()
        out["table_build_s"] = round(ix.build_s, 2)
        out["engine_open_s"] = round(open_s, 2)
        _freeze_heap()
        # the entries the phase starts with (the prefill's, unless the store was reset)
        used_at_start = int(ix.gauges()["used_slots"])
        before = dict(h.stats)
        sched = h.scheduler_connector.scheduler
        stored0 = sched.stored_blocks_total
        timer = _StepTimer(h)
        _pace(h, timer, forward_s)
        t0 = time.perf_counter()
        for p in prompts:
            h.add_request(p, max_tokens=1)
        h.drain()
        phase_s = time.perf_counter() - t0
        res = timer.result()
        res["stored_blocks"] = sched.stored_blocks_total - stored0
        res["entries_at_start"] = used_at_start
        # The harness has no model forward (`forward_s` of sleep stands in for it): the
        # index thread's commit and eviction rate, not the step thread, bounds what gets
        # stored; blocks the slot pool could not cover were dropped (never waited for).
        res["phase_s"] = round(phase_s, 2)
        res["steps_per_s"] = round(res["steps"] / phase_s, 1)
        res["stored_blocks_per_s"] = round(res["stored_blocks"] / phase_s)
        res["planned_blocks"] = len(prompts) * (len(prompts[0]) // BLOCK_SIZE)
        res["tokens_computed"] = h.stats["tokens_computed"] - before["tokens_computed"]
        out["store"] = res
    gc.unfreeze()
    if barrier is not None:
        barrier.wait(600)
    # restart: GPU cache empty, the store kept (or, `load_common`, another engine's store)
    with EngineHarness(**(load_common or common)) as h:
        ix = h.scheduler_connector.scheduler.index
        ix.wait_ready()
        _freeze_heap()
        if barrier is not None:
            barrier.wait(600)
        before = dict(h.stats)
        timer = _StepTimer(h)
        _pace(h, timer, forward_s)
        t0 = time.perf_counter()
        for p in (prompts if load_prompts is None else load_prompts):
            h.add_request(p, max_tokens=1)
        h.drain()
        phase_s = time.perf_counter() - t0
        res = timer.result()
        # The phase's length is reported too: a load phase that crawls (a few loads a
        # second) would otherwise show only as the harness's drain limit.
        res["phase_s"] = round(phase_s, 2)
        res["steps_per_s"] = round(res["steps"] / phase_s, 1)
        res["blocks_loaded"] = sum(w.worker.loaded_bytes_total for w in h.worker_connectors) \
            // h.scheduler_connector.layout.block_bytes
        res["disk_hit_tokens"] = h.stats["external_hit_tokens"] - before["external_hit_tokens"]
        res["cross_engine_blocks"] = ix.cross_hits
        res["pool_filled_blocks"] = sum(s.get("pool_filled_blocks", 0) for s in h.kv_connector_stats)
        out["load"] = res
    gc.unfreeze()
    return out


def _engine_main(common, prompts, load_prompts, barrier, results, i, forward_s) -> None:
    """One engine process of a several-engine run (spawned)."""
    try:
        if barrier is not None:
            barrier.wait(600)
        res = _phases(common, prompts, True, load_prompts, barrier, forward_s)
        res["pid"] = os.getpid()
        results.put((i, res))
    except BaseException as exc:    # reported by the parent
        results.put((i, {"error": f"{type(exc).__name__}: {exc}"}))
        if barrier is not None:
            barrier.abort()


def _several(common: dict, sets: list[list], n: int, forward_s: float) -> list[dict]:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [ctx.Process(target=_engine_main,
                         args=(common, sets[i], sets[(i + 1) % n], barrier, results, i, forward_s))
             for i in range(n)]
    for p in procs:
        p.start()
    out: list = [None] * n
    try:
        for _ in range(n):
            i, res = results.get(timeout=3600)
            out[i] = res
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    errs = [f"engine {i}: {r['error']}" for i, r in enumerate(out) if "error" in r]
    if errs:
        from kvstore.errors import KVStoreError
        raise KVStoreError("bench connector with several engines failed: " + "; ".join(errs))
    return out


def run(index_entries: int = 1_000_000, requests: int = 256, prompt_tokens: int = 8192,
        baseline: bool = True, workdir: str | None = None, engines: int = 1,
        thread_cpus: str | None = None, io_thread_nice: int | None = None,
        forward_ms: float = 10.0, remote: dict | None = None) -> dict:
    """The phases (module docstring). With `remote` (a store's "remote" settings), the
    store has the fleet's pool behind it: the store phase publishes to it, and the load
    phase runs on a second, empty store, whose every block comes from the pool."""
    from kvstore.drivers.simulator import EngineHarness
    tmp = tempfile.TemporaryDirectory(prefix="kvstore-bench-conn-", dir=workdir)
    d = tmp.name
    store = os.path.join(d, "store")
    cfg = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"path": store, "capacity": "2G", "staging": "64M",
                                         "store_policy": "eager"}}
    if thread_cpus is not None:
        cfg["kv_connector_extra_config"]["thread_cpus"] = thread_cpus
    if io_thread_nice is not None:
        cfg["kv_connector_extra_config"]["io_thread_nice"] = io_thread_nice
    load_cfg = None
    if remote is not None:
        cfg["kv_connector_extra_config"]["remote"] = remote
        load_cfg = {**cfg, "kv_connector_extra_config": {
            **cfg["kv_connector_extra_config"], "path": os.path.join(d, "store-b")}}
    per_step = 8192
    ntok = prompt_tokens + BLOCK_SIZE // 2
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 30000) for _ in range(ntok)] for _ in range(requests)]
    prompts_b = [[rng.randrange(10, 30000) for _ in range(ntok)] for _ in range(requests)]
    blocks = -(-ntok // BLOCK_SIZE)
    common = dict(kv_transfer_config=cfg, num_layers=1, num_kv_heads=1, head_dim=16,
                  block_size=BLOCK_SIZE, num_gpu_blocks=4 * blocks + 64,
                  max_num_batched_tokens=per_step, max_num_seqs=8, max_model_len=ntok + 64,
                  workdir=d, verify=False)
    forward_s = forward_ms / 1e3
    out: dict = {"index_entries": index_entries, "requests": requests, "forward_ms": forward_ms,
                 "prompt_tokens": prompt_tokens, "tokens_per_step": per_step,
                 "thread_cpus": thread_cpus, "cpus": len(os.sched_getaffinity(0))}
    try:
        with EngineHarness(**common) as h:      # creates the store (its layout)
            # what the connector resolved (io_thread_nice's default depends on the platform)
            out["io_thread_nice"] = h.scheduler_connector.cfg.io_thread_nice
        if index_entries:
            out.update(_prefill(store, index_entries))
        if engines > 1:
            sets = [prompts] + [[[rng.randrange(10, 30000) for _ in range(ntok)]
                                 for _ in range(requests)] for _ in range(engines - 1)]
            per = _several(common, sets, engines, forward_s)
            out["engines"] = per
            res = per[0]
        elif load_cfg is not None:
            res = _run_phases(common, prompts, None, None, forward_s,
                              load_common={**common, "kv_transfer_config": load_cfg})
        else:
            res = _phases(common, prompts, index_thread=True, forward_s=forward_s)
        out["phases"] = {"store": res["store"], "load": res["load"]}
        out["table_build_s"] = res["table_build_s"]
        out["engine_open_s"] = res["engine_open_s"]
        if baseline:
            b = _phases(common, prompts_b, index_thread=False, forward_s=forward_s)
            out["baseline"] = {"phases": {"store": b["store"], "load": b["load"]},
                               "engine_open_s": b["engine_open_s"]}
    finally:
        tmp.cleanup()
    return out


def format_table(r: dict) -> str:
    lines = [f"kvstore bench connector: index prefilled with {r['index_entries']:,} entries "
             f"(full: every store evicts), {r['requests']} prompts of {r['prompt_tokens']} tokens, "
             f"{r['tokens_per_step']} tokens per step; {r['cpus']} CPUs, kvstore's threads on "
             + (f"CPUs {r['thread_cpus']} (thread_cpus)" if r.get("thread_cpus") else "any")
             + f", its I/O threads at nice +{r.get('io_thread_nice', 0)}",
             f"engine open {r['engine_open_s']:.2f} s; lookup table built in the background in "
             f"{r['table_build_s']:.2f} s",
             "connector time on the scheduler thread per step (ms):",
             f"{'design':<22} {'phase':<6} {'steps':>6} {'p50':>8} {'p99':>8} {'max':>8} "
             f"{'fsyncs':>7}"]
    rows = [("index thread (new)", r["phases"])]
    if len(r.get("engines", ())) > 1:
        lines[0] += f"; {len(r['engines'])} engine processes on the one store"
        rows = [(f"engine {i} (pid {e['pid']})", {"store": e["store"], "load": e["load"]})
                for i, e in enumerate(r["engines"])]
    if "baseline" in r:
        rows.append(("synchronous (old)", r["baseline"]["phases"]))
    for name, phases in rows:
        for ph in ("store", "load"):
            p = phases[ph]
            lines.append(f"{name:<22} {ph:<6} {p['steps']:>6} {p['step_p50_ms']:>8.3f} "
                         f"{p['step_p99_ms']:>8.3f} {p['step_max_ms']:>8.3f} "
                         f"{p['step_thread_fsyncs']:>7}")
    st, ld = r["phases"]["store"], r["phases"]["load"]
    lines.append("the step thread's own CPU per step (ms; wall minus CPU is GIL and lock waits), and "
                 "garbage collections inside the connector's calls:")
    lines.append(f"{'design':<22} {'phase':<6} {'cpu p50':>8} {'cpu p99':>8} {'cpu max':>8} "
                 f"{'gc steps':>9} {'gc max':>8}")
    for name, phases in rows:
        for ph in ("store", "load"):
            p = phases[ph]
            lines.append(f"{name:<22} {ph:<6} {p['step_cpu_p50_ms']:>8.3f} {p['step_cpu_p99_ms']:>8.3f} "
                         f"{p['step_cpu_max_ms']:>8.3f} {p['steps_with_gc']:>9} {p['step_gc_max_ms']:>8.3f}")
    lines.append("the step thread's run-queue delay (waiting for a CPU, preempted by any thread, "
                 "kvstore's included), p99 ms / steps over 0.5 ms: " + "; ".join(
                     f"{ph} {r['phases'][ph].get('step_runq_p99_ms', 0):.3f} / "
                     f"{r['phases'][ph].get('steps_with_runq_over_0_5ms', 0)}"
                     for ph in ("store", "load")))
    if "gc_collections" in st:
        lines.append("garbage collections by the thread that triggered them (count, longest ms; "
                     "each holds the GIL): " + "; ".join(
                         f"{ph} " + ", ".join(f"{k} {v['count']} ({v['max_ms']:.2f})" for k, v in
                                              r["phases"][ph]["gc_collections"].items())
                         for ph in ("store", "load")))
    if "worker_step_p50_ms" in st:
        lines.append("the worker connector's calls per step (TP=1: the same thread in vLLM's "
                     "single-process executor), p50 / p99 ms: " + "; ".join(
                         f"{ph} {r['phases'][ph]['worker_step_p50_ms']:.3f} / "
                         f"{r['phases'][ph]['worker_step_p99_ms']:.3f}" for ph in ("store", "load")))
    lines.append("for scale, vLLM's own scheduler per step (schedule + update_from_output, connector "
                 "calls excluded), p50 / p99 ms: " + "; ".join(
                     f"{ph} {r['phases'][ph]['vllm_scheduler_p50_ms']:.3f} / "
                     f"{r['phases'][ph]['vllm_scheduler_p99_ms']:.3f}" for ph in ("store", "load")))
    fwd = r.get("forward_ms", 0)
    lines.append(f"store phase: {st['steps_per_s']} steps/s ("
                 + (f"{fwd:g} ms of sleep for the model's forward per step" if fwd else
                    "no model forward") + f"), {st['stored_blocks_per_s']} "
                 "blocks/s committed by the index thread; blocks the slot pool could not cover "
                 "were dropped, never waited for")
    for name, phases in rows:
        st, ld = phases["store"], phases["load"]
        lines.append(f"{name}: store phase {st['stored_blocks']} of {st['planned_blocks']} blocks "
                     f"committed; load phase {ld['blocks_loaded']} blocks loaded in "
                     f"{ld['phase_s']} s, "
                     f"{ld['disk_hit_tokens']} tokens from disk, "
                     f"{ld.get('cross_engine_blocks', 0)} found in LMDB only (stored by another "
                     "engine after this one's table was built)")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """Per-step connector time on the scheduler thread as distributions (one panel per
    phase): the index-thread design's wall time and its own CPU, the synchronous design's
    wall time when it ran, and the 0.5 ms p99 target. Saved as PNG (matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    series = [("index thread: wall", r["phases"], "wall_ms", "#1f77b4", "-"),
              ("index thread: own CPU", r["phases"], "cpu_ms", "#1f77b4", ":")]
    if "baseline" in r:
        series.append(("synchronous (old): wall", r["baseline"]["phases"], "wall_ms", "#d62728", "-"))
    for ax, ph in zip(axes, ("store", "load")):
        for label, phases, field, color, style in series:
            xs = np.sort(np.asarray(phases[ph].get("per_step", {}).get(field, []), dtype=float))
            if not xs.size:
                continue
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, style, color=color, label=label)
        ax.axvline(0.5, color="#2ca02c", lw=1, ls="--", label="target p99 0.5 ms")
        ax.axhline(0.99, color="#999999", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("connector time per step (ms, log)")
        ax.set_ylabel("fraction of steps")
        ax.set_title(f"{ph} phase ({r['phases'][ph]['steps']} steps)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"kvstore bench connector: vLLM's scheduler thread, index of "
                 f"{r['index_entries']:,} entries, {r['tokens_per_step']} tokens per step",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
