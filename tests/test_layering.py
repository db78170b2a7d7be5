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


# Where kvstore reads another package's private attribute on purpose (the peer it is
# measured against, vLLM's internals it wraps, torch's AMX probe): (file, attribute) -> why.
FOREIGN_PRIVATE = {
    ("kvstore/bench/peers_bench.py", "_use_o_direct"): "vLLM's fs tier: no public O_DIRECT switch",
    ("kvstore/bench/peers_bench.py", "_lookup_manager"): "vLLM's fs tier: its batched lookups",
    ("kvstore/drivers/simulator.py", "_kvstore_harness_wrapped"): "a marker on vLLM's publisher",
    ("kvstore/drivers/simulator.py", "_inflight_prefills"): "vLLM's scheduler: the harness's view",
    ("kvstore/bench/peers_bench.py", "_HAS_FSIO_C"): "vLLM's fs tier: whether its C helper loaded",
    ("kvstore/bench/tier_bench.py", "_num_chunks"): "vLLM's CPU primary tier: its chunk count",
    ("kvstore/vllm/keys.py", "_NON_CRYPTO_HASH_FUNCTIONS"): "vLLM's hash functions by name",
    ("kvstore/vllm/plugin.py", "_registry"): "vLLM's connector factory: registered once",
    ("kvstore/remote/agent.py", "_exit"): "os._exit: the fleet agent skips Mooncake's teardown",
    ("kvstore/vllm/connector.py", "_is_amx_tile_supported"): "torch's AMX probe",
    ("kvstore/vllm/connector.py", "_C"): "torch's AMX permission request",
    ("kvstore/vllm/connector.py", "_cpu"): "torch's AMX permission request",
    ("kvstore/vllm/connector.py", "_init_amx"): "torch's AMX permission request",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reach(root: str) -> list[str]:
    """Every place a kvstore module imports another module's `_private` name, or reads a
    `_private` attribute of an object that is neither `self`/`cls` nor defined in that
    module (what a module shares is named without the underscore)."""
    import ast
    extensions = {os.path.splitext(f)[0] for f in os.listdir(os.path.join(root, "cython_src", "kvstore"))
                  if f.endswith(".pyx")}
    out = []
    pkg = os.path.join(root, "kvstore")
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)
            tree = ast.parse(open(path).read(), rel)
            defined = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defined.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    defined.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
                elif isinstance(node, ast.arg):
                    defined.add(node.arg)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvstore"):
                    for a in node.names:
                        if _private(a.name) and not (node.module == "kvstore" and a.name in extensions):
                            out.append(f"{rel}:{node.lineno}: imports {node.module}.{a.name}")
                elif (isinstance(node, ast.Attribute) and _private(node.attr)
                      and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                      and node.attr not in defined and node.attr not in extensions
                      and (rel, node.attr) not in FOREIGN_PRIVATE):
                    out.append(f"{rel}:{node.lineno}: reads .{node.attr} of another module's object")
    return sorted(out)


def test_no_module_reaches_into_another_modules_private_names():
    found = private_reach(ROOT)
    assert not found, "\n".join(found)


def test_a_planted_private_import_is_found(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "kvstore"), tree / "kvstore",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(os.path.join(ROOT, "cython_src"), tree / "cython_src",
                    ignore=shutil.ignore_patterns("*.c", "*.html"))
    tier = tree / "kvstore" / "vllm" / "tier.py"
    tier.write_text(tier.read_text() + "\n\nfrom kvstore.lookup.table import _CHUNK  # noqa\n\n"
                    "def planted(rio):\n    return rio._fds\n")
    found = private_reach(str(tree))
    assert any("imports kvstore.lookup.table._CHUNK" in f for f in found), found
    assert any("reads ._fds" in f for f in found), found
