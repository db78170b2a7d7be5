# A file mapped MAP_SHARED: the state several engine processes of one store share.
#
# Several engines on one store: each engine keeps its own table, and shares
# two things with the others through files mapped MAP_SHARED (`SharedMap`): its pin counts
# (its lease file, read by the other engines' eviction claims) and the store's per-slot
# generation array (STORE/engines/slots: the generation of the entry a slot holds, 0 when
# none). A hit is valid only while its slot still holds its generation; a lookup pins, then
# (after a full fence) checks the generation, and an eviction clears the generation, then
# (after a full fence) checks every engine's pins: of two such races, one side always sees
# the other (Dekker's pattern), so no engine evicts a slot another is about to load, and
# no engine loads a slot another has taken. A table entry whose slot moved on is dropped
# where a lookup meets it, or by `sweep`.
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memset
from cpython.bytes cimport PyBytes_AS_STRING

from kvstore.includes.atomics cimport KT_LOAD64, KT_STORE64, KT_ADD64, KT_LOAD32, KT_ADD32

cdef extern from "<unistd.h>" nogil:
    int usleep(unsigned int usec)

cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_SHARED, MAP_ANONYMOUS, MAP_FIXED
    void *MAP_FAILED

cdef extern from "<errno.h>" nogil:
    int errno


cdef class SharedMap:
    """A file mapped MAP_SHARED, for state that several engine processes share: the
    store's slot generations (STORE/engines/slots: a 4096-byte header of u64 words, then a
    u64 per slot) and each engine's pin counts (its lease file: the header, then a u32 per
    slot). Word access is atomic (sequentially consistent)."""
    def __cinit__(self, int fd, size_t nbytes, bint writable=True):
        self.p = NULL
        if nbytes < SHARED_HDR:
            raise ValueError(f"SharedMap: {nbytes} bytes is less than the header")
        cdef void *q = mmap(NULL, nbytes, PROT_READ | (PROT_WRITE if writable else 0),
                            MAP_SHARED, fd, 0)
        if q == MAP_FAILED:
            import os
            raise OSError(errno, f"mmap of {nbytes} bytes failed: {os.strerror(errno)}")
        self.p = <char *>q
        self.nbytes = nbytes
        self.writable = writable

    def __dealloc__(self):
        if self.p != NULL:
            munmap(self.p, self.nbytes)
            self.p = NULL

    def detach(self):
        """Replace the file's mapping by private zeroed memory at the same address (a
        forked child's copy of its parent's lease: a mapping holds the file's open
        description, and with it the parent's flock, alive). Pointers into it (a
        KeyTable's pins) stay valid; nothing reaches the file any more."""
        if self.p == NULL:
            return
        cdef void *q = mmap(self.p, self.nbytes, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0)
        if q == MAP_FAILED:
            import os
            raise OSError(errno, f"SharedMap.detach: {os.strerror(errno)}")

    cdef uint64_t *_word(self, size_t i) except NULL:
        if self.p == NULL:
            raise ValueError("SharedMap is closed")
        if i >= SHARED_HDR // 8:
            raise IndexError(f"header word {i} out of range")
        return <uint64_t *>(self.p + i * 8)

    def load(self, size_t i):
        """Header word i (atomic)."""
        return KT_LOAD64(self._word(i))

    def store(self, size_t i, uint64_t v):
        if not self.writable:
            raise ValueError("SharedMap is read-only")
        KT_STORE64(self._word(i), v)

    def add(self, size_t i, uint64_t d=1):
        """Atomically add d to header word i; returns the new value."""
        if not self.writable:
            raise ValueError("SharedMap is read-only")
        return KT_ADD64(self._word(i), d)

    cdef uint64_t *_gens(self, Py_ssize_t n) except NULL:
        if self.p == NULL:
            raise ValueError("SharedMap is closed")
        if SHARED_HDR + <size_t>n * 8 > self.nbytes:
            raise IndexError("slot out of the map")
        return <uint64_t *>(self.p + SHARED_HDR)

    def publish(self, list slots, list gens):
        """Slot generations (a slots map): slots[j] holds generation gens[j] from now on."""
        if not self.writable:
            raise ValueError("SharedMap is read-only")
        cdef Py_ssize_t j, n = len(slots)
        cdef uint64_t *g
        if len(gens) != n:
            raise ValueError("publish: slots and gens differ in length")
        cdef uint64_t cap = (self.nbytes - SHARED_HDR) // 8
        for j in range(n):
            if <uint64_t>slots[j] >= cap:
                raise IndexError(f"slot {slots[j]} out of the map")
        g = self._gens(0)
        for j in range(n):
            KT_STORE64(&g[<uint64_t>slots[j]], <uint64_t>gens[j])

    def retract(self, list slots):
        """Slot generations: slots[j] holds nothing any more."""
        self.publish(slots, [0] * len(slots))

    def generation(self, uint64_t slot):
        cdef uint64_t cap = (self.nbytes - SHARED_HDR) // 8
        if slot >= cap:
            raise IndexError(f"slot {slot} out of the map")
        return KT_LOAD64(&self._gens(0)[slot])

    def clear_array(self):
        """Zero everything after the header (a slots map being rebuilt)."""
        if not self.writable:
            raise ValueError("SharedMap is read-only")
        memset(self.p + SHARED_HDR, 0, self.nbytes - SHARED_HDR)

    def load_generations(self, rows, Py_ssize_t yield_every=65536, unsigned int yield_us=100):
        """Publish every (key, value) row of the index's keys db (slot u32, generation
        u64, ...); the GIL is released now and then as in KeyTable.load. Returns count."""
        cdef uint64_t *g = self._gens(0)
        cdef uint64_t cap = (self.nbytes - SHARED_HDR) // 8
        cdef const unsigned char *v
        cdef uint32_t slot
        cdef uint64_t gen
        cdef Py_ssize_t count = 0
        cdef object k, val
        cdef int j
        for k, val in rows:
            v = <const unsigned char *>PyBytes_AS_STRING(val)
            slot = (<uint32_t>v[0]) | (<uint32_t>v[1] << 8) | (<uint32_t>v[2] << 16) | (<uint32_t>v[3] << 24)
            gen = 0
            for j in range(7, -1, -1):
                gen = (gen << 8) | v[4 + j]
            if slot < cap:
                KT_STORE64(&g[slot], gen)
            count += 1
            if yield_every > 0 and count % yield_every == 0:
                with nogil:
                    usleep(yield_us)
        return count

    def add32(self, list slots, int delta):
        """A pin map outside a KeyTable: atomically add delta (+1 or -1) to the u32 count
        of each slot (sequentially consistent: a later generation check is ordered after
        it). A count never goes below 0."""
        if not self.writable:
            raise ValueError("SharedMap is read-only")
        cdef uint64_t cap = (self.nbytes - SHARED_HDR) // 4
        cdef uint32_t *a = <uint32_t *>(self.p + SHARED_HDR)
        cdef object x
        cdef uint64_t v
        for x in slots:
            if <uint64_t>x >= cap:
                raise IndexError(f"slot {x} out of the map")
        for x in slots:
            v = <uint64_t>x
            if delta > 0:
                KT_ADD32(&a[v], 1)
            elif KT_LOAD32(&a[v]) > 0:
                KT_ADD32(&a[v], <uint32_t>0xFFFFFFFF)

    def try_clear(self, uint64_t slot, list peers, long long epoch=-1):
        """An eviction's claim outside a KeyTable (a slots map): clear the slot's
        generation, then look at the other engines' pin maps; if one pins the slot, put
        the generation back and return False (the slot must not be taken). With `epoch`
        (header word W_EPOCH as it was before `peers` were listed), an engine that came
        or went since (its pins are not in `peers`) also refuses the slot."""
        cdef uint64_t cap = (self.nbytes - SHARED_HDR) // 8
        cdef SharedMap m
        cdef uint64_t old
        cdef uint64_t *g
        if slot >= cap:
            raise IndexError(f"slot {slot} out of the map")
        g = self._gens(0)
        old = KT_LOAD64(&g[slot])
        KT_STORE64(&g[slot], 0)
        for m in peers:
            if SHARED_HDR + (slot + 1) * 4 <= m.nbytes and KT_LOAD32(<uint32_t *>(m.p + SHARED_HDR) + slot) != 0:
                KT_STORE64(&g[slot], old)
                return False
        if epoch >= 0 and KT_LOAD64(<uint64_t *>self.p + W_EPOCH) != <uint64_t>epoch:
            KT_STORE64(&g[slot], old)
            return False
        return True

    def count_nonzero32(self):
        """u32 counts after the header that are not 0 (a pin map: the slots it pins)."""
        if self.p == NULL:
            raise ValueError("SharedMap is closed")
        cdef uint32_t *a = <uint32_t *>(self.p + SHARED_HDR)
        cdef size_t i, n = (self.nbytes - SHARED_HDR) // 4, m = 0
        with nogil:
            for i in range(n):
                if a[i] != 0:
                    m += 1
        return m
