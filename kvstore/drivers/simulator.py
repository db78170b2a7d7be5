"""CPU engine harness: a real vLLM ``Scheduler`` plus N worker-side KV connectors
over CPU KV tensors, with a deterministic "forward" and a byte-exact verifier.

Used by the tests, the demo and the benchmarks. Nothing here needs a GPU.

The harness plays the roles vLLM's ``EngineCore`` and ``GPUModelRunner`` play:

    schedule() -> per rank: handle_preemptions, bind_connector_metadata,
    [start_load_kv if the step has sync loads], verify newly scheduled
    requests, forward (per layer: wait_for_layer_load, write KV, save_kv_layer),
    [start_load_kv otherwise], wait_for_save, get_transfer_results,
    get_block_ids_with_load_errors, get_kv_connector_stats,
    build_connector_worker_meta, clear_connector_metadata
    -> KVOutputAggregator over the ranks -> update_from_output.

The forward writes, for every computed token position ``p`` of every layer ``l``
and rank ``r``, bytes that are a pure function of (hash of token ids[0..p], l,
p, r). Any block the request starts with (``num_computed_tokens > 0`` at its
first scheduling: local prefix-cache hit or external load) is checked against
that function before the forward runs, so a connector that delivers wrong bytes
is caught (``blocks_mismatched``).

With ``sliding_window`` set the model is hybrid: two KV cache groups of the same
block size (full attention over the first half of the layers, sliding window over
the second half), planned by vLLM's own ``get_kv_cache_groups`` /
``get_kv_cache_config_from_groups`` with the hybrid KV cache manager on, so the
groups' tensors alias one allocation and vLLM's ``HybridKVCacheCoordinator``
schedules them. Each layer is written and verified through its own group's block
table; sliding-window layers are verified only inside the window vLLM keeps
(positions ``>= num_computed_tokens - num_retained_tokens``).

With ``mamba=True`` a Mamba group joins them (three groups with ``sliding_window``):
vLLM's ``MambaSpec`` in "align" mode, a ``[num_blocks, 1, 1, state_bytes]`` int8 view
on a page padded to the attention page. Its fake state is a pure function of (hash of
the prefix, layer, rank) written into the state block of the step's last position; a
request that starts from a hit is checked on the state block at the hit's end, and every
later step of a request reads (checks) the state it continues from, as an SSM does.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

__all__ = [
    "write_model_dir",
    "EngineHarness",
    "expected_token_bytes",
    "expected_state_bytes",
    "prefix_hashes",
    "HarnessError",
]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class HarnessError(AssertionError):
    """The harness saw the engine misbehave (stuck request, leak, ...)."""


# --------------------------------------------------------------------------
# model directory
# --------------------------------------------------------------------------


def write_model_dir(
    path: str | os.PathLike,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_attention_heads: int | None = None,
    vocab_size: int = 32000,
    max_position_embeddings: int = 8192,
    dtype: str = "float16",
) -> str:
    """Write a tiny llama-like ``config.json`` that vLLM's ``ModelConfig``
    accepts offline (use ``skip_tokenizer_init=True``; no tokenizer files).
    Returns the directory path."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if num_attention_heads is None:
        num_attention_heads = num_kv_heads * 2
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": num_attention_heads * head_dim,
        "intermediate_size": 2 * num_attention_heads * head_dim,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": num_layers,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path


# --------------------------------------------------------------------------
# deterministic KV content
# --------------------------------------------------------------------------


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, vectorized over uint64 arrays (wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def prefix_hashes(token_ids: Sequence[int], start: int = 0, prev: int = 0) -> list[int]:
    """Rolling 64-bit hash: element ``i`` is a hash of token_ids[0..start+i]
    (inclusive). ``prev`` is the hash at ``start - 1`` (0 for start == 0)."""
    out = []
    h = prev
    for t in token_ids[start:]:
        h = _mix_int(h * 0x100000001B3 + int(t) + _GOLDEN)
        out.append(h)
    return out


def expected_token_bytes(
    hashes: np.ndarray, positions: np.ndarray, layer: int, rank: int, nbytes: int
) -> np.ndarray:
    """uint8 array ``[T, nbytes]``: KV bytes of each token (prefix hash,
    position) at ``layer`` on ``rank``. Pure function of its arguments."""
    hashes = np.asarray(hashes, dtype=np.uint64)
    positions = np.asarray(positions, dtype=np.uint64)
    salt = np.uint64(_mix_int((layer << 32) ^ (rank << 16) ^ 0x5EED))
    with np.errstate(over="ignore"):
        seed = _mix64(hashes ^ _mix64(positions + salt))
        nwords = (nbytes + 7) // 8
        words = _mix64(
            seed[:, None] + np.arange(1, nwords + 1, dtype=np.uint64)[None, :]
            * np.uint64(_GOLDEN)
        )
    return words.view(np.uint8).reshape(len(hashes), nwords * 8)[:, :nbytes]


_STATE_POSITION = 1 << 62  # salts a Mamba state apart from any token's KV


def expected_state_bytes(prefix_hash: int, layer: int, rank: int, nbytes: int) -> np.ndarray:
    """uint8 array ``[nbytes]``: the fake Mamba state of a Mamba ``layer`` on ``rank``
    after the prefix whose last token has hash ``prefix_hash``. Pure function of its
    arguments (a real SSM state is a function of the prefix too)."""
    return expected_token_bytes(
        np.asarray([prefix_hash], dtype=np.uint64),
        np.asarray([_STATE_POSITION], dtype=np.uint64), layer, rank, nbytes)[0]


# --------------------------------------------------------------------------
# harness
# --------------------------------------------------------------------------


@dataclass
class _ReqState:
    tables: list[list[int]] = field(default_factory=lambda: [[]])  # per KV cache group
    hashes: list[int] = field(default_factory=list)  # prefix hash per position
    sampled: list[int] = field(default_factory=list)  # tokens the harness emitted

    @property
    def block_ids(self) -> list[int]:  # group 0 block table
        return self.tables[0]


@dataclass
class _Rank:
    rank: int
    vllm_config: Any
    connector: Any  # worker-side connector or None
    kv_caches: dict  # layer name -> [B, H, N, C] view (spec dtype)
    byte_views: list  # per layer, uint8 view [B, H, N, Cbytes]
    forward_context: Any = None


_HARNESS_IDS = itertools.count()


class EngineHarness:
    """A real vLLM Scheduler + ``tp_size`` worker-side connectors on CPU.

    Args:
        model_dir: directory with a config.json; written (tiny llama) if None.
        kv_transfer_config: dict of ``KVTransferConfig`` fields, or None for no
            connector (plain prefix caching).
        num_gpu_blocks: size of the "GPU" KV cache (small, so it overflows).
        layout: KV cache layout name (``LBNHC``, ``LBHNC``, ``BLNHC``, ...).
        kv_events: enable KV cache events with the "null" publisher (True), or with the
            KVEventsConfig fields given (a dict, e.g. vLLM's ZMQ publisher).
        async_scheduling: build an AsyncScheduler and lag update_from_output by
            one step, like vLLM's async engine loop.
        sliding_window: None (default) for one full-attention KV cache group. A
            window in tokens for a hybrid model: group 0 is FullAttentionSpec over
            the first half of the layers, group 1 SlidingWindowSpec(sliding_window)
            over the second half (num_layers must be even, >= 2), both with
            ``block_size``, planned with vLLM's hybrid KV cache manager enabled.
        mamba: add a Mamba group (vLLM's ``MambaSpec`` in ``mamba_cache_mode``
            "align", states padded to the attention page): the layers split in equal
            parts, full attention first, then sliding window (if set), then Mamba.
            The fake forward writes, after each step, the state of the prefix's last
            token into the block of that position; a request starting from a hit is
            verified on the state block at its hit's end, and each later step reads
            the state it continues from (``states_read``; a wrong one counts in
            ``blocks_mismatched``). An int k > 1 makes k Mamba
            groups (a hybrid with k times as many Mamba layers as attention layers,
            which vLLM splits into groups of equal size).
        mamba_cache_mode: the cache config's (and MambaSpec's) mode with ``mamba``.
        retention_interval: vLLM's ``prefix_cache_retention_interval`` (sliding-window
            and Mamba checkpoints it keeps: 0, its default, only the replay boundary
            and shared-prefix junctions; N also one every N tokens; None all).
    """

    def __init__(
        self,
        model_dir: str | None = None,
        *,
        workdir: str | None = None,
        num_layers: int = 2,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        dtype: str = "float16",
        block_size: int = 16,
        num_gpu_blocks: int = 64,
        max_num_batched_tokens: int = 256,
        max_num_seqs: int = 16,
        max_model_len: int = 4096,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        kv_transfer_config: dict | None = None,
        kv_events: bool | dict = False,
        tp_size: int = 1,
        layout: str = "LBNHC",
        async_scheduling: bool = False,
        hash_algo: str = "sha256",
        verify: bool = True,
        sliding_window: int | None = None,
        mamba: bool | int = False,
        mamba_cache_mode: str = "align",
        retention_interval: int | None = 0,
    ):
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )

        if num_kv_heads % tp_size:
            raise ValueError("num_kv_heads must be divisible by tp_size")
        self._tmp = None
        if model_dir is None:
            if workdir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-harness-")
                workdir = self._tmp.name
            model_dir = write_model_dir(
                os.path.join(workdir, "model"),
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                max_position_embeddings=max(8192, max_model_len),
            )
        self.model_dir = model_dir
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
        self.num_layers = int(hf["num_hidden_layers"])
        self.num_kv_heads = int(hf.get("num_key_value_heads", hf["num_attention_heads"]))
        self.head_dim = int(
            hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
        )
        self.vocab_size = int(hf.get("vocab_size", 32000))
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.tp_size = tp_size
        self.layout_name = layout
        self.verify_enabled = verify
        self.async_scheduling = async_scheduling
        if sliding_window is not None:
            if isinstance(sliding_window, bool) or int(sliding_window) != sliding_window \
                    or sliding_window < 1:
                raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
            sliding_window = int(sliding_window)
        self.sliding_window = sliding_window
        if isinstance(mamba, bool):
            mamba = int(mamba)
        if not isinstance(mamba, int) or mamba < 0:
            raise ValueError(f"mamba must be a bool or a number of Mamba groups, got {mamba!r}")
        self.mamba = mamba > 0
        #: kind of each KV cache group: "full", then "swa" and/or "mamba" (once per group)
        self.group_kinds = ["full"] + (["swa"] if sliding_window is not None else []) \
            + ["mamba"] * mamba
        k = len(self.group_kinds)
        if k > 1 and (self.num_layers < k or self.num_layers % k):
            if k == 2 and not self.mamba:
                raise ValueError(
                    "sliding_window needs an even num_layers >= 2 (half full attention, "
                    f"half sliding window); the model has {self.num_layers}"
                )
            raise ValueError(
                f"{'+'.join(self.group_kinds)} needs num_layers a multiple of {k} (one "
                f"{k}th of the layers per KV cache group); the model has {self.num_layers}"
            )

        model_config = ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=0,
            max_model_len=max_model_len,
        )
        self.dtype = model_config.dtype
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        )
        cache_config = CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=hash_algo,
            **({} if retention_interval == 0
               else {"prefix_cache_retention_interval": retention_interval}),
        )
        ktc = None
        if kv_transfer_config is not None:
            ktc_args = dict(kv_transfer_config)
            ktc_args.setdefault("kv_role", "kv_both")
            ktc = KVTransferConfig(**ktc_args)
        kec = None
        if isinstance(kv_events, dict):     # e.g. {"publisher": "zmq", "endpoint": ...}
            kec = KVEventsConfig(enable_kv_cache_events=True, **kv_events)
        elif kv_events:
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
        vllm_config.cache_config.kv_cache_layout = layout
        vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        vllm_config.cache_config.num_gpu_blocks_override = num_gpu_blocks
        vllm_config.parallel_config.tensor_parallel_size = tp_size
        vllm_config.parallel_config.world_size = tp_size
        if k > 1:
            # VllmConfig turns the hybrid KV cache manager off on platforms that do not
            # support it (CPU) and refuses an explicit False at construction; on a GPU
            # it stays on for a hybrid model. Enable it as a GPU engine would have it.
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
        if self.mamba:
            # What vLLM's MambaModelConfig sets for a Mamba model with prefix caching:
            # states cached at block boundaries ("align"), Mamba blocks of block_size.
            vllm_config.cache_config.mamba_cache_mode = mamba_cache_mode
            vllm_config.cache_config.mamba_block_size = block_size
        self.vllm_config = vllm_config

        self.kv_cache_config = self._build_kv_cache_config()
        self.page_bytes = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        # bytes of one token of one layer on one rank
        self.token_bytes = self.page_bytes // block_size

        self._build_scheduler(hash_algo)
        try:
            self._build_workers()
        except BaseException:
            # A worker connector refused to start (bad config, layout mismatch): close
            # what was built, so the store's writer lock is not held by a half-made engine.
            for rk in getattr(self, "ranks", []):
                if rk.connector is not None:
                    rk.connector.shutdown()
            for c in getattr(self, "_partial_workers", []):
                c.shutdown()
            self.scheduler.shutdown()
            if self._tmp is not None:
                self._tmp.cleanup()
            raise

        self.stats: dict[str, int] = {
            "steps": 0,
            "tokens_computed": 0,
            "requests_added": 0,
            "requests_finished": 0,
            "requests_aborted": 0,
            "blocks_verified": 0,
            "blocks_loaded": 0,
            "blocks_mismatched": 0,
            "states_read": 0,
            "local_hit_tokens": 0,
            "external_hit_tokens": 0,
            "finished_recving": 0,
            "finished_sending": 0,
            "invalid_block_ids": 0,
            "failed_recving": 0,
        }
        self.mismatches: list[dict] = []  # details of the first mismatches
        self.events: list[Any] = []  # KV events seen through the publisher
        self.kv_connector_stats: list[Any] = []
        self.finished: dict[str, list[int]] = {}  # req id -> output token ids
        self._outputs: dict[str, list[int]] = {}
        self._last_tables: dict[str, list[list[int]]] = {}  # tables of freed reqs
        self._req_state: dict[str, _ReqState] = {}
        # block id -> (prefix hash of last written token, tokens written in
        # the block, KV cache group) for blocks the harness forward wrote itself.
        self._block_owner: dict[int, tuple[int, int]] = {}
        self._forget_owner_of_new_blocks()
        self._req_counter = itertools.count()
        self._hid = next(_HARNESS_IDS)
        self._pending: tuple[Any, Any] | None = None  # async scheduling lag
        self.last_step_executed = False   # the last step scheduled tokens (ran the model)
        self._closed = False
        self._collect_events()  # hook the publisher before the first step

    # ------------------------------------------------------------------ setup

    def _build_kv_cache_config(self):
        import torch

        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads // self.tp_size,
            head_size=self.head_dim,
            dtype=self.dtype if isinstance(self.dtype, torch.dtype) else torch.float16,
        )
        self.layer_names = [
            f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)
        ]
        if len(self.group_kinds) > 1:
            return self._build_hybrid_kv_cache_config(spec)
        groups = [KVCacheGroupSpec(list(self.layer_names), spec)]
        available = spec.page_size_bytes * self.num_layers * self.num_gpu_blocks
        cfg = get_kv_cache_config_from_groups(self.vllm_config, groups, available)
        assert cfg.num_blocks == self.num_gpu_blocks, cfg.num_blocks
        cfg.kv_cache_layout = self.layout_name
        cfg.hash_block_size = self.block_size
        self._set_group_info(cfg)
        return cfg

    def _mamba_spec(self, full_spec):
        """A Mamba2-like state per layer and rank (a conv state and an SSM state, fp16,
        split over the TP ranks like vLLM shards them), its page padded to the attention
        page as vLLM's HybridAttentionMambaModelConfig pads it."""
        import torch

        from vllm.v1.kv_cache_interface import MambaSpec

        tp = self.tp_size
        return MambaSpec(
            block_size=full_spec.block_size,
            shapes=((3, 64 // tp), (2, 16, 16 // tp)),
            dtypes=(torch.float16, torch.float16),
            page_size_padded=full_spec.page_size_bytes,
            mamba_cache_mode=self.vllm_config.cache_config.mamba_cache_mode,
        )

    def _build_hybrid_kv_cache_config(self, full_spec):
        """Full attention over the first part of the layers, then sliding window and/or
        Mamba over equal parts (``group_kinds``), grouped and planned by vLLM's own
        planner (as the engine core does for a hybrid model with the hybrid KV cache
        manager on): one KVCacheTensor per group, all aliasing one allocation from
        byte 0."""
        from vllm.v1.core.kv_cache_planning import (
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
        from vllm.v1.core.kv_cache_utils import (
            resolve_cache_hit_alignment_tokens,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

        assert not self.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        specs = {"full": full_spec}
        if "swa" in self.group_kinds:
            specs["swa"] = SlidingWindowSpec(
                block_size=full_spec.block_size,
                num_kv_heads=full_spec.num_kv_heads,
                head_size=full_spec.head_size,
                dtype=full_spec.dtype,
                sliding_window=self.sliding_window,
            )
        if self.mamba:
            specs["mamba"] = self._mamba_spec(full_spec)
        per = self.num_layers // len(self.group_kinds)
        part = [self.layer_names[i * per:(i + 1) * per] for i in range(len(self.group_kinds))]
        per_layer = {name: specs[kind] for kind, names in zip(self.group_kinds, part)
                     for name in names}
        groups = get_kv_cache_groups(self.vllm_config, per_layer)
        got = [(type(g.kv_cache_spec), list(g.layer_names)) for g in groups]
        cls = {"full": FullAttentionSpec, "swa": SlidingWindowSpec, "mamba": MambaSpec}
        want = [(cls[kind], names) for kind, names in zip(self.group_kinds, part)]
        if got != want:  # pragma: no cover - a vLLM planner change
            raise HarnessError(f"vLLM grouped the hybrid model unexpectedly: {got}")
        per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                        for g in groups)
        cfg = get_kv_cache_config_from_groups(
            self.vllm_config, groups, per_block * self.num_gpu_blocks
        )
        assert cfg.num_blocks == self.num_gpu_blocks, cfg.num_blocks
        assert len(cfg.kv_cache_tensors) == len(groups)
        assert all(t.offset == 0 for t in cfg.kv_cache_tensors)
        cfg.kv_cache_layout = self.layout_name
        # What the engine core writes before building the scheduler and workers.
        sbs, hbs = resolve_kv_cache_block_sizes(cfg, self.vllm_config)
        assert sbs == hbs == self.block_size, (sbs, hbs)
        cfg.hash_block_size = hbs
        cfg.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            cfg, self.vllm_config, sbs, hbs
        )
        self._set_group_info(cfg)
        return cfg

    def _set_group_info(self, cfg) -> None:
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        self.group_specs = [g.kv_cache_spec for g in cfg.kv_cache_groups]
        self.num_groups = len(self.group_specs)
        index = {n: i for i, n in enumerate(self.layer_names)}
        #: group of each layer (index into ``layer_names``)
        self.layer_groups = [0] * self.num_layers
        #: layer indices of each group
        self.group_layers = [[index[n] for n in g.layer_names] for g in cfg.kv_cache_groups]
        for g, layers in enumerate(self.group_layers):
            for li in layers:
                self.layer_groups[li] = g
        # tokens before num_computed_tokens that a group still holds (None: all)
        self._group_retained = [
            s.num_retained_tokens if isinstance(s, SlidingWindowSpec) else None
            for s in self.group_specs
        ]
        #: whether each group is a Mamba group (one state block per request position)
        self.group_is_mamba = [isinstance(s, MambaSpec) for s in self.group_specs]
        #: bytes of one Mamba state (one layer, one rank): what a Mamba block holds
        self.mamba_state_bytes = next(
            (s.real_page_size_bytes for s in self.group_specs if isinstance(s, MambaSpec)), 0)
        self._hybrid = self.num_groups > 1

    def _forget_owner_of_new_blocks(self) -> None:
        """A block vLLM's block pool hands out as new (``get_new_blocks``: free, its
        hash evicted or reset) is not a prefix-cache hit, whatever bytes it still holds:
        forget what the forward once wrote there. Otherwise a load into a block that
        held the same content before (the free queue cycles blocks back to the same
        requests, e.g. a replay after ``reset_prefix_cache``) counted as a local hit,
        not in ``blocks_loaded``."""
        pool = self.scheduler.kv_cache_manager.block_pool
        get_new_blocks = pool.get_new_blocks
        owner = self._block_owner

        def new_blocks(num_blocks: int):
            blocks = get_new_blocks(num_blocks)
            for b in blocks:
                owner.pop(b.block_id, None)
            return blocks

        pool.get_new_blocks = new_blocks

    def _build_scheduler(self, hash_algo: str):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.block_size,
            **({"hash_block_size": self.kv_cache_config.hash_block_size}
               if self._hybrid else {}),
        )
        hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(
            self.kv_cache_config.hash_block_size, hash_fn
        )
        self.scheduler_connector = self.scheduler.connector

    def _build_workers(self):
        import torch

        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.forward_context import ForwardContext
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        layout = KVCacheLayout[self.layout_name]
        self.ranks: list[_Rank] = []
        for r in range(self.tp_size):
            rank_config = copy.copy(self.vllm_config)
            pc = copy.copy(self.vllm_config.parallel_config)
            pc.rank = r  # what vLLM's WorkerBase sets (worker_base.py:86)
            object.__setattr__(rank_config, "parallel_config", pc)
            kv_caches = allocate_kv_cache(
                self.kv_cache_config,
                torch.device("cpu"),
                layout,
                [self.block_size] * self.num_groups,
            )
            byte_views = [kv_caches[n].view(torch.uint8) for n in self.layer_names]
            connector = None
            if self.vllm_config.kv_transfer_config is not None:
                with set_current_vllm_config(rank_config):
                    connector = KVConnectorFactory.create_connector(
                        config=rank_config,
                        role=KVConnectorRole.WORKER,
                        kv_cache_config=self.kv_cache_config,
                    )
                    self._partial_workers = getattr(self, "_partial_workers", [])
                    self._partial_workers.append(connector)
                    connector.register_kv_caches(kv_caches)
            ctx = ForwardContext(
                no_compile_layers={
                    n: SimpleNamespace(kv_cache=kv_caches[n], layer_name=n)
                    for n in self.layer_names
                },
                attn_metadata={n: SimpleNamespace() for n in self.layer_names},
                slot_mapping={},
            )
            self.ranks.append(
                _Rank(r, rank_config, connector, kv_caches, byte_views, ctx)
            )
        self.worker_connectors = [rk.connector for rk in self.ranks]
        self._aggregator = None
        if self.ranks[0].connector is not None:
            self._aggregator = KVOutputAggregator.from_connector(
                self.ranks[0].connector, self.tp_size
            )

    # --------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: Sequence[int],
        max_tokens: int = 1,
        req_id: str | None = None,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> str:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        if req_id is None:
            req_id = f"h{self._hid}-r{next(self._req_counter)}"
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            skip_reading_prefix_cache=skip_reading_prefix_cache or None,
        )
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self._block_hasher,
            cache_salt=cache_salt,
        )
        self.scheduler.add_request(req)
        self.stats["requests_added"] += 1
        return req_id

    def abort(self, req_ids: str | Iterable[str]) -> None:
        from vllm.v1.request import RequestStatus

        if isinstance(req_ids, str):
            req_ids = [req_ids]
        aborted = self.scheduler.finish_requests(
            list(req_ids), RequestStatus.FINISHED_ABORTED
        )
        self.stats["requests_aborted"] += len(aborted)

    # -------------------------------------------------------------- stepping

    def _tokens(self, req_id: str) -> list[int]:
        # prompt + the tokens this harness sampled: with async scheduling the
        # scheduler's all_token_ids lags one token behind the worker.
        req = self.scheduler.requests[req_id]
        return list(req.prompt_token_ids) + self._req_state[req_id].sampled

    def _hashes_for(self, req_id: str, tokens: Sequence[int], upto: int) -> list[int]:
        st = self._req_state.setdefault(req_id, _ReqState())
        h = st.hashes
        if len(h) < upto:
            h.extend(
                prefix_hashes(tokens[:upto], start=len(h), prev=h[-1] if h else 0)
            )
        return h

    def _update_block_tables(self, so) -> list[tuple[str, int]]:
        """Apply the scheduler output to the per-request, per-group block tables,
        like the model runner does. Returns (req_id, num_computed_tokens) of
        requests scheduled for the first time (new or resumed)."""
        first: list[tuple[str, int]] = []
        ng = self.num_groups
        for nr in so.scheduled_new_reqs:
            st = self._req_state.setdefault(nr.req_id, _ReqState())
            st.tables = [list(nr.block_ids[g]) for g in range(ng)]
            first.append((nr.req_id, nr.num_computed_tokens))
        cr = so.scheduled_cached_reqs
        for i, req_id in enumerate(cr.req_ids):
            st = self._req_state.setdefault(req_id, _ReqState())
            nb = cr.new_block_ids[i]
            if req_id in cr.resumed_req_ids:
                st.tables = [list(nb[g]) if nb is not None else [] for g in range(ng)]
                first.append((req_id, cr.num_computed_tokens[i]))
            elif nb is not None:
                for g in range(ng):
                    st.tables[g].extend(nb[g])
        if self._hybrid:
            self._sync_null_blocks(so.num_scheduled_tokens)
        return first

    def _sync_null_blocks(self, scheduled) -> None:
        """Mirror into the harness tables the blocks vLLM replaced by the null block
        (sliding-window blocks that left the window, ``remove_skipped_blocks`` in
        ``allocate_slots``). vLLM's model runner keeps the stale ids (its kernels
        never read them); the harness drops them so that ``block_tables`` shows the
        blocks the request still holds, and checks that its tables agree with the
        scheduler's."""
        stms = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        for req_id, st in self._req_state.items():
            if req_id not in scheduled:
                # Not scheduled this step: its table may be stale (a preempted request
                # that vLLM allocated again for a load it now waits for).
                continue
            for g, stm in enumerate(stms):
                blocks = stm.req_to_blocks.get(req_id)
                if blocks is None:
                    continue  # not allocated (preempted, finished, waiting)
                table = st.tables[g]
                if len(blocks) != len(table):
                    continue  # allocated past what this step's output carried
                for i, b in enumerate(blocks):
                    if b.is_null:
                        table[i] = 0
                    elif table[i] != b.block_id:
                        raise HarnessError(
                            f"{req_id}: group {g} block table {table} disagrees with "
                            f"the scheduler's {[x.block_id for x in blocks]} at {i}"
                        )

    def _slots(self, block_ids: list[int], start: int, end: int):
        pos = np.arange(start, end, dtype=np.int64)
        bidx = np.asarray(block_ids, dtype=np.int64)[pos // self.block_size]
        return pos, bidx, pos % self.block_size

    def _window_start(self, group: int, num_computed: int) -> int:
        """First position of ``num_computed`` computed tokens that ``group`` still
        holds (0 for full attention; for a sliding window the last
        ``num_retained_tokens = sliding_window - 1`` tokens, as vLLM's
        ``SlidingWindowManager.get_num_skipped_tokens``)."""
        retained = self._group_retained[group]
        if retained is None:
            return 0
        return max(0, num_computed - retained)

    def _verify(self, req_id: str, num_computed: int) -> None:
        if num_computed <= 0:
            return
        tokens = self._tokens(req_id)
        hashes = np.asarray(
            self._hashes_for(req_id, tokens, num_computed)[:num_computed], dtype=np.uint64
        )
        st = self._req_state[req_id]
        for g in range(self.num_groups):
            if self.group_is_mamba[g]:
                self._verify_state(req_id, st, g, num_computed, hashes)
            else:
                self._verify_group(req_id, st, g, num_computed, hashes)

    def _verify_state(self, req_id: str, st: _ReqState, g: int, num_computed: int,
                      hashes: np.ndarray) -> None:
        """Check a Mamba group: the one state block a request starts from (the block
        of position ``num_computed - 1``) must hold the state after exactly
        ``num_computed`` tokens on every Mamba layer and rank. A null block there counts
        as mismatched; the other blocks of the table are not read by the model."""
        bs = self.block_size
        i = (num_computed + bs - 1) // bs - 1
        table = st.tables[g]
        bid = table[i] if i < len(table) else 0
        h = int(hashes[num_computed - 1])
        bad = bid == 0
        if bad and len(self.mismatches) < 16:
            self.mismatches.append(dict(req_id=req_id, group=g, rank=None, layer=None,
                                        position=num_computed, block_id=0, null=True))
        for rk in self.ranks if bid else ():
            for li in self.group_layers[g]:
                got = rk.byte_views[li][bid, 0, 0, :].numpy()
                exp = expected_state_bytes(h, li, rk.rank, self.mamba_state_bytes)
                if (got != exp).any():
                    if not bad and len(self.mismatches) < 16:
                        self.mismatches.append(dict(req_id=req_id, group=g, rank=rk.rank,
                                                    layer=li, position=num_computed,
                                                    block_id=bid, state=True))
                    bad = True
        if bid:
            key = (h, num_computed - i * bs, g)
            owner = self._block_owner.get(bid)
            if owner is None or owner != key:
                self.stats["blocks_loaded"] += 1
            if not bad:
                self._block_owner[bid] = key
        self.stats["blocks_verified"] += 1
        self.stats["blocks_mismatched"] += int(bad)

    def _read_state(self, req_id: str, g: int, start: int, hsh: int) -> None:
        """The state a running request's step continues from (the block of position
        ``start - 1``, every Mamba layer and rank) must be the state after exactly
        ``start`` tokens: a fake SSM that reads its input state. ``states_read`` counts
        them; a wrong one counts in ``blocks_mismatched``."""
        bs = self.block_size
        i = (start + bs - 1) // bs - 1
        table = self._req_state[req_id].tables[g]
        bid = table[i] if i < len(table) else 0
        bad = []
        for rk in self.ranks if bid else ():
            for li in self.group_layers[g]:
                got = rk.byte_views[li][bid, 0, 0, :].numpy()
                if (got != expected_state_bytes(hsh, li, rk.rank, self.mamba_state_bytes)).any():
                    bad.append((rk.rank, li))
        self.stats["states_read"] += 1
        if bid and not bad:
            return
        self.stats["blocks_mismatched"] += 1
        if len(self.mismatches) < 16:
            rank, layer = bad[0] if bad else (None, None)
            self.mismatches.append(dict(req_id=req_id, group=g, rank=rank, layer=layer,
                                        position=start, block_id=bid, state=True,
                                        state_read=True, null=not bid))

    def _verify_group(self, req_id: str, st: _ReqState, g: int, num_computed: int,
                      hashes: np.ndarray) -> None:
        """Check the bytes of group ``g``'s layers at the positions the group still
        holds: all of [0, num_computed) for full attention, the window for a sliding
        window. A null block where a held position should be counts as mismatched."""
        import torch

        bs = self.block_size
        table = st.tables[g]
        lo = self._window_start(g, num_computed)
        first_block = lo // bs
        nblocks = (num_computed + bs - 1) // bs
        bad = np.zeros(nblocks, dtype=bool)
        pos, bidx, off = self._slots(table, lo, num_computed)
        if self._hybrid:
            null = bidx == 0
            if null.any():
                for b in np.unique(pos[null] // bs).tolist():
                    bad[b] = True
                    if len(self.mismatches) < 16:
                        self.mismatches.append(
                            dict(req_id=req_id, group=g, rank=None, layer=None,
                                 position=int(b * bs), block_id=0, null=True)
                        )
                keep = ~null
                pos, bidx, off = pos[keep], bidx[keep], off[keep]
        n = len(pos)
        h = hashes[pos] if lo or len(pos) != num_computed else hashes
        tb = torch.from_numpy(bidx)
        to = torch.from_numpy(off)
        for rk in self.ranks:
            for li in self.group_layers[g]:
                bv = rk.byte_views[li]
                got = bv[tb, :, to, :].reshape(n, -1).numpy()
                exp = expected_token_bytes(h, pos, li, rk.rank, got.shape[1])
                tok_bad = (got != exp).any(axis=1)
                if tok_bad.any():
                    bad |= np.bincount(
                        pos[tok_bad] // bs, minlength=nblocks
                    )[:nblocks].astype(bool)
                    if len(self.mismatches) < 16:
                        j = int(np.flatnonzero(tok_bad)[0])
                        m = dict(req_id=req_id, rank=rk.rank, layer=li,
                                 position=int(pos[j]), block_id=int(bidx[j]))
                        if self._hybrid:
                            m["group"] = g
                        self.mismatches.append(m)
        for i in range(first_block, nblocks):
            bid = table[i]
            if bid == 0 and self._hybrid:
                continue  # counted as mismatched above
            end = min((i + 1) * bs, num_computed)
            key = (int(hashes[end - 1]), end - i * bs, g)
            owner = self._block_owner.get(bid)
            # A block the harness wrote with exactly this content (and vLLM did not
            # hand out anew since, see _forget_owner_of_new_blocks) is a local
            # prefix-cache hit; anything else arrived from outside.
            if owner is None or owner[0] != key[0] or owner[1] < key[1] or owner[2] != g:
                self.stats["blocks_loaded"] += 1
            if not bad[i]:
                self._block_owner[bid] = key
        self.stats["blocks_verified"] += nblocks - first_block
        self.stats["blocks_mismatched"] += int(bad.sum())

    def _forward_write(self, rk: _Rank, writes) -> None:
        """``writes[g]``: this step's (positions, block ids, offsets, hashes) in
        group ``g``'s blocks; each layer writes through its own group's table."""
        import torch

        for li, name in enumerate(self.layer_names):
            if rk.connector is not None:
                rk.connector.wait_for_layer_load(name)
            bv = rk.byte_views[li]
            if self.group_is_mamba[self.layer_groups[li]]:
                for bid, hsh, _ in writes[self.layer_groups[li]]:
                    exp = expected_state_bytes(hsh, li, rk.rank, self.mamba_state_bytes)
                    bv[bid, 0, 0, :] = torch.from_numpy(exp)
                if rk.connector is not None:
                    rk.connector.save_kv_layer(
                        name, rk.kv_caches[name], rk.forward_context.attn_metadata[name]
                    )
                continue
            for pos, bidx, off, hashes in writes[self.layer_groups[li]]:
                exp = expected_token_bytes(hashes, pos, li, rk.rank, self.token_bytes)
                val = torch.from_numpy(exp).reshape(len(pos), bv.shape[1], bv.shape[3])
                bv[torch.from_numpy(bidx), :, torch.from_numpy(off), :] = val
            if rk.connector is not None:
                rk.connector.save_kv_layer(
                    name, rk.kv_caches[name], rk.forward_context.attn_metadata[name]
                )

    def step(self) -> dict:
        """Run one engine step. Returns the EngineCoreOutputs dict of
        update_from_output (possibly of the previous step with async
        scheduling)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        self.stats["steps"] += 1
        self.last_step_executed = so.total_num_scheduled_tokens > 0
        first = self._update_block_tables(so)

        # Prepare this step's writes (same for every rank, content differs), per
        # KV cache group.
        writes: list[list] = [[] for _ in range(self.num_groups)]
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        first_ids = {r for r, _ in first}
        state_reads: list[tuple] = []   # (req, group, start, prefix hash at start - 1)
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # already advanced by schedule()
            start = end - n
            st = self._req_state[req_id]
            tokens = self._tokens(req_id)
            h = self._hashes_for(req_id, tokens, end)
            hs = np.asarray(h[start:end], dtype=np.uint64)
            for g in range(self.num_groups):
                if self.group_is_mamba[g]:
                    if n > 0 and start > 0 and req_id not in first_ids:
                        # A running request continues from the state its previous
                        # step wrote (a request scheduled for the first time is
                        # checked by _verify, after the forward).
                        state_reads.append((req_id, g, start, int(h[start - 1])))
                    # The state after this step's last token, in the block of that
                    # position (align mode: vLLM ends prefill chunks at block
                    # boundaries, so block i keeps the state after (i+1)*block_size).
                    i = (end + self.block_size - 1) // self.block_size - 1
                    if n > 0 and i < len(st.tables[g]) and st.tables[g][i] != 0:
                        writes[g].append((st.tables[g][i], int(h[end - 1]),
                                          end - i * self.block_size))
                    continue
                pos, bidx, off = self._slots(st.tables[g], start, end)
                if self._hybrid:
                    keep = bidx != 0  # null block: outside the window, not written
                    if not keep.all():
                        pos, bidx, off, hs_g = pos[keep], bidx[keep], off[keep], hs[keep]
                        writes[g].append((pos, bidx, off, hs_g))
                        continue
                writes[g].append((pos, bidx, off, hs))
            self.stats["tokens_computed"] += n
            req_ids.append(req_id)
            if end >= len(req.prompt_token_ids) and end >= len(tokens):
                tok = int(h[end - 1] % (self.vocab_size - 10)) + 10
                st.sampled.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])

        # Phase 1, every rank: bind metadata, synchronous loads.
        for rk in self.ranks:
            c = rk.connector
            if c is not None:
                meta = so.kv_connector_metadata
                c.handle_preemptions(meta)
                c.bind_connector_metadata(meta)
                if so.has_sync_kv_loads:
                    c.start_load_kv(rk.forward_context)
        # The Mamba states this step's forward reads, before it writes (decode updates
        # the state block in place), as an SSM reads them: overwritten by anything but
        # the request's own previous step, they are a mismatch.
        if self.verify_enabled:
            for req_id, g, start, hsh in state_reads:
                self._read_state(req_id, g, start, hsh)
        # Phase 2, every rank: forward (writes this step's tokens).
        for rk in self.ranks:
            self._forward_write(rk, writes)
        for g, group_writes in enumerate(writes):
            if self.group_is_mamba[g]:
                for bid, hsh, ntok in group_writes:
                    self._block_owner[bid] = (hsh, ntok, g)
                continue
            for pos, bidx, off, hashes in group_writes:
                self._record_owner(bidx, off, hashes, g)
        # Verify the prefix every newly scheduled request starts from. After
        # the forward, because a request may hit blocks that another request
        # computes in this same step (the attention kernel would read them
        # after the KV write of the layer, as in vLLM).
        if self.verify_enabled:
            for req_id, nct in first:
                self._verify(req_id, nct)
        # Phase 3, every rank: async load start, save, results.
        outputs: list[Any] = []
        for rk in self.ranks:
            c = rk.connector
            kv_out = None
            if c is not None:
                if not so.has_sync_kv_loads:
                    c.start_load_kv(rk.forward_context)
                c.wait_for_save()
                tr = c.get_transfer_results(so.finished_req_ids)
                kv_out = KVConnectorOutput(
                    finished_sending=tr.finished_sending or None,
                    finished_recving=tr.finished_recving or None,
                    failed_recving=tr.failed_recving,
                    invalid_block_ids=c.get_block_ids_with_load_errors(),
                    kv_connector_stats=c.get_kv_connector_stats(),
                    kv_cache_events=c.get_kv_connector_kv_cache_events(),
                    kv_connector_worker_meta=c.build_connector_worker_meta(),
                )
                c.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=list(req_ids),
                    req_id_to_index={r: j for j, r in enumerate(req_ids)},
                    sampled_token_ids=[list(x) for x in sampled],
                    logprobs=None,
                    prompt_logprobs_dict={},
                    pooler_output=None,
                    kv_connector_output=kv_out,
                )
            )

        mro = outputs[0]
        if self._aggregator is not None:
            mro = self._aggregator.aggregate(outputs, 0)
            kco = mro.kv_connector_output
            if kco is not None:
                self.stats["finished_recving"] += len(kco.finished_recving or ())
                self.stats["finished_sending"] += len(kco.finished_sending or ())
                self.stats["invalid_block_ids"] += len(kco.invalid_block_ids or ())
                self.stats["failed_recving"] += len(kco.failed_recving or ())

        if self.async_scheduling:
            prev, self._pending = self._pending, (so, mro)
            if prev is None:
                return {}
            return self._update(*prev)
        return self._update(so, mro)

    def _record_owner(self, bidx, off, hashes, group: int = 0) -> None:
        if len(bidx) == 0:
            return
        # last write per block wins; writes within a block are in order
        last = {}
        for b, o, h in zip(bidx.tolist(), off.tolist(), hashes.tolist()):
            last[b] = (h, o + 1, group)
        self._block_owner.update(last)

    def _update(self, so, mro) -> dict:
        from vllm.v1.request import RequestStatus

        eco = self.scheduler.update_from_output(so, mro)
        for outs in eco.values():
            for o in outs.outputs:
                self._outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = self._outputs.pop(o.request_id)
                    self.stats["requests_finished"] += 1
            st = outs.scheduler_stats
            if st is not None:
                pcs = st.prefix_cache_stats
                if pcs is not None:
                    self.stats["local_hit_tokens"] += int(pcs.hits)
                cpcs = st.connector_prefix_cache_stats
                if cpcs is not None:
                    self.stats["external_hit_tokens"] += int(cpcs.hits)
                if st.kv_connector_stats:
                    self.kv_connector_stats.append(st.kv_connector_stats)
        # requests freed without output (e.g. aborted) drop their state
        for rid in list(self._req_state):
            if rid not in self.scheduler.requests:
                self._last_tables[rid] = self._req_state.pop(rid).tables
        self._collect_events()
        return eco

    def _collect_events(self) -> None:
        pub = self.scheduler.kv_event_publisher
        # The null publisher drops batches; wrap publish once to keep them.
        if not getattr(pub, "_kvstore_harness_wrapped", False):
            orig = pub.publish

            def publish(batch, _orig=orig, _sink=self.events):
                _sink.extend(batch.events)
                return _orig(batch)

            try:
                pub.publish = publish
                pub._kvstore_harness_wrapped = True
            except Exception:  # pragma: no cover - publisher without __dict__
                pass

    def busy(self) -> bool:
        """True while vLLM's EngineCore would keep stepping."""
        return self.scheduler.has_requests() or self._pending is not None

    def drain(self, max_steps: int | None = None, timeout_s: float = 120.0) -> None:
        """Step until the engine would go idle (``Scheduler.has_requests()``
        false). Raises HarnessError after ``max_steps`` steps (if given) or
        ``timeout_s`` seconds: background I/O makes the step count vary, so the
        bound that matters is time."""
        import time as _time

        self._collect_events()
        deadline = _time.monotonic() + timeout_s
        steps = 0
        while True:
            if not self.scheduler.has_requests():
                if self._pending is not None:
                    prev, self._pending = self._pending, None
                    self._update(*prev)
                    continue
                return
            if (max_steps is not None and steps >= max_steps) or _time.monotonic() > deadline:
                break
            self.step()
            steps += 1
            # As vLLM's EngineCore after a step that ran no model while requests remain
            # (waiting for their KV loads, delayed frees): a 1 ms sleep that yields the
            # GIL to the transfer threads (`_process_engine_step`, vLLM 0.32 and 0.33).
            # Without it the harness spins on empty steps, and kvstore's nice-19 I/O
            # threads crawl through the loads (docs/benchmarks.md).
            if not self.last_step_executed and self.scheduler.has_requests():
                _time.sleep(0.001)
        raise HarnessError(
            f"engine still busy after {steps} steps / {timeout_s:.0f}s: "
            f"{len(self.scheduler.requests)} requests, "
            f"waiting={len(self.scheduler.waiting)}, "
            f"kv_holding_waiting={len(self.scheduler.kv_holding_waiting)}, "
            f"running={len(self.scheduler.running)}"
        )

    def idle_steps(self, n: int) -> None:
        """Run ``n`` steps with nothing to schedule (vLLM's EngineCore does not
        do this by itself; use it to let a connector finish background work)."""
        for _ in range(n):
            self.step()

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 1,
        *,
        idle_steps: int = 0,
        max_steps: int | None = None,
        cache_salt: str | None = None,
    ) -> dict:
        """Add ``prompts``, step until the engine is idle, return stats."""
        for p in prompts:
            self.add_request(p, max_tokens=max_tokens, cache_salt=cache_salt)
        self.drain(max_steps)
        if idle_steps:
            self.idle_steps(idle_steps)
            self.drain(max_steps)
        return dict(self.stats)

    # ------------------------------------------------------------ checks/etc
    def forget_finished(self) -> None:
        """Drop the per-request history of finished requests (outputs, block tables),
        so that a long soak measures the product's memory, not the harness's."""
        self.finished.clear()
        self._last_tables.clear()
        self.kv_connector_stats.clear()
        self.events.clear()


    def assert_no_leaks(self) -> None:
        s = self.scheduler
        problems = []
        if s.requests:
            problems.append(f"requests={list(s.requests)}")
        if len(s.waiting) or len(s.kv_holding_waiting) or s.running:
            problems.append(
                f"queues waiting={len(s.waiting)} "
                f"kv_holding_waiting={len(s.kv_holding_waiting)} running={len(s.running)}"
            )
        if s.finished_req_ids:
            problems.append(f"finished_req_ids={s.finished_req_ids}")
        if s.finished_recving_kv_req_ids or s.failed_recving_kv_req_ids:
            problems.append("recving sets not empty")
        if s._inflight_prefills:
            problems.append("inflight prefills")
        mgr = s.kv_cache_manager
        for stm in mgr.coordinator.single_type_managers:
            if stm.req_to_blocks:
                problems.append(f"req_to_blocks={list(stm.req_to_blocks)}")
        pool = mgr.block_pool
        held = [b.block_id for b in pool.blocks if b.ref_cnt != 0 and not b.is_null]
        if held:
            problems.append(f"blocks with ref_cnt>0: {held[:20]}")
        free = pool.free_block_queue.num_free_blocks
        if free != pool.num_gpu_blocks - 1:
            problems.append(f"free blocks {free} != {pool.num_gpu_blocks - 1}")
        if problems:
            raise HarnessError("leak: " + "; ".join(problems))

    def block_table(self, req_id: str) -> list[int]:
        """Group-0 block table of a request as the worker saw it last (also
        after the request finished)."""
        return self.block_tables(req_id)[0]

    def block_tables(self, req_id: str) -> tuple[list[int], ...]:
        """Block table of every KV cache group of a request (one list per group, as
        ``KVCacheBlocks.get_block_ids()``), as the worker saw it last, also after the
        request finished. Block id 0 is vLLM's null block (sliding-window blocks
        outside the window)."""
        st = self._req_state.get(req_id)
        tables = st.tables if st is not None else self._last_tables[req_id]
        return tuple(list(t) for t in tables)

    def layers_of_group(self, group: int) -> list[int]:
        """Layer indices (for ``byte_views``, ``corrupt_block``) of a KV cache group."""
        return list(self.group_layers[group])

    def corrupt_block(self, block_id: int, rank: int = 0, layer: int = 0,
                      byte: int = 0) -> None:
        """Flip one byte of ``block_id`` in a rank's KV cache (test helper). ``layer``
        indexes ``layer_names``; the block is read through that layer's group (see
        ``layer_groups``/``layers_of_group``). Byte ``b`` is, in the logical
        ``[H, N, C]`` page, head ``b // (N*C)``, token ``b // C % N``, byte ``b % C``."""
        bv = self.ranks[rank].byte_views[layer]  # [B, H, N, Cbytes], strided
        _, nh, nn, nc = bv.shape
        hi, rest = divmod(byte % (nh * nn * nc), nn * nc)
        ni, ci = divmod(rest, nc)
        bv[block_id, hi, ni, ci] ^= 0xFF

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rk in self.ranks:
            if rk.connector is not None:
                rk.connector.shutdown()
        try:
            self.scheduler.shutdown()
            # vLLM's ZMQ publisher closes its sockets but leaves its context (and the
            # context's fds) to the process; a harness is a whole engine: it ends it.
            ctx = getattr(self.scheduler.kv_event_publisher, "_ctx", None)
            if ctx is not None and not ctx.closed:
                ctx.term()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> EngineHarness:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
