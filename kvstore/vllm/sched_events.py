"""KV events of the connector's scheduler side (vLLM's `--kv-events-config`): a committed
store is a `BlockStored` with medium STORAGE and what vLLM's own GPU event of that block
carries (`BlockOrigins`, taken when the store is planned); an eviction or a drop is a
`BlockRemoved`; entries found on disk at start are announced by hash."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys)

MEDIUM = "STORAGE"


@dataclass(slots=True)
class BlockOrigins:
    """What each planned block's `BlockStored` event carries besides its hash, as vLLM's
    own GPU events do: one list per field, position i for the store job's block i (no
    object per block). Taken when the store is planned: the request has usually finished
    (and is gone) by the time every rank reported the write durable. Lazy stores come from
    vLLM's free queue, which keeps no tokens: they have none (the lists end before them)."""
    tokens: list[list[int]] = field(default_factory=list)
    parents: list = field(default_factory=list)         # parent block hash, or None
    lora_ids: list[int | None] = field(default_factory=list)
    lora_names: list[str | None] = field(default_factory=list)
    extra_keys: list = field(default_factory=list)
    sessions: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, req, i: int, block_size: int) -> None:
        """Block i of vLLM request `req`."""
        bs = block_size
        lora = req.lora_request
        extra, _ = generate_block_hash_extra_keys(req, i * bs, (i + 1) * bs, 0)
        self.tokens.append(list(req.all_token_ids[i * bs:(i + 1) * bs]))
        self.parents.append(maybe_convert_block_hash(req.block_hashes[i - 1]) if i > 0 else None)
        self.lora_ids.append(lora.adapter_id if lora else None)
        self.lora_names.append(lora.name if lora else None)
        self.extra_keys.append(to_event_extra_keys([extra]))
        self.sessions.append(getattr(req, "session_id", None))

    def truncate(self, n: int) -> None:
        """Keep the first n blocks' origins."""
        del self.tokens[n:], self.parents[n:], self.lora_ids[n:], self.lora_names[n:], \
            self.extra_keys[n:], self.sessions[n:]


class KVEvents:
    """The KV events of this engine's store, queued until vLLM takes them (`take`)."""

    def __init__(self, block_size: int, enabled: bool):
        self.block_size = block_size
        self.enabled = enabled
        self.pending: list = []

    def take(self) -> list:
        out, self.pending = self.pending, []
        return out

    def removed(self, keys: list[bytes]) -> None:
        if self.enabled and keys:
            self.pending.append(BlockRemoved(
                block_hashes=[maybe_convert_block_hash(k[:-4]) for k in keys], medium=MEDIUM))

    def stored(self, good, keys: list[bytes], origins: BlockOrigins | None) -> None:
        """A `BlockStored` per committed (key, slot, generation) of `good`; `keys` are
        the store job's keys in order, `origins` what its blocks' events carry."""
        at = dict(zip(keys, range(len(origins)))) if origins is not None else {}
        bs = self.block_size
        pending = self.pending
        for key, _slot, _gen in good:
            i = at.get(key)
            if i is None:       # (a lazy store: the hash only)
                tokens, parent, lora_id, lora_name, extra, session = \
                    [], None, None, None, None, None
            else:
                tokens, parent, lora_id, lora_name, extra, session = (
                    origins.tokens[i], origins.parents[i], origins.lora_ids[i],
                    origins.lora_names[i], origins.extra_keys[i], origins.sessions[i])
            pending.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(key[:-4])], parent_block_hash=parent,
                token_ids=tokens, block_size=bs, lora_id=lora_id, medium=MEDIUM,
                lora_name=lora_name, extra_keys=extra, session_id=session,
                group_idx=int.from_bytes(key[-4:], "big")))

    def announce(self, keys: list[bytes]) -> list:
        """BlockStored events for entries found on disk at start (index thread): the
        hashes only (the store keeps no tokens, parents or LoRA names), one event per
        KV cache group in the batch."""
        by_group: dict[int, list] = {}
        for k in keys:
            by_group.setdefault(int.from_bytes(k[-4:], "big"), []).append(
                maybe_convert_block_hash(k[:-4]))
        return [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                            block_size=self.block_size, lora_id=None, medium=MEDIUM,
                            lora_name=None, group_idx=g)
                for g, hashes in by_group.items()]
