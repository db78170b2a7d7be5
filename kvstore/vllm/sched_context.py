"""What the parts of the connector's scheduler side share (`KVStoreScheduler` composes
them: `Lookups`, `StorePlanner`, `KVEvents`): the serving index, the KV cache groups,
the requests vLLM handed over, the step's counters, one job id sequence and the
warn-once log."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from kvstore.lookup.table import ServingIndex
from kvstore.vllm.config import ConnectorConfig
from kvstore.vllm.metrics import KVStoreStats

log = logging.getLogger("kvstore.vllm.scheduler")


@dataclass(slots=True)
class SchedulerContext:
    """One engine's scheduler-side state that every part reads. `stats` is reset in
    place when reported (`KVStoreScheduler.get_stats`), so every part adds to the same
    object; `requests` is vLLM's `Request` by id, from its first lookup to
    `request_finished`."""
    cfg: ConnectorConfig
    index: ServingIndex
    block_size: int
    # (kind, tokens a hit needs before its end) per KV cache group: "full", "swa" or
    # "mamba" (`kv_group_kinds`). One group is the fast path; several (a hybrid model)
    # store and load every group as vLLM's hybrid coordinator defines a hit.
    group_kinds: list[tuple[str, int]]
    events_enabled: bool
    # The fleet agent's client (`kvstore.remote.client.RemoteClient`) when the store has a
    # remote level, else None.
    remote: Any = None
    requests: dict[str, Any] = field(default_factory=dict)
    stats: KVStoreStats = field(default_factory=KVStoreStats)
    hybrid: bool = field(init=False)
    mamba_groups: frozenset[int] = field(init=False)
    # load and store jobs share one sequence: a worker tells the step's jobs apart by id
    job_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    warned: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.hybrid = len(self.group_kinds) > 1
        self.mamba_groups = frozenset(g for g, (kind, _) in enumerate(self.group_kinds)
                                      if kind == "mamba")

    def warn_once(self, what: str, exc: Exception) -> None:
        if what not in self.warned:
            self.warned.add(what)
            log.warning("kvstore: %s failed (%s); serving continues without it", what, exc)

    def job_id(self) -> int:
        return next(self.job_ids)

    def window_blocks(self, retained: int) -> int:
        return -(-retained // self.block_size)

    def group_lo(self, g: int, start: int, end: int) -> int:
        """First block group g needs for a hit ending at block `end`: the whole prefix
        after the GPU hit (full attention), only the window before the end (sliding
        window), or only the state at the end (Mamba)."""
        kind, retained = self.group_kinds[g]
        if kind == "full":
            return start
        if kind == "mamba":
            return end - 1
        return max(start, end - self.window_blocks(retained))
