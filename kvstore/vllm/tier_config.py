"""The secondary tier's configuration and identity: its `secondary_tiers` options
(`TierConfig`: the store's settings, `kvstore.store.config.StoreConfig`, and the tier's
own), the store layout of the engine's primary chunks (`tier_layout`), the model identity
(`tier_identity`) and the check of an existing tier store against them."""
from __future__ import annotations

import os
from dataclasses import dataclass

from vllm.v1.kv_offload.base import Locality

from kvstore.errors import ConfigError, LayoutMismatch
from kvstore.format.layout import Layout, read_fingerprint
from kvstore.store.config import STORE_KEYS, Options, StoreConfig
from kvstore.vllm.config import ConnectorConfig
from kvstore.vllm.identity import identity_of_offload_model

# The tier's own keys, besides the store's (`STORE_KEYS`).
TIER_KEYS = ("enable_kv_events", "locality")

# Staging memory of each I/O thread when the chunks must go through it (the direct path
# needs only one slot's worth).
DEFAULT_STAGING = 64 << 20


@dataclass(frozen=True)
class TierConfig(StoreConfig):
    """A `secondary_tiers` entry of kvstore (without "type", "module_path" and
    "backpressure", which vLLM's factory takes): the store's settings and the tier's."""

    staging_bytes: int = DEFAULT_STAGING
    enable_kv_events: bool = False
    locality: str | None = None      # vLLM's Locality value ("LOCAL", "REMOTE")

    @classmethod
    def from_options(cls, options: dict) -> "TierConfig":
        """Check every option; unknown keys are refused, naming them."""
        unknown = sorted(set(options) - set(STORE_KEYS) - set(TIER_KEYS))
        if unknown:
            raise ConfigError(
                f"kvstore tier: unknown secondary_tiers key(s) {unknown}; valid keys: "
                f"{sorted(STORE_KEYS + TIER_KEYS)} besides \"type\", \"module_path\" and "
                "\"backpressure\" (see docs/CONFIG.md, \"As a secondary tier\")")
        if not isinstance(options.get("path"), str) or not options.get("path"):
            raise ConfigError('kvstore tier: the secondary_tiers entry needs "path": the store '
                              'directory on local NVMe, e.g. {"type": "KVStoreTier", "module_path": '
                              '"kvstore.vllm.tier", "path": "/mnt/nvme/kvstore-tier", '
                              '"capacity": "500G"}')
        locality = options.get("locality")
        if locality is not None:
            try:
                Locality(locality)
            except ValueError:
                raise ConfigError(f"kvstore tier: locality={locality!r} is not valid; choose one "
                                  f"of {', '.join(x.value for x in Locality)}") from None
        return cls(**StoreConfig.store_fields(options, staging_default=DEFAULT_STAGING,
                                              forward_on_host=ConnectorConfig.forward_on_host()),
                   enable_kv_events=Options(options, "kvstore tier").boolean("enable_kv_events", False),
                   locality=locality)


def tier_layout(offloading_spec, chunk_bytes: int) -> Layout:
    """The store layout of this engine's primary chunks: what makes a chunk's bytes valid.

    The tier stores whole primary chunks (every worker's part, as the primary holds it),
    so the fingerprint records the model, dtype, tokens per chunk, the chunk's byte size
    and its geometry in `kv_layout` ("tier-chunk;name=value;..."): blocks per chunk,
    tokens per hash, bytes per worker block, the groups, the KV cache layout, canonical or
    direct layout, and the parallel layout unless the bytes are parallelism-agnostic. The
    tier does not see vLLM's hash algorithm: `hash_algo` is "vllm-offload-key" (vLLM's
    block hash + group, as OffloadingConnector keys chunks)."""
    c = offloading_spec.config
    par = c.parallel
    # (causes before derived sizes: a mismatch names the first field that differs)
    fields = {
        "blocks_per_chunk": c.cache.blocks_per_chunk,
        "tokens_per_hash": c.cache.tokens_per_hash,
        "groups": "+".join(f"{g.group_id}:{g.tokens_per_block}x{len(g.layer_names)}"
                           for g in c.groups) or "-",
        "parallel": ("agnostic" if par.is_parallelism_agnostic else
                     f"tp{par.tp_size}-pp{par.pp_size}-pcp{par.pcp_size}-dcp{par.dcp_size}"
                     f"-world{par.world_size}"),
        "replicated": int(bool(c.replicated_layout)),
        "canonical": int(bool(c.canonical_layout)),
        "kv_cache_layout": c.kv_cache_layout or "-",
        "worker_block_bytes": c.worker_kv_bytes_per_block,
        "chunk_bytes": chunk_bytes,
    }
    layers = sum(len(g.layer_names) for g in c.groups)
    return Layout(
        model=str(c.model.name),
        dtype=str(c.model.dtype),
        block_size=max(1, c.cache.tokens_per_hash * c.cache.blocks_per_chunk),
        block_bytes=chunk_bytes,
        num_layers=max(1, layers),
        num_kv_heads=0,
        head_dim=0,
        tp_size=1,
        hash_algo="vllm-offload-key",
        kv_layout="tier-chunk;" + ";".join(f"{k}={v}" for k, v in fields.items()),
    )


def tier_identity(offloading_spec):
    """The model identity of the engine behind `offloading_spec` (`kvstore.vllm.identity`):
    its model's weights and config from the name vLLM gives the offloading config, and the
    engine's vLLM settings when its `VllmConfig` is the current one."""
    c = offloading_spec.config
    vllm_config = getattr(offloading_spec, "vllm_config", None)
    if vllm_config is None:
        try:
            from vllm.config import get_current_vllm_config_or_none
            vllm_config = get_current_vllm_config_or_none()
        except ImportError:
            vllm_config = None
    return identity_of_offload_model(str(c.model.name), vllm_config)


def _chunk_fields(kv_layout: str) -> dict[str, str]:
    if not kv_layout.startswith("tier-chunk;"):
        return {}
    return dict(p.split("=", 1) for p in kv_layout.split(";")[1:] if "=" in p)


def check_tier_store(path: str, layout: Layout) -> None:
    """Refuse a store written for other chunks, naming the field (`kv_layout.<name>` for
    the chunk geometry). A store that does not exist yet passes (it is created)."""
    if not os.path.lexists(os.path.join(path, "kvstore.json")):
        return
    stored, _, _ = read_fingerprint(path)
    diffs = stored.differences(layout)
    if not diffs:
        return
    name, have, want = diffs[0]
    if name == "kv_layout":
        a, b = _chunk_fields(str(have)), _chunk_fields(str(want))
        for sub in list(b) + [k for k in a if k not in b]:
            if a.get(sub) != b.get(sub):
                raise LayoutMismatch(
                    f"store {path} was written for primary chunks with {sub}={a.get(sub)!r} but "
                    f"this engine's chunks have {sub}={b.get(sub)!r}; refusing to serve KV of "
                    "another layout. Give the tier another path (or delete this store) for this "
                    "model/configuration.", field=f"kv_layout.{sub}")
    raise LayoutMismatch(
        f"store {path} was written with {name}={have!r} but this engine's primary chunks have "
        f"{name}={want!r}; refusing to serve KV of another layout. Give the tier another path "
        "(or delete this store) for this model/configuration.", field=name)


