"""Block keys of a prompt: vLLM's own block hashes plus the KV-cache group id.

A store's keys are what vLLM computes for `Request.block_hashes`
(`vllm.v1.core.kv_cache_utils.get_request_block_hasher`): a chain over the prompt's
*full* blocks of `block_size` tokens, `hash_i = H((hash_{i-1}, tokens_i, extra_keys_i))`
with `hash_{-1} = NONE_HASH`, where H is the prefix-caching hash function
(`--prefix-caching-hash-algo`, default sha256) and NONE_HASH is what `init_none_hash(H)`
derives (`H(seed)`; the seed is vLLM's fixed default for cryptographic hashes unless
PYTHONHASHSEED is set, exactly as in the serving process). The store key of block i is
`bytes(hash_i) + group.to_bytes(4, "big")`: vLLM's own `BlockHashWithGroupId` packing
(`make_block_hash_with_group_id`), which is what the connector stores and looks up
(`kvstore.vllm.config.block_key`; a test holds the two together). vLLM is imported
lazily (it takes seconds).

Supported extra keys: `cache_salt` (on the first block, as vLLM does). Requests with
LoRA adapters, multimodal inputs or prompt embeddings hash extra keys that a token list
alone does not carry; their blocks cannot be derived here.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from kvstore.errors import ConfigError

__all__ = ["prompt_block_keys", "none_hash"]


@lru_cache(maxsize=8)
def _hash_fn(hash_algo: str):
    from vllm.utils.hashing import get_hash_fn_by_name
    try:
        return get_hash_fn_by_name(hash_algo)
    except ValueError as exc:
        raise ConfigError(f"unknown prefix-caching hash algorithm {hash_algo!r}: {exc}") from None


@lru_cache(maxsize=8)
def none_hash(hash_algo: str = "sha256") -> bytes:
    """NONE_HASH as `init_none_hash(H)` sets it in vLLM (without touching vLLM's global)."""
    import os
    from vllm.v1.core import kv_cache_utils as kcu
    fn = _hash_fn(hash_algo)
    if fn in kcu._NON_CRYPTO_HASH_FUNCTIONS and os.getenv("PYTHONHASHSEED") is None:
        raise ConfigError(
            f"hash algorithm {hash_algo!r} seeds vLLM's block hashes randomly per process, so "
            "keys cannot be reproduced here; set PYTHONHASHSEED to the value the server uses "
            "(or serve with the default sha256)")
    return bytes(fn(kcu.resolve_none_hash_seed(fn)))


def prompt_block_keys(token_ids: Sequence[int], block_size: int, group: int = 0, *,
                      hash_algo: str = "sha256", cache_salt: str | None = None) -> list[bytes]:
    """Store keys of the full blocks of `token_ids` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ConfigError(f"block_size must be positive, got {block_size}")
    if not 0 <= group < 1 << 32:
        raise ConfigError(f"KV-group id must fit 4 bytes (0..2**32-1), got {group}")
    from vllm.v1.core.kv_cache_utils import hash_block_tokens
    fn = _hash_fn(hash_algo)
    parent = none_hash(hash_algo)
    suffix = group.to_bytes(4, "big")
    ids = [int(t) for t in token_ids]
    out: list[bytes] = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        h = hash_block_tokens(fn, parent, ids[start:start + block_size], extra)
        out.append(bytes(h) + suffix)
        parent = h
    return out
