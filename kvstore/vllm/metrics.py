"""Connector statistics (`KVConnectorStats`) and Prometheus metrics for kvstore."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics, KVConnectorStats,
)

COUNTERS = {
    "hit_blocks": "Blocks found in the disk store at lookup (longest prefix)",
    "miss_lookups": "Lookups that found no block on disk",
    "hit_tokens": "Prompt tokens served from disk instead of recomputed",
    "loaded_blocks": "Blocks read from disk, verified and copied into the KV cache",
    "loaded_bytes": "Payload bytes loaded from disk",
    "stored_blocks": "Blocks written to disk and committed to the index",
    "stored_bytes": "Payload bytes written to disk",
    "store_dropped_blocks": "Blocks not stored (store full, staging full or write error)",
    "evicted_blocks": "Blocks evicted from the disk store (LRU)",
    "load_failures": "Blocks whose load failed (I/O error, checksum mismatch, timeout): recomputed",
    "admission_rejected_blocks": "Blocks not stored at their first sighting (admission second_sight)",
    "pool_lookups": "Local misses asked of the fleet's KV pool (remote)",
    "pool_filled_blocks": "Blocks the KV pool filled into the local store for a lookup",
    "pool_timeouts": "Pool lookups that did not answer within remote.fetch_timeout_s",
    "pool_published_blocks": "Blocks handed to the fleet agent to publish to the KV pool",
}
GAUGES = {
    "used_slots": "Slots holding a committed block",
    "free_slots": "Free slots",
    "failed_devices": "Data directories (devices) fenced as failed; their blocks are not served",
}
# Per failed device: a gauge key DEVICE_FAILED + data directory = 1, exported as
# vllm:kvstore_device_failed{device="<data directory>"} (several data directories only).
DEVICE_FAILED = "device_failed:"
# Wear accounting, per device (data directory; the store directory for a single-directory
# store): counter keys DEVICE_WRITTEN / DEVICE_READ + data directory, bytes the workers
# wrote / read there since the last report (every rank's, summed by the aggregation),
# exported as vllm:kvstore_device_bytes_written_total{device="<data directory>"} and
# vllm:kvstore_device_bytes_read_total{device=...}.
DEVICE_WRITTEN = "device_bytes_written:"
DEVICE_READ = "device_bytes_read:"
# Failed I/O ops per device (several data directories), exported as
# vllm:kvstore_device_io_errors_total{device=...}: the EIOs below `device_eio_limit` that
# cost only their blocks show here before a device is fenced.
DEVICE_ERRORS = "device_io_errors:"
_DEVICE_COUNTERS = (DEVICE_WRITTEN, DEVICE_READ, DEVICE_ERRORS)


def _is_gauge(k: str) -> bool:
    return k in GAUGES or k.startswith(DEVICE_FAILED)


@dataclass
class KVStoreStats(KVConnectorStats):
    """Counters since the last reset; gauges are last-known values."""

    def __post_init__(self):
        for k in COUNTERS:
            self.data.setdefault(k, 0)

    def reset(self):
        self.data = {k: 0 for k in COUNTERS}

    def add(self, **kw):
        for k, v in kw.items():
            self.data[k] = self.data.get(k, 0) + v

    def aggregate(self, other: KVConnectorStats) -> "KVStoreStats":
        for k, v in other.data.items():
            if _is_gauge(k):
                self.data[k] = v
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {k: self.data.get(k, 0) for k in COUNTERS}
        for k in GAUGES:
            if k in self.data:
                out[k] = self.data[k]
        for k, v in self.data.items():
            if k.startswith(DEVICE_FAILED):
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items()
                       if k in COUNTERS or k.startswith(_DEVICE_COUNTERS))


class KVStorePromMetrics(KVConnectorPromMetrics):
    """`vllm:kvstore_*` counters and gauges, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        self.gauges = {}
        for k, doc in COUNTERS.items():
            m = self._counter_cls(name=f"vllm:kvstore_{k}", documentation=doc, labelnames=labelnames)
            self.counters[k] = {e: m.labels(*v) for e, v in per_engine_labelvalues.items()}
        for k, doc in GAUGES.items():
            m = self._gauge_cls(name=f"vllm:kvstore_{k}", documentation=doc, labelnames=labelnames)
            self.gauges[k] = {e: m.labels(*v) for e, v in per_engine_labelvalues.items()}
        self._engine_labels = per_engine_labelvalues
        self._device_failed = self._gauge_cls(
            name="vllm:kvstore_device_failed",
            documentation="1 for a data directory (device) fenced as failed",
            labelnames=list(labelnames) + ["device"])
        self._device_bytes = {
            DEVICE_WRITTEN: self._counter_cls(
                name="vllm:kvstore_device_bytes_written",
                documentation="Bytes kvstore wrote to a data directory (device), all ranks: "
                              "wear accounting", labelnames=list(labelnames) + ["device"]),
            DEVICE_READ: self._counter_cls(
                name="vllm:kvstore_device_bytes_read",
                documentation="Bytes kvstore read from a data directory (device), all ranks",
                labelnames=list(labelnames) + ["device"]),
            DEVICE_ERRORS: self._counter_cls(
                name="vllm:kvstore_device_io_errors",
                documentation="I/O ops that failed on a data directory (device), all ranks "
                              "(EIO fences the device at device_eio_limit within its window)",
                labelnames=list(labelnames) + ["device"]),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)
            elif k in self.gauges:
                self.gauges[k][engine_idx].set(v)
            elif k.startswith(DEVICE_FAILED):
                self._device_failed.labels(*self._engine_labels[engine_idx],
                                           k[len(DEVICE_FAILED):]).set(v)
            elif k.startswith(_DEVICE_COUNTERS) and v:
                p = next(p for p in _DEVICE_COUNTERS if k.startswith(p))
                self._device_bytes[p].labels(*self._engine_labels[engine_idx],
                                             k[len(p):]).inc(v)
