"""kvstore info: fingerprint, slot counts, counters, files and writer of real stores."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
from click.testing import CliRunner

from kvstore.cli import main
from kvstore.engine import DiskStore, slot_file_path
from kvstore.layout import Layout
from kvstore.tools.info import format_text, gather

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    assert info["writer_pid"] is None
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
                 "rank1", "writer", "none"):
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
    from kvstore.engine import DiskStore
    st = DiskStore(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.read()
    st.close()
""")


def test_info_shows_the_writer(tmp_path):
    p = tmp_path / "s"
    fill(p, 3)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(p), REPO], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        r = CliRunner().invoke(main, ["info", str(p)])
        assert r.exit_code == 0
        assert f"pid {proc.pid} holds the writer lock" in r.output
        assert gather(str(p))["used_slots"] == 3       # read-only open next to the writer
    finally:
        proc.stdin.close()
        proc.wait(30)


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
