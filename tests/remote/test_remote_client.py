"""The fleet agent as a process (`RemoteClient`, what the connector runs): it answers
fetches over its pipe, never blocks the caller, counts what it drops, says why it could
not start, and comes back after it dies; and the `"remote"` settings are checked with
errors that name the key."""
import os
import signal
import time
from multiprocessing import Pipe

import pytest

from kvstore.errors import ConfigError
from kvstore.remote.agent import AgentStats, _Inbox
from kvstore.remote.client import RemoteClient
from kvstore.store.config import RemoteConfig
from kvstore.store.disk import DiskStore
from test_fleet_agent import chain, make_store, payload


def _until(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out")


def _answer(c, token):
    """Fetch `token`'s answer, once the agent gave it."""
    got = []
    _until(lambda: got.append(c.answer(token)) or got[-1] is not None)
    return got[-1]


def test_agent_process_fills_and_publishes_and_restarts_after_a_kill(fleet_pool, tmp_path):
    ks = chain(6, b"p")
    with make_store(tmp_path / "A") as a:
        a.put(ks, payload)
    make_store(tmp_path / "B").close()
    cfg = RemoteConfig.parse({**fleet_pool.remote_config(), "buffer": "4M"})
    ca = RemoteClient(str(tmp_path / "A"), cfg)
    cb = RemoteClient(str(tmp_path / "B"), cfg)
    try:
        ca.publish(ks)      # queued while the agent starts
        _until(lambda: ca.alive and cb.alive)
        def published():
            ca.request_stats()
            return ca.stats().get("published_blocks") == 6
        _until(published)
        assert cb.ask(1, ks)
        assert _answer(cb, 1).blocks == 6
        with DiskStore(str(tmp_path / "B"), readonly=True) as b:
            assert len(b.longest_prefix(ks)) == 6
        # the agent killed: the client says so at once, answers nothing, then restarts it
        cb.RESTART_S = 0.5
        pid = cb._proc.pid
        os.kill(pid, signal.SIGKILL)
        _until(lambda: cb.down)
        assert not cb.ask(2, ks)
        _until(lambda: cb.alive and cb._proc.pid != pid)
        assert cb.ask(3, ks) and _answer(cb, 3).blocks == 6
        assert cb.stats()["agent_starts"] == 2
    finally:
        ca.close()
        cb.close()
    assert ca.fds() == [] and cb.fds() == []


def test_a_killed_agent_comes_back_after_its_back_off_with_nothing_asked(fleet_pool, tmp_path):
    """The restart does not wait for the engine to ask: an idle engine's agent comes back
    once `RESTART_S` has passed since its last start, even when it died sooner."""
    make_store(tmp_path / "B").close()
    c = RemoteClient(str(tmp_path / "B"), RemoteConfig.parse(fleet_pool.remote_config()))
    try:
        _until(lambda: c.alive)
        c.RESTART_S = 3.0       # longer than the start took: the death falls inside it
        pid = c._proc.pid
        os.kill(pid, signal.SIGKILL)
        _until(lambda: c.down)
        _until(lambda: c.alive and c._proc.pid != pid, timeout=30)
        assert c.stats()["agent_starts"] == 2
    finally:
        c.close()
    assert c.fds() == []


def test_agent_that_cannot_open_the_store_says_why(fleet_pool, tmp_path):
    c = RemoteClient(str(tmp_path / "no-such-store"), RemoteConfig.parse(fleet_pool.remote_config()))
    try:
        _until(lambda: c.down)
        assert "no-such-store" in c.failure or "store" in c.failure.lower(), c.failure
        assert not c.ask(1, chain(1))
        c.publish(chain(3))
        assert c.stats()["publish_dropped"] == 3
    finally:
        c.close()


def test_publish_queue_is_bounded_and_counts_what_it_drops():
    ours, theirs = Pipe()
    st = AgentStats()
    inbox = _Inbox(theirs, 5, st)
    for i in range(10):
        ours.send(("publish", chain(3, b"%d" % i)))
    ours.send(("fetch", 1, chain(2)))
    _until(lambda: st.publish_dropped == 27 and len(inbox.fetches) == 1)
    assert inbox.next()[0] == "fetch"             # fetches first
    assert inbox.next() == ("publish", chain(3, b"0"))
    ours.close()
    assert inbox.next() == ("stop",)


@pytest.mark.parametrize("remote, words", [
    ("mooncake", "must be an object"),
    ({"kind": "redis"}, "kind"),
    ({"master": "nohost"}, "host:port"),
    ({"protocol": "udp"}, "protocol"),
    ({"buffer": "4K"}, "buffer"),
    ({"fetch_timeout_s": 0}, "fetch_timeout_s"),
    ({"mastr": "127.0.0.1:1"}, "unknown remote key"),
])
def test_remote_settings_are_checked(remote, words):
    with pytest.raises(ConfigError, match=words):
        RemoteConfig.parse(remote)


def test_remote_settings_round_trip():
    cfg = RemoteConfig.parse({"master": "10.0.0.5:50051", "buffer": "128M", "publish_queue": 100})
    assert RemoteConfig.parse(cfg.to_dict()) == cfg
    assert cfg.buffer_bytes == 128 << 20
