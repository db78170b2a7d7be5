"""`kvstore bench peers --dir A,B`: with several directories kvstore runs one store
striped over all of them, fio a job on every directory at once, the one-thread baseline a
thread per directory and vLLM's fs tier (one root_dir) the first directory; the JSON and
the table report every system per directory next to its total. Needs vLLM (the fs tier)
and fio (`make test` installs it), as `bench io --dir A,B,C`'s test does."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.slow
def test_bench_peers_over_two_dirs(tmp_path):
    dirs = [str(tmp_path / "dev0"), str(tmp_path / "dev1")]
    for d in dirs:
        os.mkdir(d)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "peers", "--dir", ",".join(dirs),
                        "--size", "8M", "--block-sizes", "128K", "--rounds", "1", "--samples", "2",
                        "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    c = out["config"]
    assert c["dirs"] == dirs and c["dir"] == ",".join(dirs)
    assert c["kvstore_dirs"] == dirs and c["fio_dirs"] == dirs and c["one_thread_dirs"] == dirs
    assert c["vllm_fs_dirs"] == dirs[:1]           # one root_dir: the first directory
    assert c["size_per_dir"] == 4 << 20

    rows = out["per_device"]["131072"]
    assert [x["dir"] for x in rows] == dirs
    res = out["results"]["131072"]
    for row in rows:
        for s in ("kvstore", "fio", "one_thread"):    # every one of these ran on both
            assert row[s]["store_gbps"] > 0 and row[s]["load_gbps"] > 0, (s, row)
    # kvstore's store is striped: an equal share of the blocks on each directory
    k0, k1 = (x["kvstore"]["store_gbps"] for x in rows)
    assert abs(k0 - k1) < 1e-9 * max(k0, 1.0)
    # vLLM's fs tier moved everything on the first directory, nothing on the second
    assert rows[0]["vllm_fs"]["store_gbps"] == res["vllm_fs"]["store_gbps"]
    assert rows[1]["vllm_fs"] == {"store_gbps": 0.0, "load_gbps": 0.0}
    for s in ("kvstore", "vllm_fs", "one_thread", "fio"):   # the rows add up to the total
        for f in ("store_gbps", "load_gbps"):
            tot = res[s][f]
            assert abs(sum(x[s][f] for x in rows) - tot) <= 1e-6 * tot, (s, f)
    for d in dirs:      # nothing left behind on either directory
        assert os.listdir(d) == []

    from kvstore.bench.peers_bench import format_table
    table = format_table(out)
    assert "over 2 directories" in table and "1 thread/dir" in table
    assert f"*vLLM fs tier: {dirs[0]} only" in table
    per_dir = [line.split()[2] for line in table.splitlines() if line.startswith("128.0 KiB /")]
    assert per_dir == dirs
