"""kvstore inside a real vLLM engine: `vllm serve` (vLLM's own worker, model runner, sampler,
engine-core/worker process boundary) with a real model, driven through the OpenAI API.

Every test compares the greedy tokens (and logprobs) of the shared workload with the
reference run of a server without kvstore (fixture `reference`).
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from e2e_util import (
    MAX_TOKENS, PREEMPT_OUT, assert_same, copy_store, fsck, info, kvstore_cli, kvstore_threads,
    thread_cpus, wait_stored,
)
from kvstore.store import shared
from kvstore.drivers.client import Client
from kvstore.drivers.server import ServerStartError
from kvstore.drivers.workload import Workload


def replay(server, workload):
    return workload.replay(Client(server.url), max_tokens=MAX_TOKENS)


def hits(before: dict, after: dict) -> tuple[int, int]:
    """(kvstore's hit tokens, vLLM's external prefix cache hits) between two /metrics reads."""
    k = after.get("vllm:kvstore_hit_tokens_total", 0) - before.get("vllm:kvstore_hit_tokens_total", 0)
    v = (after.get("vllm:external_prefix_cache_hits_total", 0)
         - before.get("vllm:external_prefix_cache_hits_total", 0))
    return int(k), int(v)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_identical_tokens_cold_and_after_restart(serve, workload, reference, tmp_path, async_scheduling,
                                                 request):
    if async_scheduling and not request.getfixturevalue("async_scheduling_kept"):
        pytest.skip("this engine serves with async scheduling off whatever --async-scheduling says "
                    "(vLLM's CPU build: CpuPlatform.check_and_update_config); [sync] is this case here")
    store = tmp_path / "store"
    with serve.running(store, async_scheduling=async_scheduling) as s:
        assert_same(reference, replay(s, workload), workload)
        wait_stored(s)
        stored = s.metrics()["vllm:kvstore_stored_blocks_total"]
        threads, base = kvstore_threads(s), os.getpriority(os.PRIO_PROCESS, s.proc.pid)
    assert stored > 0
    # vLLM's CPU build runs its forward on these CPUs: kvstore's I/O threads keep the
    # process's priority there (io_thread_nice defaults to 0, kvstore.io.threads.io_nice).
    assert {"kvs-index", "kvs-io-rank0"} <= set(threads), threads
    assert all(n == [base] * len(n) for n in threads.values()), (base, threads)
    # A new process on the same store: vLLM's own prefix cache is empty, kvstore is not.
    with serve.running(store, async_scheduling=async_scheduling) as s:
        m0 = s.metrics()
        assert_same(reference, replay(s, workload), workload)
        m1 = s.metrics()
    k, v = hits(m0, m1)
    assert k > 0, "nothing came from disk after the restart"
    assert k == v, f"kvstore counted {k} hit tokens, vLLM {v}"
    assert m1.get("vllm:kvstore_load_failures_total", 0) == 0
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core beside the forward's")
def test_thread_cpus_on_the_core_vllm_reserves_keeps_the_forwards_core_free(serve, workload, tmp_path):
    """vLLM's CPU build binds the forward to every core but the reserved ones, taken from
    the end of the list (VLLM_CPU_NUM_OF_RESERVED_CPU=1 on this host). `thread_cpus` naming
    the reserved core is accepted although the worker's step thread, which parses it, is
    bound to the forward's core; kvstore's I/O thread runs there and never on the forward's
    core, and what it stored is loaded back after a restart, token for token (the reference
    is this binding's own first run: a forward on fewer cores may sum in another order)."""
    store = tmp_path / "store"
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    extra = {"thread_cpus": str(max(os.sched_getaffinity(0)))}
    with serve.running(store, extra=extra, env=env) as s:
        first = replay(s, workload)
        wait_stored(s)
        cpus = thread_cpus(s, "VLLM::Worker", "kvs-io-rank0")
    forward = set().union(*cpus["VLLM::Worker"])
    io = set().union(*cpus["kvs-io-rank0"])
    assert forward and io == {max(os.sched_getaffinity(0))}, cpus
    assert not io & forward, f"kvstore's I/O thread shares the forward's cores: {cpus}"
    with serve.running(store, extra=extra, env=env) as s:
        m0 = s.metrics()
        got = replay(s, workload)
        m1 = s.metrics()
    assert hits(m0, m1)[0] > 0, "nothing came from disk after the restart"
    assert_same(first, got, workload)


def _written_slots(store) -> list[tuple[str, int]]:
    """(slot file, byte offset of the slot) of every slot that holds a written header."""
    with open(os.path.join(store, "kvstore.json")) as f:
        fp = json.load(f)
    size, per_file = fp["slot_size"], fp["slots_per_file"]
    out = []
    rank0 = os.path.join(store, "rank0")
    for name in sorted(os.listdir(rank0)):
        if not name.endswith(".kvs"):
            continue
        path = os.path.join(rank0, name)
        with open(path, "rb") as f:
            for i in range(per_file):
                f.seek(i * size)
                if f.read(8).strip(b"\0"):
                    out.append((path, i * size))
    return out


def test_flipped_bits_are_recomputed_and_their_entries_dropped(serve, workload, reference, warm_store, tmp_path):
    store = copy_store(warm_store, tmp_path / "store")
    used0 = info(store)["used_slots"]
    slots = _written_slots(store)
    assert len(slots) == used0 > 8
    damaged = slots[::3]
    for path, off in damaged:                      # one flipped bit in each payload
        with open(path, "r+b") as f:
            f.seek(off + 4096 + 777)
            b = f.read(1)
            f.seek(off + 4096 + 777)
            f.write(bytes([b[0] ^ 0x10]))
    with serve.running(store) as s:
        assert_same(reference, replay(s, workload), workload)
        wait_stored(s)
        m = s.metrics()
    assert m["vllm:kvstore_load_failures_total"] > 0, "no damaged block was ever read"
    # Every damaged slot that was read lost its entry; what is in the store now verifies.
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_full_store_keeps_serving_identical_tokens(serve, workload, reference, tmp_path):
    store = tmp_path / "store"
    # Room for 24 blocks of 32 KiB: the workload's ~60 distinct blocks evict each other.
    with serve.running(store, extra={"capacity": "800K"}) as s:
        assert_same(reference, replay(s, workload), workload)
        assert_same(reference, replay(s, workload), workload)
        wait_stored(s)
        m = s.metrics()
    assert m["vllm:kvstore_evicted_blocks_total"] > 0
    assert info(store)["used_slots"] <= info(store)["capacity_slots"]
    with serve.running(store) as s:
        assert_same(reference, replay(s, workload), workload)
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def _fill(path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)


def test_full_disk_keeps_serving_identical_tokens(serve, workload, reference, small_disk):
    store = small_disk / "store"
    first = Workload(workload.spec, documents=2, doc_tokens=640, questions=1, sessions=1, turns=1,
                     system_tokens=200, seed=11)
    with serve.running(store, extra={"capacity": "4M"}) as s:
        replay(s, first)
        wait_stored(s)
        _fill(small_disk / "filler")                  # another tenant takes every free byte
        assert_same(reference, replay(s, workload), workload)
        wait_stored(s)
        m = s.metrics()
    assert m["vllm:kvstore_stored_blocks_total"] > 0
    os.unlink(small_disk / "filler")
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_sigkill_while_storing_then_fsck_clean_and_identical_tokens(serve, workload, reference, tmp_path):
    store = tmp_path / "store"
    s = serve.server(store).start()
    # A second server on a store that is being served attaches to it: both
    # engine cores hold a live lease, and the second one outlives the kill below.
    other = serve.server(store).start()
    live = [e for e in shared.engines(str(store)) if e.alive]
    assert sorted(os.getpgid(e.pid) for e in live) == sorted([s.proc.pid, other.proc.pid]), live
    # Traffic with new prefixes keeps the store busy (round after round of new documents
    # and chats, until the kill ends it); kill -9 the whole server while stores complete.
    stop = threading.Event()
    errors: list = []

    def traffic():
        seed = 23
        while not stop.is_set():
            many = Workload(workload.spec, documents=6, doc_tokens=900, questions=1, sessions=4,
                            turns=2, system_tokens=300, seed=seed)
            seed += 1
            try:
                many.replay(Client(s.url, timeout_s=60), max_tokens=4)
            except Exception as exc:  # noqa: BLE001 - the server is killed under it
                errors.append(exc)    # (or one request timed out on a loaded machine: go on)
                time.sleep(0.5)
    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    # Kill at a moment the stored-blocks counter is moving (it grew since the previous
    # sample, a fraction of a second ago) while the traffic still sends new prefixes:
    # stores are in flight then, not only done. The deadline only bounds a hang.
    deadline = time.monotonic() + 600
    last = s.metrics().get("vllm:kvstore_stored_blocks_total", 0)
    while True:
        assert s.proc.poll() is None, "the server died before the kill"
        assert time.monotonic() < deadline, f"no store completed while the traffic ran: {errors[-3:]}"
        time.sleep(0.1)
        n = s.metrics().get("vllm:kvstore_stored_blocks_total", 0)
        if n > last:
            break
        last = n
    s.kill()
    stop.set()
    t.join(120)
    assert not t.is_alive(), "the traffic did not end after the kill"
    code, doc = fsck(store)                 # next to the survivor
    assert code == 0 and doc["findings"] == [], doc
    assert other.healthy(), "the other server died with the killed one"
    deadline = time.monotonic() + 30        # it reclaims the dead engine's lease
    while any(not e.alive for e in shared.engines(str(store))):
        assert time.monotonic() < deadline, "the dead server's lease was never reclaimed"
        time.sleep(0.5)
    other.stop()
    with serve.running(store) as s2:
        assert_same(reference, replay(s2, workload), workload)
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_small_kv_cache_preemptions_identical_tokens(serve, references, preempt_prompts, tmp_path):
    store = tmp_path / "store"
    # 40 blocks of 32 tokens; four concurrent ~300-token prompts (10 blocks each) fill them,
    # and each then grows by 320 output tokens (10 more blocks): vLLM must preempt. The
    # reference: each prompt alone on a server without kvstore (fixture `references`).
    prompts, ref = preempt_prompts, references["preempt"]
    out_tokens = PREEMPT_OUT
    for phase in range(2):
        with serve.running(store, max_model_len=1024, extra_args=["--num-gpu-blocks-override", "40"]) as s:
            out: dict[int, object] = {}

            def one(i, p, url=s.url):
                out[i] = Client(url).complete(p, max_tokens=out_tokens)
            threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(600)
            # The second server finds every block on disk already: it stores nothing new,
            # so its counter only has to settle (at 0), not pass 0.
            wait_stored(s, above=0.0 if phase == 0 else -1.0)
            m = s.metrics()
        assert m.get("vllm:num_preemptions_total", 0) > 0, "no preemption happened"
        for i in range(len(prompts)):
            assert out[i].token_ids == ref[i].token_ids, f"phase {phase} prompt {i}"
    assert m["vllm:kvstore_hit_tokens_total"] > 0, "the second run did not load from disk"
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_bad_configuration_is_refused_at_start_and_loses_nothing(serve, warm_store, tmp_path):
    store = copy_store(warm_store, tmp_path / "store")
    used = info(store)["used_slots"]
    with pytest.raises(ServerStartError) as err:
        serve.server(store, model=str(tmp_path / "no-such-model")).start()
    assert "no-such-model" in str(err.value), str(err.value)
    with pytest.raises(ServerStartError) as err:
        serve.server(store, extra={"pth": "/typo"}).start()
    assert "unknown kv_connector_extra_config key" in str(err.value) and "pth" in str(err.value), str(err.value)
    # A store made with 32-token blocks, a server with 64-token blocks: other KV.
    with pytest.raises(ServerStartError) as err:
        serve.server(store, block_size=64).start()
    assert "LayoutMismatch" in str(err.value) and "block_size" in str(err.value), str(err.value)
    assert info(store)["used_slots"] == used
    code, doc = fsck(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_warmup_with_the_real_engine_then_a_fresh_server_answers_from_disk(
        serve, engine, model_dir, workload, reference, tmp_path):
    store = tmp_path / "new-node-store"
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        for r in workload.requests:
            if r.kind == "document":
                f.write(json.dumps({"prompt": r.prompt}) + "\n")
    r = kvstore_cli("warmup", str(store), str(prompts), "--model", model_dir, "--capacity", "256M",
                    "--engine-arg", "dtype=float32", "--engine-arg", "block_size=32", "--json",
                    python=engine[0], env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    sm = json.loads(r.stdout)
    assert sm["blocks_written"] > 0, sm
    with serve.running(store) as s:
        m0 = s.metrics()
        comps = replay(s, workload)
        m1 = s.metrics()
    assert_same(reference, comps, workload)
    k, v = hits(m0, m1)
    assert k >= sm["blocks_written"] * 32 * 0.5 and k == v, (k, v, sm)


@pytest.mark.parametrize("tp", [2])
def test_tensor_parallel_on_the_cpu_build(serve, workload, reference, tmp_path, tp):
    store = tmp_path / "store"
    # The CPU build binds each TP worker's OpenMP threads to a NUMA node and refuses two
    # workers on one node unless told which cores each gets.
    binding = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % os.cpu_count()) for i in range(tp))}
    tp_args = ["--tensor-parallel-size", str(tp)]
    with serve.running(store, extra_args=tp_args, env=binding) as s:
        assert_same(reference, replay(s, workload), workload)
        wait_stored(s)
    with serve.running(store, extra_args=tp_args, env=binding) as s:
        m0 = s.metrics()
        assert_same(reference, replay(s, workload), workload)
        k, v = hits(m0, s.metrics())
    assert k > 0 and k == v
    assert info(store)["tp_size"] == tp
