"""Worker side of the kvstore connector: moves bytes, reports completions.

Owns one TP rank's slot files, io_uring ring and staging memory (through
`kvstore.io.rank.RankIO`, whose `Staging` is also the free list of staging slots), the
device<->staging copies (`kvstore.vllm.transfer.KVTransfer`) and one I/O thread that is the
only user of the ring and sets the rank's device first. Stores are enqueued as copies out
of the KV cache within the step that computed them (`wait_for_save`, which never waits
for the GPU; whatever vLLM enqueues on the compute stream afterwards, from zeroing a
reallocated block to the next forward, is ordered behind the copy), then written and
made durable in the background once the copy is done; loads are read, verified and
copied into the KV cache in the background, ordered after the step that scheduled them,
and reported through `get_finished` only after their copy completed. Any failure
becomes a per-block report (the scheduler drops the entry; vLLM recomputes the block);
nothing raises into the engine and nothing waits forever (loads time out after
`load_timeout_s`). Failures close: a load whose order behind the compute stream cannot
be set up is recomputed, and staging a failed copy may still touch is given back only
once that copy is done (or never, when the driver cannot say).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from kvstore.errors import KVStoreError
from kvstore.io.records import SlotRefs
from kvstore.io.threads import make_thread
from kvstore.lookup.opening import ensure_serving_store, open_rank_io
from kvstore.vllm.transfer import CopyError, KVTransfer, check_groups_alias
from kvstore.vllm.config import ConnectorConfig, carrier_group
from kvstore.vllm.metadata import (KVStoreMetadata, KVStoreWorkerMeta, LoadJob, StoreJob, StoreReport,
                                   load_keys, store_keys)
from kvstore.vllm.metrics import DEVICE_ERRORS, DEVICE_READ, DEVICE_WRITTEN, KVStoreStats

log = logging.getLogger("kvstore.vllm.worker")


@dataclass
class _LoadState:
    job: LoadJob
    started: float
    done: bool = False
    cancelled: bool = False
    # Past load_timeout_s while the I/O thread held `lock` (copying blocks of it into the
    # KV cache): set by the step thread without the lock. The I/O thread starts no further
    # copy for it and cancels it; the step thread reports it at its first look after the
    # copy in progress ended (those blocks cannot go back to vLLM while it may still write).
    timed_out: bool = False
    after: int = 0        # copy ticket: the compute stream's work before this step
    failed_idx: set = field(default_factory=set)   # blocks vLLM recomputes
    bad_idx: set = field(default_factory=set)      # of those, blocks whose entry is dropped
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The I/O thread's bookkeeping while the load runs (published at `_finish_load`):
    io_failed: set = field(default_factory=set)
    io_bad: set = field(default_factory=set)
    left: int = 0                                  # blocks not yet delivered or failed
    keys: list | None = None                       # the job's store keys, once made


# The I/O thread's queue holds one record per job, by kind; the shutdown mark is None.
@dataclass(slots=True)
class LoadItem:
    """A request's load (its state is the step thread's too: `_LoadState`)."""
    state: _LoadState


@dataclass(slots=True)
class StoreItem:
    """A store job whose first `len(stage)` blocks are being copied into staging slots
    `stage` (copy ticket `ticket`); `dropped`: the job's block indices that found no
    staging (reported failed with the write's failures)."""
    job: StoreJob
    stage: list[int]
    ticket: int
    dropped: list[int]


@dataclass(slots=True)
class ReleaseItem:
    """Staging slots a failed copy may still write, given back once its ticket is done."""
    stage: list[int]
    ticket: int


class KVStoreWorker:
    """Per-rank worker-side state of the connector (see module docstring)."""

    def __init__(self, cfg: ConnectorConfig, layout, rank: int, kv_caches, kv_cache_config,
                 identity=None):
        self.cfg = cfg
        self.rank = rank
        ensure_serving_store(cfg, layout, identity)
        self.io = open_rank_io(cfg, layout, rank)
        self.transfer = None
        try:
            # Several KV cache groups (a hybrid model: full attention, sliding window,
            # Mamba) alias one allocation: group g's layer i is the same memory as the
            # carrier group's layer i (a Mamba state is the head of its padded page), and
            # a block id belongs to one group at a time, so the carrier's transfer copies
            # any group's block (`check_groups_alias` refuses anything else).
            groups = kv_cache_config.kv_cache_groups
            self.hybrid = len(groups) > 1
            carrier = carrier_group(groups)
            if self.hybrid:
                check_groups_alias(kv_caches, kv_cache_config, carrier)
            self.transfer = KVTransfer(kv_caches, kv_cache_config, self.io.staging, (carrier,))
            if self.transfer.block_bytes != layout.block_bytes:
                raise KVStoreError(f"KV cache blocks are {self.transfer.block_bytes} bytes, the "
                                   f"layout says {layout.block_bytes}")
        except BaseException:
            if self.transfer is not None:
                self.transfer.close()
            self.io.close()
            raise
        self.slots = self.io.staging
        # Loads before stores: a request waits on its load (time to first token), while a
        # store only delays when its blocks become hits. (priority, sequence, item): a
        # `LoadItem`, `StoreItem` or `ReleaseItem`, or None (shutdown)
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = 0
        self._lock = threading.Lock()
        self._loads: dict[str, _LoadState] = {}
        self._finished_loads: set[str] = set()
        self._bad_block_ids: set[int] = set()
        self._failed_reqs: set[str] = set()     # hybrid: whole-request failures
        self._bad_keys: list[bytes] = []
        self._store_reports: dict[int, StoreReport] = {}
        self._stats = KVStoreStats()     # updated and taken under self._lock
        self._meta: KVStoreMetadata | None = None
        self._started_jobs: set[int] = set()
        self._closed = False
        self._outstanding = 0           # jobs queued or running (a timed-out load included)
        self.load_busy_s = 0.0          # I/O thread time spent on loads (for throughput)
        self.loaded_bytes_total = 0
        self._reported_devices: set[int] = set()   # failed devices already reported
        self.staging_lost = 0           # staging slots a failed copy may still write: never reused
        self._io_reported = self.io.io_bytes.copy()  # per device [read, written] reported
        self._errors_reported = self.io.io_errors.copy()   # per device failed ops reported
        self._thread = make_thread(self._run, f"kvstore-io-rank{rank}", cfg.thread_cpus,
                                   nice=cfg.io_thread_nice)
        self._thread.start()

    # -- step hooks ------------------------------------------------------------------
    def bind(self, meta: KVStoreMetadata) -> None:
        # The metadata object may be shared by several ranks in one process: never mutate
        # it; remember which of its jobs this rank already started instead.
        self._meta = meta
        self._started_jobs: set[int] = set()

    def _mark(self) -> int | None:
        """A copy ticket for the compute stream's work so far (0 on CPU); None when it
        cannot be made: a load not ordered behind this step could be overwritten by it
        (or overwrite what it computes), so the load is not run."""
        try:
            return self.transfer.mark()
        except Exception as exc:
            log.warning("kvstore rank %d: marking the compute stream failed (%s); the "
                        "step's loads are recomputed", self.rank, exc)
            return None

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        for job in meta.loads:
            if job.job_id in self._started_jobs:
                continue
            self._started_jobs.add(job.job_id)
            after = None if job.unavailable else self._mark()
            st = _LoadState(job, time.monotonic(), after=after or 0)
            with self._lock:
                self._loads[job.req_id] = st
            if after is None:       # not planned by the scheduler, or not orderable:
                st.io_failed.update(range(len(job.slots)))   # recompute, no I/O
                self._finish_load(st)
                continue
            self._put(0, LoadItem(st))

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None:
            return
        for job in meta.stores:
            if job.job_id not in self._started_jobs:
                self._started_jobs.add(job.job_id)
                self._start_store(job)

    def _start_store(self, job: StoreJob) -> None:
        n = len(job.block_ids)
        # Never block the step: store the prefix of the job that free staging slots hold
        # (blocks are in prefix order per request) and drop the rest. Dropping the whole
        # job instead would mean a prefill step larger than staging is never stored.
        k = min(n, self.slots.free)
        stage = self.slots.take(k) if k else None
        if stage is None:
            self._report_store(job.job_id, list(range(n)))
            return
        dropped = list(range(k, n))
        try:
            ticket = self.transfer.gather(job.block_ids[:k], stage)
        except Exception as exc:
            log.warning("kvstore rank %d: gather for store failed: %s", self.rank, exc)
            self._report_store(job.job_id, list(range(n)))
            self._give_after(stage, exc.ticket if isinstance(exc, CopyError) else 0)
            return
        self._put(1, StoreItem(job, stage, ticket, dropped))

    def _give_after(self, stage: list[int], ticket: int) -> None:
        """Return staging slots a failed copy may still write: at once (0), by the I/O
        thread once the copy's ticket completed (> 0), or never (-1: the driver cannot
        say when; reusing them could put another copy's bytes under a valid checksum)."""
        if ticket == 0:
            self.slots.give(stage)
        elif ticket > 0:
            self._put(1, ReleaseItem(stage, ticket))
        else:
            self.staging_lost += len(stage)
            log.error("kvstore rank %d: %d staging slots are held for good after a failed "
                      "copy (%d in all); restart the engine to get them back", self.rank,
                      len(stage), self.staging_lost)

    def _put(self, priority: int, item: LoadItem | StoreItem | ReleaseItem | None) -> None:
        with self._lock:
            self._seq += 1
            seq = self._seq
            if item is not None:
                self._outstanding += 1
        self._jobs.put((priority, seq, item))

    # -- the I/O thread --------------------------------------------------------------
    MAX_LOAD_BATCH = 64   # requests whose loads share one ring pass
    DEVICE_CHECK_S = 2.0  # how often the I/O thread checks the devices (markers, patrol reads)

    def _run(self) -> None:
        try:
            self.transfer.bind_thread()
        except Exception as exc:
            log.error("kvstore rank %d: cannot use device %s on the I/O thread: %s", self.rank,
                      self.transfer.device, exc)
        next_check = time.monotonic() + self.DEVICE_CHECK_S
        while True:
            if self.io.ndev > 1:
                # Every few seconds, between jobs: a device unmounted while serving (its
                # marker is gone), and a patrol read of each healthy device (one that died
                # while no job touched it); I/O errors are caught as they happen.
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + self.DEVICE_CHECK_S
                    try:
                        self.io.check_devices()
                    except Exception as exc:
                        log.warning("kvstore rank %d: device check failed: %s", self.rank, exc)
                try:
                    entry = self._jobs.get(timeout=self.DEVICE_CHECK_S)
                except queue.Empty:
                    continue
            else:
                entry = self._jobs.get()
            item = entry[2]
            if item is None:
                return
            jobs = 1
            states: list = []
            try:
                if isinstance(item, LoadItem):
                    states = self._more_loads([item.state])
                    jobs = len(states)
                    self._do_load(states)
                else:
                    self._run_store_item(item)
            except Exception as exc:  # a bug must not kill the I/O thread silently
                log.exception("kvstore rank %d: I/O job failed: %s", self.rank, exc)
                self._fail_unfinished(states)
            finally:
                with self._lock:
                    self._outstanding -= jobs

    def _run_store_item(self, item: StoreItem | ReleaseItem) -> None:
        """A queued store or staging release. A store that raises (rather than failing
        its blocks) is reported with every block failed, so that the scheduler never
        waits for it (its report is the last thing `_do_store` makes)."""
        if isinstance(item, ReleaseItem):
            self._release_staging(item.stage, item.ticket)
            return
        try:
            self._do_store(item)
        except Exception as exc:
            log.exception("kvstore rank %d: store job failed: %s", self.rank, exc)
            self._report_store(item.job.job_id, list(range(len(item.job.block_ids))))

    def _fail_unfinished(self, states: list) -> None:
        """Loads of a pass that raised outside its read: those not reported yet fail now
        (vLLM recomputes them) instead of at their timeout. None of them has a copy into
        the KV cache in flight: copies start and end inside the read."""
        for st in states:
            if not st.done:
                st.io_failed.update(range(len(st.job.block_ids)))
                st.left = 0
                self._finish_load(st)
        try:
            self._release_unused_tickets(states)
        except Exception as exc:
            log.warning("kvstore rank %d: releasing the ordering tickets of a failed load "
                        "pass failed: %s", self.rank, exc)

    def _next_queued(self, *kinds: type):
        """The job at the head of the queue if it is of one of `kinds` (taken), else None
        (the head, a job of another kind or the shutdown mark, keeps its place)."""
        try:
            entry = self._jobs.get_nowait()
        except queue.Empty:
            return None
        item = entry[2]
        if not isinstance(item, kinds):
            self._jobs.put(entry)   # same (priority, sequence): its place is kept
            return None
        return item

    def _more_loads(self, states: list) -> list:
        """Every other load already queued joins this pass: one ring batch keeps the queue
        depth full across requests instead of draining it at the end of each one."""
        while len(states) < self.MAX_LOAD_BATCH:
            item = self._next_queued(LoadItem)
            if item is None:
                break
            states.append(item.state)
        return states

    def _run_queued_stores(self) -> None:
        """Run the store jobs (and staging releases) queued now (loads come first in the
        queue, so what follows the loads in hand are these); a load or the shutdown mark
        stays queued."""
        while (item := self._next_queued(StoreItem, ReleaseItem)) is not None:
            try:
                self._run_store_item(item)
            finally:
                with self._lock:
                    self._outstanding -= 1

    def _release_staging(self, stage: list[int], ticket: int) -> None:
        try:
            self.transfer.wait(ticket)
        except Exception as exc:
            self.staging_lost += len(stage)
            log.error("kvstore rank %d: a failed copy did not complete (%s); %d staging "
                      "slots are held for good", self.rank, exc, len(stage))
            return
        self.slots.give(stage)

    def _do_store(self, item: StoreItem) -> None:
        job, stage = item.job, item.stage
        refs: list = []
        try:
            # The keys of the eager stores are made here, on the I/O thread (the scheduler
            # sends vLLM's hashes); a job whose keys cannot be made fails alone.
            keys = store_keys(job)
            if not len(keys) == len(job.slots) == len(job.generations) == len(job.block_ids):
                raise ValueError(f"store job {job.job_id}: {len(keys)} keys, {len(job.slots)} "
                                 f"slots, {len(job.generations)} generations, "
                                 f"{len(job.block_ids)} blocks")
            refs = SlotRefs(keys, job.slots, job.generations)[:len(stage)]
            malformed = None
        except Exception as exc:
            malformed = exc
        try:
            # The copy into staging must be complete before the slot is written (and
            # before staging goes back to the free list).
            self.transfer.wait(item.ticket)
            if malformed is not None:
                raise malformed
            errors = self.io.write_staged(refs, stage, durable=self.cfg.durability == "fdatasync")
        except Exception as exc:
            errors = [exc] * len(stage)
        finally:
            self.slots.give(stage)
        failed = [i for i, e in enumerate(errors) if e is not None]
        if failed:
            log.warning("kvstore rank %d: %d of %d block writes failed (first: %s); they are "
                        "not committed", self.rank, len(failed), len(errors), errors[failed[0]])
        self._add_stats(stored_bytes=(len(errors) - len(failed)) * self.io.payload_len)
        self._report_store(job.job_id, failed + item.dropped)

    def _report_store(self, job_id: int, failed: list[int]) -> None:
        with self._lock:
            self._store_reports[job_id] = StoreReport(ranks=1, failed=sorted(failed))

    def _add_stats(self, **counts) -> None:
        with self._lock:
            self._stats.add(**counts)

    def _do_load(self, states: list) -> None:
        t0 = time.perf_counter()
        try:
            self._do_load_timed(states)
        finally:
            self.load_busy_s += time.perf_counter() - t0

    def _do_load_timed(self, states: list) -> None:
        # One pass for every request in `states`: their blocks are read as one sequence,
        # and each request is reported as soon as its last block is in the KV cache.
        ref_keys: list[bytes] = []      # the blocks to read, as parallel lists (SlotRefs)
        ref_slots: list[int] = []
        ref_gens: list[int] = []
        # each block's load state and index in its job, as parallel lists (a tuple per
        # block would be ~1 object per block for the garbage collector to count on this
        # thread: a collection it triggers holds the GIL vLLM's step thread waits for)
        owner_st: list = []
        owner_i: list[int] = []
        for st in states:
            job = st.job
            st.left = len(job.slots)
            # The keys are made here, on the I/O thread (the scheduler sends the hashes).
            # A job whose keys cannot be made (malformed metadata, no memory) fails alone,
            # at once: vLLM recomputes it; the others in the pass go on.
            try:
                st.keys = load_keys(job)
                if not len(st.keys) == len(job.slots) == len(job.generations) == len(job.block_ids):
                    raise ValueError(f"{len(st.keys)} keys, {len(job.slots)} slots, "
                                     f"{len(job.generations)} generations and "
                                     f"{len(job.block_ids)} blocks")
            except Exception as exc:
                log.warning("kvstore rank %d: load of request %s failed before reading (%s); "
                            "it will be recomputed", self.rank, job.req_id, exc)
                st.io_failed.update(range(len(job.block_ids)))   # what vLLM recomputes
                st.left = 0
                self._finish_load(st)
                continue
            ref_keys.extend(st.keys)
            ref_slots.extend(job.slots)
            ref_gens.extend(job.generations)
            owner_st.extend([st] * len(st.keys))
            owner_i.extend(range(len(st.keys)))
        for st in states:
            if not st.job.slots and not st.done:
                self._finish_load(st)
        refs = SlotRefs(ref_keys, ref_slots, ref_gens)
        if not refs:            # nothing to read: the ordering tickets go unused
            self._release_unused_tickets(states)
            return
        # Two staging areas when the load spans several chunks: the ring reads the next
        # chunk while this thread scatters the previous one into the KV cache.
        # Areas take what is free (stores may hold most of staging): a smaller area only
        # means more, smaller chunks, never a load waiting for slots it does not need.
        step = max(1, min(len(refs), self.slots.total // 4 or 1))
        areas = []
        first = self.slots.take_up_to(step)
        if not first:
            # Every staging slot holds a store waiting behind these loads: write those
            # out first (they free staging), or the loads would wait for them in vain.
            self._run_queued_stores()
            first = self.slots.take_up_to(step, timeout=self.cfg.load_timeout_s)
        if first:
            areas.append(first)
            if len(refs) > len(first):
                second = self.slots.take_up_to(len(first))
                if second:
                    areas.append(second)

        unsafe = [False]     # a failed scatter may still read staging: keep it

        def consume(start, stop, stage, errors):
            groups: dict[int, tuple] = {}
            for j, e in enumerate(errors):
                st, i = owner_st[start + j], owner_i[start + j]
                g = groups.setdefault(id(st), (st, [], [], [0]))
                g[3][0] += 1
                if e is not None:
                    st.io_failed.add(i)
                    st.io_bad.add(i)         # this slot's bytes are unreadable or wrong
                    log.warning("kvstore rank %d: load of block %d of request %s failed: %s; "
                                "it will be recomputed", self.rank, i, st.job.req_id, e)
                else:
                    g[1].append(stage[j])
                    g[2].append(st.job.block_ids[i])
            for st, stage_ids, block_ids, count in groups.values():
                with st.lock:
                    if st.timed_out and not st.cancelled:
                        # Timed out during an earlier copy of it: copy nothing more; the
                        # step thread reports every block failed (vLLM recomputes them).
                        st.cancelled = True
                    if not st.cancelled and stage_ids:   # timed out: vLLM recomputes, hands off
                        after, st.after = st.after, 0
                        try:
                            ticket = self.transfer.scatter(stage_ids, block_ids, after)
                        except CopyError as exc:
                            # What the failed scatter queued must land before its blocks
                            # go back to vLLM (recomputed) and its staging to the next
                            # read; the pass then fails, and vLLM recomputes.
                            if exc.ticket > 0:
                                self.transfer.wait(exc.ticket)
                            elif exc.ticket < 0:
                                unsafe[0] = True
                            raise
                        self.transfer.wait(ticket)
                st.left -= count[0]
                if st.left == 0:
                    self._finish_load(st)

        # No staging, or the pass itself failed (not one slot's bytes): vLLM recomputes
        # what was not delivered, and the store keeps its entries (they may be fine).
        if not areas:
            for st in states:
                st.io_failed.update(range(len(st.job.slots)))
        else:
            try:
                self.io.read_pipelined(refs, areas, consume, verify=self.cfg.verify)
            except Exception as exc:
                for st in states:
                    if st.left:
                        st.io_failed.update(range(len(st.job.slots)))
                log.warning("kvstore rank %d: load of %d request(s) failed: %s; recomputing "
                            "them", self.rank, len(states), exc)
            finally:
                for area in areas:
                    if unsafe[0]:
                        self.staging_lost += len(area)
                    else:
                        self.slots.give(area)
        self._release_unused_tickets(states)
        for st in states:
            if st.left:     # not reported from consume: no staging, or the read raised
                st.left = 0
                self._finish_load(st)

    def _release_unused_tickets(self, states: list) -> None:
        for st in states:
            if st.after:   # no block of it was copied: its ordering ticket is unused
                self.transfer.release(st.after)
                st.after = 0

    def _finish_load(self, st: _LoadState) -> None:
        with st.lock:
            if st.cancelled:
                return
            failed = st.failed_idx = st.io_failed
            st.bad_idx = st.io_bad
            st.done = True
        n = max(0, len(st.job.slots) - len(failed))     # blocks delivered
        self.loaded_bytes_total += n * self.io.payload_len
        # Block counts (loaded_blocks, load_failures) are the scheduler's: once per
        # block, not once per rank.
        self._add_stats(loaded_bytes=n * self.io.payload_len)

    # -- reports to the scheduler ----------------------------------------------------
    def _collect_loads(self) -> None:
        now = time.monotonic()
        with self._lock:
            items = list(self._loads.items())
        for req_id, st in items:
            expired = not st.done and now - st.started > self.cfg.load_timeout_s
            # The I/O thread holds st.lock while it copies into the KV cache: never wait
            # for it here (the step thread must not wait for the GPU); look again next step.
            # Its blocks cannot be handed back to vLLM while that copy may still write into
            # them, so a load that times out meanwhile is only marked: the I/O thread
            # copies nothing more for it, and it is reported at the first look after the
            # copy in progress (a stall in the ring holds no lock: reported at once).
            if not st.lock.acquire(blocking=False):
                if expired and not st.timed_out:
                    st.timed_out = True
                    log.warning("kvstore rank %d: load of request %s timed out after %.1fs "
                                "while its blocks were being copied into the KV cache; "
                                "recomputing it once that copy ends", self.rank, req_id,
                                self.cfg.load_timeout_s)
                continue
            try:
                if expired:
                    # Stalled I/O: give up; vLLM recomputes these blocks, and the I/O
                    # thread will not touch them any more (cancelled under st.lock).
                    if not st.timed_out and not st.cancelled:
                        log.warning("kvstore rank %d: load of request %s timed out after "
                                    "%.1fs; recomputing", self.rank, req_id,
                                    self.cfg.load_timeout_s)
                    st.cancelled = True
                    st.failed_idx = set(range(len(st.job.block_ids)))
                elif not st.done:
                    continue
            finally:
                st.lock.release()
            with self._lock:
                self._loads.pop(req_id, None)
                self._finished_loads.add(req_id)
                if self.hybrid and (st.failed_idx or st.job.unavailable):
                    # Block ids are per group: vLLM takes whole-request failures only.
                    self._failed_reqs.add(req_id)
                for i in sorted(st.failed_idx):
                    if not self.hybrid:
                        self._bad_block_ids.add(st.job.block_ids[i])
                    if not st.cancelled and i in st.bad_idx:
                        self._bad_keys.append((st.keys or load_keys(st.job))[i])

    def get_finished(self, finished_req_ids) -> tuple[set[str] | None, set[str] | None]:
        self._collect_loads()
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
        return None, (done or None)

    def take_failed_recving(self) -> set[str]:
        """Requests whose load failed, for a hybrid model (vLLM then recomputes the whole
        request); empty with one KV cache group, whose failures are per block."""
        with self._lock:
            out, self._failed_reqs = self._failed_reqs, set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._bad_block_ids = self._bad_block_ids, set()
        return bad

    def build_worker_meta(self) -> KVStoreWorkerMeta | None:
        with self._lock:
            reports, self._store_reports = self._store_reports, {}
            bad, self._bad_keys = self._bad_keys, []
        devs = {}
        if self.io.failed and len(self.io.failed) > len(self._reported_devices):
            # reported once: the scheduler fences the device (see RankIO.failed)
            devs = {d: why for d, why in dict(self.io.failed).items()
                    if d not in self._reported_devices}
            self._reported_devices.update(devs)
        if not reports and not bad and not devs:
            return None
        return KVStoreWorkerMeta(store_reports=reports, bad_keys=bad, failed_devices=devs)

    def get_stats(self) -> KVStoreStats | None:
        # Wear accounting: the bytes this rank moved per device since the last report
        # (RankIO.io_bytes, which the device threads add to; only this thread reads it).
        now = self.io.io_bytes.copy()
        delta = now - self._io_reported
        self._io_reported = now
        dev = {}
        for d in delta.any(axis=1).nonzero()[0].tolist():
            ddir = self.io.dirs[d]
            if delta[d, 1]:
                dev[DEVICE_WRITTEN + ddir] = int(delta[d, 1])
            if delta[d, 0]:
                dev[DEVICE_READ + ddir] = int(delta[d, 0])
        errs = self.io.io_errors.copy()
        for d in (errs - self._errors_reported).nonzero()[0].tolist():
            dev[DEVICE_ERRORS + self.io.dirs[d]] = int(errs[d] - self._errors_reported[d])
        self._errors_reported = errs
        # Copy and reset under the lock the I/O thread adds under: no count is lost.
        with self._lock:
            if self._stats.is_empty() and not dev:
                return None
            out = KVStoreStats(dict(self._stats.data))
            self._stats.reset()
        out.data.update(dev)
        return out

    def pending(self) -> int:
        """Jobs queued or running on the I/O thread (for tests and shutdown)."""
        with self._lock:
            return self._outstanding + sum(1 for s in self._loads.values() if not s.done)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._put(2, None)
        self._thread.join(timeout=max(5.0, self.cfg.load_timeout_s))
        if self._thread.is_alive():
            # The I/O thread is stuck inside a ring submit (a hung disk): closing the ring
            # or freeing staging under it would crash the process (the kernel may still
            # write into staging). Leave them to the process exit.
            log.error("kvstore rank %d: I/O thread still busy after %.0fs at shutdown; "
                      "leaving its ring and slot files open", self.rank,
                      max(5.0, self.cfg.load_timeout_s))
            return
        self.transfer.close()
        self.io.close()
