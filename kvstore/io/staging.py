"""Staging: the host memory between a rank's KV cache and its slot files.

The one owner of staging: the aligned mapping (`HostBuffer`), its pinning for DMA
(`cuMemHostRegister`, when the KV cache is on a GPU), the free list of its slots (taken
by vLLM's step thread for stores and by the I/O thread for loads) and the views of slot
images and payloads. A staging slot has the on-disk slot layout, [HEADER_SIZE header]
[payload rounded up to ALIGN], so io_uring moves a slot as one op and the copy engine
DMAs payloads in place: the bytes between the GPU and NVMe are never copied on the host.
Never does I/O and never copies KV bytes itself.
"""
from __future__ import annotations

import logging
import threading

import numpy as np

from kvstore._hostbuf import HostBuffer
from kvstore.errors import ConfigError, StoreClosed
from kvstore.format.layout import ALIGN, HEADER_SIZE

log = logging.getLogger("kvstore.io.staging")


class Staging:
    """`num_slots` slot images of `slot_size` bytes in one aligned mapping.

    Lifecycle: `close()` is idempotent; it unpins the memory and releases the mapping
    (deferred by HostBuffer while numpy views exist). The caller must have finished
    every copy and I/O into it first (the copy engine is closed before staging).
    """

    def __init__(self, num_slots: int, slot_size: int, payload_len: int):
        if slot_size <= 0 or slot_size % ALIGN:
            raise ConfigError(f"staging slot size {slot_size} must be a positive multiple of {ALIGN}")
        if not 0 < payload_len <= slot_size - HEADER_SIZE:
            raise ConfigError(f"payload of {payload_len} bytes does not fit a {slot_size}-byte slot "
                              f"after its {HEADER_SIZE}-byte header")
        if num_slots < 1:
            raise ConfigError(f"staging needs at least one slot of {slot_size} bytes")
        self.slot_size = slot_size
        self.payload_len = payload_len
        self.num_slots = num_slots
        self.buffer = HostBuffer(num_slots * slot_size)
        self._np = self.buffer.numpy()
        self._pinned = False
        self._device = 0
        self._free = list(range(num_slots - 1, -1, -1))
        self._cv = threading.Condition()

    @classmethod
    def for_bytes(cls, nbytes: int, slot_size: int, payload_len: int) -> "Staging":
        """As many slots as `nbytes` holds (at least one)."""
        return cls(max(1, nbytes // slot_size), slot_size, payload_len)

    # -- memory ----------------------------------------------------------------------
    @property
    def address(self) -> int:
        return self.buffer.address

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    @property
    def closed(self) -> bool:
        return self._np is None

    @property
    def pinned(self) -> bool:
        """True when the memory is registered with the CUDA driver (a DMA target)."""
        return self._pinned

    def numpy(self) -> np.ndarray:
        if self._np is None:
            raise StoreClosed("staging memory is closed")
        return self._np

    def slot_view(self, i: int) -> np.ndarray:
        """The slot image (header + payload area) of staging slot i."""
        base = i * self.slot_size
        return self.numpy()[base:base + self.slot_size]

    def payload_view(self, i: int) -> np.ndarray:
        """The payload (`payload_len` bytes) of staging slot i."""
        base = i * self.slot_size + HEADER_SIZE
        return self.numpy()[base:base + self.payload_len]

    def pin(self, device: int = 0) -> bool:
        """Register the memory with the CUDA driver (portable pinned memory, in the
        primary context of `device`), so that device copies DMA straight into and out of
        it. False, with one warning, when the driver refuses (the caller must then not
        use CUDA copies)."""
        if self._pinned:
            return True
        from kvstore import _cuda
        try:
            _cuda.host_register(self.address, self.nbytes, device)
        except _cuda.CudaError as exc:
            log.warning("kvstore: pinning %d bytes of staging for DMA failed: %s", self.nbytes, exc)
            return False
        self._pinned = True
        self._device = device
        return True

    # -- slot free list --------------------------------------------------------------
    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def total(self) -> int:
        return self.num_slots

    def take(self, n: int, timeout: float | None = 0.0) -> list[int] | None:
        """n free slots, waiting up to `timeout` for them; None if they are not free."""
        with self._cv:
            if timeout:
                self._cv.wait_for(lambda: len(self._free) >= n, timeout)
            if len(self._free) < n:
                return None
            return [self._free.pop() for _ in range(n)]

    def take_up_to(self, n: int, timeout: float = 0.0) -> list[int]:
        """Between 1 and n slots, waiting up to `timeout` for at least one; [] if none."""
        with self._cv:
            if timeout:
                self._cv.wait_for(lambda: len(self._free) >= 1, timeout)
            k = min(n, len(self._free))
            return [self._free.pop() for _ in range(k)]

    def give(self, slots) -> None:
        with self._cv:
            self._free.extend(slots)
            self._cv.notify_all()

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Unpin and release the memory (idempotent)."""
        if self._np is None:
            return
        if self._pinned:
            from kvstore import _cuda
            try:
                _cuda.host_unregister(self.address, self._device)
            except _cuda.CudaError as exc:
                log.warning("kvstore: unpinning staging failed: %s", exc)
            self._pinned = False
        self._np = None
        self.buffer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"Staging({self.num_slots} slots x {self.slot_size} bytes, "
                f"{'closed' if self.closed else ('pinned' if self._pinned else 'pageable')})")
