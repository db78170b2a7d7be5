"""vLLM's tiered offloading (`OffloadingConnector` + `TieringOffloadingSpec`) on vLLM's CPU build.

`CPUTieringOffloadingSpec` is vLLM's `TieringOffloadingSpec` with one difference: the worker
that moves KV cache blocks between the engine's KV cache and the primary tier's shared
region. vLLM's own worker (`vllm.v1.kv_offload.cpu.gpu_worker.CPUOffloadingWorker`) copies
with DMA from pinned host memory on CUDA/XPU streams, and the spec refuses other platforms
("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"). On the CPU build
the "GPU" KV cache is itself a CPU tensor, so `CPUCopyOffloadingWorker` does what the CUDA
handler does, done by memcpy: the same block-id to chunk-slot addressing (a chunk holds
`blocks_per_chunk` engine blocks; a group's first block may start inside a chunk, by its
`block_indices` offset; each KV cache group copies every one of its layer refs'
`page_size_bytes`), with one vectorized torch gather/scatter per (group, tensor) and
transfer. Everything else (the scheduler-side manager, the primary tier, its secondary
tiers such as `kvstore.vllm.tier.KVStoreTier`) is vLLM's unchanged.

It exists to run the OffloadingConnector path, secondary tiers included, inside a real
`vllm serve` on a machine without a GPU:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {
        "spec_name": "CPUTieringOffloadingSpec",
        "spec_module_path": "kvstore.vllm.cpu_offload",
        "cpu_bytes_to_use": 268435456,
        "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.vllm.tier",
                             "path": "/mnt/nvme/kvstore-tier", "capacity": "500G"}]}}'

On a GPU build use vLLM's own `"spec_name": "TieringOffloadingSpec"`; this spec refuses a KV
cache that is not in CPU memory. vLLM's `canonical_layout` option is not supported here
(refused at start).

Copies run synchronously in `submit_store` / `submit_load` (the CPU build's forward is
synchronous too: a store is submitted a step after the forward that wrote its blocks, a load
before the forward that reads them), and their results are reported by the next
`get_finished`, each with its byte count and time. A copy that fails is reported as failed
(`success=False`) with the error logged, never as done.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.cpu_offload")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_slots(chunk_ids: np.ndarray, blocks_per_chunk: int, count: int,
                skip: int) -> tuple[np.ndarray, np.ndarray]:
    """(chunk id, block slot within the chunk) of `count` consecutive engine blocks that
    start `skip` slots into the first of `chunk_ids`: the enumeration of vLLM's
    `compute_sub_block_ptrs` (pointer of slot j of chunk c = base + c * row_stride +
    j * block_page_size)."""
    flat = (chunk_ids[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
    flat = flat[skip:skip + count]
    if len(flat) != count:
        raise ValueError(f"{len(chunk_ids)} chunk(s) of {blocks_per_chunk} blocks from slot "
                         f"{skip} cannot hold {count} blocks")
    return flat // blocks_per_chunk, flat % blocks_per_chunk


class CPUCopyOffloadingWorker(OffloadingWorker):
    """Moves KV cache blocks (CPU tensors) to and from the primary tier's chunks by memcpy.

    `kv_tensors[t]` is engine tensor t as int8 rows of one block (`page_size_bytes`);
    `chunk_tensors[t]` is the shared region's view for tensor t, one row per chunk of
    `blocks_per_chunk * page_size_bytes` (vLLM's `create_next_worker_view`)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 mmap_region: SharedOffloadRegion):
        self._mmap_region: SharedOffloadRegion | None = mmap_region
        self.blocks_per_chunk = blocks_per_chunk
        self.layer_refs_per_group: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self.kv_tensors: list[torch.Tensor] = []
        self.chunk_slots: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            if t.tensor.device.type != "cpu":
                raise ConfigError(
                    f"CPUTieringOffloadingSpec copies a KV cache in CPU memory (vLLM's CPU "
                    f"build); this one is on {t.tensor.device}. On a GPU build use vLLM's "
                    f"\"spec_name\": \"TieringOffloadingSpec\"")
            page = t.page_size_bytes
            kv = t.tensor.view(torch.int8).view((-1, page))
            chunks = mmap_region.create_next_worker_view(page * blocks_per_chunk)
            assert chunks.stride(1) == 1
            # (chunk, block slot, byte) over the same bytes as the chunk rows
            slots = chunks.as_strided((chunks.shape[0], blocks_per_chunk, page),
                                      (chunks.stride(0), page, 1))
            self.kv_tensors.append(kv)
            self.chunk_slots.append(slots)
        self._finished: list[TransferResult] = []

    def _copy(self, to_chunks: bool, kv_spec: GPULoadStoreSpec,
              chunk_spec: BlockIDsLoadStoreSpec) -> int:
        """One transfer, both directions: the mapping of vLLM's
        `SingleDirectionOffloadingHandler.transfer_async` (direct layout). Returns bytes."""
        kv_blocks = np.asarray(kv_spec.block_ids, dtype=np.int64)
        chunk_ids = np.asarray(chunk_spec.block_ids, dtype=np.int64)
        group_sizes: Sequence[int] = kv_spec.group_sizes
        block_indices: Sequence[int] = kv_spec.block_indices
        if len(group_sizes) != len(self.layer_refs_per_group):
            raise ValueError(f"{len(group_sizes)} block groups for "
                             f"{len(self.layer_refs_per_group)} KV cache groups")
        kv_off = chunk_off = 0
        nbytes = 0
        for g, (size, first) in enumerate(zip(group_sizes, block_indices)):
            if size == 0:
                continue
            skip = first % self.blocks_per_chunk
            n_chunks = cdiv(size + skip, self.blocks_per_chunk)
            blocks = torch.from_numpy(kv_blocks[kv_off:kv_off + size])
            cids, slots = chunk_slots(chunk_ids[chunk_off:chunk_off + n_chunks],
                                      self.blocks_per_chunk, size, skip)
            cids, slots = torch.from_numpy(cids), torch.from_numpy(slots)
            for ref in self.layer_refs_per_group[g]:
                kv = self.kv_tensors[ref.tensor_idx]
                dst_slots = self.chunk_slots[ref.tensor_idx]
                n = ref.page_size_bytes
                if to_chunks:
                    dst_slots[cids, slots, :n] = kv[blocks, :n]
                else:
                    kv[blocks, :n] = dst_slots[cids, slots, :n]
                nbytes += size * n
            kv_off += size
            chunk_off += n_chunks
        if kv_off != len(kv_blocks) or chunk_off != len(chunk_ids):
            raise ValueError(f"the spec names {len(kv_blocks)} blocks and {len(chunk_ids)} "
                             f"chunks; its groups use {kv_off} and {chunk_off}")
        return nbytes

    def _run(self, job_id: int, to_chunks: bool, kv_spec, chunk_spec) -> bool:
        t0 = time.perf_counter()
        try:
            nbytes = self._copy(to_chunks, kv_spec, chunk_spec)
        except Exception:  # noqa: BLE001 - the job is reported failed, with the cause logged
            log.exception("KV %s job %d failed", "store" if to_chunks else "load", job_id)
            self._finished.append(TransferResult(job_id=job_id, success=False))
            return True
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                             transfer_time=time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        """Engine blocks -> primary chunks."""
        return self._run(job_id, True, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        """Primary chunks -> engine blocks."""
        return self._run(job_id, False, dst_spec, src_spec)

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Every submitted copy is done when its submit returns."""

    def shutdown(self) -> None:
        self.kv_tensors.clear()
        self.chunk_slots.clear()
        region, self._mmap_region = self._mmap_region, None
        if region is not None:
            region.cleanup()


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's `TieringOffloadingSpec` whose worker copies by memcpy (vLLM's CPU build)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUCopyOffloadingWorker:
        if self.config.canonical_layout:
            raise ConfigError("CPUTieringOffloadingSpec copies the direct KV layout only: "
                              "remove canonical_layout from kv_connector_extra_config")
        # The region exactly as TieringOffloadingSpec.create_worker opens it.
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return CPUCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
