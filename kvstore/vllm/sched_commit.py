"""Store jobs in flight on the connector's scheduler side: from the step that planned
one (`StorePlanner`) until every TP rank reported it written, then until the index
thread committed its good blocks (and fsynced) and put them in the table."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore._keytable import KeySet, keys_with_packed
from kvstore.vllm.metadata import HashedBlocks, StoreJob, StoreReport
from kvstore.vllm.sched_context import SchedulerContext
from kvstore.vllm.sched_events import BlockOrigins


@dataclass(slots=True)
class InflightStore:
    """A store job between planning and its commit: reported by `ranks` ranks so far.
    Blocks are parallel lists (no object per block: a step stores hundreds of them):
    `keys`, then the blocks of `hashed` (their keys are made by the index thread)."""
    keys: list[bytes]
    slots: Sequence[int]            # arrays "I" / "Q" from the slot pool, or lists
    generations: Sequence[int]
    origins: BlockOrigins | None    # for BlockStored events (None without KV events)
    started: float
    hashed: HashedBlocks | None = None
    ranks: int = 0
    failed: set[int] = field(default_factory=set)   # block indices, from any rank
    reset: bool = False             # reset_cache ran meanwhile: nothing is committed

    def all_keys(self) -> list[bytes]:
        return keys_with_packed(self.keys, self.hashed)

    def keys_or_made(self, hashed: HashedBlocks | None = None) -> list[bytes]:
        """Every key, or the ones made at planning if the rest cannot be made. Once the
        commit is queued, the hashed blocks went with it: `hashed` is what the index
        thread handed back with a commit it could not key."""
        try:
            return keys_with_packed(self.keys, hashed) if hashed is not None else self.all_keys()
        except Exception:   # (no memory) what was made at planning, then
            return self.keys


class StoreCommits:
    """The store jobs in flight (`inflight`, by job id) and the commits queued to the
    index thread (`committing`). `storing` holds the keys planned and not yet committed
    or dropped (the planner adds them; the index thread releases a commit's keys)."""

    def __init__(self, ctx: SchedulerContext, tp_size: int):
        self.ctx = ctx
        self.index = ctx.index
        self.stats = ctx.stats
        self.tp_size = tp_size
        # fingerprints in C (`plan_new` probes it with the ones its walk made), a set's
        # API for the other planners
        self.storing = KeySet()
        self.inflight: dict[int, InflightStore] = {}
        self.committing = 0                     # stores handed to the index thread
        self.stored_blocks_total = 0            # blocks committed since start (benchmarks)

    def track(self, job: StoreJob, origins: BlockOrigins | None) -> None:
        """`job` goes to the workers with this step's metadata."""
        self.inflight[job.job_id] = InflightStore(
            keys=job.keys, slots=job.slots, generations=job.generations, origins=origins,
            started=time.monotonic(), hashed=job.hashed)

    def reported(self, job_id: int, report: StoreReport) -> None:
        """Ranks reported store job `job_id` written (`report.failed`: its blocks that
        failed on any of them); once every rank did, its good blocks are durable and the
        index thread commits them (and fsyncs). Their keys stay in `storing` until that
        commit is applied."""
        st = self.inflight.get(job_id)
        if st is None:
            return
        st.ranks += report.ranks
        st.failed.update(report.failed)
        if st.ranks < self.tp_size:
            return
        del self.inflight[job_id]
        self.committing += 1
        # The keys of st.hashed are made by the index thread. After a reset every block
        # is aborted (nothing is committed).
        failed = set(range(len(st.slots))) if st.reset else st.failed
        # The index thread releases the job's keys from `storing` itself, once its good
        # blocks are in the table: no per-block work here when the commit comes back.
        self.index.commit_blocks(st.keys, st.slots, st.generations, failed, tag=st,
                                 packed=st.hashed,
                                 keys_back=self.ctx.events_enabled or self.ctx.remote is not None,
                                 release=self.storing)
        # The queued commit holds vLLM's hashes now, mostly their last reference (the
        # requests have finished): they are freed on the index thread, not here.
        st.hashed = None

    def committed(self, ev) -> list[bytes] | None:
        """The index thread applied a commit (`lookup.events.Committed`, tagged with its
        `InflightStore`). Returns the job's keys when it has them (KV events)."""
        st = ev.tag
        self.committing -= 1
        # every key of the job left `storing` on the index thread (`release`); as
        # fingerprints if it could not release them, as keys when it could not make
        # fingerprints; `keys` when KV events need them
        keys = ev.keys
        if ev.fps:
            self.storing.discard_fingerprints(ev.fps)
        elif not ev.released:   # a commit the index thread could not key
            keys = keys or st.keys_or_made(ev.packed)
            self.storing.difference_update(keys)
        if ev.error is not None:
            # The index cannot be written (e.g. the disk is full): the store is
            # dropped; its reservations are given back when the index can be.
            self.ctx.warn_once("commit", ev.error)
        n = ev.count or len(ev.items)
        self.stored_blocks_total += n
        if not st.reset:
            self.stats.add(stored_blocks=n, store_dropped_blocks=ev.failed)
            remote = self.ctx.remote
            if remote is not None and keys and n:
                # to the pool, behind the serving path (the agent reads them back from
                # disk; a failed block is not in the index and is skipped there)
                remote.publish(keys)
                self.stats.add(pool_published_blocks=n)
        return keys

    def reset(self) -> None:
        """reset_cache: the stores in flight commit nothing."""
        for st in self.inflight.values():
            st.reset = True

    def abandoned(self) -> list:
        """The reservations of the stores in flight, to give back at shutdown: (key, slot,
        generation) each, or slots alone when the keys cannot be made."""
        try:
            return [x for st in self.inflight.values()
                    for x in zip(st.all_keys(), st.slots, st.generations)]
        except Exception:   # (no memory to make keys) by slot, then
            return [s_ for st in self.inflight.values() for s_ in st.slots]
