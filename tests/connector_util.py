"""Helpers of the connector tests: an EngineHarness running the kvstore connector, and the
end-of-test leak checks every connector test runs (vLLM block ref counts, pinned slots,
in-flight jobs, open files and rings).

Every harness here uses the same tiny model (2 layers, 2 KV heads, head_dim 16, fp16,
block_size 16: one block is 4096 payload bytes per rank, one slot 8 KiB), so a store
holds `capacity / 8 KiB` blocks per rank.
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvstore.drivers.simulator import EngineHarness  # noqa: E402

BS = 16            # tokens per block
SLOT = 8192        # bytes of one slot of the tiny model (4 KiB header + 4 KiB payload)


from leak_util import open_fds  # noqa: E402,F401  (one definition, shared with the fixtures)


def prompts(seed: int, n: int, length: int, shared: int = 0) -> list[list[int]]:
    """n random prompts of `length` tokens whose first `shared` tokens are common."""
    rng = random.Random(seed)
    base = [rng.randrange(10, 30000) for _ in range(shared)]
    return [base + [rng.randrange(10, 30000) for _ in range(length - shared)] for _ in range(n)]


def kv_config(store: str, **extra) -> dict:
    """kv_transfer_config of the kvstore connector (module path form) over `store`."""
    ex = {"path": str(store), "capacity": "4M", "staging": "1M"}
    ex.update(extra)
    ex = {k: v for k, v in ex.items() if v is not None}
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": ex}


_GATES: list = []


class Gate:
    """A Ring fault injector that holds every `op` batch ("read", "write", "fdatasync")
    on the I/O thread until `open()`. kv_harness opens every gate on exit (also when the
    test fails) before it shuts the workers down, so a worker's shutdown, which waits for
    its I/O thread, never waits for a gate. The hold has no timing role in a test: a gate
    stays shut until the test opens it, however slow the machine (HOLD_S is only a last
    resort that frees an I/O thread held by a gate no kv_harness opens: far longer than
    any test waits for anything, so no test can see it expire)."""

    HOLD_S = 600.0

    def __init__(self, op: str):
        self.op = op
        self.hits = 0          # batches that reached the gate
        self.held = 0          # of those, batches held there right now
        self.expired = 0       # batches let through by HOLD_S instead of open()
        self._ev = threading.Event()
        _GATES.append(self)

    def __call__(self, op, fds, offs, lens):
        if op == self.op:
            self.hits += 1
            self.held += 1
            try:
                if not self._ev.wait(self.HOLD_S):
                    self.expired += 1
            finally:
                self.held -= 1
        return []

    def open(self) -> None:
        self._ev.set()

    def wait_hit(self, timeout: float = 60.0) -> None:
        """Until the I/O thread reached the gate (returns as soon as it did; the timeout
        only bounds a hang)."""
        deadline = time.monotonic() + timeout
        while not self.hits and time.monotonic() < deadline:
            time.sleep(0.002)
        assert self.hits, f"the I/O thread never issued a {self.op}"


def set_injector(h, fn) -> None:
    """Install a Ring fault injector (or None) on every rank's ring."""
    for w in workers(h):
        w.io.ring.fault_injector = fn


def sched(h):
    """The connector's scheduler side (KVStoreScheduler)."""
    return h.scheduler_connector.scheduler


def workers(h):
    """The connector's worker side of every rank (KVStoreWorker)."""
    return [c.worker for c in h.worker_connectors]


def keys_of(h, tokens, salt: str | None = None, group: int = 0) -> list[bytes]:
    """Store keys (vLLM block hash + KV cache group id) of the full blocks of a prompt."""
    from vllm import SamplingParams
    from vllm.v1.request import Request
    req = Request("probe", list(tokens), SamplingParams(max_tokens=1), None,
                  block_hasher=h._block_hasher, cache_salt=salt)
    from kvstore.vllm.config import block_key
    return [block_key(bh, group) for bh in req.block_hashes]


def flip_payload_byte(store, rank: int, slot: int, byte: int = 100) -> None:
    """Corrupt one payload byte of a slot on disk, behind the store's back."""
    from kvstore._slotfile import HEADER_SIZE
    path = os.path.join(str(store), f"rank{rank}", "slots-0000.kvs")
    fd = os.open(path, os.O_RDWR)
    try:
        off = slot * SLOT + HEADER_SIZE + byte
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), off)
        os.fsync(fd)
    finally:
        os.close(fd)


def event_hash(key: bytes):
    """The block hash a KV event carries for a store key (vLLM's int conversion)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    return maybe_convert_block_hash(key[:-4])


def store_and_forget(h, ps, **kw) -> None:
    """Run the prompts `ps`, wait until their blocks are committed, then forget them on the
    GPU side: the next pass over them must load from the store."""
    h.run(ps, **kw)
    settle(h)
    drop_gpu_cache(h)


def drop_gpu_cache(h) -> None:
    """Empty vLLM's GPU prefix cache (not the connector's): the next pass must load."""
    assert h.scheduler.reset_prefix_cache() is True
    assert len(h.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block) == 0


def record_dropped_counts(h) -> list[tuple[int, int]]:
    """The (first, stop) ranges the scheduler queues to the index thread's dry-pool count
    from now on (stop clipped to the hash list), as a list that fills as they are queued."""
    counts: list[tuple[int, int]] = []
    ix = sched(h).index
    orig = ix.count_dropped

    def count_dropped(hashes, first, stop, *rest):
        counts.append((first, min(stop, len(hashes))))
        return orig(hashes, first, stop, *rest)
    ix.count_dropped = count_dropped
    return counts


def conn_stats(h) -> dict:
    """Sum of the kv_connector_stats vLLM published so far (scheduler + workers)."""
    out: dict = {}
    for s in h.kv_connector_stats:
        for k, v in s.items():
            if k in ("used_slots", "free_slots"):
                out[k] = v
            else:
                out[k] = out.get(k, 0) + v
    return out


def settle(h, timeout_s: float = 30.0) -> None:
    """Drain, then step until every in-flight store committed (the index thread applied
    it) and no job is pending on a worker, then wait for the index thread's queue (vLLM only steps while has_requests(); in-flight stores keep it stepping
    through has_pending_push_work, loads through WAITING_FOR_REMOTE_KVS)."""
    deadline = time.monotonic() + timeout_s
    h.drain(timeout_s=timeout_s)
    while time.monotonic() < deadline:
        if not sched(h).has_pending_stores() and not any(w.pending() for w in workers(h)):
            h.drain(timeout_s=timeout_s)
            sched(h).index.flush()      # touches and drops queued to the index thread
            return
        h.step()
        time.sleep(0.0005)   # let the I/O threads have the GIL
    raise AssertionError(f"kvstore connector still has work in flight after {timeout_s}s")


_STORE_OWN = re.compile(r"/(LOCK|index/(data|lock)\.mdb|rank\d+/slots-\d{4}\.kvs|engines/\d+-\d+\.lease)$")


def assert_store_fds_only(h, before: set[str], store: str) -> None:
    """The harness holds only the store's own files and one ring per rank."""
    new = open_fds() - before
    remote = sched(h).ctx.remote
    if remote is not None:      # the two pipes to the store's fleet agent
        own = {str(fd) for fd in remote.fds()}
        new = {f for f in new if f.split("->", 1)[0] not in own}
    targets = [f.split("->", 1)[1] for f in new]
    rings = [t for t in targets if t == "anon_inode:[io_uring]"]
    others = [t for t in targets if t != "anon_inode:[io_uring]"]
    assert len(rings) == h.tp_size, f"expected {h.tp_size} io_uring ring(s), got {targets}"
    store = os.path.realpath(store)
    kec = getattr(h.vllm_config, "kv_events_config", None)
    if kec is not None and kec.publisher == "zmq":   # vLLM's publisher: its ZMQ context
        others = [t for t in others if not t.startswith(("anon_inode:[event", "socket:"))]
    stray = [t for t in others if not (t.startswith(store + "/") and _STORE_OWN.search(t))]
    assert not stray, f"open files beyond the store's own: {stray}"


def assert_quiescent(h, store: str | None = None, before: set[str] | None = None) -> None:
    """The end-of-test leak checks (while the harness is still up)."""
    settle(h)
    h.assert_no_leaks()
    s = sched(h)
    assert s.index.pinned_slots == 0, f"pinned slots left: {s.index.pin_counts()}"
    assert not s.lookups.candidates and not s.lookups.pending and not s.lookups.inflight, \
        (s.lookups.candidates, s.lookups.pending, s.lookups.inflight)
    assert not s.commits.inflight and not s.stores.storing
    assert not s.lookups.failed and not s.requests
    # reserved slots are the index thread's pool, nothing else
    assert s.store.stats()["reserved_slots"] == len(s.index.pooled())
    for w in workers(h):
        assert w.pending() == 0 and not w._loads, f"rank {w.rank}: jobs in flight"
        assert w.slots.free == w.slots.total, f"rank {w.rank}: staging slots not returned"
    assert not sched(h).has_pending_stores()
    if before is not None and store is not None:
        assert_store_fds_only(h, before, store)


@contextlib.contextmanager
def kv_harness(store, *, extra: dict | None = None, check: bool = True, **kw):
    """EngineHarness with the kvstore connector over `store`; on a clean exit runs
    assert_quiescent, shuts down and checks that every file and ring it opened is closed."""
    store = str(store)
    before = open_fds()
    h = EngineHarness(kv_transfer_config=kv_config(store, **(extra or {})),
                      workdir=os.path.dirname(store), **kw)
    ok = False
    try:
        yield h
        ok = True
    finally:
        for g in _GATES:
            g.open()
        _GATES.clear()
        if ok:
            set_injector(h, None)
        if ok and check:
            try:
                assert_quiescent(h, store, before)
            except BaseException:
                h.shutdown()
                raise
        h.shutdown()
    if ok:
        leaked = {f for f in open_fds() - before if "pytest" not in f}
        assert not leaked, f"file descriptors left open after shutdown: {sorted(leaked)}"


def loads_ok(st: dict) -> None:
    """Harness stats show disk loads and every loaded block verified byte for byte."""
    assert st["blocks_loaded"] > 0, st
    assert st["blocks_mismatched"] == 0, st
