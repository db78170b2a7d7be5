# Admission on second sight (`"admission": "second_sight"`, docs/CONFIG.md).
#
# A block is stored only when its key (vLLM's block hash, which chains the whole prefix,
# + group id) was planned before within a window: the first sighting is only remembered.
# Fixed memory: an 8-way set-associative array of 64-bit XXH3 fingerprints (one 64-byte
# cache line per set), sets a power of two with at least 2 x `window` entries in all
# (16-32 bytes per window entry). A set is a FIFO: a new fingerprint goes to its head and
# pushes the oldest out, so a key is remembered over the next `window` first sightings
# (99% of them: a set can overflow) and fades out after about 2-4 x `window`. A probe is one hash and one
# cache line. Two keys sharing a fingerprint (~2^-64 per pair) only admit a block early.

from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memmove, memset
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE

cdef extern from "xxhash.h" nogil:
    unsigned long long XXH3_64bits(const void *data, size_t length)

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

DEF SEEN_WAYS = 8


cdef class SeenFilter:
    """The second-sight admission filter (see the notes above). Not thread-safe: the
    scheduler's step thread is its only user."""
    cdef uint64_t *t
    cdef uint64_t mask
    cdef readonly Py_ssize_t window
    cdef readonly Py_ssize_t capacity      # entries: sets x SEEN_WAYS
    cdef readonly long long probes, admitted, rejected
    cdef long long _rejected_taken

    def __cinit__(self, Py_ssize_t window):
        if window < 1:
            raise ValueError(f"SeenFilter: window must be >= 1, got {window}")
        cdef uint64_t sets = 1
        while sets * SEEN_WAYS < 2 * <uint64_t>window:     # 2x: the last `window` all fit
            sets <<= 1
        cdef void *p = NULL
        if posix_memalign(&p, 64, <size_t>(sets * SEEN_WAYS * sizeof(uint64_t))) != 0:
            raise MemoryError(f"SeenFilter: cannot allocate {sets * SEEN_WAYS} entries")
        self.t = <uint64_t *>p
        memset(self.t, 0, <size_t>(sets * SEEN_WAYS * sizeof(uint64_t)))
        self.mask = sets - 1
        self.window = window
        self.capacity = <Py_ssize_t>(sets * SEEN_WAYS)

    def __dealloc__(self):
        free(self.t)
        self.t = NULL

    @property
    def nbytes(self):
        return self.capacity * 8

    cdef inline bint _sight(self, const unsigned char *p, Py_ssize_t n) noexcept nogil:
        """1 when the key was seen (admit); else remember it and return 0."""
        cdef uint64_t fp = XXH3_64bits(p, <size_t>n) | 1      # 0 marks an empty way
        cdef uint64_t *s = self.t + ((fp >> 40) & self.mask) * SEEN_WAYS
        cdef int w
        self.probes += 1
        for w in range(SEEN_WAYS):
            if s[w] == fp:
                self.admitted += 1
                return 1
        memmove(s + 1, s, (SEEN_WAYS - 1) * sizeof(uint64_t))
        s[0] = fp
        self.rejected += 1
        return 0

    def sight(self, bytes key):
        """One probe: True (admit: seen before), or False (first sighting, remembered)."""
        return bool(self._sight(<const unsigned char *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)))

    def seen(self, bytes key):
        """Whether the key is remembered (no insertion, not counted; tests)."""
        cdef uint64_t fp = XXH3_64bits(PyBytes_AS_STRING(key), <size_t>PyBytes_GET_SIZE(key)) | 1
        cdef uint64_t *s = self.t + ((fp >> 40) & self.mask) * SEEN_WAYS
        cdef int w
        for w in range(SEEN_WAYS):
            if s[w] == fp:
                return True
        return False

    def admit(self, list keys, list bids, list idx, object skip):
        """Filter a plan (parallel lists keys, block ids and, or None, block indices) to
        the blocks seen before, one probe per key; the first sightings are remembered,
        left out and their keys removed from `skip` (the keys being stored). Returns
        (keys, bids, idx) of the admitted blocks (the same lists when all are)."""
        cdef Py_ssize_t n = len(keys), j, k = 0
        cdef bytes key
        if n == 0:
            return keys, bids, idx
        cdef unsigned char *ok = <unsigned char *>calloc(<size_t>n, 1)
        if ok == NULL:
            raise MemoryError("SeenFilter.admit")
        try:
            for j in range(n):
                key = <bytes?>keys[j]
                ok[j] = self._sight(<const unsigned char *>PyBytes_AS_STRING(key),
                                    PyBytes_GET_SIZE(key))
                k += ok[j]
            if k == n:
                return keys, bids, idx
            out_k, out_b = [], []
            out_i = None if idx is None else []
            for j in range(n):
                if ok[j]:
                    out_k.append(keys[j])
                    out_b.append(bids[j])
                    if idx is not None:
                        out_i.append(idx[j])
                else:
                    skip.discard(keys[j])
            return out_k, out_b, out_i
        finally:
            free(ok)

    def take_rejected(self):
        """First sightings (blocks not stored) since the last call."""
        cdef long long d = self.rejected - self._rejected_taken
        self._rejected_taken = self.rejected
        return d

    def clear(self):
        memset(self.t, 0, <size_t>(self.capacity * sizeof(uint64_t)))

