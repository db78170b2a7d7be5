"""One thread per device that drives its io_uring ring as a stream of parts.

A batch loop (`RankIO.write_blocks`, `read_pipelined`) moves a request's blocks in chunks
through a double buffer. Run as one ring call per chunk, each device's share of a chunk
ends with a tail: its last `queue_depth` ops drain with nothing to refill the queue, so a
device's mean queue occupancy is at most q(P - q/2)/P for a share of P ops at depth q (24
of 32 for P = 64). A `DeviceStream` removes the tail: the chunk's share is *started* on
the ring (`Ring.slot_io_start`: its ops queue behind the ones in flight) as soon as the
batch loop hands it over, while the thread is still pumping the share before it, so the
ring refills from the next share as the current one drains. The pump returns early when
new work is posted (`Ring.wake`), the thread starts it, and pumping goes on.

Each ring is still used by one thread only: its device's. Plain ring calls (`call`:
header reads, fdatasync) run on the same thread, between pumps; the parts already started
keep moving while they run (a ring pumps every started batch).
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from typing import Any, Callable

from kvstore.errors import StoreClosed
from kvstore.io.threads import make_thread

# Parts started on one ring at once: a Ring keeps at most 8 batches active, and one is
# left for a plain call (a header read, an fdatasync) run between pumps. Parts posted
# beyond that wait, unstarted, until one ends.
MAX_STARTED = 7


class DeviceStream:
    """The thread that owns one device's ring (see the module docstring)."""

    def __init__(self, ring, name: str, cpus: frozenset[int] | None = None, nice: int = 0):
        self.ring = ring
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = make_thread(self._run, name, cpus, nice=nice)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` (plain work on this device's ring) on the device's thread."""
        return self._post("call", fn, None)

    def start(self, make_part: Callable[[], Any], after: Callable[[Any], Any]) -> Future:
        """Start `make_part()` (a `Ring.slot_io_start` on this device's ring) on the
        device's thread, behind the parts already started; the future resolves to
        `after((results, status))` once the part's slots have moved (`after` runs on the
        device's thread too: accounting that belongs to the device)."""
        return self._post("part", make_part, after)

    def _post(self, kind, fn, after) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise StoreClosed("the device's I/O thread is stopped (the store is closing)")
            self._items.append((kind, fn, after, fut))
            self._cv.notify()
        self.ring.wake()   # a pump in progress returns, and the thread takes the new work
        return fut

    def close(self) -> None:
        """Stop the thread after the work already posted (idempotent)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        active: collections.deque = collections.deque()   # (part, after, future), oldest first
        waiting: collections.deque = collections.deque()  # parts posted, not started yet
        while True:
            with self._cv:
                while not self._items and not active and not waiting and not self._closed:
                    self._cv.wait()
                items = list(self._items)
                self._items.clear()
                closing = self._closed
            for item in items:
                kind, fn, after, fut = item
                if kind == "call":
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except BaseException as exc:   # noqa: BLE001 - handed to the waiter
                            fut.set_exception(exc)
                else:
                    waiting.append(item)
            while waiting and len(active) < MAX_STARTED:
                _, fn, after, fut = waiting.popleft()
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    active.append((fn(), after, fut))
                except BaseException as exc:   # noqa: BLE001
                    fut.set_exception(exc)
            if not active:
                if closing and not waiting:
                    return
                continue
            part, after, fut = active[0]
            try:
                if not self.ring.slot_io_pump(part):
                    continue   # woken: take the new work, then go on pumping
                active.popleft()
                fut.set_result(after(self.ring.slot_io_finish(part)))
            except BaseException as exc:   # noqa: BLE001
                # The part has ended (nothing of it is in flight; an io_uring_enter
                # failure with ops in flight closes the ring, and the other started
                # parts then fail at their own pump, each with its error).
                if active and active[0][0] is part:
                    active.popleft()
                fut.set_exception(exc)
