"""Batched copies between vLLM's paged KV cache and kvstore's staging memory.

Owns the mapping from a vLLM block id to the byte runs of that block in the worker's KV
backing allocation, derived from `KVCacheTensor` strides for layer-major and block-major
layouts alike and checked against the views vLLM built (`kv_rows`), and the copy engine
that moves whole batches of blocks along those runs (`kvstore._copy.CopyEngine`: segment
lists built in C, run as a GIL-free memcpy loop on CPU or as `cuMemcpyBatchAsync` DMA on
CUDA, straight into and out of the pinned staging payloads io_uring uses). Never a
Python loop per block, never a host copy of KV bytes, never a torch indexing op.

Which thread does what (CUDA): the step thread calls `gather` (enqueue a store after the
forward on the current stream; the stream's later work waits for it) and `mark`; neither
waits for the GPU. The I/O thread calls `bind_thread` once, then `scatter` and `wait` (it
sleeps on a blocking-sync event; no core spins). On CPU every copy is done when the call
returns. A copy that cannot be issued or ordered raises `CopyError` (its `ticket` says
when the memory it touched may be reused).

Staging slot i holds [HEADER_SIZE header][payload]; the payload of a block is the pages
of all its layers, in KVCacheTensor/layer order, concatenated.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from kvstore._copy import CopyEngine, CopyError  # noqa: F401  (CopyError: part of this API)
from kvstore.errors import ConfigError
from kvstore.format.layout import HEADER_SIZE
from kvstore.io.staging import Staging

log = logging.getLogger("kvstore.vllm.transfer")

@dataclass(frozen=True)
class KVRegion:
    """The layers of one KVCacheTensor: layer l of block b is the `page` bytes at
    base + l * layer_stride + b * block_stride of the backing allocation."""

    layers: tuple[str, ...]
    base: int
    layer_stride: int
    block_stride: int
    page: int
    num_blocks: int

    def rows(self, stage_col: int) -> list[tuple[int, int, int, int, int]]:
        """Copy-engine rows (kv_off, block_stride, stage_off, length, num_blocks): one
        per layer, or one for the whole block when its layers are adjacent
        (block-major layouts: one segment per block)."""
        L = len(self.layers)
        if L == 1 or self.layer_stride == self.page:
            return [(self.base, self.block_stride, HEADER_SIZE + stage_col, L * self.page, self.num_blocks)]
        return [(self.base + l * self.layer_stride, self.block_stride, HEADER_SIZE + stage_col + l * self.page,
                 self.page, self.num_blocks) for l in range(L)]


def _page_bytes(spec) -> int:
    # The real (unpadded) bytes of one layer of one block: vLLM pads some specs'
    # page_size_bytes (page_size_padded) for hybrid models.
    real = getattr(spec, "real_page_size_bytes", None)
    return int(real if real is not None else spec.page_size_bytes)


def check_copyable(kv_cache_config, group_ids: Sequence[int] = (0,)) -> None:
    """Refuse, before any KV tensor exists, KV cache configurations kvstore cannot copy
    (head-outermost layouts, padded pages, tensors shared by several groups), with what
    to change. `kv_regions` checks the tensors themselves once they exist."""
    groups = kv_cache_config.kv_cache_groups
    names = {n for g in group_ids for n in groups[g].layer_names}
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or ""
    for g in group_ids:
        spec = groups[g].kv_cache_spec
        # vLLM's layouts name the physical order of [L, B, H, N, C]: unless L and B are
        # the two outermost dims (LB..., BL...), a block's page of one layer is split
        # per head across the allocation (a single head, e.g. MLA, is still one run).
        if (layout and layout[:2] not in ("LB", "BL") and layout not in ("NHD", "HND")
                and int(getattr(spec, "num_kv_heads", 1)) > 1):
            raise ConfigError(
                f"kvstore cannot copy the {layout} KV cache layout: heads are outside the "
                "blocks, so a block's page is not one run of bytes. Use a layer-major "
                "(LBNHC/LBHNC) or block-major (BLNHC/BLHNC) layout: set "
                "VLLM_KV_CACHE_LAYOUT=LBNHC.")
        padded = getattr(spec, "page_size_padded", None)
        if padded is not None and int(padded) != _page_bytes(spec) and not _is_mamba(spec):
            # (A Mamba state is the head of its padded page: kv_regions copies its real
            # bytes and checks that the view steps by the padded block stride.)
            raise ConfigError(
                f"kvstore cannot store this model's KV cache: its pages are padded from "
                f"{_page_bytes(spec)} to {padded} bytes (a hybrid-model layout). Remove the "
                "kvstore connector for this model.")
    for kvt in kv_cache_config.kv_cache_tensors:
        inside = [n for n in kvt.layers if n in names]
        if inside and len(inside) != len(kvt.layers):
            raise ConfigError("a KV cache tensor mixes layers of several cache groups; kvstore "
                              "supports one full-attention group")


def _is_mamba(spec) -> bool:
    try:
        from vllm.v1.kv_cache_interface import MambaSpec
    except ImportError:     # pragma: no cover - kvstore without vLLM
        return False
    return isinstance(spec, MambaSpec)


def _block_span(t) -> int:
    """Bytes one block of a [num_blocks, ...] view spans (from its first to its last
    byte), in its own dtype's elements."""
    return (sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:])) + 1) * t.element_size()


def check_groups_alias(kv_caches: dict, kv_cache_config, carrier: int = 0) -> None:
    """With several KV cache groups (vLLM's hybrid KV cache manager), kvstore copies every
    group's blocks through the `carrier` group's layer views (its first full-attention
    group). That is right when, as vLLM 0.33 lays a hybrid model out
    (`get_kv_cache_config_from_groups`), the groups overlay one allocation:
    - an attention group's i-th layer is the same memory (address, shape, strides,
      dtype) as the carrier's i-th layer, so block b is its page wherever it owns b;
    - a Mamba group's i-th layer (a `[num_blocks, 1, 1, state_bytes]` int8 view) starts
      at the carrier's i-th layer, has as many blocks, steps by the same block stride,
      and one block's state lies inside the carrier's page (vLLM pads the Mamba page to
      the attention page), so copying the carrier's page of block b copies the state
      (and the padding after it) wherever the Mamba group owns b.
    Anything else is refused, naming the first layer that differs."""
    groups = kv_cache_config.kv_cache_groups

    def tensor(name):
        t = kv_caches[name]
        if isinstance(t, (list, tuple)):
            raise ConfigError(f"kvstore: layer {name} has several KV tensors; a hybrid "
                              "model's layers must each have one")
        return t

    def view(t):
        return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))

    carrier_names = list(groups[carrier].layer_names)
    base = [tensor(n) for n in carrier_names]
    for g, grp in enumerate(groups):
        if g == carrier:
            continue
        names = list(grp.layer_names)
        if len(names) != len(base):
            raise ConfigError(
                f"kvstore: KV cache group {g} has {len(names)} layers and group {carrier} has "
                f"{len(base)}; kvstore stores hybrid models whose groups have as many layers "
                "each (vLLM pads them so). Remove the kvstore connector for this model.")
        mamba = _is_mamba(grp.kv_cache_spec)
        for i, n in enumerate(names):
            t, b = tensor(n), base[i]
            if mamba:
                ok = (t.data_ptr() == b.data_ptr() and t.shape[0] == b.shape[0]
                      and t.stride(0) * t.element_size() == b.stride(0) * b.element_size()
                      and _block_span(t) <= _block_span(b))
            else:
                ok = view(t) == view(b)
            if not ok:
                raise ConfigError(
                    f"kvstore: layer {n} (KV cache group {g}) does not overlay layer "
                    f"{carrier_names[i]} of group {carrier}; kvstore copies a hybrid model's "
                    "blocks through one set of layer views. Remove the kvstore connector "
                    "for this model.")


def kv_regions(kv_caches: dict, kv_cache_config, group_ids: Sequence[int] = (0,)):
    """The KV regions of the transfer groups, checked against vLLM's views.

    Returns (storage base address, storage bytes, torch device, [KVRegion], block_bytes).
    Refuses (ConfigError, with the layout to use instead) any layout where one layer of
    one block is not a contiguous run of `page` bytes, e.g. head-outermost layouts.
    """
    check_copyable(kv_cache_config, group_ids)
    groups = kv_cache_config.kv_cache_groups
    page_of = {}
    for g in group_ids:
        for name in groups[g].layer_names:
            page_of[name] = _page_bytes(groups[g].kv_cache_spec)
    storage = None
    regions = []
    for kvt in kv_cache_config.kv_cache_tensors:
        names = [n for n in kvt.layers if n in page_of]
        if not names:
            continue
        first = kv_caches[names[0]]
        st = first.untyped_storage()
        if storage is None:
            storage = (st.data_ptr(), st.nbytes(), first.device)
        elif storage[0] != st.data_ptr():
            raise ConfigError("KV cache tensors do not share one backing allocation")
        page = page_of[names[0]]
        nb = kv_cache_config.num_blocks_of(kvt) if hasattr(kv_cache_config, "num_blocks_of") \
            else kv_cache_config.num_blocks
        for l, name in enumerate(names):
            v = kv_caches[name]
            start = kvt.offset + l * kvt.layer_stride
            at = v.data_ptr() - storage[0]
            if at != start:
                raise ConfigError(f"layer {name}: view starts at byte {at}, KVCacheTensor strides say "
                                  f"{start}")
            # One layer of one block must be one dense run of `page` bytes: the view's
            # block dim (vLLM puts it first) steps by the tensor's block stride and the
            # other dims span exactly `page` bytes.
            span = (sum((n - 1) * st_ for n, st_ in zip(v.shape[1:], v.stride()[1:])) + 1) * v.element_size()
            if span != page or v.stride(0) * v.element_size() != kvt.block_stride:
                raise ConfigError(
                    f"KV cache layer {name} stores a block's page non-contiguously (one layer of "
                    f"one block spans {span} bytes for a {page}-byte page; view shape "
                    f"{tuple(v.shape)}, strides {tuple(v.stride())}, block stride "
                    f"{kvt.block_stride}): kvstore copies layer-major (LBNHC/LBHNC) or "
                    "block-major (BLNHC/BLHNC) layouts; set VLLM_KV_CACHE_LAYOUT=LBNHC or use an "
                    "attention backend with such a layout")
        regions.append(KVRegion(tuple(names), kvt.offset, kvt.layer_stride, kvt.block_stride, page, nb))
    if storage is None:
        raise ConfigError("no KV cache tensor holds the layers of the transfer group")
    block_bytes = sum(len(r.layers) * r.page for r in regions)
    return storage[0], storage[1], storage[2], regions, block_bytes


class KVTransfer:
    """Gather/scatter of whole block batches between the KV cache and staging slots
    (see the module docstring for the threading contract)."""

    def __init__(self, kv_caches: dict, kv_cache_config, staging: Staging,
                 group_ids: Sequence[int] = (0,), *, use_batch: bool = True):
        base, nbytes, device, self.regions, self.block_bytes = kv_regions(kv_caches, kv_cache_config, group_ids)
        if self.block_bytes > staging.payload_len:
            raise ConfigError(f"KV cache blocks are {self.block_bytes} bytes; staging payloads hold "
                              f"{staging.payload_len}")
        self.device = device
        self.cuda = device.type == "cuda"
        self.staging = staging
        rows, col = [], 0
        for r in self.regions:
            rows += r.rows(col)
            col += len(r.layers) * r.page
        self.rows, self.kv_base, self.kv_nbytes = rows, base, nbytes
        ordinal = -1
        if self.cuda:
            ordinal = device.index if device.index is not None else 0
            if not staging.pin(ordinal):
                raise ConfigError(
                    f"cannot pin {staging.nbytes} bytes of kvstore staging for DMA (see the warning "
                    "above); lower `staging` in kv_connector_extra_config or raise the locked-memory "
                    "limit (ulimit -l)")
        self.engine = CopyEngine(rows, base, nbytes, staging.address, staging.nbytes, staging.slot_size,
                                 device=ordinal, use_batch=use_batch)

    def _stream(self) -> int:
        """The raw CUstream of the current (compute) stream of this thread."""
        import torch
        return torch.cuda.current_stream(self.device).cuda_stream

    def gather(self, block_ids: Sequence[int], stage_slots: Sequence[int]) -> int:
        """Copy blocks into staging payloads (a store): a ticket for `wait` (0: done).

        CUDA: ordered after the work already enqueued on the current stream (the forward
        that wrote the blocks), and that stream's later work (vLLM zeroing or copying into
        reallocated blocks, the next forward) is ordered after the copy; the call only
        enqueues. Raises CopyError (see `ticket`) if the copy or that order cannot be
        set up."""
        if not len(block_ids):
            return 0
        return self.engine.store(block_ids, stage_slots, self._stream() if self.cuda else 0)

    def mark(self) -> int:
        """A ticket for the work enqueued so far on the current stream (step thread): a
        `scatter(..., after=ticket)` does not start before it (0 on CPU). Raises
        CopyError when it cannot be made: a load must then not run."""
        return self.engine.mark(self._stream()) if self.cuda else 0

    def scatter(self, stage_slots: Sequence[int], block_ids: Sequence[int], after: int = 0) -> int:
        """Copy staging payloads into blocks (a load): a ticket for `wait` (0: done)."""
        return self.engine.load(stage_slots, block_ids, after)

    def wait(self, ticket: int) -> None:
        """Block the calling (I/O) thread until the copy of `ticket` is done."""
        self.engine.wait(ticket)

    def release(self, ticket: int) -> None:
        """Recycle a `mark` ticket that no scatter used."""
        self.engine.release(ticket)

    def bind_thread(self) -> None:
        """Make this rank's device current on the calling thread (the I/O thread)."""
        if self.cuda:
            import torch
            torch.cuda.set_device(self.device)
            self.engine.bind_thread()

    def close(self) -> None:
        """Drain and free the copy engine (idempotent; staging belongs to its owner)."""
        self.engine.close()
