#!/usr/bin/env bash
# The device check on a lent GPU machine, in one command (see docs/gpu.md):
#
#   tools/gpu_run.sh [OUT]        (OUT defaults to $OUT, else ./out)
#
# 1. the machine: kernel, GPUs, the python that will run the check and whether the
#    bundle (.gpu, made here by tools/gpu_bundle.sh for that python) matches it;
# 2. an io_uring probe: one block written and read back through kvstore's ring with
#    O_DIRECT (a sandbox with partial io_uring support fails here, in seconds);
# 3. tools/gpu_check.py: correctness (RESULT) and performance (PERFORMANCE) apart.
# Exit status: the probe's if it failed, else the check's.
set -uo pipefail
OUT=${1:-${OUT:-out}}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
echo "== machine"
uname -srm
nvidia-smi -L 2>&1 | head -8
"$PY" -c 'import sys, sysconfig; print("python", sys.version.split()[0], sysconfig.get_config_var("EXT_SUFFIX"))'
SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
if ! ls .gpu/kvstore/_copy"$SUFFIX" >/dev/null 2>&1; then
    echo "error: .gpu/kvstore has no extensions for this python ($SUFFIX): rebuild the bundle with" \
         "tools/gpu_bundle.sh PYTHON-OF-THAT-VERSION .gpu and carry it" >&2
    ls .gpu/kvstore 2>&1 | head -3 >&2
    exit 2
fi
echo "== io_uring probe"
"$PY" tools/gpu_check.py --bundle .gpu --probe || exit $?
echo "== device check"
PYTHONUNBUFFERED=1 "$PY" tools/gpu_check.py --bundle .gpu --out "$OUT"
