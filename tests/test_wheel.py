"""The user install: `make wheel`'s wheels (tools/build_wheel.py) install into a fresh venv
with no compiler to call and no headers, and the installed kvstore works from outside the
source tree: it creates a store, stores and loads blocks (every byte compared), and
`kvstore fsck --deep` finds the store clean.

The install runs with pip's --only-binary :all: (nothing may be built from an sdist), CC
and CXX set to /bin/false, and `gcc`, `cc`, `g++`, `c++`, `ld` first on PATH as shims that
record the call and fail; CPATH and friends are unset. The dependencies other than the
liburing binding (numpy, lmdb, xxhash, click, tqdm, dynamic-import) come from the package
index as wheels, so the test needs the index, as `make` does.
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILERS = ("gcc", "cc", "g++", "c++", "clang", "ld", "x86_64-linux-gnu-gcc")


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    """Both wheels, built by tools/build_wheel.py into a directory of this test's own."""
    out = tmp_path_factory.mktemp("wheelhouse")
    # The liburing binding's wheel depends only on its pinned version and the Python
    # (building it compiles the liburing C library, minutes here): one `make wheel` left in
    # wheelhouse/ is reused, as `make wheel` itself does. kvstore's is built every time.
    for w in glob.glob(os.path.join(ROOT, "wheelhouse", "liburing-2024.5.3-*manylinux*.whl")):
        shutil.copy2(w, out)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_wheel.py"), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return out


def _one(wheelhouse, name):
    found = glob.glob(os.path.join(str(wheelhouse), f"{name}-*.whl"))
    assert len(found) == 1, found
    return found[0]


def test_wheels_are_manylinux_and_complete(wheelhouse):
    kv, lu = _one(wheelhouse, "kvstore"), _one(wheelhouse, "liburing")
    for w in (kv, lu):
        name, version, py, abi, platforms = os.path.basename(w)[:-len(".whl")].split("-")
        assert py == abi == "cp%d%d" % sys.version_info[:2]
        assert all(p.startswith("manylinux") and p.endswith("_x86_64") for p in platforms.split(".")), w
    with zipfile.ZipFile(kv) as z:
        names = z.namelist()
        meta = z.read("kvstore-0.1.0.dist-info/METADATA").decode()
    core = {n.split("/")[1].split(".")[0] for n in names if n.startswith("kvstore/_") and n.endswith(".so")}
    assert core == {"_hostbuf", "_sharedmap", "_keytable", "_seenfilter", "_ring", "_slotfile", "_cuda",
                    "_copy"}
    # Every subpackage of the source tree is in the wheel.
    subpackages = {d for d in os.listdir(os.path.join(ROOT, "kvstore"))
                   if os.path.isfile(os.path.join(ROOT, "kvstore", d, "__init__.py"))}
    assert subpackages and all(f"kvstore/{d}/__init__.py" in names for d in subpackages)
    assert not [n for n in names if n.endswith((".pyx", ".pxd", ".c"))]
    requires = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    assert "liburing==2024.5.3" in requires
    # torch comes only with the vllm extra: the store, the tools and the CLI run without it.
    assert [r for r in requires if r.startswith("torch")] == ['torch>=2.4; extra == "vllm"']


def _no_compiler_env(tmp_path):
    """The install's environment: compilers on PATH are shims that log and fail."""
    shims = tmp_path / "no-compiler"
    shims.mkdir()
    log = tmp_path / "compiler-calls.log"
    for name in COMPILERS:
        p = shims / name
        p.write_text(f'#!/bin/sh\necho "$0 $*" >> {log}\nexit 1\n')
        p.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CPATH", "C_INCLUDE_PATH",
                        "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "LDSHARED", "CFLAGS", "LDFLAGS")}
    env.update(PATH=f"{shims}:/usr/bin:/bin", CC="/bin/false", CXX="/bin/false", PIP_NO_CACHE_DIR="1")
    return env, log


def test_wheel_installs_without_compiler_and_runs(wheelhouse, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py, env_bin = str(venv / "bin" / "python"), str(venv / "bin")
    env, log = _no_compiler_env(tmp_path)
    kv = _one(wheelhouse, "kvstore")
    # The wheel by its file (a different project is called `kvstore` on PyPI); liburing
    # from the wheelhouse, where the only binary of it is.
    r = subprocess.run([py, "-m", "pip", "install", "--no-cache-dir", "--only-binary", ":all:",
                        "--find-links", str(wheelhouse), kv],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert not log.exists(), log.read_text()

    env["PATH"] = f"{env_bin}:{env['PATH']}"
    listed = json.loads(subprocess.run([py, "-m", "pip", "list", "--format", "json"], env=env,
                                       check=True, capture_output=True, text=True).stdout)
    versions = {d["name"].lower(): d["version"] for d in listed}
    assert versions["kvstore"] == "0.1.0" and versions["liburing"] == "2024.5.3"
    assert "torch" not in versions and "vllm" not in versions

    script = tmp_path / "use_store.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        import numpy as np
        import kvstore, kvstore._ring, liburing
        from kvstore.store.disk import DiskStore
        from kvstore.format.layout import Layout

        BB = 16 << 10
        layout = Layout(model="wheel-check", dtype="float16", block_size=16, block_bytes=BB,
                        num_layers=2, num_kv_heads=2, head_dim=64, tp_size=2)

        def payload(i, rank):
            return ((np.arange(BB, dtype=np.uint32) * (i + 3) + rank * 7 + i) % 251).astype(np.uint8)

        keys = [b"block%04d" % i for i in range(24)]
        with DiskStore.create(sys.argv[1], layout, 32 * (BB + 4096) * 2, io=True) as st:
            stored = st.put(keys, payload)
        with DiskStore(sys.argv[1], layout, io=True) as st:
            got = st.get(keys)
        same = all(got[k] == [payload(i, r).tobytes() for r in (0, 1)] for i, k in enumerate(keys))
        print(json.dumps({"kvstore": kvstore.__file__, "ring": kvstore._ring.__file__,
                          "liburing": liburing.__file__, "stored": len(stored), "loaded": len(got),
                          "same": same}))
    """))
    store = tmp_path / "store"
    r = subprocess.run([py, str(script), str(store)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    site = str(venv / "lib")
    # The installed package, not the checkout's (cwd is outside it, PYTHONPATH unset).
    assert all(out[m].startswith(site) for m in ("kvstore", "ring", "liburing")), out
    assert (out["stored"], out["loaded"], out["same"]) == (24, 24, True)

    r = subprocess.run([os.path.join(env_bin, "kvstore"), "fsck", "--deep", "--json", "-q", str(store)],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(r.stdout)
    assert doc["clean"] and doc["findings"] == []
    assert doc["stats"]["entries"] == 24 and doc["stats"]["slots_checked"] == 24
    assert not log.exists(), log.read_text()
