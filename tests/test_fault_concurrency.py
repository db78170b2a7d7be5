"""Fault campaign, concurrency: operators and second servers next to a live server.

One server (CPU harness with the kvstore connector, 2 TP ranks, a store far smaller
than the workload so it evicts and rewrites slots all the time) runs in a child process
for the whole module. Next to it: `kvstore fsck --deep` must report no false
corruption, a second serving instance must be refused naming the holder's pid, and
`kvstore warmup` must refuse to write with a message that says what to do.

Covered elsewhere: fsck --deep next to a DiskStore writer and fsck --repair refused
while one holds the lock (test_fsck.py::test_fsck_while_a_writer_serves); a second
DiskStore writer refused with the pid (test_engine.py::
test_second_writer_refused_with_pid_and_readonly_allowed).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from connector_util import kv_config, open_fds
from fault_child import HARNESS
from fault_util import REPO, Zygote, fsck_json, progress
from kvstore import StoreLocked
from kvstore.engine import DiskStore
from kvstore.layout import read_fingerprint


class Server:
    def __init__(self, tmp):
        self.store = tmp / "store"
        self.zygote = Zygote(self.store, tmp / "server.log")
        self.pid, self.lines = self.zygote.fork(passes=0)
        self.wait_progress(3)

    def drain(self) -> None:
        """Read what the server printed (its pipe must never fill up)."""
        self.lines += self.zygote.lines_for(0)

    def wait_progress(self, n: int, timeout: float = 60) -> dict:
        """Until the server reported `n` more batches; returns its latest stats."""
        have = len(progress(self.lines))
        deadline = time.monotonic() + timeout
        while len(progress(self.lines)) < have + n:
            assert time.monotonic() < deadline, f"server stalled\n{self.zygote.log_tail()}"
            self.lines += self.zygote.lines_for(0.1)
        return progress(self.lines)[-1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("concurrency"))
    yield s
    s.drain()
    os.kill(s.pid, signal.SIGKILL)
    status, rest = s.zygote.wait(s.pid)
    s.zygote.close()
    assert os.WIFSIGNALED(status), f"the server died on its own (status {status})"
    stats = progress(s.lines + rest)
    assert stats and all(x["blocks_mismatched"] == 0 for x in stats)
    assert stats[-1]["blocks_loaded"] > 0
    code, doc = fsck_json(s.store, "--deep")
    assert code == 0 and doc["findings"] == [], doc


def test_fsck_deep_while_serving_reports_no_false_corruption(server):
    """fsck reads the index from one snapshot while the server keeps evicting and
    rewriting slots; a slot that changed under it is re-checked against the live index,
    never reported as damage."""
    from kvstore.tools.fsck import fsck
    changed = checked = 0
    t0 = time.monotonic()
    runs = 0
    while runs < 40 or (changed == 0 and time.monotonic() - t0 < 30):
        if runs % 10 == 0:            # as an operator runs it, in its own process
            code, doc = fsck_json(server.store, "--deep")
            stats, findings = doc["stats"], doc["findings"]
        else:
            rep = fsck(str(server.store), deep=True)
            code, stats, findings = rep.exit_code, rep.stats, [f.to_json() for f in rep.findings]
        assert code == 0 and findings == [], (runs, findings[:4])
        assert stats["writer_pid"] == server.pid
        changed += stats["changed_during_check"]
        checked += stats["slots_checked"]
        runs += 1
        server.drain()
    print(f"fsck --deep x{runs} next to the server: {checked} slots checked, "
          f"{changed} entries changed under it and re-checked")
    last = server.wait_progress(2)          # and the server kept serving meanwhile
    assert last["blocks_mismatched"] == 0
    assert checked > 0
    assert changed > 0, "no entry changed during a check: the race was never exercised"


def test_second_server_on_the_same_store_is_refused_with_the_pid(server, tmp_path):
    before = open_fds()
    from kvstore.testing import EngineHarness
    with pytest.raises(StoreLocked) as ei:
        EngineHarness(kv_transfer_config=kv_config(server.store, capacity="640K"),
                      model_dir=str(server.store.parent / "model"), workdir=str(tmp_path),
                      **HARNESS)
    assert ei.value.pid == server.pid
    assert f"pid {server.pid}" in str(ei.value) and str(server.store) in str(ei.value)
    del ei
    assert not {f for f in open_fds() - before if "pytest" not in f}
    server.wait_progress(1)                  # the first server did not notice


def test_warmup_into_a_served_store_is_refused_with_what_to_do(server, tmp_path):
    layout, _, _ = read_fingerprint(str(server.store))
    src = str(tmp_path / "src")
    with DiskStore.create(src, layout, "256K", io=True) as st:
        st.put([b"w%d" % i for i in range(3)], lambda i, r: bytes([i]) * layout.block_bytes)

    def warmup(*args):
        return subprocess.run([sys.executable, "-m", "kvstore.cli", "warmup", str(server.store),
                               "--from-store", src, "--all", "-q", *args],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
    r = warmup()
    assert r.returncode == 1, r
    msg = r.stderr
    assert f"pid {server.pid}" in msg and "Stop that process" in msg and "--dry-run" in msg, msg
    r = warmup("--dry-run", "--json")       # the read-only way still works while it serves
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["dry_run"] and doc["blocks"] == 3
    assert doc["blocks_written"] + doc["blocks_no_space"] == 3   # the served store is full
    server.wait_progress(1)
