"""The index thread: the one LMDB writer of the serving index, and its rounds.

`IndexThread` owns the thread: at open it builds the lookup table from LMDB (lookups read
LMDB until then), then, round after round, takes every operation queued by then
(`kvstore.lookup.ops.OpQueue`), applies them in order (`IndexWrites`, the drops' and
fences' other halves, the counts of a dry pool), refills the slot pool and follows the
other engines of a shared store. After a restart it also announces every entry found on
disk, a batch per round, in order with the other events. It stops on `close`, after
applying what is queued and giving the pool's slots back.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from kvstore._keytable import make_keys
from kvstore.io.threads import make_thread
from kvstore.lookup.events import AnnounceBatch, Counted, IndexEvent
from kvstore.lookup.lookups import yield_gil
from kvstore.lookup.ops import (STOP, AbortOp, CommitBlocksOp, CommitOp, CountHitsOp,
                                CountNewOp, DropAllOp, DropOp, FenceOp, MarkOp, RefillOp,
                                StopOp, TouchBlocksOp, TouchOp)
from kvstore.lookup.peers import PEERS_EVERY_S

log = logging.getLogger("kvstore.lookup.table")


class IndexThread:
    """See the module docstring. The parts it drives: `lookups` (`TableLookups`),
    `writes` (`IndexWrites`), `pool` (`SlotPool`), `peers` (`PeerFollower`), `devices`
    (`DeviceFences`); `requests` (`OpQueue`) and `outbox` (`Outbox`) connect it to the
    step thread."""

    def __init__(self, index, lookups, writes, pool, peers, devices, requests, outbox, *,
                 announce=None):
        self.index = index
        self.lookups = lookups
        self.writes = writes
        self.pool = pool
        self.peers = peers
        self.devices = devices
        self.requests = requests
        self.outbox = outbox
        self.lease = peers.lease
        # After a restart, every entry on disk is announced (KV events a router learns
        # from): `announce(keys)` makes a batch's events on the index thread, posted in
        # order with evictions and drops (an `AnnounceBatch` event), two batches at most
        # waiting for the step thread (`announced` gives one back).
        self.announce = announce
        self.announce_room = threading.Semaphore(2)
        self.closed = False
        self.build_s = 0.0
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ step thread

    def start(self, thread_cpus: frozenset[int] | None = None) -> None:
        self.thread = make_thread(self.run, "kvstore-index", thread_cpus)
        self.thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """`ServingIndex.wait_ready`."""
        lookups = self.lookups
        deadline = None if timeout is None else time.monotonic() + timeout
        while not lookups.ready and self.thread.is_alive():
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return lookups.ready

    def poll(self) -> list[IndexEvent]:
        """`ServingIndex.poll`."""
        self.requests.send_counts()
        out = []
        ev = self.outbox.events
        while ev:
            out.append(ev.popleft())
        return out

    def announced(self) -> None:
        """The step thread published an `AnnounceBatch`: room for the next."""
        self.announce_room.release()

    def close(self, join_s: float) -> bool:
        """`ServingIndex.close`: stop after what is queued, waiting `join_s` at most."""
        if self.closed:
            return not self.thread.is_alive()
        self.closed = True
        self.requests.send_counts()
        self.requests.put(STOP)
        self.thread.join(timeout=join_s)
        self.index.pause = None
        if self.thread.is_alive():
            log.error("kvstore: index thread still busy after %.0fs at shutdown; its "
                      "reservations are reclaimed at the next open", join_s)
            return False
        return True

    # ------------------------------------------------------------------ index thread

    def build(self) -> None:
        """Build the lookup table; LMDB lookups stay in use if that fails."""
        t0 = time.perf_counter()
        try:
            self.lookups.build()
        except Exception as exc:  # LMDB lookups stay in use: slower, still correct
            log.error("kvstore: building the lookup table failed (%s); lookups read LMDB", exc)
            self.outbox.fail("building the lookup table", exc)
        else:
            self.build_s = time.perf_counter() - t0
            self.lookups.ready = True

    def run(self) -> None:
        self.build()
        announcing = None
        if self.announce is not None and self.lookups.ready:
            announcing = self.index.iter_key_batches()
        else:
            self.announce = None
        ops_q = self.requests.ops
        stop = False
        while not stop:
            if announcing is not None:
                # One batch per round, between the rounds of operations (never ahead of
                # them), while the step thread has room for it.
                if self.announce_room.acquire(blocking=False):
                    announcing = self.announce_next(announcing)
                try:
                    ops = [ops_q.get(timeout=0.05)]
                except queue.Empty:
                    self.upkeep_shared_safe()
                    continue
            elif self.lease is not None:
                try:
                    ops = [ops_q.get(timeout=PEERS_EVERY_S)]
                except queue.Empty:
                    self.upkeep_shared_safe()
                    continue
            else:
                ops = [ops_q.get()]
            while True:     # everything queued by now is handled in this round
                try:
                    ops.append(ops_q.get_nowait())
                except queue.Empty:
                    break
            stop = self.apply(ops)

    def apply(self, ops: list) -> bool:
        """One round: apply `ops` in order (touches batched between the other writes),
        then the counts, the upkeep and the refill; True once told to stop."""
        writes = self.writes
        touches: list[bytes] = []
        hits = misses = 0
        marks = []
        stop = False
        for op in ops:
            try:
                match op:
                    case TouchOp(keys):
                        touches.extend(keys)
                        continue
                    case TouchBlocksOp(runs):
                        for hashes, groups in runs:
                            touches.extend(make_keys(hashes, groups))
                        continue
                if touches:         # keep the order of touches and the other writes
                    writes.touch(touches)
                    touches = []
                match op:
                    case CommitOp(good, bad, tag):
                        writes.commit(good, bad, tag)
                    case CommitBlocksOp():
                        writes.commit_blocks(op)
                    case AbortOp(items):
                        self.index.abort(items)
                    case DropOp(keys):
                        writes.drop(keys)
                        self.lookups.drop_applied(keys)
                    case DropAllOp():
                        writes.drop_all()
                        self.lookups.drop_all_applied()
                    case FenceOp(dev, reason, removed):
                        self.devices.apply(dev, reason, removed)
                    case CountNewOp(hashes, start, stop_at, skip, group):
                        n = 0
                        try:
                            n = self.lookups.count_new(hashes, start, stop_at, skip, group)
                        finally:        # the step thread waits for every count
                            self.outbox.post(Counted(count=n))
                    case CountHitsOp():
                        hits += op.hits
                        misses += op.misses
                    case MarkOp():
                        marks.append(op.done)
                    case StopOp():
                        stop = True
                    case RefillOp():
                        pass            # every round refills the pool
            except Exception as exc:
                self.outbox.fail(op.what, exc)
        try:
            if touches:
                writes.touch(touches)
            if hits or misses:
                self.index.count_hits(hits, misses)
            if stop:
                self.pool.give_back()
            else:
                self.peers.upkeep()
                self.pool.refill()
            writes.refresh_gauges()
        except Exception as exc:
            self.outbox.fail("index upkeep", exc)
        for m in marks:
            m.set()
        return stop

    def announce_next(self, batches):
        """Post the next batch of announcements (1024 keys); None (and `announce` None)
        when every entry found at open is announced or announcing failed."""
        try:
            keys = next(batches, None)
            if keys is None:
                self.announce = None
                return None
            events = []
            for i in range(0, len(keys), 1024):
                events.extend(self.announce(keys[i:i + 1024]))
                yield_gil()
            # In order with evictions and drops; not a wake-up for the step thread.
            self.outbox.events.append(AnnounceBatch(events=events))
            return batches
        except Exception as exc:
            self.announce = None
            self.outbox.fail("announcing the stored blocks", exc)
            return None

    def upkeep_shared_safe(self) -> None:
        try:
            self.peers.upkeep()
        except Exception as exc:
            if not self.closed:
                self.outbox.fail("following the other engines", exc)
