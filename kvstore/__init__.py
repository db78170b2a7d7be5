"""kvstore: a persistent NVMe disk tier for vLLM's KV cache.

Layers (each calls only the one below): `kvstore.vllm` (the connector) -> `kvstore.engine`
(DiskStore, the public API) -> `kvstore.index` (LMDB) and the Cython I/O core
(`kvstore._ring.Ring`, `kvstore._slotfile.SlotFile`, `kvstore._hostbuf.HostBuffer`).
"""
from kvstore.errors import (  # noqa: F401
    AlignmentError, ConfigError, CorruptIndex, CorruptSlot, KVStoreError, LayoutMismatch,
    StoreFull, StoreLocked, StoreNotFound,
)

__version__ = "0.1.0"


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
