"""Asking the pool one key at a time, for a caller that looks keys up one by one and can
answer "ask again" (vLLM's secondary tiers: `LookupResult.RETRY`, which the
OffloadingConnector's scheduler takes as "defer this request" and which does not stop its
scan of the request's keys).

`KeyAsks.state(key, req_id)` says "retry" (the key waits for the pool: asked, or to be
asked at the step's end), "filled" (its fetch just ended with blocks filled: the caller
looks in its local store again, where the agent put what the pool had) or "done" (the
pool has nothing for it, or cannot answer). `flush()`, once per step,
hands the keys each request registered to the fleet agent as one fetch, in the order the
caller looked them up (the agent fills the prefix of them the pool has). A key the pool
was asked for is not asked again for `TRIED_S`.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from kvstore.remote.client import RemoteClient


@dataclass(slots=True)
class Ask:
    """One fetch in flight: its keys, and the agent's answer once read (blocks local)."""
    token: int
    deadline: float
    keys: list[bytes]
    result: int | None = None     # blocks local after the fetch (-1: no answer in time)


class KeyAsks:
    """See the module docstring. For one thread (the caller's lookups and steps)."""

    TRIED_S = 30.0

    def __init__(self, client: RemoteClient, timeout_s: float, adopt=None):
        """`adopt(keys, slots, generations)`: entries the agent reports local, for the
        caller's in-memory table."""
        self.client, self.timeout_s, self.adopt = client, timeout_s, adopt
        self._batch: dict[str, list[bytes]] = {}
        self._asks: dict[bytes, Ask] = {}
        self._tried: dict[bytes, float] = {}    # key -> until when it is not asked again
        self._tokens = itertools.count(1)
        self.lookups = self.filled = self.timeouts = 0

    def state(self, key: bytes, req_id: str) -> str:
        now = time.monotonic()
        ask = self._asks.get(key)
        if ask is not None:
            if ask.result is None:
                ans = self.client.answer(ask.token)
                if ans is None:
                    if now < ask.deadline and not self.client.down:
                        return "retry"
                    got = -1
                    self.timeouts += 1
                    self.client.abandon(ask.token)
                else:
                    got = ans.blocks
                    self.filled += got
                    if got and self.adopt is not None:
                        self.adopt(ask.keys[:got], ans.slots, ans.generations)
                ask.result = got
            for k in ask.keys:
                if self._asks.get(k) is ask:
                    del self._asks[k]
                self._tried[k] = now + self.TRIED_S
            return "filled" if ask.result > 0 else "done"
        until = self._tried.get(key)
        if until is not None:
            if now < until:
                return "done"
            del self._tried[key]
        if self.client.down:
            return "done"
        keys = self._batch.setdefault(req_id, [])
        if not keys or keys[-1] != key:
            keys.append(key)
        return "retry"

    def flush(self) -> None:
        """Hand this step's registered keys to the agent, one fetch per request."""
        if self._batch:
            now = time.monotonic()
            for keys in self._batch.values():
                token = next(self._tokens)
                if self.client.ask(token, keys):
                    self.lookups += 1
                    ask = Ask(token, now + self.timeout_s, keys)
                    for k in keys:
                        self._asks[k] = ask
                else:
                    for k in keys:
                        self._tried[k] = now + self.TRIED_S
            self._batch.clear()
        if len(self._tried) > 100_000:      # forget the expired (insertion order: oldest first)
            now = time.monotonic()
            for k in [k for k, t in itertools.islice(self._tried.items(), 50_000) if t <= now]:
                del self._tried[k]

    def take_counts(self) -> tuple[int, int, int]:
        """(lookups asked, blocks filled, timeouts) since the last call."""
        out = (self.lookups, self.filled, self.timeouts)
        self.lookups = self.filled = self.timeouts = 0
        return out
