#!/usr/bin/env bash
# Build what tools/gpu_check.py needs on the lent GPU machine, which has no network and
# runs its own python3 (with torch and numpy, without the `liburing` binding, lmdb or
# vLLM): kvstore's extensions built for that Python, and the liburing binding and lmdb
# built for it, in one folder to carry.
#
#   tools/gpu_bundle.sh [PYTHON] [OUTDIR]     (defaults: python3.12, .gpu)
#
# Then, on the device machine:  tools/gpu_run.sh $OUT   (carry [".gpu"]; docs/gpu.md).
# `.gpu/` is in .gitignore, so it never gets committed.
set -euo pipefail
PY=${1:-python3.12}
OUT=${2:-.gpu}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=$(mktemp -d /tmp/kvstore-gpu-bundle.XXXXXX)
trap 'rm -rf "$VENV"' EXIT
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q "liburing==2024.5.3" "Cython>=3.0,<3.1" "numpy>=2.0" lmdb setuptools wheel
rm -rf "$OUT" && mkdir -p "$OUT/kvstore" "$OUT/site"
# Build from a copy of the sources, so the checkout's own build (and its generated C in
# build/cython, made against another numpy) stays untouched.
mkdir -p "$VENV/src"
cp -r setup.py cython_src csrc kvstore "$VENV/src/"
find "$VENV/src/kvstore" -name '*.so' -delete
(cd "$VENV/src" && "$VENV/bin/python" setup.py -q build_ext --inplace)
cp "$VENV"/src/kvstore/*.so "$OUT/kvstore/"
SITE=$("$VENV/bin/python" -c 'import liburing, os; print(os.path.dirname(os.path.dirname(liburing.__file__)))')
for pkg in liburing dynamic_import lmdb; do
    cp -r "$SITE/$pkg" "$OUT/site/"
    cp -r "$SITE/$pkg"-*.dist-info "$OUT/site/" 2>/dev/null || true
done
du -sh "$OUT"
ls "$OUT/kvstore"
