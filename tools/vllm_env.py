#!/usr/bin/env python3
"""Install vLLM 0.33.0 (the CUDA build, from the package index) into the main venv.

    python3 tools/vllm_env.py [.venv]

`make build`/`make test` run this. On a machine with an NVIDIA GPU (`nvidia-smi -L` lists
one), or with KVSTORE_VLLM_FULL=1, it is plain `pip install vllm==0.33.0`.

Elsewhere the suite uses vLLM for what runs on any machine: its scheduler, KV-cache
planning, connector API, KV events and engine core. vLLM's wheel also requires GPU kernel
libraries that only a GPU forward pass loads (FlashInfer, TileLang, CUTLASS DSL, QuACK,
TokenSpeed MLA, humming kernels, cuDNN frontend) and NVIDIA's video decoder, together about
2.5 GB of the venv's ~9.5 GB. A CI machine once had 14 GiB free for both venvs, so here
this script installs vLLM's other requirements (torch==2.14.0 with its CUDA libraries
included: torch does not import without them), then the vLLM wheel itself with --no-deps.
It is idempotent: nothing is installed when vllm==0.33.0 already is.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from engine_env import REPO, download_wheel, pip, quiet, requires_dist, run

VLLM = "0.33.0"
GPU_ONLY = {"flashinfer-python", "tilelang", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla",
            "humming-kernels", "nvidia-cudnn-frontend", "pynvvideocodec"}
# What kvstore and its tests import from vLLM: each must import without the packages above.
SMOKE = ("import vllm, vllm.config, vllm.v1.core.sched.scheduler, vllm.v1.core.sched.async_scheduler, "
         "vllm.v1.engine.core, vllm.v1.worker.utils, vllm.v1.kv_cache_layout, vllm.v1.core.kv_cache_planning, "
         "vllm.distributed.kv_transfer.kv_connector.factory, vllm.distributed.kv_events, "
         "vllm.v1.kv_offload.tiering.fs, vllm.tokenizers; print('vllm_env: ok', vllm.__version__)")


def has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except OSError:
        return False


def main() -> int:
    venv = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / ".venv").resolve()
    py = str(venv / "bin" / "python")
    if not quiet(py, f"import importlib.metadata as m; assert m.version('vllm') == '{VLLM}'"):
        if has_gpu() or os.environ.get("KVSTORE_VLLM_FULL") == "1":
            pip(py, f"vllm=={VLLM}")
        else:
            print(f"vllm_env: no GPU here; installing vllm=={VLLM} without its GPU kernel packages "
                  f"({', '.join(sorted(GPU_ONLY))}); KVSTORE_VLLM_FULL=1 installs them", flush=True)
            with tempfile.TemporaryDirectory() as d:
                wheel = download_wheel(py, f"vllm=={VLLM}", d)
                pip(py, *requires_dist(wheel, drop=GPU_ONLY))
                pip(py, "--no-deps", str(wheel))
    run(py, "-c", SMOKE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
