"""Several engines on one store, at the scheduler level: two and four engines,
each a separate process (multiprocessing's fork server, see `_PRELOAD`) running vLLM's
REAL scheduler and the connector's worker side over CPU KV tensors
(`kvstore.drivers.simulator.EngineHarness`), every block a request starts from verified byte for
byte. What one engine stores another loads without computing it; one engine's eviction
pressure never makes another load a wrong block or leaves a request stuck; a SIGKILLed
engine (mid-store, mid-load) leaves the others serving the same tokens, its reservations
reclaimed, its lease gone, fsck clean.

Each child builds its own harness over the same store path and model directory (one
layout); the parent only sends commands and reads the store read-only.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback

import pytest

from connector_util import prompts
from kvstore.store import shared
from kvstore.store.disk import DiskStore
from kvstore.drivers.simulator import write_model_dir
from kvstore.tools.fsck import fsck

BS = 16
L = 70                  # prompt length: 4 full blocks (the 5th is partial, never stored)
FULL = L // BS
# A GPU cache large enough that nothing is preempted (a resumed request would be
# verified, and counted as loaded, twice).
HARNESS = dict(num_gpu_blocks=160, max_num_batched_tokens=256, max_num_seqs=16)
STATS = ("steps", "tokens_computed", "requests_added", "requests_finished", "blocks_verified",
         "blocks_loaded", "blocks_mismatched", "external_hit_tokens", "local_hit_tokens",
         "finished_recving", "invalid_block_ids", "failed_recving")


# ------------------------------------------------------------------ the child engine

# The children come from multiprocessing's fork server, which imports these once: each
# child then starts in a fraction of a second instead of importing torch and vLLM (5-20 s
# each on a busy 2-core machine). A fork server is a fresh process that only imported
# modules (no threads, no engine), so forking it is as safe as spawning.
_PRELOAD = ["torch", "numpy", "vllm", "vllm.config", "vllm.v1.core.sched.scheduler",
            "vllm.v1.core.sched.async_scheduler", "vllm.v1.executor", "vllm.v1.worker.utils",
            "vllm.v1.worker.worker_base", "vllm.distributed.kv_transfer.kv_connector.factory",
            "vllm.v1.core.kv_cache_planning", "kvstore.drivers.simulator", "kvstore.vllm",
            "kvstore.vllm.connector", "connector_util"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _engine(path, model_dir, extra, harness, busy, cmds, out):
    """A child engine: a harness with the kvstore connector over `path`; runs commands
    from `cmds`, answers on `out` (("error", traceback) when a command raised)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from connector_util import drop_gpu_cache, keys_of, kv_config, sched, set_injector, settle, \
        workers
    from kvstore.drivers.simulator import EngineHarness

    h = EngineHarness(model_dir, kv_transfer_config=kv_config(path, **extra),
                      **{**HARNESS, **harness})
    s = sched(h)
    s.index.wait_ready(30)
    owner = s.store.lease.owner
    out.put(("ready", os.getpid(), owner))

    def run(batch, max_tokens, drop):
        """One batch of requests to completion (a stuck one raises HarnessError), then
        settled: its stores committed. Stats of the batch, outputs in prompt order."""
        if drop:
            drop_gpu_cache(h)
        before = {k: h.stats[k] for k in STATS}
        ids = [h.add_request(p, max_tokens=max_tokens) for p in batch]
        h.drain(timeout_s=90)
        settle(h, timeout_s=60)
        st = {k: h.stats[k] - before[k] for k in STATS}
        return st, [h.finished[r] for r in ids], list(h.mismatches[:4])

    while True:
        cmd = cmds.get()
        op = cmd[0]
        try:
            if op == "stop":
                h.shutdown()
                out.put(("stopped",))
                out.close()
                out.join_thread()
                os._exit(0)         # the interpreter's teardown (torch, vLLM) takes seconds
            if op == "run":                 # ("run", batches, max_tokens, drop)
                res = [run(b, cmd[2], cmd[3]) for b in cmd[1]]
                out.put(("ran", res))
            elif op == "serve":             # ("serve", prompts, max_tokens, min_rounds)
                # rounds over the same prompts, vLLM's cache dropped before each (every
                # round loads from disk), at least min_rounds and while `busy` is set
                res = []
                while (len(res) < cmd[3] or busy.is_set()) and len(res) < 400:
                    res.append(run(cmd[1], cmd[2], True))
                out.put(("served", res))
            elif op == "keys":
                out.put(("keys", [keys_of(h, p) for p in cmd[1]]))
            elif op == "hang":              # ("hang", io op, prompts, steps after)
                # Hold every `io op` batch of the I/O thread forever (until SIGKILL), then
                # step until it was reached and `steps after` more: the engine is killed
                # with those stores or loads in flight.
                hit = threading.Event()

                def hold(io_op, fds, offs, lens, _want=cmd[1]):
                    if io_op == _want:
                        hit.set()
                        threading.Event().wait()
                    return []
                set_injector(h, hold)
                for p in cmd[2]:
                    h.add_request(p, max_tokens=2)
                deadline = time.monotonic() + 30
                while not hit.is_set():
                    assert time.monotonic() < deadline, f"no {cmd[1]} reached the I/O thread"
                    h.step()
                    time.sleep(0.001)
                for _ in range(cmd[3]):
                    h.step()
                out.put(("hung", dict(
                    inflight_stores=len(s.commits.inflight),
                    inflight_loads=len(s.lookups.inflight),
                    pinned=s.index.pinned_slots,
                    owned=s.store.index.owned_counts().get(owner, 0),
                    pending=sum(w.pending() for w in workers(h)))))
                # frozen with its I/O in flight: wait for the SIGKILL
            elif op == "check":
                # quiescent, and this engine's reservations are its pool and nothing
                # else (the store's reserved rows belong to every engine)
                settle(h)
                h.assert_no_leaks()
                s.index.flush()
                out.put(("checked", dict(
                    pinned=s.index.pinned_slots,
                    owned=s.store.index.owned_counts().get(owner, 0),
                    pooled=len(s.index.pooled()),
                    cross_hits=s.index.cross_hits,
                    reclaimed=s.index.reclaimed,
                    inflight=len(s.commits.inflight) + len(s.lookups.inflight),
                    peers=s.index._table.peer_count)))
            else:
                raise ValueError(f"unknown command {op!r}")
        except BaseException:
            out.put(("error", traceback.format_exc()))


class Engine:
    """The parent's handle on a child engine."""

    def __init__(self, ctx, path, model_dir, busy, extra, harness):
        self.cmds, self.out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_engine, daemon=True, args=(
            path, model_dir, extra, harness, busy, self.cmds, self.out))
        self.proc.start()
        self.pid = self.owner = None

    def wait_ready(self, timeout=180):
        msg = self.recv(timeout)
        assert msg[0] == "ready", msg
        _, self.pid, self.owner = msg
        assert self.owner == shared.owner_id(self.pid, shared.process_start_ticks(self.pid))

    def send(self, *cmd):
        self.cmds.put(cmd)

    def recv(self, timeout=180):
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.out.get(timeout=1)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise AssertionError(f"engine {self.proc.pid} died "
                                         f"(exit {self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"engine {self.proc.pid}: no answer in {timeout}s") \
                        from None
                continue
            if msg[0] == "error":
                raise AssertionError(f"engine {self.proc.pid} failed:\n{msg[1]}")
            return msg

    def call(self, *cmd, timeout=180):
        self.send(*cmd)
        return self.recv(timeout)

    def run(self, batch, max_tokens=2, drop=False):
        """(stats, outputs, mismatches) of one batch."""
        return self.call("run", [batch], max_tokens, drop)[1][0]

    def stop(self):
        assert self.call("stop")[0] == "stopped"
        assert self._exit_status() == 0

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self._exit_status() == -signal.SIGKILL

    def _exit_status(self, timeout: float = 300) -> int:
        """The engine's exit status once it exited (`timeout` bounds a hang only). Polled,
        not join(): join waits until the process's sentinel pipe closes, which a process it
        forked may hold open after it exited."""
        deadline = time.monotonic() + timeout
        while self.proc.exitcode is None:
            assert time.monotonic() < deadline, f"engine {self.proc.pid} did not exit in {timeout:.0f} s"
            time.sleep(0.05)
        return self.proc.exitcode


@pytest.fixture
def engines(tmp_path):
    """engines(n, harness=None, **extra) -> n child engines on one store (built in
    parallel), killed at teardown if still alive. harness: EngineHarness arguments over
    HARNESS; extra: kv_connector_extra_config fields."""
    ctx = _context()
    model_dir = write_model_dir(tmp_path / "model")
    path = str(tmp_path / "store")
    busy = ctx.Event()
    started: list[Engine] = []

    def start(n, harness=None, **extra):
        extra.setdefault("capacity", "4M")
        es = [Engine(ctx, path, model_dir, busy, extra, harness or {}) for _ in range(n)]
        started.extend(es)
        for e in es:
            e.wait_ready()
        return es
    start.path = path
    start.busy = busy
    yield start
    for e in started:
        if e.proc.is_alive():
            e.proc.kill()
        e.proc.join(10)


# ------------------------------------------------------------------------ checks

def ok_batch(res, n, max_tokens=2):
    """Every request finished, no block mismatched."""
    st, outs, mism = res
    assert st["blocks_mismatched"] == 0, (st, mism)
    assert st["requests_finished"] == st["requests_added"] == n, st
    assert len(outs) == n and all(len(o) == max_tokens for o in outs), outs
    return st


def from_disk(res, n):
    """Every full block of the n prompts was loaded from disk (none recomputed, none
    mismatched): only the partial tail and the decode computed."""
    st = ok_batch(res, n)
    assert st["external_hit_tokens"] == n * FULL * BS, st
    assert st["tokens_computed"] == n * (L - FULL * BS + 1), st
    assert st["invalid_block_ids"] == st["failed_recving"] == 0, st
    return st


def loaded_all(res, n):
    """from_disk, by an engine that never computed these prompts: the harness counts
    each of their blocks as arrived from outside (`blocks_loaded`; an engine that
    computed a block before may get its load into the same GPU block, not counted)."""
    st = from_disk(res, n)
    assert st["blocks_loaded"] == n * FULL, st
    return st


def owned(path) -> dict:
    with DiskStore(path, readonly=True) as st:
        return st.index.owned_counts()


def store_clean(path) -> None:
    """After every engine stopped: LMDB consistent, no reservation, no lease, deep fsck
    (every slot's bytes read and checked) clean."""
    with DiskStore(path, readonly=True) as st:
        assert st.index.check_consistency() == []
        assert st.index.owned_counts() == {}
        assert st.stats()["reserved_slots"] == 0
    assert shared.engines(path) == []
    rep = fsck(path, deep=True)
    assert rep.error is None and rep.findings == [] and rep.exit_code == 0, rep.to_json()


def wait_reaped(path, dead: Engine, alive: list[Engine], timeout=300.0) -> None:
    """Until the survivors reclaimed the dead engine's reservations and its lease."""
    deadline = time.monotonic() + timeout
    while True:
        gone = dead.owner not in owned(path)
        leases = shared.engines(path)
        if gone and sorted(e.pid for e in leases) == sorted(e.pid for e in alive):
            assert all(e.alive for e in leases), leases
            return
        assert time.monotonic() < deadline, \
            f"dead engine not reaped after {timeout}s: owned {owned(path)}, leases {leases}"
        time.sleep(0.1)


# ------------------------------------------------------------------------- tests

@pytest.mark.slow
def test_two_engines_load_what_the_other_stored(engines):
    a, b = engines(2)
    pa, pb = prompts(100, 6, L), prompts(101, 6, L)
    # A stores; B has never seen these prompts: every full block comes from A's stores
    st = ok_batch(a.run(pa), 6)
    assert st["blocks_loaded"] == 0 and st["tokens_computed"] == 6 * (L + 1)
    res_b = b.run(pa)
    loaded_all(res_b, 6)
    assert res_b[1] == a.run(pa, drop=True)[1]          # the same tokens on both engines
    # the other way round
    ok_batch(b.run(pb), 6)
    res_a = a.run(pb)
    loaded_all(res_a, 6)
    assert b.call("check")[1]["cross_hits"] == 6 * FULL
    ca = a.call("check")[1]
    assert ca["cross_hits"] == 6 * FULL and ca["pinned"] == 0 and ca["owned"] == ca["pooled"]
    # both engines' entries stand, once each
    with DiskStore(engines.path, readonly=True) as st:
        assert st.stats()["used_slots"] == 12 * FULL
    a.stop()
    b.stop()
    store_clean(engines.path)


def test_four_engines_each_load_every_other_engines_prompts(engines):
    es = engines(4)
    mine = [prompts(200 + i, 4, L) for i in range(4)]
    for e, p in zip(es, mine):                      # all four store at once
        e.send("run", [p], 2, False)
    outs = []
    for e in es:
        res = e.recv()[1][0]
        assert ok_batch(res, 4)["blocks_loaded"] == 0
        outs.append(res[1])
    for i, e in enumerate(es):                      # then all four load at once
        others = [p for j, ps in enumerate(mine) if j != i for p in ps]
        e.send("run", [others], 2, False)
    for i, e in enumerate(es):
        res = e.recv()[1][0]
        loaded_all(res, 12)
        assert res[1] == [o for j, os_ in enumerate(outs) if j != i for o in os_]
    for e in es:
        c = e.call("check")[1]
        assert c["cross_hits"] == 12 * FULL and c["owned"] == c["pooled"] and c["pinned"] == 0
        assert c["peers"] == 3
    with DiskStore(engines.path, readonly=True) as st:
        assert st.stats()["used_slots"] == 16 * FULL
        assert st.index.check_consistency() == []
    assert sorted(e.pid for e in shared.engines(engines.path)) == sorted(e.pid for e in es)
    for e in es:
        e.stop()
    store_clean(engines.path)


def test_eviction_pressure_from_one_engine_while_another_loads(engines):
    """A 48-slot store (pools of 8): while B loads, round after round, a shared-prefix set
    of prompts that A stored, A writes 48 new prompts (192 blocks, four times the store)
    in batches of 4 at once: B's pins keep A's evictions off the slots it loads, B's table
    entries for slots A evicted are never served (B recomputes those blocks), and every
    request of both engines finishes with its tokens unchanged."""
    a = engines(1, harness=dict(max_num_batched_tokens=64), capacity="384K", slot_pool=8)[0]
    b = engines(1, slot_pool=8)[0]
    pb = prompts(300, 4, L, shared=3 * BS)      # 3 shared blocks + 1 own each: 7 distinct
    ok_batch(a.run(pb), 4)
    first = b.run(pb)                           # all from A's stores, nothing evicted yet
    ok_batch(first, 4)
    assert first[0]["blocks_loaded"] >= 7 and first[0]["external_hit_tokens"] >= 7 * BS
    storm = prompts(301, 48, L)
    engines.busy.set()
    b.send("serve", pb, 2, 3)
    time.sleep(0.2)
    a.send("run", [storm[i:i + 4] for i in range(0, 48, 4)], 2, False)
    try:
        storm_res = a.recv(timeout=240)[1]
    finally:
        engines.busy.clear()
    rounds = b.recv(timeout=240)[1]
    for r in storm_res:
        assert ok_batch(r, 4)["blocks_loaded"] == 0
    loaded = []
    for r in rounds:
        st = ok_batch(r, 4)
        assert r[1] == first[1], "B's tokens changed under A's eviction pressure"
        # every token was loaded, hit in vLLM's cache or computed (a load that failed
        # was recomputed)
        assert st["tokens_computed"] + st["external_hit_tokens"] + st["local_hit_tokens"] \
            >= 4 * (L + 1), st
        loaded.append(st["blocks_loaded"])
    assert len(rounds) >= 3
    with DiskStore(engines.path, readonly=True) as st:
        stats = st.stats()
        assert st.index.check_consistency() == []
    print(f"B: {len(rounds)} rounds under pressure, blocks loaded per round {loaded}; "
          f"store: {stats['evictions']} evictions, {stats['used_slots']} used")
    assert stats["evictions"] >= 48, stats      # the store turned over
    for e in (a, b):
        c = e.call("check")[1]
        assert c["pinned"] == 0 and c["owned"] == c["pooled"] and c["inflight"] == 0, c
    # after the storm B still serves them, verified (loaded or recomputed)
    ok_batch(b.run(pb, drop=True), 4)
    a.stop()
    b.stop()
    store_clean(engines.path)


@pytest.mark.parametrize("where", ["store", "load"])
def test_sigkill_of_one_engine_the_other_keeps_serving(engines, where):
    """A is SIGKILLed with stores (`store`: its writes held on the I/O thread) or loads
    (`load`: its reads held, the slots pinned in its lease) in flight, while B serves:
    B's tokens stay those of its first run, nothing mismatches, B's index thread reclaims
    A's reservations and lease within seconds, and the store is fsck clean."""
    a, b = engines(2, capacity="1M")        # 128 slots, pools of 16
    pb = prompts(400, 4, L)
    qa = prompts(401, 6, L)                 # A's work when it dies
    ref = b.run(pb)
    ok_batch(ref, 4)
    qkeys = b.call("keys", qa)[1]
    if where == "load":
        ok_batch(b.run(qa), 6)              # B stores them, A will load them
        hung = a.call("hang", "read", qa, 0)[1]
        assert hung["inflight_loads"] > 0 and hung["pinned"] > 0, hung
        lease = [e for e in shared.engines(engines.path, pins=True) if e.pid == a.pid]
        assert lease and lease[0].alive and lease[0].pinned_slots > 0, lease
    else:
        hung = a.call("hang", "write", qa, 20)[1]
        assert hung["inflight_stores"] > 0 and hung["pending"] > 0, hung
    assert hung["owned"] > 0 and owned(engines.path).get(a.owner, 0) > 0
    # B serves (loads from disk, round after round) while A dies
    engines.busy.set()
    b.send("serve", pb, 2, 4)
    time.sleep(0.3)
    a.kill()
    time.sleep(0.5)
    engines.busy.clear()
    rounds = b.recv(timeout=120)[1]
    for r in rounds:
        from_disk(r, 4)
        assert r[1] == ref[1], "B's tokens changed when A was killed"
    wait_reaped(engines.path, a, [b])
    c = b.call("check")[1]
    assert c["reclaimed"] > 0 and c["peers"] == 0, c
    assert c["owned"] == c["pooled"] and c["pinned"] == 0, c
    with DiskStore(engines.path, readonly=True) as st:
        assert st.stats()["reserved_slots"] == c["pooled"]
        entries = {e.key for e in st.index.iter_entries()}
    if where == "store":
        # nothing A was writing was committed: B computes those prompts itself
        assert not entries & {k for ks in qkeys for k in ks}
        st = ok_batch(b.run(qa), 6)
        assert st["blocks_loaded"] == 0 and st["tokens_computed"] == 6 * (L + 1)
    # pressure from B until the whole store turned over (128 evictions): the slots A
    # had reserved or pinned are B's to use, its pins died with its lease; A's blocks
    # (the oldest in the LRU) are gone
    with DiskStore(engines.path, readonly=True) as st:
        ev0 = st.stats()["evictions"]
    for i in range(8):
        for r in b.call("run", [prompts(402 + 10 * i + j, 8, L) for j in range(4)], 2,
                        False)[1]:
            ok_batch(r, 8)
        with DiskStore(engines.path, readonly=True) as st:
            if st.stats()["evictions"] - ev0 >= 128:
                break
    with DiskStore(engines.path, readonly=True) as st:
        assert st.stats()["evictions"] - ev0 >= 128, st.stats()
        entries = {e.key for e in st.index.iter_entries()}
        assert st.index.check_consistency() == []
    assert not entries & {k for ks in qkeys for k in ks}, "A's pinned entries outlived it"
    ok_batch(b.run(pb, drop=True), 4)
    b.stop()
    store_clean(engines.path)
