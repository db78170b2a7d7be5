"""Batched copies between vLLM's paged KV cache and kvstore's staging memory.

Owns the mapping from a vLLM block id to the bytes of that block in the worker's KV
backing allocation (derived from `KVCacheTensor` strides, for layer-major and
block-major layouts alike), and the gather (device -> staging, for stores) and scatter
(staging -> device, for loads) of whole batches of blocks with one indexed copy per
KV tensor, never a Python loop per block.

On CPU the copies are synchronous. On CUDA they run on a side stream: a gather first
waits (GPU-side) for the compute stream's work so far, and the returned event tells the
I/O thread when staging holds the bytes; the compute stream is never blocked by the
host, and source blocks stay valid because the connector finishes every gather before
the next step's forward may reuse a block (`fence`).

Staging slot i holds [4096-byte header][payload]; the payload of a block is the pages
of all its layers, in KVCacheTensor/layer order, concatenated.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.transfer")
HEADER_SIZE = 4096


@dataclass(frozen=True)
class _TensorRegion:
    layers: tuple[str, ...]
    base: int            # byte offset of layer 0, block 0 in the backing storage
    layer_stride: int
    block_stride: int
    page: int            # bytes of one layer of one block (contiguous)
    num_blocks: int


def _np_rows(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a strided uint8 CPU tensor."""
    from numpy.lib.stride_tricks import as_strided
    base = t.untyped_storage()
    flat = np.frombuffer(memoryview(_as_buffer(base)), dtype=np.uint8)
    return as_strided(flat[t.storage_offset():], shape=tuple(t.shape), strides=tuple(t.stride()),
                      writeable=True)


def _as_buffer(storage):
    # A writable buffer over the storage's memory (CPU tensors only).
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)).numpy()


def _storage_u8(t: torch.Tensor) -> torch.Tensor:
    """The whole backing storage of `t` as a flat uint8 tensor (no copy)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def kv_regions(kv_caches: dict[str, torch.Tensor], kv_cache_config, group_ids: Sequence[int] = (0,)):
    """Derive per-layer page regions of the transfer groups from KVCacheTensor strides.

    Returns (raw uint8 storage, [ _TensorRegion ], block_bytes). Refuses layouts where one
    layer of one block is not a contiguous run of bytes (e.g. head-outermost layouts).
    """
    groups = kv_cache_config.kv_cache_groups
    layer_names = set()
    page_of = {}
    for g in group_ids:
        spec = groups[g].kv_cache_spec
        for name in groups[g].layer_names:
            layer_names.add(name)
            page_of[name] = spec.page_size_bytes
    raw = None
    regions = []
    for kvt in kv_cache_config.kv_cache_tensors:
        names = [n for n in kvt.layers if n in layer_names]
        if not names:
            continue
        if len(names) != len(kvt.layers):
            raise ConfigError("a KV cache tensor mixes layers of several cache groups; kvstore "
                              "supports one full-attention group")
        first = kv_caches[names[0]]
        storage_raw = _storage_u8(first)
        if raw is None:
            raw = storage_raw
        elif raw.data_ptr() != storage_raw.data_ptr():
            raise ConfigError("KV cache tensors do not share one backing allocation")
        page = page_of[names[0]]
        nb = kv_cache_config.num_blocks_of(kvt)
        base = kvt.offset
        for l, name in enumerate(names):
            v = kv_caches[name]
            start = base + l * kvt.layer_stride
            if v.data_ptr() - raw.data_ptr() != start:
                raise ConfigError(f"layer {name}: view starts at byte {v.data_ptr() - raw.data_ptr()}, "
                                  f"KVCacheTensor strides say {start}")
            # One layer of one block must be one dense run of `page` bytes.
            span = sum((s - 1) * st for s, st in zip(v.shape[1:], v.stride()[1:])) + 1
            if span * v.element_size() != page or v.stride(0) * v.element_size() != kvt.block_stride:
                raise ConfigError(
                    f"KV cache layout of layer {name} stores a block's page non-contiguously "
                    f"(span {span * v.element_size()} bytes, page {page}); kvstore needs a "
                    "layer-major (LBNHC/LBHNC) or block-major (BLNHC/BLHNC) layout: set "
                    "VLLM_KV_CACHE_LAYOUT=LBNHC")
        regions.append(_TensorRegion(tuple(names), base, kvt.layer_stride, kvt.block_stride, page, nb))
    if raw is None:
        raise ConfigError("no KV cache tensor holds the layers of the transfer group")
    block_bytes = sum(len(r.layers) * r.page for r in regions)
    return raw, regions, block_bytes


class KVTransfer:
    """Gather/scatter of whole block batches between the KV cache and staging slots."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], kv_cache_config, staging_tensor: torch.Tensor,
                 slot_size: int, group_ids: Sequence[int] = (0,)):
        self.raw, self.regions, self.block_bytes = kv_regions(kv_caches, kv_cache_config, group_ids)
        self.device = self.raw.device
        self.cuda = self.device.type == "cuda"
        self.slot_size = slot_size
        nslots = staging_tensor.numel() // slot_size
        self.num_stage_slots = nslots
        # [slot, layer-in-payload, page] views of every region over staging payloads.
        self._stage = staging_tensor
        self._views = []
        self._stage_views = []
        col = 0
        for r in self.regions:
            L = len(r.layers)
            self._views.append(self.raw.as_strided((L, r.num_blocks, r.page),
                                                   (r.layer_stride, r.block_stride, 1), r.base))
            self._stage_views.append(_np_rows(staging_tensor.as_strided(
                (nslots, L, r.page), (slot_size, r.page, 1), HEADER_SIZE + col)))
            col += L * r.page
        # Row views: each row is one contiguous run of bytes of one block (all layers of a
        # block-major tensor, or one layer of a layer-major one), paired with the matching
        # rows of the staging payloads. A gather/scatter is then one index_select /
        # index_copy_ over rows per pair: a loop over layers at most, never over blocks.
        self._rows = []
        col = 0
        for r in self.regions:
            L = len(r.layers)
            if L == 1 or r.layer_stride == r.page:
                pairs = [(self.raw.as_strided((r.num_blocks, L * r.page), (r.block_stride, 1), r.base),
                          staging_tensor.as_strided((nslots, L * r.page), (slot_size, 1), HEADER_SIZE + col))]
            else:
                pairs = [(self.raw.as_strided((r.num_blocks, r.page), (r.block_stride, 1), r.base + l * r.layer_stride),
                          staging_tensor.as_strided((nslots, r.page), (slot_size, 1), HEADER_SIZE + col + l * r.page))
                         for l in range(L)]
            if not self.cuda:
                # numpy's fancy indexing copies whole rows with memcpy (~8 GB/s here);
                # torch's CPU index_select/index_copy_ on uint8 rows is ~30x slower.
                pairs = [(_np_rows(d),
                          _np_rows(st)) for d, st in pairs]
            self._rows.extend(pairs)
            col += L * r.page
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._last_event = None

    def _idx(self, ids, device):
        return torch.as_tensor(list(ids), dtype=torch.long, device=device)

    def gather(self, block_ids: Sequence[int], stage_slots: Sequence[int]):
        """Copy blocks into staging payloads; returns a pending copy (CUDA) or None (done)."""
        if not block_ids:
            return None
        if self.cuda:
            return self._gather_cuda(block_ids, stage_slots)
        self._copy_cpu(block_ids, stage_slots, to_staging=True)
        return None

    def scatter(self, stage_slots: Sequence[int], block_ids: Sequence[int]):
        """Copy staging payloads into blocks; returns an event (CUDA) or None (done)."""
        if not block_ids:
            return None
        if self.cuda:
            return self._scatter_cuda(stage_slots, block_ids)
        self._copy_cpu(block_ids, stage_slots, to_staging=False)
        return None

    def _copy_cpu(self, block_ids, stage_slots, *, to_staging: bool) -> None:
        bidx = np.asarray(block_ids, dtype=np.int64)
        sidx = np.asarray(stage_slots, dtype=np.int64)
        for dev_rows, stage_rows in self._rows:
            if to_staging:
                stage_rows[sidx] = dev_rows[bidx]
            else:
                dev_rows[bidx] = stage_rows[sidx]

    # -- CUDA path: side stream, events, pinned bounce buffers ------------------------
    def _gather_cuda(self, block_ids, stage_slots):
        compute = torch.cuda.current_stream(self.device)
        ev = torch.cuda.Event()
        hosts = []
        with torch.cuda.stream(self._stream):
            # GPU-side ordering only: the copy starts after the forward that produced the
            # KV; neither the host nor the compute stream waits for it here.
            self._stream.wait_stream(compute)
            bidx = self._idx(block_ids, self.device)
            for v in self._views:
                packed = v.index_select(1, bidx).permute(1, 0, 2).contiguous()
                host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(packed, non_blocking=True)
                packed.record_stream(self._stream)  # keep the source alive until copied
                hosts.append(host)
            ev.record(self._stream)
        self._last_event = ev
        return _PendingGather(ev, hosts, list(stage_slots), self)

    def _scatter_cuda(self, stage_slots, block_ids):
        ev = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            bidx = self._idx(block_ids, self.device)
            sidx = np.asarray(stage_slots, dtype=np.int64)
            for v, sv in zip(self._views, self._stage_views):
                host = torch.from_numpy(sv[sidx]).pin_memory()
                dev = host.to(self.device, non_blocking=True)
                v.index_copy_(1, bidx, dev.permute(1, 0, 2))
            ev.record(self._stream)
        return ev

    def fence(self):
        """Make the compute stream wait (GPU-side) for the last gather: before a block
        that was just gathered can be overwritten by the next forward."""
        if self.cuda and self._last_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_event)

    @staticmethod
    def wait(pending) -> None:
        """Block the calling (I/O) thread until a gather/scatter is complete in staging."""
        if pending is None:
            return
        if isinstance(pending, _PendingGather):
            pending.complete()
        else:
            pending.synchronize()


class _PendingGather:
    """A CUDA gather in flight: device -> pinned bounce buffers, then -> staging slots."""

    def __init__(self, event, hosts, stage_slots, transfer):
        self.event, self.hosts, self.stage_slots, self.transfer = event, hosts, stage_slots, transfer

    def complete(self) -> None:
        self.event.synchronize()
        sidx = np.asarray(self.stage_slots, dtype=np.int64)
        for host, sv in zip(self.hosts, self.transfer._stage_views):
            sv[sidx] = host.numpy()
        self.hosts = []


def register_host_memory(staging_tensor: torch.Tensor) -> bool:
    """cudaHostRegister the staging mmap so it is a DMA target and an io_uring buffer."""
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(staging_tensor.data_ptr(), staging_tensor.numel(), 0)
    ok = int(err) == 0 if not isinstance(err, tuple) else int(err[0]) == 0
    if not ok:
        log.warning("cudaHostRegister of %d bytes of staging failed (%s); copies will bounce",
                    staging_tensor.numel(), err)
    return ok
