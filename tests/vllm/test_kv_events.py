"""KV events a router can trust, through vLLM's own ZMQ publisher and a real ZMQ SUB socket.

- a STORAGE `BlockStored` carries what vLLM's own GPU event for the same block carries
  (tokens, parent, extra keys such as the cache salt, session);
- after a restart, every entry on disk is announced again (in batches, one per step, made on
  the index thread), so a KV-aware router learns what this node holds;
- evictions and drops are `BlockRemoved` events.
"""
from __future__ import annotations

import shutil
import tempfile
import time

import pytest

import vllm  # noqa: E402,F401  (needed: a vLLM that does not import fails these tests)
import zmq  # noqa: E402

from connector_util import (BS, SLOT, drop_gpu_cache, event_hash, keys_of,  # noqa: E402
                            kv_harness, prompts, sched, settle)


@pytest.fixture
def endpoint():
    """An ipc endpoint vLLM's publisher binds (a tcp host:port it would connect to)."""
    d = tempfile.mkdtemp(prefix="kvev-", dir="/tmp")     # short: ipc paths are < 108 bytes
    yield f"ipc://{d}/events"
    shutil.rmtree(d, ignore_errors=True)


class Subscriber:
    """A real ZMQ SUB socket on vLLM's publisher endpoint, decoding KVEventBatch."""

    def __init__(self, endpoint: str):
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []

    def join(self, h, timeout_s: float = 60.0) -> None:
        """Until the SUB socket receives what the harness's publisher sends (ZMQ's slow
        joiner: a PUB drops what it sends before the subscription reached it). Probes are
        empty batches through vLLM's own publisher, sent until one arrives; they carry no
        event. The timeout only bounds a hang: this returns at the first probe received."""
        from vllm.distributed.kv_events import KVEventBatch
        pub = h.scheduler.kv_event_publisher
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
            if self.sock.poll(100):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events.extend(self.dec.decode(payload).events)
                return
        raise AssertionError(f"the subscriber received nothing from the publisher in {timeout_s}s")

    def pump(self, until=None, timeout_s: float = 60.0) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if until is not None and until(self.events):
                break
            if self.sock.poll(100):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events.extend(self.dec.decode(payload).events)
            elif until is None:
                break
        return self.events

    def storage(self, kind: str) -> list:
        return [e for e in self.events if type(e).__name__ == kind
                and getattr(e, "medium", "STORAGE") == "STORAGE"]

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def _zmq_events(endpoint: str) -> dict:
    return {"publisher": "zmq", "endpoint": endpoint, "topic": ""}


def test_stored_events_carry_what_vllm_gpu_events_carry(tmp_path, endpoint):
    sub = Subscriber(endpoint)
    ps = prompts(61, 2, 70)
    try:
        with kv_harness(tmp_path / "store", kv_events=_zmq_events(endpoint)) as h:
            sub.join(h)             # the SUB socket joined before the first batch
            h.run(ps, max_tokens=1, cache_salt="tenant-a")
            settle(h)
            want = {event_hash(k) for p in ps for k in keys_of(h, p, "tenant-a")}
            sub.pump(until=lambda ev: want <= {x for e in ev if type(e).__name__ == "BlockStored"
                                              and e.medium == "STORAGE" for x in e.block_hashes})
        stored = sub.storage("BlockStored")
        # vLLM's own GPU events, per block (one event may carry a run of blocks).
        gpu = {}
        for e in sub.events:
            if type(e).__name__ == "BlockStored" and e.medium == "GPU":
                for i, x in enumerate(e.block_hashes):
                    gpu[x] = (e.lora_id, e.lora_name,
                              e.extra_keys[i] if e.extra_keys else None,
                              e.block_hashes[i - 1] if i else e.parent_block_hash,
                              e.token_ids[i * BS:(i + 1) * BS])
        got = {x for e in stored for x in e.block_hashes}
        assert want <= got
        salted = compared = 0
        for e in stored:
            h0 = e.block_hashes[0]
            assert e.token_ids and e.block_size == BS and len(e.block_hashes) == 1
            if e.extra_keys and e.extra_keys[0]:
                assert "tenant-a" in e.extra_keys[0]
                salted += 1
            g = gpu.get(h0)
            if g is not None:       # same block as vLLM's own event: same facts
                assert (e.lora_id, e.lora_name, e.extra_keys[0] if e.extra_keys else None,
                        e.parent_block_hash, e.token_ids) == g
                compared += 1
        assert compared == len(want)
        assert salted == len(ps)    # the salt is in each prompt's first block's extra keys
    finally:
        sub.close()


def test_restart_announces_every_stored_block_to_a_subscriber(tmp_path, endpoint):
    store = tmp_path / "store"
    ps = prompts(62, 3, 70)             # 4 full blocks each
    with kv_harness(store) as h:        # no events: the first run only fills the store
        h.run(ps, max_tokens=1)
        settle(h)
        on_disk = {event_hash(k) for p in ps for k in keys_of(h, p)}
    assert len(on_disk) == 12
    sub = Subscriber(endpoint)
    try:
        with kv_harness(store, kv_events=_zmq_events(endpoint)) as h:
            sub.join(h)
            sched(h).index.wait_ready(30)
            # Announcements go out with the steps of whatever the engine serves next.
            h.run(prompts(63, 1, 40), max_tokens=1)
            settle(h)
            announced = lambda ev: on_disk <= {x for e in ev if type(e).__name__ == "BlockStored"  # noqa: E731
                                               and e.medium == "STORAGE" for x in e.block_hashes}
            deadline = time.monotonic() + 60     # bounds a hang; ends when announced
            while not announced(sub.pump(timeout_s=0.5)) and time.monotonic() < deadline:
                h.run(prompts(int(time.monotonic() * 1000) % 10**6, 1, 20), max_tokens=1)
            assert not sched(h).index.announcing
        ann = [e for e in sub.storage("BlockStored") if not e.token_ids]
        assert on_disk <= {x for e in ann for x in e.block_hashes}
        assert all(e.group_idx == 0 and e.parent_block_hash is None for e in ann)
    finally:
        sub.close()


def test_evictions_and_drops_are_removed_events(tmp_path, endpoint):
    sub = Subscriber(endpoint)
    a, b, c = prompts(64, 3, 70)
    try:
        with kv_harness(tmp_path / "store", kv_events=_zmq_events(endpoint),
                        extra={"capacity": 12 * SLOT, "slot_pool": 4}) as h:
            sub.join(h)
            for p in (a, b, c):         # 12 blocks + a pool of 4 in 12 slots: a is evicted
                h.run([p], max_tokens=1)
                settle(h)
                drop_gpu_cache(h)
            ka = {event_hash(k) for k in keys_of(h, a)}
            sub.pump(until=lambda ev: ka & {x for e in ev if type(e).__name__ == "BlockRemoved"
                                            for x in e.block_hashes})
        removed = {x for e in sub.storage("BlockRemoved") for x in e.block_hashes}
        assert ka & removed
    finally:
        sub.close()
