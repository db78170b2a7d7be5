"""The fleet agent against a real Mooncake Store pool on loopback: what one store
publishes another fills itself with, byte for byte; a record that is corrupt, of another
fingerprint or of another block is never written; a pool that is down costs nothing but
the fill."""
import dataclasses
import os
import signal
import time

import numpy as np
import pytest

from kvstore.format.identity import ModelIdentity
from kvstore.format.layout import Layout
from kvstore.remote.agent import FleetAgent
from kvstore.remote.records import HEADER_SIZE, encode_into, pool_key
from kvstore.store.config import RemoteConfig
from kvstore.store.disk import DiskStore

BB = 16 << 10
LAYOUT = Layout(model="tiny-llama", dtype="float16", block_size=16, block_bytes=BB, num_layers=2,
                num_kv_heads=2, head_dim=64, tp_size=2)
IDENT = ModelIdentity(weights="sha256:" + "ab" * 32)


def payload(i, rank):
    return ((np.arange(BB, dtype=np.uint32) * (i + 3) + rank * 7 + i) % 251).astype(np.uint8)


def chain(n, tag=b"c"):
    return [tag + b"%031d" % i + b"\0\0\0\0" for i in range(n)]


def make_store(path, layout=LAYOUT, identity=IDENT, blocks=64):
    st = DiskStore.create(str(path), layout, blocks * (layout.block_bytes + 4096) * layout.tp_size,
                          io=True, identity=identity)
    return st


def remote(fl, **kw):
    return RemoteConfig.parse({**fl.remote_config(), "buffer": "4M", **kw})


def test_publish_on_one_store_fill_on_another_byte_identical(fleet_pool, tmp_path):
    ks = chain(12, b"a")
    with make_store(tmp_path / "A") as a:
        assert a.put(ks, lambda i, r: payload(i, r)) == ks
    agent_a = FleetAgent(str(tmp_path / "A"), remote(fleet_pool))
    try:
        assert agent_a.publish(ks) == 12
        assert agent_a.publish(ks) == 0         # the pool has them: nothing read or sent
        assert agent_a.stats.published_blocks == 12
    finally:
        agent_a.close()
    make_store(tmp_path / "B").close()
    agent_b = FleetAgent(str(tmp_path / "B"), remote(fleet_pool))
    try:
        assert agent_b.fetch(ks + chain(3, b"z")) == 12    # the pool's part of the chain
        s = agent_b.stats
        assert (s.pool_hit_blocks, s.filled_blocks, s.verify_failed) == (12, 12, 0)
        assert s.fill_bytes == 12 * 2 * BB
        assert agent_b.fetch(ks) == 12          # local now: the pool is not read again
        assert agent_b.stats.pool_hit_blocks == 12
    finally:
        agent_b.close()
    with DiskStore(str(tmp_path / "B"), io=True) as b:
        got = b.get(ks)
        assert list(got) == ks
        for i, k in enumerate(ks):
            for r in range(2):
                assert np.array_equal(np.frombuffer(got[k][r], np.uint8), payload(i, r))


@pytest.mark.parametrize("other", ["layout", "weights"])
def test_a_store_of_another_model_or_layout_never_sees_the_blocks(fleet_pool, tmp_path, other):
    ks = chain(4, b"f" + other[:1].encode())
    with make_store(tmp_path / "A") as a:
        a.put(ks, payload)
    ag = FleetAgent(str(tmp_path / "A"), remote(fleet_pool))
    try:
        assert ag.publish(ks) == 4
    finally:
        ag.close()
    kw = ({"layout": dataclasses.replace(LAYOUT, num_layers=3)} if other == "layout"
          else {"identity": ModelIdentity(weights="sha256:" + "cd" * 32)})
    make_store(tmp_path / "C", **kw).close()
    ag = FleetAgent(str(tmp_path / "C"), remote(fleet_pool))
    try:
        assert ag.fetch(ks) == 0
        assert ag.stats.pool_hit_blocks == 0 and ag.stats.filled_blocks == 0
    finally:
        ag.close()


def _put_raw(ag, name, data):
    """Put `data` under pool key `name`, through the agent's own registered buffer."""
    ag.pool.remove(name)
    ag.pool.buffer[:len(data)] = np.frombuffer(data, np.uint8)
    assert ag.pool.put_from([name], [0], [len(data)]) == [0]


@pytest.mark.parametrize("damage", ["flipped_bit", "other_block", "other_fingerprint"])
def test_a_bad_pool_record_is_never_written_and_leaves_the_pool(fleet_pool, tmp_path, damage):
    ks = chain(6, b"d" + damage[-3:].encode())
    with make_store(tmp_path / "A") as a:
        a.put(ks, payload)
    make_store(tmp_path / "B").close()
    ag = FleetAgent(str(tmp_path / "A"), remote(fleet_pool))
    try:
        assert ag.publish(ks) == 6
        victim = pool_key(ag.digest, ks[3], 1)
        rec = bytearray(HEADER_SIZE + BB)
        if damage == "flipped_bit":
            encode_into(rec, ag.digest, ks[3], 1, payload(3, 1))
            rec[HEADER_SIZE + 100] ^= 0x10
        elif damage == "other_block":
            encode_into(rec, ag.digest, ks[4], 1, payload(4, 1))
        else:
            encode_into(rec, bytes(32), ks[3], 1, payload(3, 1))
        _put_raw(ag, victim, bytes(rec))
    finally:
        ag.close()
    ag = FleetAgent(str(tmp_path / "B"), remote(fleet_pool))
    try:
        assert ag.fetch(ks) == 3                # the chain stops before the bad block
        assert ag.stats.verify_failed == 1
        assert ag.pool.exists([victim]) == [False]     # removed: never read again
    finally:
        ag.close()
    with DiskStore(str(tmp_path / "B"), io=True) as b:
        assert list(b.get(ks)) == ks[:3]


def test_pool_master_killed_fetches_answer_local_and_count_errors(own_fleet_pool, tmp_path):
    ks = chain(5, b"m")
    with make_store(tmp_path / "A") as a:
        a.put(ks[:2], payload)
    ag = FleetAgent(str(tmp_path / "A"), remote(own_fleet_pool))
    try:
        assert ag.pool.available()
        os.kill(own_fleet_pool.master_pid, signal.SIGKILL)
        time.sleep(0.5)
        assert ag.fetch(ks) == 2                # what the local store has
        assert ag.stats.pool_errors >= 1 and ag.stats.pool_down
        t = time.monotonic()
        assert ag.fetch(ks) == 2                # marked down: no pool call at all
        assert time.monotonic() - t < 1.0
        assert ag.publish(ks[:2]) == 0
    finally:
        ag.close()
