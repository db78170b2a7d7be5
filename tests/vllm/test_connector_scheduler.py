"""Tests of the scheduler side of the kvstore connector (KVStoreScheduler: lookups, pins,
reservations, LRU eviction, commits, reset, events, stats) through the real vLLM
scheduler, plus the connector's start-up contract (config validation, layout checks,
plugin registration). Every harness test ends with the leak checks of `kv_harness`.
"""
import json
import os

import pytest

from connector_util import (
    BS, SLOT, Gate, conn_stats, drop_gpu_cache, event_hash, keys_of, kv_config, kv_harness,
    loads_ok, open_fds, prompts, record_dropped_counts, sched, set_injector, settle, workers,
)
from kvstore.errors import ConfigError, LayoutMismatch


# ------------------------------------------------------------------ lookups and hits


def test_prefix_reuse_across_requests(tmp_path):
    store = tmp_path / "store"
    shared = 6 * BS
    first, *rest = prompts(40, 4, 6 * BS + 40, shared=shared)
    with kv_harness(store) as h:
        h.run([first], max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        # Three requests with the same 6-block prefix and new suffixes, at once: each
        # loads exactly the shared prefix (vLLM does not cache blocks still loading, so
        # all three ask the disk and pin the same slots).
        rids = [h.add_request(p, max_tokens=2) for p in rest]
        before = dict(h.stats)
        h.step()
        s = sched(h)
        assert set(s.lookups.inflight) == set(rids)
        assert s.index.pinned_slots == 6
        assert set(s.index.pin_counts().values()) == {3}
        h.drain()
        st = h.stats
        loads_ok(st)
        assert st["external_hit_tokens"] - before["external_hit_tokens"] == 3 * shared
        assert st["blocks_loaded"] - before["blocks_loaded"] == 3 * 6
        settle(h)
        # Each suffix's full blocks (6 + 2 full of 136 tokens) got stored once.
        assert s.store.stats()["used_slots"] == 6 + 4 * 2
        assert conn_stats(h)["hit_blocks"] == 18


def test_partial_gpu_hit_plus_disk_hit(tmp_path):
    store = tmp_path / "store"
    p = prompts(41, 1, 8 * BS + 12)[0]       # 8 full blocks
    with kv_harness(store) as h:
        h.run([p], max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        # Bring only the first 3 blocks back into vLLM's GPU cache (they load from disk).
        h.run([p[:3 * BS + 5]], max_tokens=1)
        settle(h)
        before = dict(h.stats)
        st = h.run([p], max_tokens=2)
        loads_ok(st)
        # 3 blocks from the GPU prefix cache, the 5 after them from disk.
        assert st["local_hit_tokens"] - before["local_hit_tokens"] == 3 * BS
        assert st["external_hit_tokens"] - before["external_hit_tokens"] == 5 * BS
        assert st["blocks_loaded"] - before["blocks_loaded"] == 5
        assert st["tokens_computed"] - before["tokens_computed"] == 12 + 1
        s = conn_stats(h)
        assert s["hit_blocks"] == 3 + 5 and s["hit_tokens"] == 8 * BS


def test_skip_reading_prefix_cache_never_loads(tmp_path):
    store = tmp_path / "store"
    p = prompts(42, 1, 70)[0]
    with kv_harness(store) as h:
        h.run([p], max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        h.add_request(p, max_tokens=1, skip_reading_prefix_cache=True)
        h.drain()
        assert h.stats["external_hit_tokens"] == 0 and h.stats["blocks_loaded"] == 0
        assert sched(h).index.pinned_slots == 0
        assert conn_stats(h)["hit_blocks"] == 0   # not even looked up


def test_tenants_with_different_cache_salt_never_share_blocks(tmp_path):
    store = tmp_path / "store"
    ps = prompts(43, 2, 70)
    with kv_harness(store) as h:
        h.run(ps, max_tokens=1, cache_salt="tenant-a")
        settle(h)
        assert sched(h).store.stats()["used_slots"] == 8
        for salt in ("tenant-b", None):
            drop_gpu_cache(h)
            before = dict(h.stats)
            st = h.run(ps, max_tokens=1, cache_salt=salt)
            assert st["external_hit_tokens"] == before["external_hit_tokens"], salt
            assert st["blocks_loaded"] == before["blocks_loaded"], salt
            settle(h)
        # Same tokens, three tenants: three disjoint key sets on disk.
        ka, kb, kn = (set(keys_of(h, ps[0], s)) for s in ("tenant-a", "tenant-b", None))
        assert not (ka & kb) and not (ka & kn) and not (kb & kn)
        assert sched(h).store.stats()["used_slots"] == 3 * 8
        drop_gpu_cache(h)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=1, cache_salt="tenant-a")
        loads_ok(st)
        assert st["external_hit_tokens"] - before["external_hit_tokens"] == 2 * 4 * BS


# ---------------------------------------------------------------- eviction and full


def test_lru_eviction_spares_pinned_blocks(tmp_path):
    store = tmp_path / "store"
    a, b, c = prompts(44, 3, 70)        # 4 full blocks each
    # 8 slots for data + a pool of 4 reserved slots
    with kv_harness(store, kv_events=True, extra={"capacity": 12 * SLOT, "slot_pool": 4}) as h:
        assert sched(h).store.stats()["capacity_slots"] == 12
        counts = record_dropped_counts(h)
        h.run([a], max_tokens=1)
        settle(h)
        h.run([b], max_tokens=1)
        settle(h)                         # full: A is least recently used, then B
        drop_gpu_cache(h)
        gate = Gate("read")
        set_injector(h, gate)
        ra = h.add_request(a, max_tokens=1)   # A's slots pinned for the load ...
        h.step()
        assert sched(h).index.pinned_slots == 4
        h.add_request(c, max_tokens=1)        # ... while C's store needs 4 slots
        h.step()
        h.step()
        gate.open()
        set_injector(h, None)
        h.drain()
        settle(h)
        s = sched(h).store
        assert all(s.lookup(k) is not None for k in keys_of(h, a))       # pinned: kept
        assert all(s.lookup(k) is None for k in keys_of(h, b))           # LRU victim
        assert all(s.lookup(k) is not None for k in keys_of(h, c))
        assert conn_stats(h)["evicted_blocks"] == 4
        # a walk the pool covered exactly (4 of 4) queues no count of nothing
        assert all(a_ < b_ for a_, b_ in counts), counts
        removed = [x for e in h.events if type(e).__name__ == "BlockRemoved"
                   and e.medium == "STORAGE" for x in e.block_hashes]
        assert sorted(removed) == sorted(event_hash(k) for k in keys_of(h, b))
        assert ra in h.finished
        assert h.stats["blocks_mismatched"] == 0


def test_lru_eviction_follows_hits(tmp_path):
    """A disk hit makes a prefix most recently used: the next eviction takes another."""
    store = tmp_path / "store"
    a, b, c = prompts(45, 3, 70)
    with kv_harness(store, extra={"capacity": 12 * SLOT, "slot_pool": 4}) as h:
        for p in (a, b):
            h.run([p], max_tokens=1)
            settle(h)
        drop_gpu_cache(h)
        loads_ok(h.run([a], max_tokens=1))     # touch A: B is now the oldest
        settle(h)
        h.run([c], max_tokens=1)
        settle(h)
        s = sched(h).store
        assert all(s.lookup(k) is not None for k in keys_of(h, a))
        assert all(s.lookup(k) is None for k in keys_of(h, b))
        assert all(s.lookup(k) is not None for k in keys_of(h, c))


def test_staggered_prefills_of_one_prompt_store_each_block_once(tmp_path):
    """Four requests with the same 40-block prompt, each a step after the last, prefilled
    in 64-token chunks: vLLM hands a later one the blocks an earlier one computed, and the
    later one then runs ahead of it. Each block is written once: no duplicate commit, one
    BlockStored per hash, every slot used holds a distinct block. (A store walk that skipped
    the table probe past a request's lookup miss would store 12 of these 40 blocks twice.)"""
    import collections
    import time
    p = prompts(77, 1, 40 * BS + 5)[0]
    with kv_harness(tmp_path / "store", num_gpu_blocks=512, max_num_batched_tokens=256,
                    kv_events=True) as h:
        s = sched(h)
        h.scheduler.scheduler_config.long_prefill_token_threshold = 64
        for i in range(30):
            if i < 4:
                h.add_request(p, max_tokens=1)
            h.step()
            time.sleep(0.05)        # the index thread commits between steps
        settle(h)
        st = s.store.stats()
        stored = collections.Counter(
            x for e in h.events if type(e).__name__ == "BlockStored" and e.medium == "STORAGE"
            for x in e.block_hashes)
        assert st["duplicates"] == 0, st
        assert st["used_slots"] == 40 and len(stored) == 40, (st, len(stored))
        assert set(stored.values()) == {1}, stored
        assert conn_stats(h)["stored_blocks"] == 40
        assert all(s.store.lookup(k) is not None for k in keys_of(h, p))


def test_full_store_drops_stores_and_keeps_serving(tmp_path):
    """Every slot pinned by in-flight loads or reserved by in-flight stores: the pool
    runs dry, stores are dropped, requests keep being served, and stores resume once the
    pins are gone."""
    store = tmp_path / "store"
    a, c, d = prompts(46, 3, 70)
    with kv_harness(store, extra={"capacity": 8 * SLOT, "slot_pool": 4}) as h:
        h.run([a], max_tokens=1)
        settle(h)
        assert sched(h).store.stats()["free_slots"] == 0     # 4 used, 4 in the pool
        drop_gpu_cache(h)
        reads, syncs = Gate("read"), Gate("fdatasync")
        set_injector(h, lambda op, *args: (reads if op == "read" else syncs)(op, *args))
        h.add_request(a, max_tokens=1)          # pins A's 4 slots
        h.step()
        assert sched(h).index.pinned_slots == 4
        s0 = conn_stats(h)
        assert s0["stored_blocks"] == 4 and s0["store_dropped_blocks"] == 0
        h.add_request(c, max_tokens=3)          # takes the pool's 4 slots (not committed)
        h.step()
        sched(h).index.flush()
        assert len(sched(h).index.pooled()) == 0   # nothing to refill from: pinned or reserved
        rd = h.add_request(d, max_tokens=3)
        for _ in range(6):
            h.step()
        assert rd in h.finished                  # served while nothing could be stored
        sched(h).index.flush()                   # the dry pool's drops are counted by the
        h.step()                                 # index thread, published at a next step
        assert sched(h).stores.counting == 0
        s = conn_stats(h)
        assert s["store_dropped_blocks"] == 4 and s["stored_blocks"] == 4
        reads.open()
        syncs.open()
        set_injector(h, None)
        h.drain()
        settle(h)
        assert h.stats["blocks_mismatched"] == 0
        # Pins gone: D is stored now (evicting).
        h.run([d], max_tokens=1)
        settle(h)
        drop_gpu_cache(h)
        before = dict(h.stats)
        loads_ok(h.run([d], max_tokens=1))
        assert h.stats["external_hit_tokens"] - before["external_hit_tokens"] == 4 * BS


# --------------------------------------------------------------------------- reset


def test_reset_cache_with_stores_and_loads_in_flight(tmp_path):
    store = tmp_path / "store"
    a, b, c, d = prompts(47, 4, 70)
    with kv_harness(store, kv_events=True) as h:
        h.run([a, b], max_tokens=1)
        settle(h)
        pre_reset = list(sched(h).store.index.iter_entries())
        drop_gpu_cache(h)
        reads, syncs = Gate("read"), Gate("fdatasync")
        set_injector(h, lambda op, *args: (reads if op == "read" else syncs)(op, *args))
        ra = h.add_request(a, max_tokens=2)    # load of A in flight (pinned)
        rc = h.add_request(c, max_tokens=2)    # store of C in flight (reserved)
        h.step()
        s = sched(h)
        assert ra in s.lookups.inflight and s.commits.inflight
        # The GPU side refuses (blocks in use); the connector resets: nothing hits any
        # more, not even the entries being read (their slots stay pinned).
        assert h.scheduler.reset_prefix_cache(reset_connector=True) is False
        assert not any(s.index.contains(k) for k in keys_of(h, a) + keys_of(h, b))
        s.index.flush()     # LMDB follows on the index thread
        assert s.store.stats()["used_slots"] == 0
        a_slots = set(s.lookups.inflight[ra].job.slots)
        b_slots = {e.slot for e in pre_reset if e.key in set(keys_of(h, b))}
        assert s.index.pinned_slots == 4
        # Stores planned after the reset (slots from the pool, refilled from the freed
        # slots) never get the ones the load still reads.
        jobs_before = set(s.commits.inflight)
        rd = h.add_request(d, max_tokens=1)
        h.step()
        new_slots = {sl for j, st in s.commits.inflight.items() if j not in jobs_before
                     for sl in st.slots}
        assert len(new_slots) == 4 and not new_slots & a_slots
        s.index.flush()
        assert not {sl for sl, _ in s.index.pooled()} & a_slots
        assert b_slots
        reads.open()
        syncs.open()
        set_injector(h, None)
        h.drain()
        settle(h)
        assert h.stats["blocks_mismatched"] == 0 and h.stats["blocks_loaded"] == 4
        assert rc in h.finished and ra in h.finished and rd in h.finished
        # The store that was in flight during the reset was not committed.
        assert all(s.store.lookup(k) is None for k in keys_of(h, c))
        assert s.store.stats()["reserved_slots"] == len(s.index.pooled())
        removed = {x for e in h.events if type(e).__name__ == "BlockRemoved"
                   and e.medium == "STORAGE" for x in e.block_hashes}
        assert {event_hash(k) for k in keys_of(h, a) + keys_of(h, b)} <= removed
        # Serving and storing go on after the reset; the connector's own reset_cache
        # (nothing in flight) empties the store.
        h.run([b], max_tokens=1)
        settle(h)
        assert all(s.store.lookup(k) is not None for k in keys_of(h, b))
        assert h.scheduler_connector.reset_cache() is True
        s.index.flush()
        assert s.store.stats()["used_slots"] == 0


# ---------------------------------------------------------------- events and stats


def test_events_and_stats(tmp_path):
    store = tmp_path / "store"
    ps = prompts(48, 2, 70)
    with kv_harness(store, kv_events=True, tp_size=2) as h:
        h.run(ps, max_tokens=1)
        settle(h)
        stored = [e for e in h.events if type(e).__name__ == "BlockStored"
                  and e.medium == "STORAGE"]
        gpu = [e for e in h.events if type(e).__name__ == "BlockStored" and e.medium == "GPU"]
        gpu_hashes = [x for e in gpu for x in e.block_hashes]
        assert sorted(x for e in stored for x in e.block_hashes) == sorted(gpu_hashes)
        for p in ps:
            keys = keys_of(h, p)
            by_hash = {e.block_hashes[0]: e for e in stored}
            for i, k in enumerate(keys):
                e = by_hash[event_hash(k)]
                assert e.block_size == BS and e.group_idx == 0
                assert e.token_ids == p[i * BS:(i + 1) * BS]
                assert e.parent_block_hash == (
                    event_hash(keys[i - 1]) if i else None)
        s = conn_stats(h)
        assert s["stored_blocks"] == 8 and s["miss_lookups"] == 2
        assert s["stored_bytes"] == 2 * 8 * workers(h)[0].io.payload_len   # both ranks
        assert s["used_slots"] == 8 and s["hit_blocks"] == 0
        n = len(h.kv_connector_stats)
        drop_gpu_cache(h)
        h.run(ps, max_tokens=1)
        settle(h)
        s2 = conn_stats(h)
        assert s2["hit_blocks"] == 8 and s2["hit_tokens"] == 8 * BS
        assert s2["loaded_blocks"] == 8 and s2["load_failures"] == 0
        assert s2["loaded_bytes"] == 2 * 8 * workers(h)[0].io.payload_len
        assert s2["stored_blocks"] == 8 and s2["evicted_blocks"] == 0
        assert len(h.kv_connector_stats) > n
        # Published stats are deltas: a quiet connector reports nothing new (the
        # scheduler's, once its gauges as they settled were reported).
        for c in h.worker_connectors:
            assert c.get_kv_connector_stats() is None
        last = h.scheduler_connector.get_kv_connector_stats()
        assert last is None or last.data["loaded_blocks"] == 0
        assert h.scheduler_connector.get_kv_connector_stats() is None


# ---------------------------------------------------------- start-up and config


def test_plugin_registers_connector_by_name_idempotently(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvstore.vllm.connector import KVStoreConnector
    from kvstore.vllm.plugin import NAME, register
    KVConnectorFactory._registry.pop(NAME, None)
    register()
    register()   # a second call must not raise (vLLM's factory does on duplicates)
    assert NAME == "KVStoreConnector" and NAME in KVConnectorFactory._registry
    from vllm.config import KVTransferConfig
    ktc = KVTransferConfig(kv_connector=NAME, kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc) is KVStoreConnector
    # And an engine works with the name alone (no kv_connector_module_path).
    from kvstore.drivers.simulator import EngineHarness
    cfg = kv_config(tmp_path / "store")
    del cfg["kv_connector_module_path"]
    before = open_fds()
    with EngineHarness(kv_transfer_config=cfg, workdir=str(tmp_path)) as h:
        assert type(h.scheduler_connector) is KVStoreConnector
        h.run(prompts(49, 1, 40), max_tokens=1)
        settle(h)
        h.assert_no_leaks()
    assert not open_fds() - before


@pytest.mark.parametrize("extra, words", [
    ({"path": "/x", "io_mode": "mmap"}, ["io_mode", "'mmap'", "direct", "page_cache"]),
    ({"path": "/x", "capcity": "1G"}, ["unknown", "capcity", "capacity"]),
    ({"capacity": "1G"}, ['"path"']),
    ({"path": ""}, ['"path"']),
    ({"path": "/x", "store_policy": "always"}, ["store_policy", "eager", "lazy"]),
    ({"path": "/x", "queue_depth": 0}, ["queue_depth", "1..4096"]),
    ({"path": "/x", "inflight_bytes": "lots"}, ["inflight_bytes", "'lots'", '"8M"', "queue_depth alone"]),
    ({"path": "/x", "inflight_bytes": "8G"}, ["inflight_bytes", '"4G"']),
    ({"path": "/x", "load_timeout_s": -1}, ["load_timeout_s", "positive"]),
    ({"path": "/x", "capacity": "lots"}, ["lots"]),
    ({"path": "/x", "device_eio_window_s": float("nan")}, ["device_eio_window_s", "positive"]),
    ({"path": "/x", "device_eio_limit": 0}, ["device_eio_limit", "1..1048576"]),
    ({"path": "/x", "thread_cpus": "1-"}, ["thread_cpus", "'1-'", "taskset", "2-5,8"]),
    ({"path": "/x", "thread_cpus": "3-1"}, ["thread_cpus", "CPU list"]),
    ({"path": "/x", "thread_cpus": [True]}, ["thread_cpus", "list of CPU ids"]),
    ({"path": "/x", "thread_cpus": -1}, ["thread_cpus", "a CPU id (6)"]),
    ({"path": "/x", "thread_cpus": []}, ["thread_cpus", "may run on"]),
    ({"path": "/x", "thread_cpus": "100000"}, ["thread_cpus", "100000", "may not run on",
                                                "cgroup cpuset"]),
    ({"path": "/x", "io_thread_nice": 20}, ["io_thread_nice", "0..19"]),
    ({"path": "/x", "io_thread_nice": True}, ["io_thread_nice", "0..19"]),
], ids=["io_mode", "unknown-key", "missing-path", "empty-path", "store_policy",
        "queue_depth", "inflight_bytes", "inflight_too_big", "load_timeout_s", "capacity", "eio_window_nan", "eio_limit",
        "cpus_syntax", "cpus_backwards", "cpus_bool", "cpus_negative", "cpus_empty", "cpus_not_allowed",
        "nice_range", "nice_bool"])
def test_config_validation_names_the_key(extra, words):
    from kvstore.vllm.config import ConnectorConfig
    with pytest.raises(ConfigError) as ei:
        ConnectorConfig.from_extra_config(extra)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_thread_cpus_pins_kvstores_threads_and_only_them(tmp_path):
    """thread_cpus: the index thread, the I/O thread and the device streams run only on
    the CPUs named, the I/O threads below the index thread's priority (io_thread_nice: 19
    by default with vLLM's GPU build, set to 0 first); vLLM's step thread (here, the
    test's) keeps its mask and priority; serving works."""
    import threading
    mine = os.sched_getaffinity(0)
    me = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, me)
    cpu = max(mine)
    ps = prompts(61, 2, 80)

    def kv_threads():
        return {t.name: (os.sched_getaffinity(t.native_id),
                         os.getpriority(os.PRIO_PROCESS, t.native_id))
                for t in threading.enumerate() if t.name.startswith("kvstore-")}

    with kv_harness(tmp_path / "store", extra={"io_thread_nice": 0}) as h:   # as the process
        h.run(ps, max_tokens=1)
        settle(h)
        ts = kv_threads()
        assert {"kvstore-index", "kvstore-io-rank0"} <= set(ts), ts
        assert all(v == (mine, base) for v in ts.values()), ts
    with kv_harness(tmp_path / "store", extra={"thread_cpus": [cpu]}) as h:   # a restart
        st = h.run(ps, max_tokens=1)
        settle(h)
        assert st["external_hit_tokens"] > 0 and st["blocks_loaded"] > 0
        ts = kv_threads()
        assert {"kvstore-index", "kvstore-io-rank0", "kvstore-dev0-r0"} <= set(ts), ts
        assert all(m == {cpu} for m, _ in ts.values()), ts
        assert ts["kvstore-index"][1] == base
        assert ts["kvstore-io-rank0"][1] == ts["kvstore-dev0-r0"][1] == min(19, base + 19), ts
        assert os.sched_getaffinity(0) == mine
        assert os.getpriority(os.PRIO_PROCESS, me) == base
    assert os.sched_getaffinity(0) == mine
    assert os.getpriority(os.PRIO_PROCESS, me) == base


def test_kvstore_threads_name_themselves_to_the_kernel_without_opening_a_file(monkeypatch):
    """A thread kvstore starts names itself ("kvstore-io-rank0" -> "kvs-io-rank0", 15 bytes
    at most) with prctl, so `ps -L` shows it, and opens no file doing so: a thread opening /proc/.../comm while a harness closes would
    show up in the fd-leak check."""
    import threading
    from kvstore.io.threads import make_thread
    opened = []
    real_open = open

    def spy(path, *a, **k):
        opened.append(str(path))
        return real_open(path, *a, **k)
    monkeypatch.setattr("builtins.open", spy)
    seen = {}

    def body():
        with real_open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen["comm"] = f.read().strip()
    t = make_thread(body, "kvstore-io-rank0-long-name")
    t.start()
    t.join()
    assert seen["comm"] == "kvs-io-rank0-lo", seen
    assert not [p for p in opened if "/comm" in p], opened


def test_io_thread_nice_default_follows_where_the_forward_runs():
    """19 unless vLLM's forward runs on the host's CPUs (its CPU build) on CPUs kvstore
    shares with it; an explicit value always wins. This venv has vLLM's GPU build (the
    forward is not on the host); the CPU build's default is checked inside the real engine
    (tests/e2e/test_real_engine.py::test_identical_tokens_cold_and_after_restart)."""
    from kvstore.io.threads import io_nice
    from kvstore.vllm.config import ConnectorConfig
    cpus = frozenset({0})
    assert [io_nice(None, None, True), io_nice(cpus, None, True), io_nice(None, None, False),
            io_nice(cpus, None, False), io_nice(None, 7, True), io_nice(cpus, 0, False)] \
        == [0, 19, 19, 19, 7, 0]
    assert ConnectorConfig.forward_on_host() is False
    cpu = str(max(os.sched_getaffinity(0)))
    nice = {json.dumps(extra): ConnectorConfig.from_extra_config({"path": "/x", **extra}).io_thread_nice
            for extra in ({}, {"thread_cpus": cpu}, {"thread_cpus": cpu, "io_thread_nice": 0},
                          {"io_thread_nice": 7}, {"thread_cpus": int(cpu)})}
    assert list(nice.values()) == [19, 19, 0, 7, 19], nice
    assert ConnectorConfig.from_extra_config(
        {"path": "/x", "thread_cpus": int(cpu)}).thread_cpus == {int(cpu)}


def test_bad_config_refuses_engine_start_without_leaking(tmp_path):
    from kvstore.drivers.simulator import EngineHarness
    before = open_fds()
    for extra in ({"io_mode": "mmap"}, {"path": None}, {"bogus": 1}):
        with pytest.raises(ConfigError):
            EngineHarness(kv_transfer_config=kv_config(tmp_path / "store", **extra),
                          workdir=str(tmp_path))
    assert not os.path.exists(tmp_path / "store")
    assert not open_fds() - before


@pytest.mark.parametrize("change, field", [
    ({"num_kv_heads": 4}, "num_kv_heads"),
    ({"dtype": "bfloat16"}, "dtype"),
    ({"tp_size": 2}, "tp_size"),
    ({"num_layers": 3}, "num_layers"),
    ({"block_size": 32}, "block_size"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_layout_mismatch_refuses_at_startup(tmp_path, change, field):
    from kvstore.drivers.simulator import EngineHarness
    store = tmp_path / "store"
    with kv_harness(store) as h:
        h.run(prompts(50, 1, 40), max_tokens=1)
        settle(h)
    before = open_fds()
    with pytest.raises(LayoutMismatch) as ei:
        EngineHarness(kv_transfer_config=kv_config(store), workdir=str(tmp_path), **change)
    msg = str(ei.value)
    assert "refusing" in msg and str(store) in msg
    assert ei.value.field in msg
    assert not open_fds() - before
    # The refused store is untouched and still serves the engine it was made for.
    with kv_harness(store) as h:
        loads_ok(h.run(prompts(50, 1, 40), max_tokens=1))
    assert ei.value.field == field
