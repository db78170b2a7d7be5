"""The connector worker's failure paths that are not a block's own error, through the real
vLLM scheduler (`kv_harness`): a ring that closed itself after an io_uring_enter error, a
store job that raises instead of failing its blocks, a load pass that raises before its
read. Faults are injected into kvstore's own code; every test ends with the harness's
leak checks (staging returned, nothing pinned or reserved, every job reported)."""
import time

import pytest

from connector_util import (conn_stats, keys_of, kv_harness, loads_ok, prompts, sched, settle,
                            store_and_forget, workers)

from kvstore.io.staging import Staging
from kvstore.vllm.worker import KVStoreWorker

pytestmark = pytest.mark.timeout(300)


def _raise_once(monkeypatch, owner, name, when=lambda *a, **kw: True):
    real = getattr(owner, name)
    fired = []

    def faulty(*a, **kw):
        if not fired and when(*a, **kw):
            fired.append(True)
            raise RuntimeError(f"injected into {name}")
        return real(*a, **kw)
    monkeypatch.setattr(owner, name, faulty)
    return fired


def test_a_worker_ring_that_closed_itself_is_rebuilt(tmp_path):
    store = tmp_path / "store"
    ps = prompts(41, 2, 70)
    with kv_harness(store) as h:
        store_and_forget(h, ps, max_tokens=1)
        workers(h)[0].io.ring.close()        # as the ring leaves itself after an enter error
        before = dict(h.stats)
        st = h.run(ps, max_tokens=2)
        loads_ok(st)
        assert st["invalid_block_ids"] == before["invalid_block_ids"]
        assert st["blocks_loaded"] - before["blocks_loaded"] == 8


def test_a_store_job_that_raises_is_reported_failed(tmp_path, monkeypatch):
    """The store's bookkeeping raises after its writes: the job is still reported (every
    block failed, none committed), so the scheduler does not wait for it; the blocks are
    stored again by a later pass and then load."""
    store = tmp_path / "store"
    ps = prompts(42, 1, 70)
    with kv_harness(store) as h:
        fired = _raise_once(monkeypatch, KVStoreWorker, "_add_stats",
                            lambda self, **kw: "stored_bytes" in kw)
        h.run(ps, max_tokens=1)
        settle(h, timeout_s=20)
        assert fired
        keys = keys_of(h, ps[0])
        assert all(sched(h).store.lookup(k) is None for k in keys)
        assert conn_stats(h).get("stored_blocks", 0) == 0
        store_and_forget(h, ps, max_tokens=1)      # computed and stored again
        assert all(sched(h).store.lookup(k) is not None for k in keys)
        st = h.run(ps, max_tokens=1)
        loads_ok(st)


def test_a_load_pass_that_raises_before_reading_is_recomputed_at_once(tmp_path, monkeypatch):
    """The load pass raises before its read (here: taking staging): its loads are
    reported failed at once, not at load_timeout_s, and vLLM recomputes them; the
    entries stay (nothing was wrong with them)."""
    store = tmp_path / "store"
    ps = prompts(43, 1, 70)
    with kv_harness(store, extra={"load_timeout_s": 60}) as h:
        store_and_forget(h, ps, max_tokens=1)
        keys = keys_of(h, ps[0])
        fired = _raise_once(monkeypatch, Staging, "take_up_to")
        before = dict(h.stats)
        t0 = time.monotonic()
        st = h.run(ps, max_tokens=2)
        assert fired
        assert time.monotonic() - t0 < 20, "the failed load waited for its timeout"
        assert st["blocks_mismatched"] == 0, h.mismatches
        assert st["invalid_block_ids"] - before["invalid_block_ids"] == 4
        assert all(sched(h).store.lookup(k) is not None for k in keys)
