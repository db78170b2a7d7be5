"""kvstore info: fingerprint, slot counts, counters, files and attached engines of real stores."""
from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
from click.testing import CliRunner

from kvstore.cli import main
from kvstore.store.disk import DiskStore, slot_file_path
from kvstore.format.layout import Layout
from kvstore.tools.info import format_text, gather

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BLOCK = 8192
SLOT = 4096 + BLOCK


def layout(tp=1):
    return Layout(model="tiny-llama", dtype="bfloat16", block_size=16, block_bytes=BLOCK, num_layers=2,
                  num_kv_heads=2, head_dim=16, tp_size=tp)


def key(i):
    return i.to_bytes(4, "big") * 8 + b"\x00"


def fill(path, n, cap=16, tp=1):
    with DiskStore.create(str(path), layout(tp), cap * SLOT * tp, io=True, staging_bytes=1 << 20) as st:
        keys = [key(i) for i in range(n)]
        st.put(keys, lambda i, r: np.full(BLOCK, i % 251, np.uint8))
        return st, keys


def test_info_json_fields_and_counts(tmp_path):
    p = tmp_path / "s"
    fill(p, 0, cap=16, tp=2)
    with DiskStore(str(p), io=True, staging_bytes=1 << 20) as st:
        keys = [key(i) for i in range(20)]          # 20 > 16 slots: 4 evictions
        for i in range(0, 20, 4):
            st.put(keys[i:i + 4], lambda j, r: np.full(BLOCK, 7, np.uint8))
        st.get(keys[16:20])                          # hit
        st.get([b"missing-key"])                     # miss
    info = gather(str(p))
    assert info["capacity_slots"] == 16
    assert info["used_slots"] == 16 and info["free_slots"] == 0 and info["reserved_slots"] == 0
    assert info["pinned_slots"] == 0
    assert info["used_slots"] + info["free_slots"] + info["reserved_slots"] == info["capacity_slots"]
    assert info["evictions"] == 4
    assert info["hits"] == 4 and info["misses"] == 1
    assert info["oldest_tick"] is not None and info["oldest_age_ticks"] == info["tick"] - info["oldest_tick"]
    assert info["writer_pid"] is None and info["engines"] == [] and info["unowned_reserved_slots"] == 0
    assert info["layout"]["model"] == "tiny-llama" and info["tp_size"] == 2
    f = info["files"]
    assert f["slot_bytes"] == 16 * SLOT * 2 and f["slot_allocated_bytes"] >= 16 * SLOT * 2
    assert f["index_bytes"] > 0 and f["fingerprint_bytes"] > 0
    assert [r["missing_files"] for r in f["ranks"]] == [0, 0]

    r = CliRunner().invoke(main, ["info", "--json", str(p)])
    assert r.exit_code == 0
    doc = json.loads(r.output)
    for k in ("capacity_slots", "used_slots", "free_slots", "pinned_slots"):
        assert doc[k] == info[k]

    r = CliRunner().invoke(main, ["info", str(p)])
    assert r.exit_code == 0
    for word in ("fingerprint", "model=tiny-llama", "used 16 (100.0%)", "evictions", "oldest entry",
                 "rank1", "engines", "none attached"):
        assert word in r.output, r.output


def test_info_empty_store(tmp_path):
    p = tmp_path / "s"
    fill(p, 0)
    info = gather(str(p))
    assert info["used_slots"] == 0 and info["free_slots"] == 16 and info["oldest_tick"] is None
    assert info["hit_rate"] is None
    assert "store is empty" in format_text(info)


HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from kvstore.store.disk import DiskStore
    st = DiskStore(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.read()
    st.close()
""")

# An engine in its own process: attaches, reserves `nres` new keys (never committed: an
# in-flight store) and pins the slots of the committed keys 0..npin-1 in its lease (as the
# serving index does: its KeyTable's pin counts live in the lease file).
ENGINE = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from kvstore._keytable import KeyTable
    from kvstore.store.disk import DiskStore
    path, nres, npin, base = sys.argv[1], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    key = lambda i: i.to_bytes(4, "big") * 8 + b"\\x00"
    st = DiskStore(path)
    refs, _ = st.reserve([key(base + i) for i in range(nres)])
    assert len(refs) == nres
    table = KeyTable(st.geometry.num_slots)
    table.attach(st.lease.slots, st.lease.pins)
    table.pin([st.lookup(key(i)).slot for i in range(npin)])
    print("ready", flush=True)
    sys.stdin.read()
    st.abort(refs)
    st.close()
""")


def start_engine(p, nres=0, npin=0, base=1000):
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(p), REPO, str(nres), str(npin), str(base)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc):
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(30)


def cli(*args):
    """`kvstore ARGS` in its own process (this process has the store open as an engine,
    and one process opens an index once)."""
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def info_json(p):
    r = cli("info", "--json", str(p))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def by_pid(info):
    return {e["pid"]: e for e in info["engines"]}


def test_info_shows_the_writer(tmp_path):
    """One engine attached (the old single-writer case): writer_pid names it (kept for
    compatibility), the engines section lists it."""
    p = tmp_path / "s"
    fill(p, 3)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(p), REPO], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        r = CliRunner().invoke(main, ["info", str(p)])
        assert r.exit_code == 0
        assert f"1 attached (pid {proc.pid})" in r.output and f"pid {proc.pid} (engine)" in r.output
        info = gather(str(p))
        assert info["used_slots"] == 3       # read-only open next to the engine
        assert info["writer_pid"] == proc.pid and [e["pid"] for e in info["engines"]] == [proc.pid]
    finally:
        stop(proc)


def test_info_lists_the_attached_engines_and_a_dead_one_until_reclaimed(tmp_path):
    """Two engines attached (this process and a child), each holding reservations, the
    child pinning slots: `engines` gives each one's pid, start time, reservations and
    pins. The child SIGKILLed: it shows alive=false with its reservations until an
    engine attaches, which reclaims them (the store's reserved_slots go back)."""
    p = tmp_path / "s"
    fill(p, 6, cap=32)
    t0 = time.time()
    mine = DiskStore(str(p))
    procs = []
    try:
        my_refs, _ = mine.reserve([key(500 + i) for i in range(2)])
        child = start_engine(p, nres=3, npin=4)
        procs.append(child)
        t1 = time.time()
        info = info_json(p)
        eng = by_pid(info)
        assert set(eng) == {os.getpid(), child.pid}
        me, ch = eng[os.getpid()], eng[child.pid]
        assert (me["alive"], me["kind"], me["reserved_slots"], me["pinned_slots"]) == (True, "engine", 2, 0)
        assert (ch["alive"], ch["kind"], ch["reserved_slots"], ch["pinned_slots"]) == (True, "engine", 3, 4)
        for e in (me, ch):
            assert t0 - 1 <= e["started"] <= t1 + 1
            assert abs(datetime.datetime.fromisoformat(e["started_iso"]).timestamp() - e["started"]) < 1
        assert me["started"] <= ch["started"]
        assert info["reserved_slots"] == 5 and info["unowned_reserved_slots"] == 0
        assert info["pinned_slots"] == 4
        assert info["writer_pid"] in eng
        r = cli("info", str(p))
        assert r.returncode == 0, r.stderr
        assert f"engines       2 attached (pid " in r.stdout
        assert f"pid {child.pid} (engine), started " in r.stdout and "reserved 3, pinned 4" in r.stdout
        assert f"pid {os.getpid()} (engine), started " in r.stdout and "reserved 2, pinned 0" in r.stdout

        # killed: its lease stays (nobody reclaimed it yet), alive false, reservations kept
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        info = info_json(p)
        eng = by_pid(info)
        assert eng[child.pid]["alive"] is False and eng[child.pid]["reserved_slots"] == 3
        assert eng[os.getpid()]["alive"] is True
        assert info["reserved_slots"] == 5 and info["pinned_slots"] == 0   # a dead engine pins nothing
        assert info["writer_pid"] == os.getpid()
        text = format_text(info)
        assert "1 attached" in text and "1 gone, not reclaimed yet" in text
        assert f"pid {child.pid} (engine)" in text and "GONE" in text and "3 reservation(s)" in text

        # an engine attaches: the dead one's lease goes and its reservations come back
        newer = start_engine(p)
        procs.append(newer)
        info = info_json(p)
        assert set(by_pid(info)) == {os.getpid(), newer.pid}
        assert all(e["alive"] for e in info["engines"])
        assert info["reserved_slots"] == 2 == mine.stats()["reserved_slots"]
        assert by_pid(info)[os.getpid()]["reserved_slots"] == 2
        assert info["unowned_reserved_slots"] == 0
        mine.abort(my_refs)
        stop(newer)
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait(30)
        mine.close()
    assert gather(str(p))["engines"] == []


def test_info_damaged_store_still_reports(tmp_path):
    p = tmp_path / "s"
    fill(p, 3)
    os.unlink(slot_file_path(str(p), 0, 0))
    shutil.rmtree(p / "index")
    r = CliRunner().invoke(main, ["info", str(p)])
    assert r.exit_code == 1
    assert "model=tiny-llama" in r.output and "MISSING" in r.output and "rebuild-index" in r.output
    info = gather(str(p))
    assert "index_error" in info and "used_slots" not in info


def test_info_not_a_store(tmp_path):
    r = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert r.exit_code == 1 and "kvstore.json is missing" in r.output


def test_progress_plain_lines_and_tqdm():
    import io

    from kvstore.tools import Progress
    buf = io.StringIO()                       # not a TTY: plain lines, rate-limited
    with Progress("fsck", 4 << 20, "B", stream=buf, interval=0.0) as p:
        p.update(1 << 20)
        p.update(1 << 20, errors=0)
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("fsck: 1.0 MiB of 4.0 MiB (25%)") and "GB/s" in lines[0]
    assert lines[1].startswith("fsck: 2.0 MiB of 4.0 MiB (50%)") and lines[1].endswith("errors=0")
    buf = io.StringIO()
    with Progress("warmup", 10, "prompts", stream=buf, interval=3600) as p:
        p.update(5)
    assert buf.getvalue() == ""               # a short run prints nothing
    buf = io.StringIO()
    with Progress("warmup", 10, "prompts", stream=buf, tty=True, interval=0) as p:   # a terminal: tqdm
        p.update(5, blocks=7)
    assert "5/10" in buf.getvalue() and "blocks=7" in buf.getvalue()
    quiet = io.StringIO()
    with Progress("x", 10, stream=quiet, enabled=False, tty=True) as p:
        p.update(10)
    assert quiet.getvalue() == ""
