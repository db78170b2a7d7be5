"""Per device and rank, the bytes kvstore read and wrote and its failed I/O ops: a small
preallocated counter file (`rank<N>/iostats`) mapped shared, so a counter is a memory add
and a killed process loses nothing. Read by `kvstore info` and the connector's metrics."""
from __future__ import annotations

import logging
import mmap
import os
import struct
import threading

from kvstore.io.paths import rank_dir

log = logging.getLogger(__name__)

OP_READ, OP_WRITE = 0, 1        # the ring's opcodes, as RankIO counts them


IOSTATS = "iostats"   # per device and rank: bytes read and written through kvstore
_IOSTATS_MAGIC = b"KVSTIOST"
_IOSTATS_SIZE = 4096
_IOSTATS_LOCK = threading.Lock()   # one process's openers of a rank add exactly


def iostats_path(device_dir: str, rank: int) -> str:
    return os.path.join(rank_dir(device_dir, rank), IOSTATS)


def create_iostats(device_dir: str, rank: int) -> None:
    """Create a zeroed counter file (preallocated: updates through the mapping never
    need a block the file system might not have)."""
    fd = os.open(iostats_path(device_dir, rank), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_size < _IOSTATS_SIZE:
            os.posix_fallocate(fd, 0, _IOSTATS_SIZE)
            os.pwrite(fd, _IOSTATS_MAGIC + struct.pack("<IIQQ", 1, 0, 0, 0), 0)
    finally:
        os.close(fd)


def read_iostats(device_dir: str, rank: int) -> tuple[int, int, int] | None:
    """(bytes read, bytes written, failed I/O ops) recorded for one rank on one device, or
    None when the counter file is missing or damaged (nothing tracked)."""
    try:
        fd = os.open(iostats_path(device_dir, rank), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 40, 0)
    finally:
        os.close(fd)
    if len(raw) < 32 or raw[:8] != _IOSTATS_MAGIC:
        return None
    errors = struct.unpack_from("<Q", raw, 32)[0] if len(raw) >= 40 else 0
    return (*struct.unpack_from("<QQ", raw, 16), errors)


_libc = None


def _mmap_shared(fd: int, size: int) -> int:
    """mmap(MAP_SHARED) through libc: Python's mmap keeps a dup of the fd open for the
    mapping's life (3.11 has no trackfd=False), which the fd audits would see."""
    import ctypes
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    return addr


class IOCounters:
    """The mapped counter file of one rank on one device: bytes read and written, and
    failed I/O ops (word 4, zero in files older than it: the file is preallocated), added
    by memory stores (no syscall per batch; the kernel writes the page back, so a killed
    process loses nothing, a power loss at most the last writeback interval)."""

    def __init__(self, device_dir: str, rank: int):
        import ctypes
        path = iostats_path(device_dir, rank)
        create_iostats(device_dir, rank)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._addr = _mmap_shared(fd, _IOSTATS_SIZE)
        finally:
            os.close(fd)
        self._words = (ctypes.c_uint64 * 5).from_address(self._addr)
        if bytes(self._words)[:8] != _IOSTATS_MAGIC:
            log.warning("%s is damaged; its byte counters restart at 0", path)
            ctypes.memmove(self._addr, _IOSTATS_MAGIC + struct.pack("<IIQQ", 1, 0, 0, 0), 32)

    def add(self, opcode: int, nbytes: int) -> None:
        i = 2 if opcode == OP_READ else 3
        with _IOSTATS_LOCK:
            self._words[i] += nbytes

    def add_errors(self, n: int) -> None:
        with _IOSTATS_LOCK:
            self._words[4] += n

    def close(self) -> None:
        if self._addr:
            self._words = None
            _libc.munmap(self._addr, _IOSTATS_SIZE)
            self._addr = 0
