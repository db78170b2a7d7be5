"""Slots whose payload lives in caller memory (`RankIO.write_from`/`read_into`,
`write_at`/`read_at`, `register_memory`): the caller's memory checked (host memory only;
each block's payload contiguous, long enough, 4096-aligned for O_DIRECT) and turned into
addresses, and `CallerMemory`, which moves the slots: each header in kvstore's header
memory, each payload at its address in the caller's memory, no staging copy."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore._hostbuf import HostBuffer
from kvstore.errors import AlignmentError
from kvstore.format.layout import HEADER_SIZE
from kvstore.io.batches import Batches
from kvstore.io.iostats import OP_READ, OP_WRITE


def host_array(x):
    """A CPU torch tensor as the numpy array sharing its memory; anything else unchanged.
    Device memory is refused: the ring can only move host memory."""
    if type(x).__module__.startswith("torch") and hasattr(x, "data_ptr"):
        if x.device.type != "cpu":
            raise TypeError(f"payloads must be host memory, not a {x.device.type} tensor: copy "
                            "through pinned host memory (the connector uses staging for this)")
        return x.detach().numpy()
    return x


def view_at(addr: int, nbytes: int) -> np.ndarray:
    """A uint8 view of nbytes at a raw address (caller memory that is alive for the call)."""
    import ctypes
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


@dataclass(slots=True)
class CallerPayloads:
    """The payload address of each block (uint64), and what keeps that memory referenced
    until every chunk has moved."""
    addrs: np.ndarray
    keep: object


def payload_addrs(payloads, n: int, io_len: int, payload_len: int, direct: bool,
                  writable: bool) -> CallerPayloads:
    """Addresses of n caller payload buffers, each checked: C-contiguous, holding the
    payload's transfer length `io_len` (the payload_len-byte payload rounded up to 4096)
    and, for O_DIRECT, 4096-aligned. `payloads` is a 2-D array (one row per block) or a
    sequence of buffers."""
    payloads = host_array(payloads)
    if isinstance(payloads, np.ndarray) and payloads.ndim != 2:
        raise ValueError(f"payloads must be a 2-D array with one row per block, or a sequence "
                         f"of per-block buffers; got a {payloads.ndim}-D array of shape "
                         f"{payloads.shape}")
    if isinstance(payloads, np.ndarray):
        arr = payloads
        if arr.shape[0] != n:
            raise ValueError(f"{arr.shape[0]} payload rows for {n} blocks")
        if arr.dtype.hasobject:
            raise TypeError("payload memory must hold plain numbers, not Python objects")
        row = arr.shape[1] * arr.itemsize
        if arr.strides[1] != arr.itemsize or row < io_len:
            raise AlignmentError(
                f"payload rows must be contiguous and hold {io_len} bytes (the {payload_len}"
                f"-byte payload rounded up to 4096); got rows of {row} bytes")
        if n > 1 and arr.strides[0] < max(row, io_len):
            raise AlignmentError(f"payload rows overlap or run backwards (row stride "
                                 f"{arr.strides[0]} for {io_len}-byte transfers)")
        if writable and not arr.flags.writeable:
            raise ValueError("payload array is read-only; reads need writable memory")
        base = arr.__array_interface__["data"][0]
        addrs = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(arr.strides[0])
        if direct and (base % HEADER_SIZE or arr.strides[0] % HEADER_SIZE):
            raise AlignmentError(
                f"payload rows at 0x{base:x} with stride {arr.strides[0]} are not 4096-aligned, "
                "which O_DIRECT needs: allocate them with kvstore.HostBuffer (or mmap), or "
                "open the store with io_mode='page_cache'")
        return CallerPayloads(addrs, arr)
    if payloads is None or isinstance(payloads, (bytes, bytearray, memoryview)):
        raise ValueError("payloads must be a 2-D array with one row per block, or a sequence "
                         f"of per-block buffers; got {type(payloads).__name__}")
    bufs = [host_array(b) for b in payloads]
    if len(bufs) != n:
        raise ValueError(f"{len(bufs)} payload buffers for {n} blocks")
    views = []
    addrs = np.empty(n, dtype=np.uint64)
    for i, b in enumerate(bufs):
        mv = memoryview(b)
        if "O" in mv.format:
            raise TypeError(f"payload buffer {i} holds Python objects; pass plain memory")
        if writable and mv.readonly:
            raise ValueError(f"payload buffer {i} is read-only; reads need writable memory")
        if not mv.c_contiguous or mv.nbytes < io_len:
            raise AlignmentError(
                f"payload buffer {i} must be contiguous and hold {io_len} bytes (the "
                f"{payload_len}-byte payload rounded up to 4096); got {mv.nbytes}")
        a = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
        addr = a.__array_interface__["data"][0]
        if direct and addr % HEADER_SIZE:
            raise AlignmentError(
                f"payload buffer {i} at 0x{addr:x} is not 4096-aligned, which O_DIRECT "
                "needs: allocate it with kvstore.HostBuffer (or mmap), or open the store "
                "with io_mode='page_cache'")
        addrs[i] = addr
        views.append(a)
    return CallerPayloads(addrs, views)


def check_addrs(addrs, n: int, direct: bool) -> np.ndarray:
    """Payload addresses given by the caller (uint64, one per block), checked: n of
    them and, for O_DIRECT, 4096-aligned."""
    addrs = np.ascontiguousarray(addrs, dtype=np.uint64)
    if addrs.ndim != 1 or len(addrs) != n:
        raise ValueError(f"{addrs.size} payload addresses for {n} blocks")
    if direct and n and (addrs % np.uint64(HEADER_SIZE)).any():
        bad = int(addrs[np.flatnonzero(addrs % np.uint64(HEADER_SIZE))[0]])
        raise AlignmentError(
            f"payload address 0x{bad:x} is not 4096-aligned, which O_DIRECT needs: move "
            "the payloads through staging, or open the store with io_mode='page_cache'")
    return addrs


def check_registrable(buffers) -> list:
    """Caller memory for `RankIO.register_memory`, as host arrays: writable host memory
    (numpy arrays, mmap, CPU tensors), else TypeError."""
    buffers = [host_array(b) for b in buffers]
    for b in buffers:
        try:
            readonly = memoryview(b).readonly
        except TypeError:
            raise TypeError(f"register_memory takes host memory (numpy arrays, mmap, CPU "
                            f"tensors), not {type(b).__name__}") from None
        if readonly:
            raise TypeError("register_memory needs writable memory (the kernel pins it "
                            "for both directions); pass read-only sources to write_from "
                            "unregistered")
    return buffers


class CallerMemory:
    """The header memory of caller-memory transfers (`header_batch` headers, allocated
    once, so it can stay registered with the rings) and the ring batches that move slots
    between disk and caller memory, `header_batch` slots per batch."""

    def __init__(self, batches: Batches, payload_len: int):
        self._batches = batches
        self.payload_len = payload_len
        self.headers: HostBuffer | None = None

    def header_pool(self, header_batch: int) -> HostBuffer:
        if self.headers is None:
            self.headers = HostBuffer(max(1, header_batch) * HEADER_SIZE)
        return self.headers

    def _chunks(self, refs, addrs, header_batch: int):
        """(start, stop, header addresses, payload addresses) of each ring batch."""
        hdrs = self.header_pool(header_batch)
        step = max(1, min(header_batch, hdrs.nbytes // HEADER_SIZE))
        hbase = np.uint64(hdrs.address) + np.arange(min(len(refs), step), dtype=np.uint64) * np.uint64(HEADER_SIZE)
        for start in range(0, len(refs), step):
            stop = min(len(refs), start + step)
            yield start, stop, hbase[:stop - start], addrs[start:stop]

    def write(self, refs, addrs, durable: bool, header_batch: int) -> list[Exception | None]:
        """Write refs[i] with its payload at addrs[i]: the ring stamps each header and
        writes header + payload (a writev, or two fixed-buffer ops in registered memory)."""
        errors: list[Exception | None] = [None] * len(refs)
        for start, stop, hdrs, pays in self._chunks(refs, addrs, header_batch):
            chunk = refs[start:stop]
            batch = self._batches.slot_io(OP_WRITE, chunk, hdrs, pays, 0)
            errors[start:stop] = self._batches.write_errors(chunk, batch, durable)
        return errors

    def read(self, refs, addrs, verify: int, check_payload: bool,
             header_batch: int) -> list[Exception | None]:
        """Read refs[i], its payload to addrs[i], checked by the ring (`verify`: its
        level) as each completes."""
        errors: list[Exception | None] = [None] * len(refs)
        for start, stop, hdrs, pays in self._chunks(refs, addrs, header_batch):
            chunk = refs[start:stop]
            batch = self._batches.slot_io(OP_READ, chunk, hdrs, pays, verify)

            def parts(i, pays=pays):
                return (self.headers.numpy()[i * HEADER_SIZE:(i + 1) * HEADER_SIZE],
                        view_at(int(pays[i]), self.payload_len))
            errors[start:stop] = self._batches.read_errors(chunk, batch, parts, check_payload)
        return errors

    def close(self) -> None:
        if self.headers is not None:
            self.headers.close()
            self.headers = None
