"""The I/O threads of `KVStoreTier` (kvstore/vllm/tier.py): loads, stores, flushes.

`TierIO` runs the three threads behind the tier's `submit_load` / `submit_store`, over
the serving index, the two rings and the primary memory the tier opened:

- the **load thread** (`kvstore-tier-load`) takes every queued load job, pins the hits
  in the table, reads and verifies them with one ring batch (its own `RankIO`) straight
  into the primary chunks, unpins, drops the entries that failed and posts the results;
- the **store thread** (`kvstore-tier-store`) takes every queued store job as one batch:
  it skips chunks the store has or is storing, takes reserved slots from the pool, and
  writes header + payload straight from the primary chunks with one ring batch (its own
  `RankIO`);
- the **sync thread** (`kvstore-tier-sync`) flushes the batches written by then with one
  fdatasync per slot file while the store thread writes the next one, and hands their
  commits to the index thread (group commit); once a commit is applied (an LMDB
  transaction and its fsync) it posts the jobs' results: a finished store is a durable
  hit. It is the one thread that takes the index thread's outcomes (`ServingIndex.poll`).

Every job a thread takes is reported exactly once, through the tier's `finish`: the batch
functions record which jobs they reported or handed on, and whatever a batch that raised
leaves unreported fails. With the direct data path payloads move by io_uring between the
primary chunks and the slot files; otherwise through the rings' staging memory, copied by
numpy on these threads.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from kvstore.errors import CorruptSlot, KVStoreError
from kvstore.io.rank import RankIO, fence_reason_of
from kvstore.io.records import SlotRefs
from kvstore.io.threads import make_thread
from kvstore.lookup.events import AnnounceBatch, Committed, Dropped, Evicted, Failed
from kvstore.lookup.table import ServingIndex
from kvstore.vllm.tier_config import TierConfig

log = logging.getLogger("kvstore.tier")

# A store job whose chunks find the slot pool dry waits this long for the index thread to
# refill it (evicting LRU entries) before the rest of the job is dropped.
POOL_WAIT_S = 2.0

ANNOUNCED = object()     # in the event queue: an "announce" batch was published


@dataclass(slots=True)
class TierCounts:
    """The tier's counters since the metrics last took them. The I/O threads add under
    `lock`; the scheduler thread adds its lookups' hits without it."""

    hits: int = 0           # lookups answered with a hit
    loaded: int = 0         # chunks loaded (verified)
    read: int = 0           # payload bytes read
    written: int = 0        # payload bytes written
    verify: int = 0         # chunks whose header or checksum did not verify
    evicted: int = 0        # chunks evicted (LRU)
    dropped: int = 0        # chunks a store job could not store
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def take(self) -> TierCounts:
        """The counts so far, zeroed here (under the lock)."""
        with self.lock:
            out = TierCounts(self.hits, self.loaded, self.read, self.written, self.verify,
                             self.evicted, self.dropped)
            self.hits = self.loaded = self.read = self.written = 0
            self.verify = self.evicted = self.dropped = 0
        return out


@dataclass(slots=True)
class LoadEntry:
    """A load job of a batch: its keys and, for each, its position in the batch's read
    (-1: not read, a miss)."""

    job: TransferJob
    keys: list[bytes]
    positions: list[int]


@dataclass(slots=True)
class StoreEntry:
    """A store job of a batch: the positions of its chunks in the batch's writes (a chunk
    the store has or is storing has none), and whether its chunk ids were valid."""

    job: TransferJob
    positions: list[int]
    valid: bool


@dataclass(slots=True, eq=False)
class StoreBatch:
    """One store batch (every store job queued when the store thread took them); the tag
    of its commit, so the index thread's `Committed` event brings it back."""

    entries: list[StoreEntry]
    keys: list[bytes]       # the batch's new chunks, in write order
    failed: set[int]        # positions not committed (no slot, write or flush error)
    start: float            # time.perf_counter() when the batch began


@dataclass(slots=True, eq=False)
class WrittenBatch:
    """The chunks of a store batch written to their slots (`keys[i]` in `slots[i]` of
    generation `gens[i]`): on the sync thread's queue, to be flushed and committed."""

    batch: StoreBatch
    keys: list[bytes]
    slots: list[int]
    gens: list[int]


class TierIO:
    """The tier's load, store and sync threads (see the module docstring). The tier owns
    the index, the rings and the primary memory; `release` drops this object's references
    to the rings and the memory once the threads have ended."""

    def __init__(self, cfg: TierConfig, sidx: ServingIndex, rio_load: RankIO,
                 rio_store: RankIO, prim: np.ndarray, row: int, direct: bool,
                 finish: Callable[[JobResult], None], counts: TierCounts,
                 events: deque, events_on: bool, medium: Medium, locality: Locality | None):
        self.cfg = cfg
        self.sidx = sidx
        self.rio_load, self.rio_store = rio_load, rio_store
        self.prim = prim
        self.base = int(prim.__array_interface__["data"][0])
        self.row = row
        self.num_chunks = len(prim) // row
        self.direct = direct
        self.finish = finish            # reports a job's result (once per job)
        self.counts = counts
        self.events, self.events_on = events, events_on
        self.medium, self.locality = medium, locality
        self.closed = False             # set by `stop`: jobs taken from then on fail
        self.load_q: queue.SimpleQueue = queue.SimpleQueue()
        self.store_q: queue.SimpleQueue = queue.SimpleQueue()
        self.fenced: set[int] = set()   # devices fenced
        self._fence_lock = threading.Lock()
        self._storing: set[bytes] = set()   # keys written, not committed (store thread adds,
        #                                      the sync thread removes once committed)
        self._batches = 0                   # sync thread only: commits in flight
        self._sync_q: queue.SimpleQueue = queue.SimpleQueue()   # WrittenBatch, or None: stop
        self._warned: set[str] = set()
        # Called on the sync thread with the keys of every store batch committed (the
        # tier's remote level publishes them to the KV pool); None without one.
        self.on_committed: Callable[[list[bytes]], None] | None = None
        cpus, nice = cfg.thread_cpus, cfg.io_thread_nice
        self.threads = [
            make_thread(self._load_loop, "kvstore-tier-load", cpus, nice=nice),
            make_thread(self._store_loop, "kvstore-tier-store", cpus, nice=nice),
            make_thread(self._sync_loop, "kvstore-tier-sync", cpus, nice=nice),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """Jobs taken from now on fail without I/O; the threads end after the batch in
        progress (the sync thread once the store thread's last batch is committed)."""
        self.closed = True
        self.load_q.put(None)
        self.store_q.put(None)

    def release(self) -> None:
        """Drop the references to the rings and the primary memory (the threads ended)."""
        self.prim = None
        self.rio_load = self.rio_store = None

    # ------------------------------------------------------------------ shared

    def _take(self, q, timeout: float | None) -> tuple[list, bool]:
        """Every item queued now (waiting `timeout` for the first); True once told to stop."""
        try:
            first = q.get(timeout=timeout) if timeout is not None else q.get()
        except queue.Empty:
            return [], False
        items = [first]
        while True:
            try:
                items.append(q.get_nowait())
            except queue.Empty:
                break
        stop = any(x is None for x in items)
        return [x for x in items if x is not None], stop

    def _chunk_addrs(self, job: TransferJob) -> np.ndarray | None:
        cids = np.asarray(job.chunk_ids, dtype=np.int64)
        if len(cids) != len(job.keys) or (len(cids) and (cids.min() < 0 or
                                                          cids.max() >= self.num_chunks)):
            self._warn("chunk ids", ValueError(
                f"job {job.job_id}: {len(cids)} chunk ids for {len(job.keys)} keys, or one out "
                f"of the primary's {self.num_chunks} chunks"))
            return None
        return cids

    def _warn(self, what: str, exc: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("kvstore tier: %s failed: %s", what, exc)

    def _check_devices(self, rio: RankIO) -> None:
        """A device the ring found failed is fenced: its entries leave the table."""
        if not rio.failed:
            return
        with self._fence_lock:
            for d, why in list(rio.failed.items()):
                if d not in self.fenced:
                    self.fenced.add(d)
                    reason = fence_reason_of(why)
                    if self.sidx.fence_device(d, reason):
                        log.error("kvstore tier: device %d (%s) failed (%s); fenced", d,
                                  self.sidx.store.data_dirs[d], why)

    def _serve_queue(self, q, run_batch, what: str) -> bool:
        """One round of an I/O thread: take every queued job and run them as one batch
        (`run_batch(jobs, handed_off)`, which adds each job it reports or hands on to
        `handed_off`); whatever the batch leaves unreported fails, so no job is ever left
        without its result. True once the queue's stop mark was taken."""
        jobs, stop = self._take(q, None)
        if jobs:
            if self.closed:
                for job in jobs:
                    self.finish(JobResult(job_id=job.job_id, success=False))
            else:
                handed_off: set[int] = set()
                try:
                    run_batch(jobs, handed_off)
                except Exception as exc:   # never leave a job unreported
                    self._warn(f"a {what}", exc)
                    log.exception("kvstore tier: %s batch failed", what)
                    for job in jobs:
                        if job.job_id not in handed_off:
                            self.finish(JobResult(job_id=job.job_id, success=False))
        return stop

    def _loop(self, q, run_batch, what: str) -> None:
        """An I/O thread: rounds until the stop mark. A round that fails is logged (its
        jobs were reported by `_serve_queue`) and the next one runs: the thread never
        dies while jobs may still come."""
        while True:
            try:
                if self._serve_queue(q, run_batch, what):
                    return
            except Exception as exc:
                log.exception("kvstore tier: a %s round failed: %s", what, exc)

    # ------------------------------------------------------------------ loads

    def _load_loop(self) -> None:
        self._loop(self.load_q, self._load_batch, "load")

    def _load_batch(self, jobs: list[TransferJob], done: set[int]) -> None:
        """Load a batch of jobs. Whatever fails, every job is reported once (here, or
        by `_serve_queue` for those not in `done`), and a key whose load failed leaves
        the tier: a lookup answers MISS from then on, so vLLM does not promote it again
        at every step."""
        try:
            self._load_jobs(jobs, done)
        except Exception:
            left = [k for job in jobs if job.job_id not in done for k in job.keys]
            if left:
                try:
                    self.sidx.drop(left)
                except Exception as exc:   # (the jobs still fail: reported by the caller)
                    log.warning("kvstore tier: dropping %d chunk(s) of a failed load "
                                "failed: %s", len(left), exc)
            raise

    def _load_jobs(self, jobs: list[TransferJob], done: set[int]) -> None:
        t0 = time.perf_counter()
        sidx = self.sidx
        keys: list[bytes] = []
        slots: list[int] = []
        gens: list[int] = []
        dest: list[int] = []
        plan: list[LoadEntry] = []
        errors: list = []
        raised = None
        try:
            for job in jobs:
                jkeys = list(job.keys)
                cids = self._chunk_addrs(job)
                pos = []
                if cids is not None:
                    for k, c in zip(jkeys, cids.tolist()):
                        s, g = sidx.lookup_pin([k])     # pinned: no eviction takes it now
                        if s:
                            pos.append(len(keys))
                            keys.append(k)
                            slots.append(s[0])
                            gens.append(g[0])
                            dest.append(c)
                        else:
                            pos.append(-1)
                else:
                    pos = [-1] * len(jkeys)
                plan.append(LoadEntry(job, jkeys, pos))
            if keys:
                try:
                    errors = self._read(SlotRefs(keys, slots, gens), dest)
                except Exception as exc:
                    # (the ring's own failure, or the read's): what reached the primary
                    # chunks is unknown, so none of the batch is served
                    raised = exc
                    errors = [exc] * len(keys)
        finally:
            if slots:
                sidx.unpin(slots)
        if keys:
            self._check_devices(self.rio_load)
        bad = [keys[i] for i, e in enumerate(errors) if e is not None]
        corrupt = sum(1 for e in errors if isinstance(e, CorruptSlot))
        if bad:
            # never served again: the table forgets them now (lookups miss), LMDB follows
            sidx.drop(bad)
            if raised is not None:
                log.warning("kvstore tier: a load of %d chunk(s) failed (%s: %s); dropped",
                            len(keys), type(raised).__name__, raised)
            else:
                for i, e in enumerate(errors):
                    if e is not None:
                        log.warning("kvstore tier: chunk %s not loaded (%s); dropped",
                                    keys[i][:-4].hex()[:16], e)
        good_n = len(keys) - len(bad)
        counts = self.counts
        with counts.lock:
            counts.loaded += good_n
            counts.read += good_n * self.row
            counts.verify += corrupt
        dt = time.perf_counter() - t0
        touched = []
        for entry in plan:
            jkeys = entry.keys
            ok = [k for k, p in zip(jkeys, entry.positions) if p >= 0 and errors[p] is None]
            touched.extend(ok)
            job_id = entry.job.job_id
            if len(ok) == len(jkeys):
                res = JobResult(job_id=job_id, success=True, transfer_time=dt,
                                transfer_bytes=len(ok) * self.row or None)
            else:
                res = JobResult(job_id=job_id, success=False,
                                successful_keys=tuple(ok) if ok else None, transfer_time=dt,
                                transfer_bytes=len(ok) * self.row or None)
            done.add(job_id)
            self.finish(res)
        if touched:
            sidx.touch(touched)

    def _read(self, refs: SlotRefs, dest: list[int]) -> list:
        rio, row = self.rio_load, self.row
        if self.direct:
            addrs = np.uint64(self.base) + np.asarray(dest, dtype=np.uint64) * np.uint64(row)
            return rio.read_at(refs, addrs, verify=self.cfg.verify)
        prim = self.prim

        def drain(start, stop, views, errs):
            for j, v in enumerate(views):
                if errs[j] is None:
                    c = dest[start + j]
                    prim[c * row:(c + 1) * row] = v[:row]
        return rio.read_blocks(refs, drain, verify=self.cfg.verify)

    # ------------------------------------------------------------------ stores

    def _store_loop(self) -> None:
        try:
            self._loop(self.store_q, self._store_batch, "store")
        finally:
            self._sync_q.put(None)     # the sync thread flushes and commits the rest

    def _store_batch(self, jobs: list[TransferJob], queued: set[int]) -> None:
        t0 = time.perf_counter()
        sidx = self.sidx
        keys: list[bytes] = []
        src: list[int] = []
        seen: dict[bytes, int] = {}
        plan: list[StoreEntry] = []
        for job in jobs:
            cids = self._chunk_addrs(job)
            if cids is None:
                plan.append(StoreEntry(job, [], False))
                continue
            pos = []
            for k, c in zip(job.keys, cids.tolist()):
                if k in seen:
                    pos.append(seen[k])
                    continue
                if k in self._storing or sidx.contains(k):
                    continue        # the store has it, or a commit in flight brings it
                seen[k] = len(keys)
                pos.append(len(keys))
                keys.append(k)
                src.append(c)
            plan.append(StoreEntry(job, pos, True))
        failed: set[int] = set()
        slots: list[int] = []
        gens: list[int] = []
        batch = StoreBatch(plan, keys, failed, t0)
        counts = self.counts
        try:
            # Slots taken here are this thread's until the sync thread has the batch:
            # whatever fails before, they go back (and the jobs fail, `_serve_queue`).
            if keys:
                s, g = sidx.take(keys)
                slots += list(s)
                gens += list(g)
                deadline = time.monotonic() + POOL_WAIT_S
                while len(slots) < len(keys) and not self.closed and time.monotonic() < deadline:
                    # the pool is dry: the index thread refills it (evicting LRU entries)
                    time.sleep(0.0005)
                    s, g = sidx.take(keys[len(slots):])
                    slots += list(s)
                    gens += list(g)
                if len(slots) < len(keys):
                    failed.update(range(len(slots), len(keys)))
                    with counts.lock:
                        counts.dropped += len(keys) - len(slots)
                n = len(slots)
                if n:
                    errors = self._write(SlotRefs(keys[:n], slots, gens), src[:n])
                    self._check_devices(self.rio_store)
                    bad = [i for i, e in enumerate(errors) if e is not None]
                    for i in bad:
                        log.warning("kvstore tier: writing chunk %s failed (%s)",
                                    keys[i][:-4].hex()[:16], errors[i])
                    failed.update(bad)
                    with counts.lock:
                        counts.written += (n - len(bad)) * self.row
                        counts.dropped += len(bad)
            n = len(slots)
            if n:
                self._storing.update(keys[:n])
                # flushed and committed by the sync thread while this one writes the next
                # batch; from here its jobs are the sync thread's to report
                self._sync_q.put(WrittenBatch(batch, keys[:n], slots, gens))
        except BaseException:
            if slots:
                self._storing.difference_update(keys[:len(slots)])
                sidx.abort(list(zip(keys[:len(slots)], slots, gens)))
            raise
        queued.update(entry.job.job_id for entry in plan)
        if not slots:
            self._complete(batch, None)

    def _write(self, refs: SlotRefs, src: list[int]) -> list:
        rio, row = self.rio_store, self.row
        durable = False     # flushed by the sync thread (`_sync_loop`)
        if self.direct:
            addrs = np.uint64(self.base) + np.asarray(src, dtype=np.uint64) * np.uint64(row)
            return rio.write_at(refs, addrs, durable=durable)
        prim = self.prim

        def fill(start, stop, views):
            for j, v in enumerate(views):
                c = src[start + j]
                v[:row] = prim[c * row:(c + 1) * row]
        return rio.write_blocks(refs, fill, durable=durable)

    def _complete(self, batch: StoreBatch, error: Exception | None) -> None:
        dt = time.perf_counter() - batch.start
        failed, row = batch.failed, self.row
        for entry in batch.entries:
            pos = entry.positions
            ok = entry.valid and error is None and not any(p in failed for p in pos)
            nbytes = sum(1 for p in pos if p not in failed) * row
            self.finish(JobResult(job_id=entry.job.job_id, success=ok, transfer_time=dt,
                                  transfer_bytes=nbytes or None))

    # ------------------------------------------------------------------ flushes, commits

    def _sync_loop(self) -> None:
        """Make written batches durable and hand them to the index thread, in order, and
        take the index thread's outcomes (the only thread that polls it).

        Every batch queued by then shares one fdatasync per slot file (the store thread
        goes on writing the next batch meanwhile, so the device is not idle while it
        flushes); a batch's chunks are committed only once their file is flushed, and a
        failed flush fails every chunk of its file. A committed batch's jobs are reported
        here, within a millisecond of the commit (not after the store thread's next
        write).

        A round that fails (anything but a failed flush, which fails only its file's
        chunks) fails the batches it had not handed to the index thread yet: their
        reservations go back, their jobs are reported failed, once; the thread goes on
        with the next round."""
        while True:
            # commits in flight: come back soon for their outcome
            items, stop = self._take(self._sync_q, 0.001 if self._batches else 0.05)
            handed: set[WrittenBatch] = set()      # the items the index thread has
            try:
                self._sync_round(items, handed)
            except Exception as exc:
                log.exception("kvstore tier: flushing or committing %d store batch(es) "
                              "failed: %s", len(items) - len(handed), exc)
                for item in items:
                    if item not in handed:
                        self._fail_written(item, exc)
            try:
                self._poll_index()
                if stop:
                    if self._batches:
                        try:
                            self.sidx.flush(timeout=60.0)   # the commits in flight are applied
                        except KVStoreError as exc:
                            self._warn("the last commits", exc)
                        self._poll_index()
                    return
            except Exception as exc:
                log.exception("kvstore tier: taking the index thread's outcomes failed: %s",
                              exc)
                if stop:
                    return

    def _sync_round(self, items: list[WrittenBatch], handed: set[WrittenBatch]) -> None:
        """Flush the written batches `items` (one fdatasync per slot file) and hand their
        commits to the index thread; `handed` gets each item handed."""
        if not items:
            return
        if self.cfg.durability != "none":
            rio = self.rio_store
            fds_of = []
            touched: set[int] = set()
            for item in items:
                failed, slots = item.batch.failed, item.slots
                ok = [i for i in range(len(item.keys)) if i not in failed]
                fds = rio.locate([slots[i] for i in ok])[0].tolist() if ok else []
                fds_of.append((ok, fds))
                touched.update(fds)
            bad: dict[int, OSError] = {}
            for fd in sorted(touched):
                try:
                    os.fdatasync(fd)
                except OSError as exc:
                    bad[fd] = exc
            for item, (ok, fds) in zip(items, fds_of):
                for i, fd in zip(ok, fds):
                    if fd in bad:
                        item.batch.failed.add(i)
                        log.warning("kvstore tier: flushing chunk %s failed (%s)",
                                    item.keys[i][:-4].hex()[:16], bad[fd])
        for item in items:
            batch, keys = item.batch, item.keys
            self.sidx.commit_blocks(keys, item.slots, item.gens,
                                    sorted(batch.failed & set(range(len(keys)))),
                                    tag=batch, keys_back=self.events_on)
            self._batches += 1
            handed.add(item)

    def _fail_written(self, item: WrittenBatch, exc: Exception) -> None:
        """A written batch that never reached the index thread: its reservations go
        back (nothing of it is committed) and its jobs are reported failed."""
        keys = item.keys
        self._storing.difference_update(keys)
        try:
            self.sidx.abort(list(zip(keys, item.slots, item.gens)))
        except Exception as abort_exc:     # (reclaimed at the next open)
            log.warning("kvstore tier: giving back %d reserved slot(s) failed: %s",
                        len(keys), abort_exc)
        self._complete(item.batch, exc)

    def _poll_index(self) -> None:
        for ev in self.sidx.poll():
            try:
                self._index_event(ev)
            except Exception as exc:    # the next events are still taken
                log.exception("kvstore tier: handling %s failed: %s", type(ev).__name__, exc)

    def _index_event(self, ev) -> None:
        if isinstance(ev, Committed):
            batch: StoreBatch = ev.tag
            self._batches -= 1
            try:
                self._storing.difference_update(batch.keys)
                if ev.error is not None:
                    self._warn("a commit", ev.error)
                if self.events_on and ev.items:     # (published with the jobs' results)
                    self.events.append(OffloadingEvent(
                        keys=[k for k, _, _ in ev.items], medium=self.medium, removed=False,
                        locality=self.locality))
                if self.on_committed is not None and ev.error is None:
                    self.on_committed([k for i, k in enumerate(batch.keys)
                                       if i not in batch.failed])
            finally:
                self._complete(batch, ev.error)
        elif isinstance(ev, (Evicted, Dropped)):
            if isinstance(ev, Evicted):
                with self.counts.lock:
                    self.counts.evicted += ev.count or len(ev.keys)
            if self.events_on and ev.keys:
                self.events.append(OffloadingEvent(
                    keys=list(ev.keys), medium=self.medium, removed=True,
                    locality=self.locality))
        elif isinstance(ev, AnnounceBatch):
            self.events.extend(ev.events)
            self.events.append(ANNOUNCED)
        elif isinstance(ev, Failed):
            self._warn(ev.what, ev.error)
