"""Helpers of the real-engine tests (tests/e2e): servers, comparisons, the kvstore CLI."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

from kvstore.drivers.client import Completion
from kvstore.drivers.models import SERVE_DTYPE
from kvstore.drivers.server import VLLMServer, connector_config
from kvstore.drivers.workload import Workload

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# float32 greedy decoding of the same prompt agrees to ~1e-6 in logprob between a prefix
# computed and a prefix loaded (see kvstore.drivers.models.SERVE_DTYPE); wrong KV moves
# logprobs by whole units.
LOGPROB_TOL = 1e-3
MAX_TOKENS = 8
# The preemption test (test_real_engine.py): four concurrent prompts of 300 words of the
# workload's system prompt, each growing by PREEMPT_OUT tokens (fixture `preempt_prompts`).
PREEMPT_PROMPTS, PREEMPT_TOKENS, PREEMPT_OUT = 4, 300, 320


def kvstore_threads(server: VLLMServer) -> dict[str, list[int]]:
    """{kernel thread name: [nice of each such thread]} of kvstore's threads (named "kvs-...",
    kvstore.io.threads.make_thread) in the server's processes (its session), from /proc."""
    out: dict[str, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != server.proc.pid:
                continue
            stats = []
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stats.append(f.read())
        except OSError:                  # the process or a thread ended meanwhile
            continue
        for stat in stats:
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if name.startswith("kvs-"):
                # fields after the name start at field 3; nice is field 19
                out.setdefault(name, []).append(int(stat[stat.rindex(")") + 2:].split()[16]))
    return out


def thread_cpus(server: VLLMServer, *names: str) -> dict[str, list[frozenset[int]]]:
    """{kernel thread name: [CPU affinity of each such thread]} of the threads named
    `names` in the server's processes (its session), from the kernel."""
    out: dict[str, list[frozenset[int]]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != server.proc.pid:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                if name in names:
                    out.setdefault(name, []).append(frozenset(os.sched_getaffinity(int(tid))))
        except OSError:                  # the process or a thread ended meanwhile
            continue
    return out


class Serve:
    """Starts servers for one test; each is stopped (or found dead) at the end."""

    def __init__(self, engine, model_dir, logs, name):
        self.engine, self.model_dir, self.logs, self.name = engine, model_dir, logs, name
        self.servers: list[VLLMServer] = []

    def server(self, store: str | None = None, extra: dict | None = None, **kw) -> VLLMServer:
        kv = None if store is None else connector_config(str(store), **{"capacity": "256M", **(extra or {})})
        s = VLLMServer(model=kw.pop("model", self.model_dir), python=self.engine[0],
                       log_path=str(self.logs / f"{self.name}-{len(self.servers)}.log"),
                       kv_transfer_config=kv, dtype=SERVE_DTYPE,
                       max_model_len=kw.pop("max_model_len", 4096), **kw)
        self.servers.append(s)
        return s

    @contextmanager
    def running(self, store=None, extra=None, **kw):
        s = self.server(store, extra, **kw).start()
        try:
            yield s
        finally:
            s.stop()

    def tier_server(self, store: str, **kw) -> VLLMServer:
        """A server whose OffloadingConnector keeps its primary tier on the CPU and a
        kvstore tier over `store` behind it (`tier_config`); stop it with `stop_tier`."""
        engine_id = f"kvstore-tier-test-{uuid.uuid4().hex[:12]}"
        s = VLLMServer(model=kw.pop("model", self.model_dir), python=self.engine[0],
                       log_path=str(self.logs / f"{self.name}-{len(self.servers)}.log"),
                       kv_transfer_config=tier_config(str(store), engine_id), dtype=SERVE_DTYPE,
                       max_model_len=kw.pop("max_model_len", 4096), **kw)
        s.engine_id = engine_id
        self.servers.append(s)
        return s

    def stop_tier(self, s: VLLMServer) -> None:
        s.stop()
        remove_primary_region(s.engine_id)

    def close(self):
        for s in self.servers:
            s.stop()
            if getattr(s, "engine_id", None):
                remove_primary_region(s.engine_id)


# Offloaded chunks of 64 tokens over the server's 32-token blocks: two engine blocks per
# chunk, so a prefix that ends inside a chunk is a partial chunk copy.
CHUNK_TOKENS = 64


def tier_config(store: str, engine_id: str) -> dict:
    """The `--kv-transfer-config` of OffloadingConnector + kvstore tier on the CPU build."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": {
                "spec_name": "CPUTieringOffloadingSpec",
                "spec_module_path": "kvstore.vllm.cpu_offload",
                "cpu_bytes_to_use": 64 << 20, "block_size": CHUNK_TOKENS,
                "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.vllm.tier",
                                     "path": store, "capacity": "256M"}]}}


def tier_counter(m: dict, name: str) -> float:
    """A counter of the kvstore tier from a server's metrics."""
    return m.get(f"vllm:kv_offload_kvstore_{name}_total", m.get(f"vllm:kv_offload_kvstore_{name}", 0.0))


def wait_cascaded(server: VLLMServer, timeout: float = 300.0) -> float:
    """Until the tier's written bytes are past 0 with no cascade job in flight, unchanged
    over three samples a second apart. Returns those bytes."""
    seen, t0 = [], time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = server.metrics()
        seen.append((tier_counter(m, "written_bytes"),
                     m.get("vllm:kv_offload_tiering_active_cascade_jobs", 0.0)))
        if seen[-1][0] > 0 and len(seen) >= 3 and seen[-3] == seen[-2] == seen[-1] and seen[-1][1] == 0:
            return seen[-1][0]
        time.sleep(1.0)
    raise AssertionError(f"the tier's writes did not settle in {timeout:.0f} s: {seen[-10:]}")


def remove_primary_region(engine_id: str) -> None:
    """vLLM's API server stops its engine core with a forced kill, which leaves the primary
    tier's shared region (/dev/shm/vllm_offload_ENGINE_ID.mmap) behind."""
    for path in glob.glob(f"/dev/shm/vllm_offload_{engine_id}*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def copy_store(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def wait_stored(server: VLLMServer, timeout: float = 300.0, above: float = 0.0) -> float:
    """Until the server's stores are committed: its stored-blocks counter is past `above`
    and has not moved for two seconds (three equal samples: one still-running write and
    fsync on a loaded machine outlasted one). Returns that count. A counter that never
    passes `above`, or never settles, within `timeout` (a bound only a hang reaches) fails
    the test, naming what it saw."""
    seen, t0 = [], time.monotonic()
    while time.monotonic() - t0 < timeout:
        n = server.metrics().get("vllm:kvstore_stored_blocks_total", 0.0)
        seen.append(n)
        if n > above and len(seen) >= 3 and seen[-3] == seen[-2] == n:
            return n
        time.sleep(1.0)
    raise AssertionError(f"the server's stored-blocks counter did not pass {above:.0f} and settle "
                         f"in {timeout:.0f} s; last samples: {seen[-10:]}")


def assert_same(ref: list[Completion], got: list[Completion], workload: Workload) -> None:
    """Token for token (and logprob within LOGPROB_TOL) equal to the reference run."""
    assert len(ref) == len(got)
    for req, a, b in zip(workload.requests, ref, got):
        assert a.token_ids == b.token_ids, f"{req.name}: tokens {b.token_ids} != reference {a.token_ids}"
        d = a.max_logprob_diff(b)
        assert d <= LOGPROB_TOL, f"{req.name}: logprobs differ by {d}"


def kvstore_cli(*args: str, python: str | None = None, timeout: float = 600,
                env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m kvstore.cli ARGS` as an operator runs it (default: this venv's Python)."""
    return subprocess.run([python or sys.executable, "-m", "kvstore.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def info(store) -> dict:
    r = kvstore_cli("info", "--json", str(store))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def fsck(store, *args: str) -> tuple[int, dict]:
    r = kvstore_cli("fsck", "--json", "-q", *args, str(store))
    try:
        return r.returncode, json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"fsck printed no JSON (exit {r.returncode}): {r.stdout!r} {r.stderr!r}") from None
