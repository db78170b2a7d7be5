"""Prometheus metrics and connector stats objects of the kvstore connector."""
import functools

import vllm  # noqa: F401  (needed: a vLLM that does not import fails these tests)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvstore.vllm.connector import KVStoreConnector  # noqa: E402
from kvstore.vllm.metrics import COUNTERS, KVStoreStats  # noqa: E402


def test_prom_metrics_observe_counters_and_gauges():
    reg = CollectorRegistry()
    types = {Gauge: functools.partial(Gauge, registry=reg), Counter: functools.partial(Counter, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    cfg = type("Cfg", (), {"kv_transfer_config": None})()
    prom = KVStoreConnector.build_prom_metrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"hit_blocks": 5, "loaded_bytes": 4096, "used_slots": 17, "free_slots": 3}, engine_idx=1)
    prom.observe({"hit_blocks": 2, "used_slots": 18}, engine_idx=1)
    labels = {"model_name": "m", "engine": "1"}
    assert reg.get_sample_value("vllm:kvstore_hit_blocks_total", labels) == 7
    assert reg.get_sample_value("vllm:kvstore_loaded_bytes_total", labels) == 4096
    assert reg.get_sample_value("vllm:kvstore_used_slots", labels) == 18
    assert reg.get_sample_value("vllm:kvstore_free_slots", labels) == 3
    assert reg.get_sample_value("vllm:kvstore_hit_blocks_total", {"model_name": "m", "engine": "0"}) == 0


def test_stats_aggregate_reduce_reset():
    a = KVStoreConnector.build_kv_connector_stats({"hit_blocks": 3, "used_slots": 10})
    b = KVStoreStats({"hit_blocks": 4, "load_failures": 1, "used_slots": 12})
    a.aggregate(b)
    r = a.reduce()
    assert r["hit_blocks"] == 7 and r["load_failures"] == 1 and r["used_slots"] == 12
    assert set(COUNTERS) <= set(r)
    assert not a.is_empty()
    a.reset()
    assert a.is_empty()
    assert KVStoreConnector.build_kv_connector_stats().is_empty()
