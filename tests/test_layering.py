"""The package's layering (`.importlinter`) holds, and the check would catch a break.

`lint-imports` (import-linter) reads every import of the package, lazy ones included:
each layer imports only the layers below it, and the storage core and the offline
tools never import vLLM or torch (transfer's two lazy imports are named exceptions)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def lint(cwd: str) -> subprocess.CompletedProcess:
    # The package is found through the working directory first (PYTHONPATH), so a copy
    # of the tree is checked as it is, not the installed one.
    env = dict(os.environ, PYTHONPATH=cwd)
    return subprocess.run([LINT, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_layering_contracts_hold():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "2 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def test_a_planted_upward_import_and_a_planted_vllm_import_break_the_contracts(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "kvstore"), tree / "kvstore",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, ".importlinter"), tree / ".importlinter")
    engine = tree / "kvstore" / "store" / "disk.py"
    engine.write_text(engine.read_text() + "\n\ndef _planted():\n"
                      "    from kvstore.vllm import connector  # noqa: F401\n"
                      "    import vllm  # noqa: F401\n")
    r = lint(str(tree))
    assert r.returncode != 0, r.stdout[-3000:]
    assert "0 kept, 2 broken" in r.stdout, r.stdout[-3000:]
    assert "kvstore.store.disk -> kvstore.vllm" in r.stdout and "kvstore.store.disk -> vllm" in r.stdout, r.stdout[-3000:]
