"""DeviceRings: one rank's io_uring rings, one per device, and the threads that drive them.

Each ring has the device's slot files and what `register` named (staging, and with
`RankIO.register_memory` kvstore's header memory and the caller's memory) registered.
A ring closes itself when io_uring_enter fails with requests in flight (`Ring._abandon`:
the call that hit it raises); `ensure_open` replaces it before the next operation.
"""
from __future__ import annotations

import logging
import threading

from kvstore._ring import Ring
from kvstore.errors import KVStoreError
from kvstore.io.device_stream import DeviceStream
from kvstore.io.files import RankFiles

# The rank's logger: everything a RankIO logs, whichever of its parts logs it.
log = logging.getLogger("kvstore.io.rank")

# Bytes each ring keeps in flight at least (docs/CONFIG.md, `inflight_bytes`): a queue depth
# counted in slots keeps 32 x 132 KiB = 4 MiB in flight with 128 KiB blocks but 256 MiB with
# 8 MiB ones; the device needs bytes in flight, not requests.
INFLIGHT_BYTES = 8 << 20
MAX_DEPTH = 1024


def ring_depth(slot_size: int, queue_depth: int, inflight_bytes: int = INFLIGHT_BYTES) -> int:
    """Slots a ring keeps in flight: `queue_depth`, or more where that many slots hold
    fewer than `inflight_bytes` bytes (at most MAX_DEPTH); 0 bytes: `queue_depth` alone."""
    need = -(-inflight_bytes // slot_size) if inflight_bytes > 0 else 0
    return max(queue_depth, min(MAX_DEPTH, need))


class DeviceRings:
    """The rings of a rank's devices (`rings[d]`), their device streams and the thread
    that overlaps a batch loop's ring calls with its caller.

    Each ring is used by one thread at a time: with one device the caller's (or the
    `submitter` thread's) or the device stream's, with several always its device
    stream's (see `streams`).
    """

    def __init__(self, files: RankFiles, staging_buffer, queue_depth: int, *, rank: int,
                 thread_cpus: frozenset[int] | None = None, thread_nice: int = 0):
        self.queue_depth = queue_depth
        self.rank = rank
        self.thread_cpus = thread_cpus
        self.thread_nice = thread_nice
        self.rings: list = []
        # What every ring has registered as its buffers (`Ring.register_buffers`); a ring
        # rebuilt after it closed itself registers the same.
        self.buffers: list = [staging_buffer]
        self._files = files
        self._pool = None
        self._streams: list[DeviceStream] | None = None
        self._streams_lock = threading.Lock()   # built once, whichever thread asks first
        try:
            for d in range(files.ndev):
                ring = Ring(queue_depth)
                self.rings.append(ring)
                ring.register_buffers([staging_buffer])
                mine = files.by_device[d]
                if mine:
                    ring.register_files([f.fd for f in mine], [f.path for f in mine])
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return not self.rings

    def register(self, buffers: list) -> bool:
        """Register `buffers` with every ring (and every ring rebuilt later). True when
        every ring took them."""
        ok = all([ring.register_buffers(buffers) for ring in self.rings])
        self.buffers = buffers
        return ok

    def ensure_open(self) -> None:
        """Every ring open (`for_use`); called before each operation."""
        for d in range(len(self.rings)):
            self.for_use(d)

    def for_use(self, d: int):
        """Device d's ring, open. A ring that closed itself is replaced here with a new
        ring of the same queue depth, the same buffers and the device's slot files
        registered, and a warning is logged. The device threads (`DeviceStream`), which
        hold the old ring, are stopped and made again on demand. Called between
        operations only (no part of the rank in flight). When the rebuild fails this
        raises KVStoreError (the operation fails, nothing moved) and the next operation
        tries again."""
        ring = self.rings[d]
        if not ring.closed:
            return ring
        new = None
        try:
            new = Ring(self.queue_depth)
            new.register_buffers(self.buffers)
            files = self._files.by_device[d]
            if files:
                new.register_files([f.fd for f in files], [f.path for f in files])
        except Exception as exc:
            if new is not None:
                new.close()
            raise KVStoreError(f"rank {self.rank}: the io_uring ring of device {d} "
                               f"({self._files.dirs[d]}) closed after an error and could not be "
                               f"rebuilt: {exc}") from exc
        with self._streams_lock:
            streams, self._streams = self._streams, None
        for stream in streams or ():
            stream.close()
        self.rings[d] = new
        log.warning("kvstore rank %d: the io_uring ring of device %d (%s) had closed after an "
                    "error; rebuilt (queue depth %d)", self.rank, d, self._files.dirs[d],
                    self.queue_depth)
        return new

    def streams(self) -> list[DeviceStream]:
        """One thread per device (`DeviceStream`): device d's ring is only ever used by
        its own thread (or, with one device, by the caller between the stream's parts),
        and the parts of consecutive chunks are started on it before the one ahead of
        them has drained, so its queue stays full across chunk boundaries."""
        streams = self._streams
        if streams is None:
            with self._streams_lock:
                # Two threads asking at once (a scan's two ring-op threads) must not build
                # two sets: two threads would drive one ring.
                if self._streams is None:
                    self._streams = [DeviceStream(self.rings[d], f"kvstore-dev{d}-r{self.rank}",
                                                 self.thread_cpus, self.thread_nice)
                                     for d in range(self._files.ndev)]
                streams = self._streams
        return streams

    def submitter(self):
        """The thread pool of a batch loop's ring calls (`Batches.pipeline`).

        One background thread drives the ring while the caller prepares or verifies the
        other half of staging: Ring.submit runs its whole submit/reap loop without the
        GIL, so disk and CPU work overlap (one submit in flight at a time, so the ring is
        never used by two threads at once). With several devices, two: chunk k+1's parts
        are queued on every device's own thread while chunk k's are still running, so a
        device that finished its part of chunk k goes on with chunk k+1 instead of
        waiting for the slowest device (each ring is still used by one thread only: its
        device's)."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1 if self._files.ndev == 1 else 2,
                                            thread_name_prefix=f"kvstore-ring-r{self.rank}")
        return self._pool

    def close(self) -> None:
        """Stop the threads, then close every ring (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._streams is not None:
            for stream in self._streams:
                stream.close()
            self._streams = None
        for ring in self.rings:
            ring.close()
        self.rings = []
        self.buffers = []     # (the caller's memory is no longer referenced)
