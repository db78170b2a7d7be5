"""kvstore: a persistent NVMe disk tier for vLLM's KV cache.

The package tree follows the data path, each layer importing only those below it
(`.importlinter`, docs/ARCHITECTURE.md): `cli` -> `bench` -> `drivers` (a real `vllm
serve`, the CPU harness, the demos) -> `tools` (fsck, info, warmup) -> `vllm` (the
connector and the secondary tier) -> `lookup` (the scheduler's index) -> `store`
(`DiskStore`, the public API) -> `io` (a rank's slot files and rings) | `index` (LMDB) ->
`format` (the layout fingerprint) -> `errors`, over the Cython I/O core (`kvstore._ring.Ring`,
`kvstore._slotfile.SlotFile`, `kvstore._hostbuf.HostBuffer`).
"""
from kvstore.errors import (  # noqa: F401
    AlignmentError, BenchmarkFailed, ConfigError, CorruptIndex, CorruptSlot, CorruptStore,
    DataDirError, KVStoreError, LayoutMismatch, MissingDependency, StoreClosed, StoreFull,
    StoreLocked, StoreNotFound,
)

__version__ = "0.1.0"


def _import_liburing(attempts=5):
    """Import the `liburing` binding once per process, serialized across processes.

    liburing 2024.5.3's `__init__` runs dynamic_import 2024.5.2's importer, which cannot
    read its own cache (its load_cache raises NameError inside a bare `except`) and so
    removes and rewrites `liburing/__pycache__/__init__.importer-311.pyc` on every import:
    two processes importing it at once (vLLM's workers, engines started together) race
    on that remove and one dies with FileNotFoundError. The Cython core imports liburing
    at module init, so kvstore imports it here first, holding an flock on the liburing
    package directory (no write access needed; every kvstore process takes the same
    lock), and retries when a process that does not take the lock raced it. Never raises:
    where the lock cannot be had it only retries, and any other failure is left to the
    core's own import to report.
    """
    import fcntl
    import importlib.util
    import os
    import sys

    if "liburing" in sys.modules:
        return
    spec = importlib.util.find_spec("liburing")
    if spec is None or not spec.submodule_search_locations:
        return                      # not installed: importing the core says what to do
    pkg_dir = list(spec.submodule_search_locations)[0]
    try:
        fd = os.open(pkg_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        fd = -1
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:         # a file system without flock: retries alone
                pass
        for _ in range(attempts):
            try:
                import liburing  # noqa: F401
                return
            except FileNotFoundError:
                # the importer recorded the package as imported before it failed
                try:
                    from dynamic_import import check
                    check.IMPORTER_CALLED.pop(os.path.join(pkg_dir, ""), None)
                except ImportError:
                    pass
            except Exception:
                # Any other failure (a broken or read-only install): importing the core
                # raises it again, with what to do; `kvstore.errors` stays importable.
                return
    finally:
        if fd >= 0:
            os.close(fd)


_import_liburing()


def __getattr__(name):
    # The compiled core is imported lazily so that `import kvstore.errors` works in a
    # checkout where the extensions are not built yet (and says how to build them).
    if name in ("Ring", "SlotFile", "HostBuffer"):
        try:
            from kvstore import _hostbuf, _ring, _slotfile
        except ImportError as exc:  # pragma: no cover - depends on the build
            raise ImportError(f"kvstore's Cython core is not built ({exc}); run `make build`") from exc
        return {"Ring": _ring.Ring, "SlotFile": _slotfile.SlotFile, "HostBuffer": _hostbuf.HostBuffer}[name]
    raise AttributeError(name)
