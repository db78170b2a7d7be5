"""How the CPU harness builds its engine, as vLLM's engine core does: the model's shape
from its ``config.json``, the ``VllmConfig`` (model, scheduler, cache, KV transfer and
KV events configs, with what the engine core resolves before it builds the workers),
the KV cache groups planned by vLLM's own planner (one full-attention group, or a
hybrid of full attention, sliding window and Mamba groups: `KVGroups`), the scheduler
(``Scheduler`` or ``AsyncScheduler``) and the request block hasher.

`EngineOptions` is what `kvstore.drivers.simulator.EngineHarness` was asked for;
`build_setup` turns it into an `EngineSetup`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kvstore.drivers.sim_content import HarnessError

__all__ = ["EngineOptions", "ModelShape", "KVGroups", "EngineSetup", "build_setup",
           "build_scheduler", "make_block_hasher", "read_model_shape"]


@dataclass(slots=True)
class EngineOptions:
    """The engine settings of an `EngineHarness` (its arguments of the same names)."""
    dtype: str = "float16"
    block_size: int = 16
    num_gpu_blocks: int = 64
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_transfer_config: dict | None = None
    kv_events: bool | dict = False
    tp_size: int = 1
    layout: str = "LBNHC"
    async_scheduling: bool = False
    hash_algo: str = "sha256"
    sliding_window: int | None = None
    mamba: bool | int = False
    mamba_cache_mode: str = "align"
    retention_interval: int | None = 0


@dataclass(slots=True)
class ModelShape:
    """What the harness reads of a model's ``config.json``."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


@dataclass(slots=True)
class KVGroups:
    """The KV cache groups of a planned ``KVCacheConfig`` and their layers."""
    layer_names: list[str]
    specs: list[Any]                 # KV cache spec of each group
    layer_groups: list[int]          # group of each layer (index into layer_names)
    group_layers: list[list[int]]    # layer indices of each group
    retained: list[int | None]       # tokens before num_computed a group holds (None: all)
    is_mamba: list[bool]             # one state block per request position
    mamba_state_bytes: int           # bytes of one Mamba state (one layer, one rank)

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @property
    def hybrid(self) -> bool:
        return len(self.specs) > 1


@dataclass(slots=True)
class EngineSetup:
    """The configuration `build_setup` made: the model, the groups, the vLLM config."""
    shape: ModelShape
    sliding_window: int | None
    mamba: bool
    group_kinds: list[str]       # "full", then "swa" and/or "mamba" (once per group)
    dtype: Any                   # the model config's torch dtype
    vllm_config: Any
    kv_cache_config: Any
    groups: KVGroups
    page_bytes: int              # one block of one layer on one rank
    token_bytes: int             # one token of one layer on one rank


def read_model_shape(model_dir: str) -> ModelShape:
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    return ModelShape(
        num_layers=int(hf["num_hidden_layers"]),
        num_kv_heads=int(hf.get("num_key_value_heads", hf["num_attention_heads"])),
        head_dim=int(hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])),
        vocab_size=int(hf.get("vocab_size", 32000)),
    )


def _group_kinds(opts: EngineOptions, num_layers: int) -> list[str]:
    """Check and normalise ``sliding_window`` and ``mamba`` (in ``opts``); the kind of
    each KV cache group."""
    sliding_window = opts.sliding_window
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or int(sliding_window) != sliding_window \
                or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
        opts.sliding_window = int(sliding_window)
    mamba = opts.mamba
    if isinstance(mamba, bool):
        mamba = int(mamba)
    if not isinstance(mamba, int) or mamba < 0:
        raise ValueError(f"mamba must be a bool or a number of Mamba groups, got {mamba!r}")
    opts.mamba = mamba
    kinds = ["full"] + (["swa"] if sliding_window is not None else []) + ["mamba"] * mamba
    k = len(kinds)
    if k > 1 and (num_layers < k or num_layers % k):
        if k == 2 and not mamba:
            raise ValueError(
                "sliding_window needs an even num_layers >= 2 (half full attention, "
                f"half sliding window); the model has {num_layers}"
            )
        raise ValueError(
            f"{'+'.join(kinds)} needs num_layers a multiple of {k} (one "
            f"{k}th of the layers per KV cache group); the model has {num_layers}"
        )
    return kinds


def _vllm_config(opts: EngineOptions, model_config, num_groups: int):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        SchedulerConfig,
        VllmConfig,
    )

    scheduler_config = SchedulerConfig(
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_model_len=opts.max_model_len,
        enable_chunked_prefill=opts.enable_chunked_prefill,
        is_encoder_decoder=False,
        async_scheduling=opts.async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=opts.block_size,
        enable_prefix_caching=opts.enable_prefix_caching,
        prefix_caching_hash_algo=opts.hash_algo,
        **({} if opts.retention_interval == 0
           else {"prefix_cache_retention_interval": opts.retention_interval}),
    )
    ktc = None
    if opts.kv_transfer_config is not None:
        ktc_args = dict(opts.kv_transfer_config)
        ktc_args.setdefault("kv_role", "kv_both")
        ktc = KVTransferConfig(**ktc_args)
    kec = None
    if isinstance(opts.kv_events, dict):     # e.g. {"publisher": "zmq", "endpoint": ...}
        kec = KVEventsConfig(enable_kv_cache_events=True, **opts.kv_events)
    elif opts.kv_events:
        kec = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    vc_kwargs: dict[str, Any] = dict(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=ktc,
    )
    if kec is not None:
        vc_kwargs["kv_events_config"] = kec
    vllm_config = VllmConfig(**vc_kwargs)
    # What the engine core resolves before building workers/scheduler.
    vllm_config.cache_config.kv_cache_layout = opts.layout
    vllm_config.cache_config.num_gpu_blocks = opts.num_gpu_blocks
    vllm_config.cache_config.num_gpu_blocks_override = opts.num_gpu_blocks
    vllm_config.parallel_config.tensor_parallel_size = opts.tp_size
    vllm_config.parallel_config.world_size = opts.tp_size
    if num_groups > 1:
        # VllmConfig turns the hybrid KV cache manager off on platforms that do not
        # support it (CPU) and refuses an explicit False at construction; on a GPU
        # it stays on for a hybrid model. Enable it as a GPU engine would have it.
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    if opts.mamba:
        # What vLLM's MambaModelConfig sets for a Mamba model with prefix caching:
        # states cached at block boundaries ("align"), Mamba blocks of block_size.
        vllm_config.cache_config.mamba_cache_mode = opts.mamba_cache_mode
        vllm_config.cache_config.mamba_block_size = opts.block_size
    return vllm_config


def build_setup(model_dir: str, opts: EngineOptions) -> EngineSetup:
    """The model's shape, the ``VllmConfig`` and the planned KV cache config."""
    from vllm.config import ModelConfig

    shape = read_model_shape(model_dir)
    kinds = _group_kinds(opts, shape.num_layers)
    model_config = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=opts.dtype,
        seed=0,
        max_model_len=opts.max_model_len,
    )
    vllm_config = _vllm_config(opts, model_config, len(kinds))
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.num_layers)]
    cfg = _plan_kv_cache(vllm_config, opts, shape, model_config.dtype, kinds, layer_names)
    groups = _kv_groups(cfg, layer_names)
    page_bytes = cfg.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    return EngineSetup(shape=shape, sliding_window=opts.sliding_window, mamba=opts.mamba > 0,
                       group_kinds=kinds, dtype=model_config.dtype, vllm_config=vllm_config,
                       kv_cache_config=cfg, groups=groups, page_bytes=page_bytes,
                       token_bytes=page_bytes // opts.block_size)


# ------------------------------------------------------------ KV cache groups


def _plan_kv_cache(vllm_config, opts: EngineOptions, shape: ModelShape, dtype,
                   kinds: list[str], layer_names: list[str]):
    import torch

    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=opts.block_size,
        num_kv_heads=shape.num_kv_heads // opts.tp_size,
        head_size=shape.head_dim,
        dtype=dtype if isinstance(dtype, torch.dtype) else torch.float16,
    )
    if len(kinds) > 1:
        return _plan_hybrid_kv_cache(vllm_config, opts, spec, kinds, layer_names)
    groups = [KVCacheGroupSpec(list(layer_names), spec)]
    available = spec.page_size_bytes * shape.num_layers * opts.num_gpu_blocks
    cfg = get_kv_cache_config_from_groups(vllm_config, groups, available)
    assert cfg.num_blocks == opts.num_gpu_blocks, cfg.num_blocks
    cfg.kv_cache_layout = opts.layout
    cfg.hash_block_size = opts.block_size
    return cfg


def _mamba_spec(vllm_config, tp_size: int, full_spec):
    """A Mamba2-like state per layer and rank (a conv state and an SSM state, fp16,
    split over the TP ranks like vLLM shards them), its page padded to the attention
    page as vLLM's HybridAttentionMambaModelConfig pads it."""
    import torch

    from vllm.v1.kv_cache_interface import MambaSpec

    tp = tp_size
    return MambaSpec(
        block_size=full_spec.block_size,
        shapes=((3, 64 // tp), (2, 16, 16 // tp)),
        dtypes=(torch.float16, torch.float16),
        page_size_padded=full_spec.page_size_bytes,
        mamba_cache_mode=vllm_config.cache_config.mamba_cache_mode,
    )


def _plan_hybrid_kv_cache(vllm_config, opts: EngineOptions, full_spec, kinds: list[str],
                          layer_names: list[str]):
    """Full attention over the first part of the layers, then sliding window and/or
    Mamba over equal parts (``kinds``), grouped and planned by vLLM's own planner (as
    the engine core does for a hybrid model with the hybrid KV cache manager on): one
    KVCacheTensor per group, all aliasing one allocation from byte 0."""
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.core.kv_cache_utils import (
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    assert not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    specs = {"full": full_spec}
    if "swa" in kinds:
        specs["swa"] = SlidingWindowSpec(
            block_size=full_spec.block_size,
            num_kv_heads=full_spec.num_kv_heads,
            head_size=full_spec.head_size,
            dtype=full_spec.dtype,
            sliding_window=opts.sliding_window,
        )
    if opts.mamba:
        specs["mamba"] = _mamba_spec(vllm_config, opts.tp_size, full_spec)
    per = len(layer_names) // len(kinds)
    part = [layer_names[i * per:(i + 1) * per] for i in range(len(kinds))]
    per_layer = {name: specs[kind] for kind, names in zip(kinds, part) for name in names}
    groups = get_kv_cache_groups(vllm_config, per_layer)
    got = [(type(g.kv_cache_spec), list(g.layer_names)) for g in groups]
    cls = {"full": FullAttentionSpec, "swa": SlidingWindowSpec, "mamba": MambaSpec}
    want = [(cls[kind], names) for kind, names in zip(kinds, part)]
    if got != want:  # pragma: no cover - a vLLM planner change
        raise HarnessError(f"vLLM grouped the hybrid model unexpectedly: {got}")
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    cfg = get_kv_cache_config_from_groups(
        vllm_config, groups, per_block * opts.num_gpu_blocks
    )
    assert cfg.num_blocks == opts.num_gpu_blocks, cfg.num_blocks
    assert len(cfg.kv_cache_tensors) == len(groups)
    assert all(t.offset == 0 for t in cfg.kv_cache_tensors)
    cfg.kv_cache_layout = opts.layout
    # What the engine core writes before building the scheduler and workers.
    sbs, hbs = resolve_kv_cache_block_sizes(cfg, vllm_config)
    assert sbs == hbs == opts.block_size, (sbs, hbs)
    cfg.hash_block_size = hbs
    cfg.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        cfg, vllm_config, sbs, hbs
    )
    return cfg


def _kv_groups(cfg, layer_names: list[str]) -> KVGroups:
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    specs = [g.kv_cache_spec for g in cfg.kv_cache_groups]
    index = {n: i for i, n in enumerate(layer_names)}
    layer_groups = [0] * len(layer_names)
    group_layers = [[index[n] for n in g.layer_names] for g in cfg.kv_cache_groups]
    for g, layers in enumerate(group_layers):
        for li in layers:
            layer_groups[li] = g
    return KVGroups(
        layer_names=list(layer_names),
        specs=specs,
        layer_groups=layer_groups,
        group_layers=group_layers,
        retained=[s.num_retained_tokens if isinstance(s, SlidingWindowSpec) else None
                  for s in specs],
        is_mamba=[isinstance(s, MambaSpec) for s in specs],
        mamba_state_bytes=next(
            (s.real_page_size_bytes for s in specs if isinstance(s, MambaSpec)), 0),
    )


# ------------------------------------------------------------------ scheduler


def build_scheduler(setup: EngineSetup, async_scheduling: bool, block_size: int):
    """vLLM's ``Scheduler`` (``AsyncScheduler`` with ``async_scheduling``) over the
    planned KV cache config."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(
        vllm_config=setup.vllm_config,
        kv_cache_config=setup.kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(setup.vllm_config),
        block_size=block_size,
        **({"hash_block_size": setup.kv_cache_config.hash_block_size}
           if setup.groups.hybrid else {}),
    )


def make_block_hasher(hash_block_size: int, hash_algo: str):
    """The block hasher of the harness's requests (vLLM's, over ``hash_algo``)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(hash_block_size, hash_fn)
