"""Mooncake Store as kvstore's pool: a client of its master (`MooncakeDistributedStore`)
that holds no pool memory of its own (the pool lives in the fleet's standalone
`mooncake_client` processes, `kvstore fleet up`), moving records through one registered
transfer buffer, with `batch_is_exist`, `batch_get_into` and `batch_put_from`.

A pool that is down or slow never raises: an operation that fails marks the pool down
for `RETRY_S` (every call answers "unavailable" meanwhile, at once) and counts the error;
the next call after that reconnects, on a thread of its own, once the master's port
accepts a TCP connection (Mooncake's setup against a master that is not there retries for
~30 s, holding the GIL): calls answer "unavailable" until it is done.
Mooncake's calls against a master that died take seconds each (its RPC retries), which is
why they run in the fleet agent, never in an engine's process.
"""
from __future__ import annotations

import logging
import mmap
import socket
import threading
import time

import numpy as np

from kvstore.store.config import RemoteConfig

log = logging.getLogger("kvstore.remote")

# Mooncake's error codes kvstore tells apart (mooncake-store/include/types.h).
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900


class PoolUnavailable(Exception):
    """The pool cannot be reached now (its master is down, or setup failed)."""


class MooncakePool:
    """One connection to the pool and its registered buffer (`buffer`, a numpy view)."""

    RETRY_S = 5.0
    PROBE_S = 1.0       # the master's port must accept a connection within this

    def __init__(self, cfg: RemoteConfig):
        self.cfg = cfg
        self._mem = mmap.mmap(-1, cfg.buffer_bytes)     # page-aligned, as registration wants
        self.buffer = np.frombuffer(self._mem, dtype=np.uint8)
        self.base = self.buffer.ctypes.data
        self._store = None
        self._connecting: threading.Thread | None = None
        self._down_until = 0.0
        self.errors = 0
        self.reconnects = 0
        self.last_error = ""

    # -- connection ----------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._store is not None

    def _connect(self):
        c = self.cfg
        host, _, port = c.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=self.PROBE_S).close()
        except OSError as exc:
            raise PoolUnavailable(f"master {c.master} does not answer ({exc})") from None
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        # global_segment_size 0: this client holds no pool memory (it would vanish with
        # the engine); a small local buffer for Mooncake's own non-registered transfers.
        rc = s.setup(c.local_hostname, c.metadata_server, 0, 16 << 20, c.protocol,
                     c.rdma_devices, c.master)
        if rc != 0:
            raise PoolUnavailable(f"Mooncake setup against master {c.master} returned {rc}")
        rc = s.register_buffer(self.base, len(self.buffer))
        if rc != 0:
            s.close()
            raise PoolUnavailable(f"registering the transfer buffer returned {rc}")
        return s

    def available(self, wait: float = 0.0) -> bool:
        """Connected; else False, and a connection is made in the background (unless the
        pool is marked down, or one is being made). `wait`: seconds to wait for it."""
        if self._store is not None:
            return True
        t = self._connecting
        if t is None and time.monotonic() >= self._down_until:
            t = self._connecting = threading.Thread(target=self._connect_in_background,
                                                    name="kvstore-pool-connect", daemon=True)
            t.start()
        if t is not None and wait > 0:
            t.join(wait)
        return self._store is not None

    def _connect_in_background(self) -> None:
        try:
            store = self._connect()
        except Exception as exc:    # noqa: BLE001 (ImportError, setup errors)
            self._down(f"connect: {exc}")
        else:
            self._store = store
            self.reconnects += 1
        finally:
            self._connecting = None

    def _down(self, why: str) -> None:
        self.errors += 1
        self.last_error = why
        self._down_until = time.monotonic() + self.RETRY_S
        log.warning("kvstore: the KV pool is unavailable (%s); serving from the local store, "
                    "retrying in %.0f s", why, self.RETRY_S)
        self.close()

    def _call(self, what: str, fn, *args) -> list[int] | None:
        if not self.available():
            return None
        try:
            codes = fn(self._store, *args)
        except Exception as exc:    # noqa: BLE001
            self._down(f"{what}: {exc}")
            return None
        if any(c == RPC_FAIL for c in codes):
            self._down(f"{what}: master unreachable (RPC_FAIL)")
            return None
        return codes

    # -- operations ----------------------------------------------------------------------
    def exists(self, keys: list[str]) -> list[bool] | None:
        """Which keys the pool holds (None: the pool is unavailable)."""
        codes = self._call("batch_is_exist", lambda s, k: s.batch_is_exist(k), keys)
        if codes is None:
            return None
        if any(c < 0 for c in codes):
            self.errors += sum(1 for c in codes if c < 0)
        return [c == 1 for c in codes]

    def get_into(self, keys: list[str], offsets: list[int], sizes: list[int]) -> list[int] | None:
        """Read each key's value into the buffer at its offset: bytes read per key, or a
        negative Mooncake code (None: the pool is unavailable)."""
        ptrs = [self.base + o for o in offsets]
        return self._call("batch_get_into", lambda s, k, p, n: s.batch_get_into(k, p, n),
                          keys, ptrs, sizes)

    def put_from(self, keys: list[str], offsets: list[int], sizes: list[int]) -> list[int] | None:
        """Write each key's value from the buffer: 0 per key stored (or already there),
        or a negative Mooncake code (None: the pool is unavailable)."""
        ptrs = [self.base + o for o in offsets]
        return self._call("batch_put_from", lambda s, k, p, n: s.batch_put_from(k, p, n),
                          keys, ptrs, sizes)

    def remove(self, key: str) -> None:
        """Best effort: a record that failed verification leaves the pool."""
        if self._store is not None:
            try:
                self._store.remove(key, True)
            except Exception:   # noqa: BLE001
                pass

    def close(self) -> None:
        if self._store is not None:
            try:
                self._store.close()
            except Exception:   # noqa: BLE001
                pass
            self._store = None
