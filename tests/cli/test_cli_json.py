"""Every `--json` output of the `kvstore` command is exactly one JSON object.

The commands are found by walking the click command tree, so a new command with a
`--json` flag fails this test until it is listed in ARGS (with arguments that keep it
small). Each runs as a real subprocess (`python -m kvstore.cli`), and its whole stdout
must parse as one JSON object: a command that prints its object twice, or a table line
before it, fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import numpy as np
import pytest

from kvstore.cli import main
from kvstore.store.disk import DiskStore
from kvstore.format.layout import Layout

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BLOCK = 4096
LAYOUT = Layout(model="tiny-llama", dtype="bfloat16", block_size=16, block_bytes=BLOCK,
                num_layers=2, num_kv_heads=2, head_dim=16, tp_size=1)

# command path -> arguments ({src}/{dst}: stores made by the fixture), and whether a
# non-zero exit status is expected to still print the JSON (soak's verdict on a tiny run).
ARGS = {
    ("bench", "io"): ["--size", "8M", "--block-size", "128K", "--rounds", "1"],
    ("bench", "index"): ["--entries", "2000"],
    ("bench", "connector"): ["--index-entries", "1000", "--requests", "2", "--prompt-tokens",
                             "64", "--no-baseline", "--thread-cpus", str(max(os.sched_getaffinity(0)))],
    ("bench", "soak"): ["--requests", "40", "--interval", "20"],
    ("bench", "peers"): ["--size", "16M", "--block-sizes", "128K", "--rounds", "1", "--samples",
                         "2", "--prefix-blocks", "16"],
    ("bench", "fleet"): ["--blocks", "16", "--block-size", "128K", "--rounds", "1",
                         "--index-entries", "1000", "--requests", "2"],
    ("bench", "warmup"): ["--size", "8M", "--block-sizes", "128K", "--rounds", "1"],
    ("bench", "tier"): ["--size", "16M", "--primary", "8M", "--chunk-tokens", "16",
                        "--job-tokens", "32"],
    ("info",): ["{src}"],
    ("fsck",): ["{src}"],
    ("warmup",): ["{dst}", "--from-store", "{src}", "--all"],
    # The real engine (vLLM's CPU build from `make engine`, or CUDA vLLM with a GPU) with
    # the tiny model: two server starts each.
    ("demo",): ["--model", "tiny", "--documents", "1", "--doc-tokens", "64", "--sessions", "1"],
    ("bench", "ttft"): ["--model", "tiny", "--lengths", "64", "--samples", "1", "--systems", "kvstore"],
    ("bench", "serve"): ["--model", "tiny", "--systems", "kvstore", "--workloads", "prefix_repetition",
                         "--num-prefixes", "1", "--prefix-len", "64", "--num-prompts", "2",
                         "--output-len", "4", "--concurrency", "2", "--capacity", "64M"],
}
MAY_FAIL = {("bench", "soak")}
# The commands that start real servers (marker e2e), and those that run for half a minute
# or more here (marker slow).
SERVES = {("demo",), ("bench", "ttft"), ("bench", "serve")}
SLOW = {("bench", "soak"), ("bench", "connector"), ("bench", "peers"), ("bench", "fleet")}


def _json_commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        path = prefix + (name,)
        if isinstance(cmd, click.Group):
            yield from _json_commands(cmd, path)
        elif any("--json" in p.opts for p in cmd.params if isinstance(p, click.Option)):
            yield path


def test_every_json_command_is_covered():
    found = set(_json_commands(main))
    assert found == set(ARGS), (f"commands with --json not covered here: {sorted(found - set(ARGS))}; "
                                f"listed but gone: {sorted(set(ARGS) - found)}")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-json")
    src, dst = str(d / "src"), str(d / "dst")
    rng = np.random.default_rng(0)
    with DiskStore.create(src, LAYOUT, 32 * (BLOCK + 4096), io=True, staging_bytes=1 << 20) as st:
        keys = [b"key-%04d" % i for i in range(8)]
        st.put(keys, lambda i, r: rng.integers(0, 256, BLOCK, dtype=np.uint8))
    DiskStore.create(dst, LAYOUT, 32 * (BLOCK + 4096)).close()
    return {"src": src, "dst": dst}


@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.e2e] * (p in SERVES)
                                                 + [pytest.mark.slow] * (p in SLOW))
                                  for p in sorted(ARGS)], ids=lambda p: "-".join(p))
def test_json_output_parses_as_one_object(path, stores, tmp_path, request):
    args = [a.format(**stores) for a in ARGS[path]]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    if path in SERVES:
        # The tiny model, made before the command looks for it: one test process at a time
        # makes it (another may be making it for its own servers).
        request.getfixturevalue("make_model")(request.getfixturevalue("engine")[0], "tiny")
        # vLLM puts its ZMQ sockets in TMPDIR, and a socket path is at most 107 bytes: a
        # server keeps the run's own (short) TMPDIR, not this test's deep tmp_path.
        env["TMPDIR"] = os.environ.get("TMPDIR", "/tmp")
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", *path, *args, "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    if path not in MAY_FAIL:
        assert r.returncode == 0, f"{' '.join(path)} exited {r.returncode}: {r.stderr[-2000:]}"
    try:
        doc = json.loads(r.stdout)
    except json.JSONDecodeError as exc:
        pytest.fail(f"`kvstore {' '.join(path)} --json` stdout is not one JSON object ({exc}):\n"
                    f"{r.stdout[:2000]}")
    assert isinstance(doc, dict) and doc
    if path == ("bench", "connector"):
        for ph in ("store", "load"):
            by = doc["phases"][ph]["gc_collections"]
            assert set(by) <= {"step_thread_in_connector", "step_thread_elsewhere",
                               "kvstore_threads", "other_threads"}, by
            assert all(v["count"] >= 1 and v["max_ms"] >= 0 for v in by.values()), by
        # each busy step is followed by the forward's stand-in (10 ms by default): the
        # store phase lasts at least that long
        st = doc["phases"]["store"]
        # the prefilled index is what the phases run on (the engine keeps the store)
        assert st["entries_at_start"] >= doc["index_entries"], st["entries_at_start"]
        assert doc["forward_ms"] == 10.0 and st["phase_s"] >= st["steps"] * 0.010, st
        # the load phase's length too (a crawling load phase showed only as a timeout)
        ld = doc["phases"]["load"]
        assert ld["phase_s"] > 0 and ld["steps_per_s"] > 0, ld
    if path == ("bench", "peers"):
        # fio on kvstore's own pattern ran beside sequential fio, and kvstore is judged on it
        r = doc["results"][str(128 << 10)]
        assert r["fio_slots"]["store_gbps"] > 0 and r["fio_slots"]["load_gbps"] > 0, r
        named = [t["target"] for t in doc["targets"]]
        assert any("fio on kvstore's slots" in t for t in named), named
    if path == ("bench", "warmup"):
        # both copied the 64 blocks (kvstore's round fails unless every block was written)
        r = doc["results"][str(128 << 10)]
        assert r["kvstore"]["copy_gbps"] > 0 and r["fio"]["copy_gbps"] > 0, r
        assert [t["target"] for t in doc["targets"]] == ["128.0 KiB: copy >= 0.95x fio (read "
                                                         "pass + write pass)"], doc["targets"]
    if path == ("bench", "fleet"):
        t = doc["transfer"]
        assert t["best"]["publish_gbps"] > 0 and t["best"]["fill_gbps"] > 0, t
        assert t["mooncake"]["put_gbps"] > 0 and t["mooncake"]["get_gbps"] > 0, t
        # the load phase with the pool ran on an empty store: the pool filled it
        assert doc["step"]["with_pool"]["load"]["pool_filled_blocks"] > 0, doc["step"]
        assert doc["step"]["without_pool"]["load"]["pool_filled_blocks"] == 0, doc["step"]


def test_bench_index_refuses_sizes_its_commit_rounds_cannot_fill():
    """`bench index` commits 1,000 keys at a time into a full index: a smaller size is
    refused up front, naming the minimum (it raised StoreFull from deep in a run)."""
    from click.testing import CliRunner
    r = CliRunner().invoke(main, ["bench", "index", "--entries", "300,5000"])
    assert r.exit_code != 0
    assert "at least 1,000" in r.output and "[300]" in r.output
    r = CliRunner().invoke(main, ["bench", "index", "--entries", ","])
    assert r.exit_code != 0 and "names no size" in r.output


def test_bench_connector_refuses_a_bad_cpu_list_before_it_prefills(tmp_path):
    from click.testing import CliRunner
    r = CliRunner().invoke(main, ["bench", "connector", "--thread-cpus", "0-", "--dir",
                                  str(tmp_path)])
    assert r.exit_code != 0 and "thread_cpus='0-'" in r.output and "taskset" in r.output
    assert not os.listdir(tmp_path)     # nothing was prefilled


@pytest.mark.slow
def test_simulated_demo_loads_every_block_byte_for_byte(tmp_path):
    """`kvstore demo --simulated`: vLLM's real scheduler with a stand-in runner, restarted on
    the same store; its one JSON object says most prompt tokens came from disk, none wrong."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "demo", "--simulated", "--json"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["blocks_mismatched"] == 0 and doc["blocks_verified"] > 0, doc
    assert doc["hit_rate_after_restart"] > 0.5, doc
