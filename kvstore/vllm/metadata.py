"""Per-step messages between the scheduler side and the workers: plain data only.

They cross process boundaries (pickled/msgspec'd by vLLM), so they hold ints, bytes and
lists, never objects with behaviour.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata, KVConnectorWorkerMetadata,
)


@dataclass
class LoadJob:
    job_id: int
    req_id: str
    block_ids: list[int]       # GPU blocks to fill, in prefix order
    keys: list[bytes]
    slots: list[int]
    generations: list[int]


@dataclass
class StoreJob:
    job_id: int
    block_ids: list[int]       # GPU blocks to copy out (this step's forward wrote them)
    keys: list[bytes]
    slots: list[int]
    generations: list[int]


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)


@dataclass
class KVStoreWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers finished since the last step, summed over ranks.

    store_reports: job_id -> [ranks that reported, sorted failed block indices (any rank)]
    bad_keys: keys whose slot failed verification or I/O on a load (to drop).
    """
    store_reports: dict[int, list] = field(default_factory=dict)
    bad_keys: list[bytes] = field(default_factory=list)

    def aggregate(self, other: "KVStoreWorkerMeta") -> "KVStoreWorkerMeta":
        out = KVStoreWorkerMeta({k: [v[0], list(v[1])] for k, v in self.store_reports.items()},
                                list(self.bad_keys))
        for job, (n, failed) in other.store_reports.items():
            cur = out.store_reports.setdefault(job, [0, []])
            cur[0] += n
            cur[1] = sorted(set(cur[1]) | set(failed))
        out.bad_keys.extend(k for k in other.bad_keys if k not in set(out.bad_keys))
        return out
