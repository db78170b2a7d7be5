"""The CPU harness's ground truth: the tiny model directory it serves, and the KV bytes
and Mamba states its fake forward writes, each a pure function of (hash of the token
prefix, layer, position, rank), which every check compares against; `slot_positions`
maps a range of token positions to (block, offset) through a block table; and
`HarnessError`, what the harness raises when the engine misbehaves.

Used by `kvstore.drivers.simulator.EngineHarness` and its parts; imports neither vLLM nor
torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

__all__ = [
    "HarnessError",
    "write_model_dir",
    "prefix_hashes",
    "expected_token_bytes",
    "expected_state_bytes",
    "slot_positions",
]

class HarnessError(AssertionError):
    """The harness saw the engine misbehave (stuck request, leak, ...)."""


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


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


def slot_positions(block_ids: list[int], start: int, end: int, block_size: int):
    """Positions ``[start, end)`` and, for each, its block id (through the block
    table ``block_ids``) and its offset in the block: three int64 arrays."""
    pos = np.arange(start, end, dtype=np.int64)
    bidx = np.asarray(block_ids, dtype=np.int64)[pos // block_size]
    return pos, bidx, pos % block_size
