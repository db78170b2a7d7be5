"""Per-step messages between the scheduler side and the workers: plain data only.

They cross process boundaries (pickled/msgspec'd by vLLM), so they hold ints, bytes,
lists and arrays, never objects with behaviour.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata, KVConnectorWorkerMetadata,
)

from kvstore._keytable import keys_with_packed, make_keys


@dataclass
class LoadJob:
    """One request's load. Its blocks' store keys are not carried: they are vLLM's block
    hashes + group id (`load_keys`), made where they are needed (the worker's I/O thread,
    the index thread's LRU touch), so the scheduler makes no Python object per block."""
    job_id: int
    req_id: str
    block_ids: list[int]       # GPU blocks to fill, in prefix order (groups one after another)
    hashes: list[bytes]        # vLLM block hash of each block, in the same order
    groups: list[tuple[int, int]]   # (KV cache group id, blocks) runs covering `hashes`
    slots: Sequence[int]       # a list, or array('I') as the packed lookup returns it
    generations: Sequence[int]  # a list, or array('Q')
    unavailable: bool = False  # nothing to read: the load fails at once (vLLM recomputes)


def load_keys(job: LoadJob) -> list[bytes]:
    """The store key of each block of `job` (hash + 4-byte group id, as `block_key`)."""
    return make_keys(job.hashes, job.groups)


class HashedBlocks(NamedTuple):
    """Blocks named by vLLM's block hashes and (KV cache group id, blocks) runs covering
    them, whose keys (hash + 4-byte group id) are made off the step thread (`make_keys`).
    A tuple: `ServingIndex.take`, `ServingIndex.commit_blocks` and `keys_with_packed` take
    it as their `packed` (hashes, runs) pair."""
    hashes: list
    runs: list[tuple[int, int]]


@dataclass
class StoreJob:
    """One step's store. Its blocks are `keys` (keys made when planned: lazy stores and
    Mamba states), then `hashes` (vLLM block hashes of the eager stores, keyed by the
    (group id, blocks) runs of `groups`: their keys are made off the step thread, by the
    worker's I/O thread and the index thread); `block_ids`, `slots` and `generations`
    follow that order (`store_keys`)."""
    job_id: int
    block_ids: list[int]       # GPU blocks to copy out (this step's forward wrote them)
    keys: list[bytes]
    slots: Sequence[int]            # arrays "I" / "Q" from the slot pool, or lists
    generations: Sequence[int]
    hashes: list[bytes] = field(default_factory=list)
    groups: list[tuple[int, int]] = field(default_factory=list)

    @property
    def hashed(self) -> HashedBlocks | None:
        """The blocks after `keys` (`hashes`, `groups`), or None when there are none."""
        return HashedBlocks(self.hashes, self.groups) if self.hashes else None


def store_keys(job: StoreJob) -> list[bytes]:
    """The store key of every block of `job`, in order."""
    return keys_with_packed(job.keys, job.hashed)


@dataclass
class StoreReport:
    """What the ranks reported about one store job: how many ranks finished it, and the
    block indices (into the job) that failed on any of them."""
    ranks: int
    failed: list[int] = field(default_factory=list)


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)


@dataclass
class KVStoreWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers finished since the last step, summed over ranks.

    store_reports: job_id -> StoreReport (ranks that reported, sorted failed block indices)
    bad_keys: keys whose slot failed verification or I/O on a load (to drop).
    failed_devices: device index -> "reason: detail" of devices a rank found failed (a
        store over several data directories; the scheduler fences them). Reported once
        per rank; the first reason of any rank is kept.
    """
    store_reports: dict[int, StoreReport] = field(default_factory=dict)
    bad_keys: list[bytes] = field(default_factory=list)
    failed_devices: dict[int, str] = field(default_factory=dict)

    def aggregate(self, other: "KVStoreWorkerMeta") -> "KVStoreWorkerMeta":
        out = KVStoreWorkerMeta({k: StoreReport(v.ranks, list(v.failed))
                                 for k, v in self.store_reports.items()}, list(self.bad_keys),
                                dict(self.failed_devices))
        for d, why in other.failed_devices.items():
            out.failed_devices.setdefault(d, why)
        for job, rep in other.store_reports.items():
            cur = out.store_reports.setdefault(job, StoreReport(0, []))
            cur.ranks += rep.ranks
            cur.failed = sorted(set(cur.failed) | set(rep.failed))
        out.bad_keys.extend(k for k in other.bad_keys if k not in set(out.bad_keys))
        return out
