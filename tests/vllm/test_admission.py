"""Wear accounting through vLLM's real scheduler: admission on second
sight (`"admission": "second_sight"`: a block is stored only when its key was planned
before within a window) and per-device bytes written/read as connector metrics, checked
against `kvstore info` after a serving run. Every load is byte-verified by the harness.
"""
from __future__ import annotations

import functools
import os

import pytest

import vllm  # noqa: E402,F401  (needed: a vLLM that does not import fails these tests)

from connector_util import (BS, SLOT, conn_stats, drop_gpu_cache, keys_of,  # noqa: E402
                            kv_harness, loads_ok, prompts, sched, settle)

from kvstore._seenfilter import SeenFilter  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.vllm.config import ConnectorConfig  # noqa: E402

SECOND = {"admission": "second_sight"}
HYB = {"sliding_window": 32, "num_layers": 2}
MAMBA = {"sliding_window": 32, "mamba": True, "num_layers": 3}



def _on_disk(h, keys) -> int:
    st = sched(h).store
    return sum(st.lookup(k) is not None for k in keys)


# -- the filter --------------------------------------------------------------------------

def test_seen_filter_admits_the_second_sighting_only():
    f = SeenFilter(1000)
    assert f.capacity >= 2000 and f.nbytes == 8 * f.capacity
    ks = [os.urandom(36) for _ in range(10)]
    skip = set(ks)
    k, b, i = f.admit(ks, list(range(10)), list(range(100, 110)), skip)
    assert (k, b, i) == ([], [], []) and not skip       # first sightings leave `skip`
    skip = set(ks[:4])
    k, b, i = f.admit(ks[:4], [7, 8, 9, 10], None, skip)
    assert k == ks[:4] and b == [7, 8, 9, 10] and i is None and skip == set(ks[:4])
    new = os.urandom(36)
    k, b, i = f.admit([ks[5], new], [1, 2], [5, 6], {ks[5], new})
    assert k == [ks[5]] and b == [1] and i == [5]
    assert f.probes == 16 and f.admitted == 5 and f.rejected == 11
    assert f.take_rejected() == 11 and f.take_rejected() == 0
    assert not f.sight(os.urandom(36))


def test_seen_filter_remembers_a_window_in_fixed_memory():
    f = SeenFilter(4096)
    cap = f.capacity
    ks = [os.urandom(36) for _ in range(40000)]
    for k in ks[:4096]:
        f.sight(k)
    assert sum(f.seen(k) for k in ks[:4096]) >= 0.97 * 4096    # the window is remembered
    for k in ks[4096:]:
        f.sight(k)
    assert sum(f.seen(k) for k in ks[:4096]) < 0.05 * 4096     # and fades out after it
    assert f.capacity == cap
    with pytest.raises(ValueError):
        SeenFilter(0)


# -- the option ----------------------------------------------------------------------------

def test_admission_keys_are_validated_naming_key_and_values():
    base = {"path": "/tmp/x"}
    c = ConnectorConfig.from_extra_config(base)
    assert c.admission == "always" and c.admission_window == 1 << 20
    c = ConnectorConfig.from_extra_config({**base, "admission": "second_sight",
                                           "admission_window": 5000})
    assert c.admission == "second_sight" and c.admission_window == 5000
    with pytest.raises(ConfigError, match=r"admission='twice' is not valid; choose one of "
                                          r"always, second_sight"):
        ConnectorConfig.from_extra_config({**base, "admission": "twice"})
    for bad in (0, 15, "1M", True, 1.5, 1 << 29):
        with pytest.raises(ConfigError, match=r"admission_window=.* must be an integer in "
                                              r"16\.\.268435456"):
            ConnectorConfig.from_extra_config({**base, "admission_window": bad})


def test_a_bad_admission_value_stops_the_engine_at_start(tmp_path):
    with pytest.raises(ConfigError, match="admission"):
        with kv_harness(tmp_path / "store", extra={"admission": "second-sight"}):
            pass
    assert not (tmp_path / "store" / "index").exists()


# -- through vLLM's scheduler ------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(tp_size=2), HYB],
                         ids=["one-group", "tp2", "hybrid-swa"])
def test_second_sight_stores_a_prefix_seen_twice_and_serves_it_after_restart(tmp_path, kw):
    store = tmp_path / "store"
    groups = (0, 1) if "sliding_window" in kw else (0,)
    once, twice = prompts(3, 2, 8 * BS + 5), prompts(4, 2, 8 * BS + 5)
    with kv_harness(store, extra=SECOND, **kw) as h:
        h.run(once + twice, max_tokens=2)
        settle(h)
        s = sched(h)
        assert not s.stores.storing
        for p in once + twice:     # first sighting: remembered, nothing stored
            assert all(_on_disk(h, keys_of(h, p, group=g)) == 0 for g in groups)
        rejected = conn_stats(h)["admission_rejected_blocks"]
        assert rejected == s.stores._admission.rejected == s.stores._admission.probes
        if groups == (0,):
            assert rejected == 4 * 8
        else:           # every full-attention block, and the window blocks vLLM kept
            assert 4 * 8 + 4 * 2 <= rejected <= 4 * 8 * 2
        assert conn_stats(h)["stored_blocks"] == 0
        # Seen again: a GPU prefix hit plans the blocks again (the first `twice` prompt),
        # and a recompute does too (the second, after vLLM's cache was emptied).
        h.run(twice[:1], max_tokens=2)
        drop_gpu_cache(h)
        h.run(twice[1:], max_tokens=2)
        settle(h)
        assert not s.stores.storing
        for p in twice:
            assert _on_disk(h, keys_of(h, p, group=0)) == 8
        for p in once:
            assert _on_disk(h, keys_of(h, p, group=0)) == 0
    with kv_harness(store, extra=SECOND, **kw) as h:     # restart: the filter is empty
        st = h.run(twice, max_tokens=2)
        loads_ok(st)
        assert st["external_hit_tokens"] == 2 * 8 * BS
        before = st["blocks_loaded"]
        st = h.run(once, max_tokens=2)
        assert st["blocks_loaded"] == before                # never stored: recomputed
        settle(h)
        for p in once:    # the filter is memory only: a first sighting again
            assert _on_disk(h, keys_of(h, p, group=0)) == 0
        h.run(once, max_tokens=2)
        settle(h)
        for p in once:    # and the second one stores them
            assert _on_disk(h, keys_of(h, p, group=0)) == 8


def test_admission_always_is_todays_behaviour(tmp_path):
    ps = prompts(5, 3, 8 * BS + 5)
    on_disk = []
    for name, extra in (("default", {}), ("always", {"admission": "always"})):
        store = tmp_path / name
        with kv_harness(store, extra=extra) as h:
            assert sched(h).stores._admission is None
            h.run(ps, max_tokens=2)
            settle(h)
            st = conn_stats(h)
            assert st["stored_blocks"] == 3 * 8 and st["admission_rejected_blocks"] == 0
            on_disk.append(sorted(k for p in ps for k in keys_of(h, p)
                                  if sched(h).store.lookup(k) is not None))
            drop_gpu_cache(h)
            loads_ok(h.run(ps, max_tokens=2))
    assert on_disk[0] == on_disk[1] and len(on_disk[0]) == 3 * 8


def test_second_sight_lazy_counts_a_block_waiting_for_eviction_once(tmp_path):
    """Lazy stores plan the head of vLLM's free queue at every step: a block that stays
    there is one sighting, however many steps see it; after a GPU hit takes it out and
    frees it again, the next sighting stores it."""
    store = tmp_path / "store"
    p = prompts(6, 1, 8 * BS + 5)
    kw = dict(num_gpu_blocks=16, extra={**SECOND, "store_policy": "lazy"})
    with kv_harness(store, **kw) as h:
        h.run(p, max_tokens=2)
        h.idle_steps(5)
        settle(h)
        assert _on_disk(h, keys_of(h, p[0])) == 0
        assert len(sched(h).stores._lazy_sighted) == 8      # waiting in the head, probed once each
        assert sched(h).stores._admission.probes == 8
        h.run(p, max_tokens=2)                       # a GPU hit: seen again
        h.idle_steps(5)
        settle(h)
        assert _on_disk(h, keys_of(h, p[0])) == 8
        assert not sched(h).stores._lazy_sighted and not sched(h).stores.storing
    with kv_harness(store, **kw) as h:
        st = h.run(p, max_tokens=2)
        loads_ok(st)
        assert st["blocks_loaded"] == 8


def test_lazy_without_admission_stores_at_first_sight(tmp_path):
    store = tmp_path / "store"
    p = prompts(6, 1, 8 * BS + 5)
    with kv_harness(store, num_gpu_blocks=16, extra={"store_policy": "lazy"}) as h:
        h.run(p, max_tokens=2)
        h.idle_steps(5)
        settle(h)
        assert _on_disk(h, keys_of(h, p[0])) == 8


def test_second_sight_keeps_mamba_states_so_a_twice_seen_prefix_hits(tmp_path):
    """Mamba states bypass the filter (vLLM hands a state off only from the forward that
    computes it): a prefix seen twice has its attention blocks and its state on disk and
    is served after a restart; one seen once has only its state."""
    store = tmp_path / "store"
    ps = prompts(81, 2, 140)
    with kv_harness(store, extra=SECOND, **MAMBA) as h:
        h.run(ps, max_tokens=2)
        settle(h)
        for p in ps:
            assert _on_disk(h, keys_of(h, p, group=0)) == 0 and _on_disk(h, keys_of(h, p, group=1)) == 0
            assert _on_disk(h, keys_of(h, p, group=2)) == 1       # the state at the boundary
        h.run(ps[:1], max_tokens=2)                       # seen again (a GPU hit)
        settle(h)
        assert _on_disk(h, keys_of(h, ps[0], group=0)) == 8
    with kv_harness(store, extra=SECOND, **MAMBA) as h:
        st = h.run(ps[:1], max_tokens=2)
        loads_ok(st)
        assert st["external_hit_tokens"] == 8 * BS
        assert st["failed_recving"] == 0


# -- wear accounting ---------------------------------------------------------------------

def _prom():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvstore.vllm.connector import KVStoreConnector
    reg = CollectorRegistry()
    types = {Gauge: functools.partial(Gauge, registry=reg),
             Counter: functools.partial(Counter, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    cfg = type("Cfg", (), {"kv_transfer_config": None})()
    return reg, KVStoreConnector.build_prom_metrics(cfg, types, ["model_name", "engine"],
                                                    {0: ["m", "0"]})


@pytest.mark.parametrize("ndirs", [1, 3])
def test_device_bytes_metrics_match_info_after_serving(tmp_path, ndirs):
    """Per-device bytes written and read, exported as vllm:kvstore_device_bytes_*{device},
    summed over both TP ranks, equal to what the slots stored on each device take and to
    what `kvstore info` reads from the per-device counters after the server stopped."""
    from kvstore.tools import info
    store = tmp_path / "store"
    if ndirs > 1:
        dirs = [str(tmp_path / f"nvme{i}") for i in range(ndirs)]
        for d in dirs:
            os.mkdir(d)
        extra = {"data_dirs": dirs, "capacity": "8M"}
    else:
        dirs, extra = [str(store)], {}
    ps = prompts(9, 3, 8 * BS + 5)
    with kv_harness(store, tp_size=2, extra=extra, check=ndirs == 1) as h:
        h.run(ps, max_tokens=2)
        settle(h)
        drop_gpu_cache(h)
        loads_ok(h.run(ps, max_tokens=2))
        settle(h)
        stats = conn_stats(h)
        st = sched(h).store
        slots = [st.lookup(k).slot for p in ps for k in keys_of(h, p)]
    assert len(slots) == 3 * 8
    reg, prom = _prom()
    for s in h.kv_connector_stats:      # what vLLM hands the Prometheus logger, per step
        prom.observe(s, engine_idx=0)
    devs = info.gather(str(store))["devices"]
    assert [d["path"] for d in devs] == dirs
    for d, ddir in enumerate(dirs):
        on_dev = sum(1 for s in slots if s % ndirs == d)
        assert on_dev > 0
        # each rank wrote header + payload of each block once, and read it back once
        want = 2 * on_dev * SLOT
        assert stats[f"device_bytes_written:{ddir}"] == want
        assert stats[f"device_bytes_read:{ddir}"] == want
        labels = {"model_name": "m", "engine": "0", "device": ddir}
        assert reg.get_sample_value("vllm:kvstore_device_bytes_written_total", labels) == want
        assert reg.get_sample_value("vllm:kvstore_device_bytes_read_total", labels) == want
        assert devs[d]["bytes_written"] == want and devs[d]["bytes_read"] == want


def test_soak_bench_compares_admission_on_the_same_workload():
    from kvstore.bench import soak_bench
    out = soak_bench.compare_admission(requests=48, interval=48, out=lambda *a: None)
    off, on = out["runs"]["always"], out["runs"]["second_sight"]
    assert off["admission"] == "always" and on["admission"] == "second_sight"
    assert off["prompt_tokens"] == on["prompt_tokens"] > 0          # the same workload
    assert off["rejected_blocks"] == 0 and on["rejected_blocks"] > 0
    assert 0 < on["bytes_written"] < off["bytes_written"]
    assert off["bytes_written"] >= off["stored_blocks"] * SLOT
    assert out["bytes_written_ratio"] == on["bytes_written"] / off["bytes_written"]
    assert 0 <= on["disk_hit_rate"] <= 1 and 0 < off["disk_hit_rate"] <= 1
    for r in (off, on):
        assert r["verdict"]["no_mismatch"] and r["verdict"]["pins_zero"]
