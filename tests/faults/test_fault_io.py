"""Fault campaign, I/O errors through the connector: reads and writes that fail with
EIO, come back short, or stall, injected at the Ring's `fault_injector` seam under the
real vLLM scheduler (CPU harness). Loads turn into recomputes (the harness verifies
every block vLLM starts from: blocks_mismatched == 0), stores are dropped and never
committed, nothing waits for a stalled disk, the connector's stats count what happened,
and `kvstore fsck --deep` finds the store clean afterwards.

Covered elsewhere (not repeated here): EIO on a chosen read -> recompute, entry dropped,
re-stored with a new generation (test_connector_worker.py::
test_eio_on_load_is_recomputed_and_entry_dropped); EIO on every read; a stalled read
past load_timeout_s; a write error on one block of a batch; a stalled fdatasync while
its request finishes (test_request_finishing_while_its_store_is_in_flight).
"""
import dataclasses
import errno
import random
import threading
import time
from collections import Counter

import numpy as np
import pytest

from connector_util import (
    SLOT, conn_stats, drop_gpu_cache, keys_of, kv_harness, loads_ok, prompts, sched,
    set_injector, settle, store_and_forget, workers,
)
from fault_util import fsck_json



@pytest.mark.parametrize("io_mode, cut", [("direct", 4096), ("page_cache", 1000)])
def test_short_reads_and_writes_are_completed(tmp_path, io_mode, cut):
    """Every read and write the kernel returns short (after `cut` bytes) is finished by
    the ring: stores commit, loads verify, nothing counts as a failure."""
    store = tmp_path / "store"
    ps = prompts(60, 3, 90)                       # 5 full blocks each
    shorts: Counter = Counter()

    def short_everything(op, fds, offs, lens):
        if op == "fdatasync":
            return []
        shorts[op] += len(fds)
        return [(i, "short", cut) for i in range(len(fds))]

    with kv_harness(store, tp_size=2, extra={"io_mode": io_mode}) as h:
        set_injector(h, short_everything)
        store_and_forget(h, ps, max_tokens=1)
        s = conn_stats(h)
        assert s["stored_blocks"] == 15 and s.get("store_dropped_blocks", 0) == 0, s
        before = dict(h.stats)
        st = h.run(ps, max_tokens=2)
        loads_ok(st)
        assert st["blocks_loaded"] - before["blocks_loaded"] == 15
        assert st["invalid_block_ids"] == before["invalid_block_ids"]
        assert conn_stats(h).get("load_failures", 0) == 0
        assert shorts["write"] >= 30 and shorts["read"] >= 30, shorts   # both ranks
        set_injector(h, None)
    code, doc = fsck_json(store, "--deep")
    assert code == 0 and doc["findings"] == [] and doc["stats"]["entries"] == 15, doc


class _LyingRing:
    """A ring that reports writes as done after `cut` bytes, as a broken driver would
    (the real Ring never returns a short count: it finishes or fails each transfer)."""

    def __init__(self, ring, cut):
        self._ring, self._cut = ring, cut

    def slot_io(self, opcode, *args, **kw):
        res, status = self._ring.slot_io(opcode, *args, **kw)
        if opcode == 1:
            # The whole slot went out, but the count claims only the header did: the
            # engine must not trust (or commit) a write it cannot prove complete.
            res = np.minimum(res, self._cut)
        return res, status

    def __getattr__(self, name):
        return getattr(self._ring, name)


def test_short_write_count_is_never_committed(tmp_path):
    """Defense in depth below the ring: a write that reports fewer bytes than a slot is a
    failed write (the block is dropped, not committed, and never loaded half-written)."""
    store = tmp_path / "store"
    ps = prompts(61, 2, 70)                       # 4 full blocks each
    with kv_harness(store) as h:
        w = workers(h)[0]
        real = w.io.ring
        w.io.ring = _LyingRing(real, 4096)        # reports only the header as written
        try:
            store_and_forget(h, ps, max_tokens=1)
        finally:
            w.io.ring = real
        s = conn_stats(h)
        assert s.get("stored_blocks", 0) == 0 and s["store_dropped_blocks"] == 8, s
        assert all(sched(h).store.lookup(k) is None for p in ps for k in keys_of(h, p))
        assert sched(h).store.stats()["reserved_slots"] == len(sched(h).index.pooled())
        before = dict(h.stats)
        st = h.run(ps, max_tokens=1)              # nothing to load: computed, and stored
        assert st["blocks_loaded"] == before["blocks_loaded"]
        assert st["blocks_mismatched"] == 0
        settle(h)
        assert all(sched(h).store.lookup(k) is not None for p in ps for k in keys_of(h, p))
    code, doc = fsck_json(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_fdatasync_error_drops_the_batch_and_slots_get_new_generations(tmp_path):
    """EIO from fdatasync: none of the batch's blocks is committed (their bytes may not
    be on the disk), the stats count them as dropped, and when the blocks are stored
    again they get fresh reservations (new generations), so a stale header left in the
    slot can never verify for a later entry."""
    store = tmp_path / "store"
    ps = prompts(62, 2, 90)
    fired = []

    def eio_on_sync(op, fds, offs, lens):
        if op != "fdatasync":
            return []
        fired.append(len(fds))
        return [(i, "error", errno.EIO) for i in range(len(fds))]

    with kv_harness(store, tp_size=2) as h:
        workers(h)[1].io.ring.fault_injector = eio_on_sync     # rank 1's disk only
        h.run(ps, max_tokens=1)
        settle(h)
        assert fired
        s = conn_stats(h)
        assert s.get("stored_blocks", 0) == 0 and s["store_dropped_blocks"] == 10, s
        st = sched(h).store
        keys = [k for p in ps for k in keys_of(h, p)]
        assert all(st.lookup(k) is None for k in keys)
        assert st.stats()["reserved_slots"] == len(sched(h).index.pooled())
        assert st.stats()["used_slots"] == 0
        gen_failed = st.stats()["generation"]      # the failed reservations' generations
        pooled = set(sched(h).index.pooled())         # reserved before, never written
        set_injector(h, None)
        drop_gpu_cache(h)
        before = dict(h.stats)
        st2 = h.run(ps, max_tokens=1)                # miss: recomputed, stored again
        assert st2["blocks_loaded"] == before["blocks_loaded"]
        settle(h)
        entries = [st.lookup(k) for k in keys]
        assert all(e is not None and (e.generation > gen_failed or (e.slot, e.generation) in pooled)
                   for e in entries)
        drop_gpu_cache(h)
        before = dict(h.stats)
        st3 = h.run(ps, max_tokens=1)
        loads_ok(st3)
        assert st3["blocks_loaded"] - before["blocks_loaded"] == 10
    code, doc = fsck_json(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_random_io_fault_campaign(tmp_path):
    """Seeded chaos on both ranks' disks for three passes of a prefix-heavy workload: a
    few percent of the transfers fail (EIO, ENOSPC), a third come back short, a tenth of
    the fdatasyncs fail, every fifth read batch and every seventh write batch stalls past
    load_timeout_s. Every request finishes with verified KV, the
    connector counts load failures and dropped stores, leaks nothing (kv_harness checks
    pins, staging, reservations, files), and once the disk heals everything left in the
    index loads and fsck --deep finds it clean."""
    store = tmp_path / "store"
    rng = random.Random(4242)
    lock = threading.Lock()
    seen: Counter = Counter()
    base = prompts(63, 1, 64)[0]
    ps = [base + p for p in prompts(64, 8, 40)] + prompts(65, 4, 90)

    def chaos(op, fds, offs, lens):
        with lock:
            faults = []
            if op == "fdatasync":
                if rng.random() < 0.1:
                    faults = [(i, "error", errno.EIO) for i in range(len(fds))]
            else:
                for i in range(len(fds)):
                    x = rng.random()
                    if x < 0.06:
                        faults.append((i, "error", rng.choice([errno.EIO, errno.EIO, errno.ENOSPC])))
                    elif x < 0.4:
                        faults.append((i, "short", 4096))
            seen[op + "_batches"] += 1
            stall = ((op == "read" and seen["read_batches"] % 5 == 2)
                     or (op == "write" and seen["write_batches"] % 7 == 3))
            seen[op] += len(fds)
            seen["faults"] += len(faults)
            seen["stalls"] += stall
        if stall:
            time.sleep(0.4)       # > load_timeout_s: a load (or one queued behind) is given up
        return faults

    with kv_harness(store, tp_size=2, extra={"load_timeout_s": 0.25, "capacity": 48 * SLOT * 2},
                    num_gpu_blocks=48) as h:
        set_injector(h, chaos)
        t0 = time.monotonic()
        n = 0
        for rnd in range(3):
            for i in range(0, len(ps), 4):
                h.run(ps[i:i + 4], max_tokens=2)
                n += len(ps[i:i + 4])
            settle(h)
            drop_gpu_cache(h)
        took = time.monotonic() - t0
        st = h.stats
        assert st["requests_finished"] == n and st["blocks_mismatched"] == 0, (st, h.mismatches)
        s = conn_stats(h)
        assert s.get("load_failures", 0) > 0 and s.get("store_dropped_blocks", 0) > 0, s
        assert s.get("loaded_blocks", 0) > 0 and s.get("stored_blocks", 0) > 0, s
        assert seen["faults"] > 20 and seen["stalls"] > 0, seen
        set_injector(h, None)
        # Healed: whatever the index holds was durably written and verifies. The 0.25 s
        # timeout was for the stalls; the healthy run gets one that only a hang reaches,
        # so a slow scheduler step on a busy machine is not mistaken for a failed load.
        for w in workers(h):
            w.cfg = dataclasses.replace(w.cfg, load_timeout_s=600.0)
        for w in workers(h):                      # stalled reads finished meanwhile
            deadline = time.monotonic() + 120     # bounds a hang only
            while w.pending() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not w.pending(), "a stalled read was still pending after 120 s"
        # What survived in the index loads and verifies (how much survived depends on
        # which faults hit which batch, so it may be nothing) ...
        before = dict(h.stats)
        loads_ok(h.run(ps, max_tokens=1))
        assert h.stats["invalid_block_ids"] == before["invalid_block_ids"]
        # ... and the healed disk stores and serves again.
        settle(h)
        drop_gpu_cache(h)
        before = dict(h.stats)
        loads_ok(h.run(ps, max_tokens=1))
        assert h.stats["blocks_loaded"] > before["blocks_loaded"]
        assert h.stats["invalid_block_ids"] == before["invalid_block_ids"]
        print("campaign:", dict(seen), {k: s.get(k) for k in ("loaded_blocks", "load_failures",
              "stored_blocks", "store_dropped_blocks")}, "loaded after healing:",
              h.stats["blocks_loaded"] - before["blocks_loaded"], f"{took:.1f}s")
    code, doc = fsck_json(store, "--deep")
    assert code == 0 and doc["findings"] == [], doc
