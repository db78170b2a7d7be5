"""Outcomes of `ServingIndex`'s index thread, for the step thread (`ServingIndex.poll`):
one frozen dataclass per kind, each with the fields it carries. `kind` names the event
(logs, diagnostics); consumers dispatch on the class. `Outbox` holds the ones posted and
not polled yet."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class Committed:
    """A queued commit was applied (or failed: `error`). Its good blocks are hits now."""
    kind: ClassVar[str] = "committed"
    tag: object = None              # the caller's tag of the commit (its store job)
    items: list = field(default_factory=list)   # (key, slot, generation) now hits (empty
    #                                             without `keys_back`)
    keys: list = field(default_factory=list)    # every key of the job, in order (with
    #                                             `keys_back`)
    count: int = 0                  # blocks committed (`items` may be left empty)
    failed: int = 0                 # blocks not committed (stale or write error)
    fps: bytes = b""                # (commit_blocks) every key's fingerprint; empty once
    #                                 the index thread released them itself
    released: bool = False          # every key left the caller's `release` set
    packed: tuple | None = None     # unkeyed (its keys could not be made): the job's
    #                                 (hashes, group runs), for the step thread to release
    error: Exception | None = None  # why the commit failed (every block is then failed)


@dataclass(frozen=True, slots=True)
class Evicted:
    """The pool refill evicted LRU entries; they left the table and LMDB."""
    kind: ClassVar[str] = "evicted"
    keys: list = field(default_factory=list)    # empty when KV events do not need them
    count: int = 0


@dataclass(frozen=True, slots=True)
class Dropped:
    """Entries removed (a load found them bad, reset_cache, a fenced device)."""
    kind: ClassVar[str] = "dropped"
    keys: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Counted:
    """`ServingIndex.count_dropped`'s count: new blocks a dry pool dropped (0 if
    counting failed: one event per call, always)."""
    kind: ClassVar[str] = "counted"
    count: int = 0


@dataclass(frozen=True, slots=True)
class AnnounceBatch:
    """Entries found on disk at open, as the events the `announce` callback made for
    them; the step thread publishes them and calls `ServingIndex.announced`."""
    kind: ClassVar[str] = "announce"
    events: list = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Failed:
    """An operation of the index thread failed (the step thread logs it once)."""
    kind: ClassVar[str] = "error"
    what: str = ""                  # what failed (the operation's name)
    error: Exception | None = None


IndexEvent = Committed | Evicted | Dropped | Counted | AnnounceBatch | Failed


class Outbox:
    """The index thread's events the step thread has not polled yet, in the order they
    were posted, and the wake-up of a step thread that waits for one (`wait`)."""

    __slots__ = ("events", "posted")

    def __init__(self):
        self.events: deque[IndexEvent] = deque()
        self.posted = threading.Event()

    def post(self, ev: IndexEvent) -> None:
        self.events.append(ev)
        self.posted.set()

    def fail(self, what: str, exc: Exception) -> None:
        self.post(Failed(what=what, error=exc))

    def take(self) -> list[IndexEvent]:
        """Every event posted so far, oldest first."""
        out = []
        ev = self.events
        while ev:
            out.append(ev.popleft())
        return out

    def wait(self, timeout: float) -> None:
        """Sleep until an event is posted, `timeout` at most (`ServingIndex.wait_events`)."""
        if self.posted.wait(timeout):
            self.posted.clear()
