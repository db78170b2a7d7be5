# cython: language_level=3
"""Aligned host staging memory.

Owns 4096-aligned anonymous mmap regions that are, at the same time, the io_uring I/O
buffer (registrable, O_DIRECT-aligned) and the target of device<->host copies (viewable as
numpy and torch uint8 without a copy, `cudaHostRegister`-able). Never allocates with
malloc: only page-aligned anonymous mappings satisfy O_DIRECT and io_uring registration.
"""
import warnings

from cpython.buffer cimport PyBUF_WRITABLE, PyBUF_FORMAT
from libc.stdint cimport uintptr_t
from kvstore.includes.posix_mem cimport (
    mmap, munmap, madvise, MAP_FAILED, PROT_READ, PROT_WRITE, MAP_PRIVATE,
    MAP_ANONYMOUS, MADV_DONTFORK, errno,
)

from kvstore.includes.format cimport KVS_ALIGN

from kvstore.errors import AlignmentError, KVStoreError

ALIGN = KVS_ALIGN

cdef Py_ssize_t _one = 1


def check_io_alignment(uintptr_t address, size_t length, unsigned long long offset,
                       size_t align=ALIGN, str what="I/O"):
    """Refuse an address/length/offset that O_DIRECT would reject, showing the numbers."""
    bad = []
    if address % align:
        bad.append(f"buffer address 0x{address:x} is {address % align} bytes past a {align}-byte boundary")
    if length % align or length == 0:
        bad.append(f"length {length} is not a positive multiple of {align}")
    if offset % align:
        bad.append(f"file offset {offset} is not a multiple of {align}")
    if bad:
        raise AlignmentError(
            f"{what} refused before submission: " + "; ".join(bad)
            + f" (address=0x{address:x}, length={length}, offset={offset}). O_DIRECT needs "
            f"{align}-aligned buffers, lengths and offsets: use kvstore.HostBuffer staging memory "
            "and slot offsets from SlotFile.")


cdef class HostBuffer:
    """A 4096-aligned anonymous mapping of `nbytes` (rounded up to 4096).

    Lifecycle: `close()` is idempotent; while numpy/torch views exist the mapping stays
    alive and is unmapped when the last view is released, so a stale view never points at
    freed memory. Not inherited across fork (MADV_DONTFORK): a forked child must not DMA
    into the parent's staging memory.
    """

    def __cinit__(self, size_t nbytes):
        self.ptr = NULL
        self.nbytes_ = 0
        self.exports = 0
        self.is_closed = True
        self.unmapped = True
        if nbytes == 0:
            raise ValueError("HostBuffer size must be > 0")
        cdef size_t size = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        cdef void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if p == MAP_FAILED:
            raise MemoryError(f"mmap of {size} bytes of staging memory failed (errno {errno}); "
                              "lower the staging size or queue depth")
        madvise(p, size, MADV_DONTFORK)
        self.ptr = <char *>p
        self.nbytes_ = size
        self.is_closed = False
        self.unmapped = False

    cdef int _unmap(self) except -1:
        if not self.unmapped and self.ptr != NULL:
            munmap(self.ptr, self.nbytes_)
            self.ptr = NULL
            self.unmapped = True
        return 0

    def close(self):
        """Release the mapping (deferred until the last exported view is released)."""
        self.is_closed = True
        if self.exports == 0:
            self._unmap()

    def __dealloc__(self):
        # Safety net only: views hold a reference, so exports is 0 here.
        if not self.unmapped and self.ptr != NULL:
            munmap(self.ptr, self.nbytes_)
            self.ptr = NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def address(self) -> int:
        self._check()
        return <uintptr_t>self.ptr

    @property
    def nbytes(self) -> int:
        return self.nbytes_

    @property
    def closed(self) -> bool:
        return self.is_closed

    def _check(self):
        if self.is_closed:
            raise KVStoreError("HostBuffer is closed")

    def check_range(self, size_t offset, size_t length, str what="I/O"):
        """Refuse [offset, offset+length) outside this buffer or misaligned for O_DIRECT."""
        self._check()
        if offset + length > self.nbytes_ or offset + length < offset:
            raise AlignmentError(
                f"{what} refused before submission: range [offset={offset}, +length={length}) "
                f"is outside the staging buffer at 0x{<uintptr_t>self.ptr:x} of {self.nbytes_} bytes")
        check_io_alignment(<uintptr_t>self.ptr + offset, length, 0, ALIGN, what)

    def numpy(self):
        """The whole buffer as a numpy uint8 array (no copy)."""
        import numpy as np
        self._check()
        return np.frombuffer(self, dtype=np.uint8)

    def torch(self):
        """The whole buffer as a torch uint8 CPU tensor (no copy)."""
        import torch
        self._check()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about writable buffers
            return torch.frombuffer(self, dtype=torch.uint8)

    def __getbuffer__(self, Py_buffer *buf, int flags):
        if self.is_closed:
            raise KVStoreError("HostBuffer is closed")
        buf.buf = self.ptr
        buf.obj = self
        buf.len = self.nbytes_
        buf.readonly = 0
        buf.itemsize = 1
        if flags & PyBUF_FORMAT:
            buf.format = "B"
        else:
            buf.format = NULL
        buf.ndim = 1
        buf.shape = <Py_ssize_t *>&self.nbytes_
        buf.strides = &_one
        buf.suboffsets = NULL
        buf.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *buf):
        self.exports -= 1
        if self.is_closed and self.exports == 0:
            self._unmap()

    def __repr__(self):
        state = "closed" if self.is_closed else f"0x{<uintptr_t>self.ptr:x}"
        return f"HostBuffer({self.nbytes_} bytes, {state})"
