"""Tests of the worker side of the kvstore connector (KVStoreWorker: the I/O thread, loads
and stores) through the real vLLM scheduler: corrupt slots, injected I/O errors, stalled
loads, aborts/preemptions while loads are in flight, requests that finish while their
store is in flight, staging memory pressure. Faults come from the Ring's
`fault_injector` seam. Every test ends with the leak checks of `kv_harness`.
"""
import errno
import time

import pytest

from connector_util import (
    BS, SLOT, Gate, conn_stats, drop_gpu_cache, event_hash, keys_of, kv_harness, loads_ok,
    flip_payload_byte, prompts, sched, set_injector, settle, store_and_forget, workers,
)



# ----------------------------------------------------------------------------- faults


@pytest.mark.parametrize("rank", [0, 1])
def test_corrupted_slot_is_recomputed_and_dropped(tmp_path, rank):
    store = tmp_path / "store"
    ps = prompts(20, 2, 90)                      # 5 full blocks each
    with kv_harness(store, tp_size=2, kv_events=True) as h:
        store_and_forget(h, ps, max_tokens=1)
        keys = keys_of(h, ps[0])
        bad = sched(h).store.lookup(keys[2])
        flip_payload_byte(store, rank, bad.slot)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=2)
        # Blocks 0-1 of prompt 0 and all of prompt 1 load; block 2 of prompt 0 fails
        # verification, vLLM recomputes from there, and the output is still right.
        assert st["blocks_mismatched"] == 0, h.mismatches
        assert st["invalid_block_ids"] - before["invalid_block_ids"] == 1
        assert st["blocks_loaded"] - before["blocks_loaded"] == 2 + 5
        assert st["requests_finished"] - before["requests_finished"] == 2
        s = conn_stats(h)
        assert s["load_failures"] == 1
        assert s["loaded_blocks"] == 5 + 5 - 1   # per logical block, not per rank
        removed = [x for e in h.events if type(e).__name__ == "BlockRemoved"
                   and e.medium == "STORAGE" for x in e.block_hashes]
        assert removed == [event_hash(keys[2])]
        # The corrupt entry was dropped, then stored again (a fresh generation) by the
        # recompute; a third pass loads every block of both prompts.
        settle(h)
        again = sched(h).store.lookup(keys[2])
        assert again is not None and again.generation > bad.generation
        drop_gpu_cache(h)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=1)
        loads_ok(st)
        assert st["blocks_loaded"] - before["blocks_loaded"] == 10
        assert st["invalid_block_ids"] == before["invalid_block_ids"]


def test_eio_on_load_is_recomputed_and_entry_dropped(tmp_path):
    store = tmp_path / "store"
    ps = prompts(21, 2, 90)
    with kv_harness(store, kv_events=True) as h:
        store_and_forget(h, ps, max_tokens=1)
        keys0, keys1 = keys_of(h, ps[0]), keys_of(h, ps[1])
        old = sched(h).store.lookup(keys0[3])
        victim = old.slot
        fired = []

        def eio_on_victim(op, fds, offs, lens):
            if op != "read":
                return []
            out = [(i, "error", errno.EIO) for i, o in enumerate(offs) if int(o) == victim * SLOT]
            fired.extend(out)
            return out
        set_injector(h, eio_on_victim)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=2)
        assert fired
        assert st["blocks_mismatched"] == 0, h.mismatches
        assert st["invalid_block_ids"] - before["invalid_block_ids"] == 1
        assert st["blocks_loaded"] - before["blocks_loaded"] == 3 + 5
        assert st["requests_finished"] - before["requests_finished"] == 2
        s = conn_stats(h)
        # Block 4 was read fine (but vLLM recomputes from block 3 on).
        assert s["load_failures"] == 1 and s["loaded_blocks"] == 9
        # Dropped (a STORAGE BlockRemoved event), then stored again by the recompute.
        removed = [x for e in h.events if type(e).__name__ == "BlockRemoved"
                   and e.medium == "STORAGE" for x in e.block_hashes]
        assert removed == [event_hash(keys0[3])]
        set_injector(h, None)
        settle(h)
        assert all(sched(h).store.lookup(k) is not None for k in keys0 + keys1)
        assert sched(h).store.lookup(keys0[3]).generation > old.generation


def test_eio_on_every_read_still_serves(tmp_path):
    store = tmp_path / "store"
    ps = prompts(22, 3, 70)
    with kv_harness(store) as h:
        store_and_forget(h, ps, max_tokens=1)
        set_injector(h, lambda op, fds, offs, lens:
                      [(i, "error", errno.EIO) for i in range(len(fds))] if op == "read" else [])
        before = dict(h.stats)
        st = h.run(ps, max_tokens=2)
        assert st["blocks_mismatched"] == 0
        assert st["blocks_loaded"] == before["blocks_loaded"]
        assert st["invalid_block_ids"] - before["invalid_block_ids"] == 3 * 4
        assert st["tokens_computed"] - before["tokens_computed"] == 3 * 71
        assert all(len(h.finished[r]) == 2 for r in list(h.finished)[-3:])
        assert conn_stats(h)["load_failures"] == 12
        set_injector(h, None)


def test_stalled_load_times_out_and_recomputes(tmp_path):
    store = tmp_path / "store"
    ps = prompts(23, 2, 70)
    with kv_harness(store, extra={"load_timeout_s": 0.3}) as h:
        store_and_forget(h, ps, max_tokens=1)
        keys = keys_of(h, ps[0]) + keys_of(h, ps[1])
        gate = Gate("read")                      # the disk does not answer until opened ...
        set_injector(h, gate)
        t0 = time.monotonic()
        before = dict(h.stats)
        st = h.run(ps, max_tokens=2)             # ... and the engine does not wait for it
        took = time.monotonic() - t0
        assert st["requests_finished"] - before["requests_finished"] == 2
        assert st["blocks_mismatched"] == 0, h.mismatches
        assert st["invalid_block_ids"] - before["invalid_block_ids"] == 8
        assert st["blocks_loaded"] == before["blocks_loaded"]
        # The gate is shut for the whole run (it opens only below), so the run ended
        # while the read was still stalled: the engine did not wait for it. The time bound
        # shows the configured 0.3 s timeout applied, not the 30 s default (a correctness
        # bound, far above the ~0.5 s this takes: a slow machine does not reach it).
        assert took < 15, f"the engine waited {took:.2f}s for a stalled read"
        gate.wait_hit()
        assert gate.hits == 1 and gate.held == 1 and not gate.expired
        assert workers(h)[0].pending() > 0
        assert conn_stats(h)["load_failures"] == 8
        # A slow disk is not a corrupt one: the entries stay.
        assert all(sched(h).store.lookup(k) is not None for k in keys)
        # The stalled reads finish later on the I/O thread and must not write into the
        # KV cache any more (those blocks belong to other requests by now).
        kv = [t.clone() for t in h.ranks[0].byte_views]     # bytes: fp16 NaN != NaN
        gate.open()
        deadline = time.monotonic() + 60         # did-not-hang bound: ends when they do
        while any(w.pending() for w in workers(h)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(w.pending() for w in workers(h))
        assert all(bool((a == b).all()) for a, b in zip(kv, h.ranks[0].byte_views))


# ------------------------------------------------------- lifecycles during loads


def test_abort_while_load_in_flight(tmp_path):
    store = tmp_path / "store"
    ps = prompts(24, 3, 90)
    with kv_harness(store) as h:
        store_and_forget(h, ps, max_tokens=1)
        gate = Gate("read")
        set_injector(h, gate)
        rids = [h.add_request(p, max_tokens=4) for p in ps]
        h.step()   # lookups, pins, loads start
        s = sched(h)
        assert set(s.lookups.inflight) == set(rids)
        assert s.index.pinned_slots == 15
        h.abort(rids[:2])
        for _ in range(5):
            h.step()
        # vLLM keeps the aborted requests' blocks until the load reports back, and the
        # slots stay pinned while the worker may still read them.
        assert s.index.pinned_slots == 15
        assert rids[0] in h.scheduler.requests and h.busy()
        gate.wait_hit()
        assert gate.hits == 1                      # the other loads queue behind it
        gate.open()
        h.drain()
        set_injector(h, None)
        assert s.index.pinned_slots == 0
        assert rids[2] in h.finished and rids[0] not in h.finished
        assert h.stats["requests_aborted"] == 2
        assert h.stats["blocks_mismatched"] == 0
        assert h.stats["finished_recving"] == 3


def test_pins_of_a_request_waiting_for_gpu_blocks(tmp_path):
    """A disk hit whose GPU allocation fails keeps its pins while it waits (the lookup is
    reused on re-entry) and drops them when it is aborted."""
    store = tmp_path / "store"
    ps = prompts(25, 2, 90)
    with kv_harness(store, num_gpu_blocks=12, max_num_batched_tokens=256) as h:
        store_and_forget(h, ps[:1], max_tokens=1)
        hog = h.add_request(ps[1], max_tokens=60)   # 6 of the 11 GPU blocks, growing
        h.step()
        r = h.add_request(ps[0], max_tokens=1)       # needs 6 blocks: only 5 are free
        s = sched(h)
        for _ in range(3):
            h.step()
            assert r in s.lookups.candidates and r not in s.lookups.inflight
            assert s.index.pinned_slots == 5
        assert conn_stats(h)["hit_blocks"] == 5      # one lookup, not one per step
        h.abort(r)
        assert s.index.pinned_slots == 0 and r not in s.lookups.candidates
        h.drain()
        assert hog in h.finished


def test_preemption_while_a_load_is_in_flight(tmp_path):
    """Two decodes outgrow the GPU cache while a third request holds blocks for a slow
    disk load: vLLM preempts a decode, which resumes later with a verified prefix."""
    store = tmp_path / "store"
    stored, a, b = prompts(26, 3, 60)
    # The load is held at the gate until the test opens it, and its load_timeout_s is
    # far beyond the loop's deadline: it stays in flight however slow the steps are.
    with kv_harness(store, extra={"load_timeout_s": 600}, num_gpu_blocks=16,
                    max_num_batched_tokens=128) as h:
        store_and_forget(h, [stored], max_tokens=1)
        ra = h.add_request(a[:30], max_tokens=80)
        rb = h.add_request(b[:30], max_tokens=80)
        h.step()
        gate = Gate("read")
        set_injector(h, gate)
        rs = h.add_request(stored, max_tokens=2)
        h.step()
        assert rs in sched(h).lookups.inflight

        def preempted():
            reqs = h.scheduler.requests
            return any(r in reqs and reqs[r].num_preemptions for r in (ra, rb))
        # Step until a decode is preempted (a fixed number of steps in: the decodes grow
        # by a token a step); the deadline only bounds a hang.
        deadline = time.monotonic() + 120
        while not preempted() and h.busy() and time.monotonic() < deadline:
            h.step()
        preempted_during_load = preempted() and rs in sched(h).lookups.inflight
        gate.wait_hit()
        assert not gate.expired                     # the read was held until now
        gate.open()
        h.drain(timeout_s=120)
        assert preempted_during_load, "no preemption while the load was in flight"
        assert len(h.finished[ra]) == 80 and len(h.finished[rb]) == 80
        assert len(h.finished[rs]) == 2
        st = h.stats
        assert st["blocks_mismatched"] == 0, h.mismatches
        # The stored prompt came from disk; the preempted decode resumed from vLLM's
        # cache or the disk, and either way its prefix verified (blocks_mismatched).
        assert st["finished_recving"] >= 1
        assert st["blocks_loaded"] >= 3
        assert st["blocks_verified"] > st["blocks_loaded"]


# ------------------------------------------------------------------------- stores


def test_request_finishing_while_its_store_is_in_flight(tmp_path):
    store = tmp_path / "store"
    ps = prompts(27, 1, 90)
    others = prompts(28, 3, 90)
    with kv_harness(store, kv_events=True, num_gpu_blocks=8, max_num_batched_tokens=96) as h:
        gate = Gate("fdatasync")
        set_injector(h, gate)
        keys = keys_of(h, ps[0])
        r = h.add_request(ps[0], max_tokens=1)
        h.step()
        assert r in h.finished                    # done in one step ...
        assert sched(h).commits.inflight          # ... while its blocks are being written
        assert h.busy()                           # vLLM keeps stepping for the store
        # Its GPU blocks are free again: the others take them over while the write waits.
        for p in others:
            o = h.add_request(p, max_tokens=1)
            h.step()
            assert set(h.block_table(o)) & set(h.block_table(r))
        gate.wait_hit()
        assert sched(h).store.lookup(keys[0]) is None   # not durable: not committed
        gate.open()
        set_injector(h, None)
        settle(h)
        assert all(sched(h).store.lookup(k) is not None for k in keys)
        # The events of the finished request's blocks carry its tokens and parents.
        stored = {e.block_hashes[0]: e for e in h.events
                  if type(e).__name__ == "BlockStored" and e.medium == "STORAGE"}
        for i, k in enumerate(keys):
            e = stored[event_hash(k)]
            assert e.token_ids == ps[0][i * BS:(i + 1) * BS]
            assert e.parent_block_hash == (event_hash(keys[i - 1]) if i else None)
        # What was written is the finished request's KV, not the blocks' new owners'.
        drop_gpu_cache(h)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=1)
        loads_ok(st)
        assert st["blocks_loaded"] - before["blocks_loaded"] == 5


def test_write_error_aborts_only_the_failed_blocks(tmp_path):
    store = tmp_path / "store"
    ps = prompts(29, 1, 90)
    with kv_harness(store) as h:
        set_injector(h, lambda op, fds, offs, lens:
                      [(1, "error", errno.EIO)] if op == "write" and len(fds) > 1 else [])
        h.run(ps, max_tokens=1)
        settle(h)
        s = conn_stats(h)
        assert s["stored_blocks"] == 4 and s["store_dropped_blocks"] == 1
        keys = keys_of(h, ps[0])
        assert sched(h).store.lookup(keys[1]) is None
        assert all(sched(h).store.lookup(k) is not None for k in keys[:1] + keys[2:])
        assert sched(h).store.stats()["reserved_slots"] == len(sched(h).index.pooled())
        set_injector(h, None)
        drop_gpu_cache(h)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=1)
        loads_ok(st)   # the prefix stops at the hole: block 0 only
        assert st["external_hit_tokens"] - before["external_hit_tokens"] == BS


def test_store_larger_than_staging_stores_what_fits(tmp_path):
    """Staging of 4 slots, a 10-block prefill: the first 4 blocks are stored, the rest
    dropped (never the whole step), and nothing blocks."""
    store = tmp_path / "store"
    ps = prompts(30, 1, 170)
    with kv_harness(store, extra={"staging": 4 * SLOT}) as h:
        assert workers(h)[0].slots.total == 4
        h.run(ps, max_tokens=1)
        settle(h)
        s = conn_stats(h)
        assert s["stored_blocks"] == 4
        assert s["store_dropped_blocks"] == 6          # counted once, not per side
        keys = keys_of(h, ps[0])
        assert [sched(h).store.lookup(k) is not None for k in keys] == [True] * 4 + [False] * 6
        # Loads of more blocks than staging holds go in chunks.
        drop_gpu_cache(h)
        before = dict(h.stats)
        st = h.run(ps, max_tokens=1)
        loads_ok(st)
        assert st["blocks_loaded"] - before["blocks_loaded"] == 4


# ------------------------------------------------------- loads batched per ring pass


def test_queued_loads_share_one_ring_pass_and_stores_keep_their_place(tmp_path):
    """Loads already queued when the I/O thread takes one join its pass (the queue depth
    stays full across requests); a store met on the way goes back with its own place."""
    import queue as _queue

    from kvstore.vllm.worker import LoadItem, StoreItem
    with kv_harness(tmp_path / "store") as h:
        w = workers(h)[0]
        real, w._jobs = w._jobs, _queue.PriorityQueue()
        store = StoreItem("s", [], 0, [])
        try:
            for seq, item in enumerate([LoadItem("b"), LoadItem("c"), store, LoadItem("d")]):
                w._jobs.put((0 if isinstance(item, LoadItem) else 1, seq + 10, item))
            assert w._more_loads(["a"]) == ["a", "b", "c", "d"]
            assert w._jobs.get_nowait() == (1, 12, store)
            w._jobs.put((2, 99, None))                 # shutdown is never swallowed
            assert w._more_loads(["a"]) == ["a"] and w._jobs.get_nowait()[2] is None
        finally:
            w._jobs = real
        # End to end: many requests hitting the store at once are all served and verified
        # (the harness compares every loaded byte), whatever passes they were batched in.
        passes = []
        orig = w.io.read_pipelined
        w.io.read_pipelined = lambda refs, *a, **k: (passes.append(len(refs)), orig(refs, *a, **k))[1]
        try:
            ps = prompts(41, 6, 70)
            store_and_forget(h, ps, max_tokens=1)
            before = dict(h.stats)
            st = h.run(ps, max_tokens=2)
        finally:
            w.io.read_pipelined = orig
        assert st["blocks_mismatched"] == 0, h.mismatches
        assert st["blocks_loaded"] - before["blocks_loaded"] >= 24
        assert sum(passes) >= 24 and len(passes) <= 6, passes


@pytest.mark.parametrize("fault", ["keys_raise", "lists_disagree"])
def test_a_load_job_the_io_thread_cannot_take_fails_alone(tmp_path, monkeypatch, fault):
    """The worker makes a load's keys on its I/O thread. A job that fails there (bad
    metadata, no memory: `keys_raise`), or whose block, slot and key lists differ in
    length (`lists_disagree`: never read as far as the shortest list goes and reported
    loaded), is recomputed at once, and the other loads of the pass are served: they do
    not wait for load_timeout_s."""
    import kvstore.vllm.worker as worker_mod
    ps = prompts(29, 2, 70)
    with kv_harness(tmp_path / "store", extra={"load_timeout_s": 20}) as h:
        store_and_forget(h, ps, max_tokens=1)
        bad_hash = keys_of(h, ps[0])[0][:-4]
        real = worker_mod.load_keys

        def faulty(job):
            keys = real(job)
            if job.hashes and bytes(job.hashes[0]) == bad_hash:
                if fault == "keys_raise":
                    raise MemoryError("no memory for the keys")
                return keys[:-1]
            return keys
        monkeypatch.setattr(worker_mod, "load_keys", faulty)
        before, cb = dict(h.stats), conn_stats(h)
        t0 = time.monotonic()
        st = h.run(ps, max_tokens=2)
        # failed at once, not after its load_timeout_s (a correctness bound, not a speed one)
        assert time.monotonic() - t0 < 15
        assert st["requests_finished"] - before["requests_finished"] == 2
        assert st["blocks_mismatched"] == 0, h.mismatches
        assert st["blocks_loaded"] - before["blocks_loaded"] == 4      # ps[1]'s blocks
        assert conn_stats(h)["load_failures"] - cb["load_failures"] == 4
        # The bytes were never read: the entries stay.
        assert all(sched(h).store.lookup(k) is not None for k in keys_of(h, ps[0]))
