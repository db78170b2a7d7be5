# The scheduler's in-memory copy of the index's keys db: key -> (slot, generation).
#
# An open-addressing hash table (linear probing, backward-shift deletion, no tombstones)
# in one C array sized once for the store's capacity, so it never grows or rehashes while
# serving: 24 bytes per bucket, at most 70% full (about 34 bytes per slot of capacity;
# with the slot records and pin counts below, about 54: 540 MiB for 10M slots).
# Keys are not kept, only a 96-bit XXH3-128 fingerprint: two different keys share a
# fingerprint with probability ~2^-96 per pair, and even then a load reads the slot's
# header, which names the real key, so a wrong hit is recomputed, never served.
# A prefix walk costs one hash and (mostly) one cache miss per key; a miss stops it.
#
# Runs of slots: a store job takes its slots from the pool in order, and the pool hands
# out free slots and LRU victims in slot order, so a prefix stored together mostly sits in
# consecutive slots (every lookup of `kvstore bench connector`'s load phase: 511 of 511).
# A per-slot record (`SlotRec`: the fingerprint and generation of the entry a slot holds,
# 16 bytes a slot) lets a walk follow such a run: the block after a hit in slot s is
# first checked against slot s + 1's record, a sequential read, and only when that fails
# is its bucket probed (a random cache miss). The record is kept in step with the table
# by `_put` and `_delete_at`, through which every change goes; it holds only fp (64
# bits), so a run-followed hit is named by 64 of the 96 bits (a wrong hit: ~2^-64 per
# block, and a load still checks the slot header's key).
#
# The table also holds the pins: a count per slot (a C array of the store's capacity, 4
# bytes a slot), so a lookup pins its hit in the same C call that finds it and the index
# thread's eviction claim checks pins without a Python object per slot.
#
# Several engines on one store: each engine keeps its own table and shares its pins and
# the store's slot generations with the others through `_sharedmap.SharedMap` (see there).
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset, memcpy
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_Check, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_Check
from cpython.list cimport PyList_GET_ITEM
from cpython cimport array
import array as _array_mod

cdef array.array _U32 = _array_mod.array("I")    # slots (the table's are uint32)
cdef array.array _U64 = _array_mod.array("Q")    # generations
assert _U32.itemsize == 4 and _U64.itemsize == 8

cdef extern from "xxhash.h" nogil:
    ctypedef struct XXH128_hash_t:
        unsigned long long low64
        unsigned long long high64
    XXH128_hash_t XXH3_128bits(const void *data, size_t length)

cdef extern from "<unistd.h>" nogil:
    int usleep(unsigned int usec)

cdef extern from "<sys/mman.h>" nogil:
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void *addr, size_t length)
    int madvise(void *addr, size_t length, int advice)
    int PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_SHARED, MAP_ANONYMOUS, MAP_FIXED, MADV_HUGEPAGE
    void *MAP_FAILED

cdef extern from "<errno.h>" nogil:
    int errno

from kvstore.includes.atomics cimport KT_LOAD64, KT_STORE64, KT_ADD64, KT_LOAD32, KT_ADD32, KT_FENCE
from kvstore._sharedmap cimport SHARED_HDR, W_EPOCH, SharedMap

# "Prefetches" are plain loads whose value is dropped: out-of-order execution keeps a
# batch's misses in flight together just the same, and a load is never dropped.
# __builtin_prefetch is not, here: at 10M entries on a 2-vCPU VM, with the TLB cold (after
# other memory traffic), 512 table probes behind prefetches cost 220-330 us, behind
# these loads 105-200 us (`bench index` walk511 cold p50 0.335 vs 0.253 ms); a C
# replica of the walk outside Python did not show it, so the cause is a guess
# (prefetches dropped on a TLB miss under nested paging).
cdef extern from *:
    """
    #define KT_PREFETCH(p) ((void)*(volatile const unsigned char *)(p))
    #define KT_PREFETCH_W(p) ((void)*(volatile const unsigned char *)(p))
    """
    void KT_PREFETCH(const void *p) nogil
    void KT_PREFETCH_W(const void *p) nogil

DEF BATCH = 32
DEF FP_BYTES = 12      # a key's fingerprint as `fingerprints` packs it: fp (8) + fp2 (4)
DEF MAX_PEERS = 256
DEF _ON_DEVICE = 0      # what KeyTable._remove_where removes: a device's entries,
DEF _STALE = 1          # or those whose slot moved on
DEF KEY_MAX = 68     # a vLLM block hash (32 bytes for sha256; up to 64) + 4-byte group id


cdef struct Bucket:
    uint64_t fp         # 0: empty
    uint64_t gen
    uint32_t slot
    uint32_t fp2


cdef struct SlotRec:    # what slot s holds, by slot (see "Runs of slots" above)
    uint64_t fp         # 0: no entry of the table names this slot
    uint64_t gen


cdef inline void _fingerprint(bytes key, uint64_t *fp, uint32_t *fp2):
    _fingerprint_raw(<const unsigned char *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), fp, fp2)


cdef class KeyTable:
    """key (bytes) -> (slot, generation), for at most `capacity` keys; see the module notes.

    Not thread-safe: callers serialize access (the scheduler's serving index does it with
    one lock shared by the step thread and the index thread).
    """
    cdef Bucket *t
    cdef size_t tbytes
    cdef uint64_t mask
    cdef readonly Py_ssize_t capacity
    cdef Py_ssize_t n
    cdef uint32_t *pins         # pin count per slot, [0, capacity)
    cdef SlotRec *rec           # per slot: the fingerprint and generation it holds
    cdef readonly long long run_follows     # hits a walk found by following a slot run
    cdef readonly long long first_misses    # walks answered by their first block's probe
    cdef Py_ssize_t npinned     # slots whose count is > 0
    cdef bint own_pins          # pins is ours (mmap) rather than a SharedMap's
    cdef uint64_t *sgen         # the store's shared slot generations, or NULL
    cdef uint64_t *shdr         # their map's header (word 3: 1 once the array is complete)
    cdef uint32_t *peers[MAX_PEERS]   # the other engines' pin arrays
    cdef int npeers
    cdef uint64_t peers_epoch   # the slots map's W_EPOCH the peers were listed at
    cdef bint check_epoch       # claim refuses every slot once W_EPOCH moved on
    cdef object _maps           # keeps the SharedMaps above mapped
    cdef readonly long long stale_dropped   # entries dropped because their slot moved on

    def __cinit__(self, Py_ssize_t capacity, bint prefault=True):
        if capacity < 1:
            raise ValueError(f"KeyTable: capacity must be >= 1, got {capacity}")
        cdef uint64_t size = 16
        while size * 7 < <uint64_t>capacity * 10:
            size *= 2
        self.tbytes = size * sizeof(Bucket)
        self.t = <Bucket *>_huge_zeroed(self.tbytes)
        if self.t == NULL:
            raise MemoryError(f"KeyTable: cannot allocate {size * sizeof(Bucket)} bytes "
                              f"for {capacity} keys")
        self.mask = size - 1
        self.capacity = capacity
        self.n = 0
        # Not faulted in: only `_put` (the index thread's fill and commits) writes a record
        # first; a walk that reads one never written reads the zero page.
        self.rec = <SlotRec *>_huge_zeroed(<size_t>capacity * sizeof(SlotRec))
        if self.rec == NULL:
            raise MemoryError(f"KeyTable: cannot allocate slot records for {capacity} slots")
        self.run_follows = 0
        self.first_misses = 0
        self.pins = <uint32_t *>_huge_zeroed(<size_t>capacity * sizeof(uint32_t))
        if self.pins == NULL:
            raise MemoryError(f"KeyTable: cannot allocate pin counts for {capacity} slots")
        # Faulted in now (5-60 ms for 10M slots): a lookup's first pin in a huge page
        # would otherwise allocate and zero it on vLLM's step thread (walks of 5 ms seen).
        # The table needs none of this: the index thread's fill writes it. Not with
        # `prefault=False`, for a table about to `attach` (its pins move to the lease).
        if prefault:
            memset(self.pins, 0, <size_t>capacity * sizeof(uint32_t))
        self.npinned = 0
        self.own_pins = True
        self.sgen = NULL
        self.shdr = NULL
        self.npeers = 0
        self.peers_epoch = 0
        self.check_epoch = False
        self._maps = ()
        self.stale_dropped = 0

    def __dealloc__(self):
        if self.t != NULL:
            munmap(self.t, self.tbytes)
        self.t = NULL
        if self.rec != NULL:
            munmap(self.rec, <size_t>self.capacity * sizeof(SlotRec))
        self.rec = NULL
        if self.pins != NULL and self.own_pins:
            munmap(self.pins, <size_t>self.capacity * sizeof(uint32_t))
        self.pins = NULL

    # -- sharing the store with other engines (see the module notes) -------------------
    def attach(self, SharedMap slots, SharedMap pins):
        """Use the store's shared generation array (`slots`) and keep this engine's pin
        counts in `pins` (its lease file, which other engines read). Pins taken so far
        move there."""
        if slots.nbytes < SHARED_HDR + <size_t>self.capacity * 8 or not slots.writable:
            raise ValueError("KeyTable.attach: the slots map is smaller than the capacity")
        if pins.nbytes < SHARED_HDR + <size_t>self.capacity * 4 or not pins.writable:
            raise ValueError("KeyTable.attach: the pins map is smaller than the capacity")
        cdef uint32_t *p = <uint32_t *>(pins.p + SHARED_HDR)
        cdef Py_ssize_t v
        for v in range(self.capacity):
            p[v] = self.pins[v] if self.npinned else 0
        if self.own_pins:
            munmap(self.pins, <size_t>self.capacity * sizeof(uint32_t))
        self.pins = p
        self.own_pins = False
        self.sgen = <uint64_t *>(slots.p + SHARED_HDR)
        self.shdr = <uint64_t *>slots.p
        self._maps = (slots, pins) + tuple(self._maps[2:])
        self.set_peers(list(self._maps[2:]), self.peers_epoch if self.check_epoch else -1)

    def set_peers(self, list maps, long long epoch=-1):
        """The other engines' pin maps (their lease files), read by `claim`. `epoch`: the
        slots map's W_EPOCH read before the maps were listed; while it stays so, `maps`
        are every other engine's, and once it moved on (an engine attached, and may pin
        slots this list does not show) `claim` takes no slot until the next call."""
        cdef SharedMap m
        if len(maps) > MAX_PEERS:
            raise ValueError(f"at most {MAX_PEERS} other engines on one store")
        for m in maps:
            if m.nbytes < SHARED_HDR + <size_t>self.capacity * 4:
                raise ValueError("KeyTable.set_peers: a pin map is smaller than the capacity")
        self.npeers = 0
        for m in maps:
            self.peers[self.npeers] = <uint32_t *>(m.p + SHARED_HDR)
            self.npeers += 1
        self.check_epoch = epoch >= 0
        self.peers_epoch = <uint64_t>epoch if epoch >= 0 else 0
        self._maps = tuple(self._maps[:2]) + tuple(maps)

    @property
    def peer_count(self):
        return self.npeers

    @property
    def peers_stale(self):
        """An engine attached or left since the peers were listed (`set_peers` with an
        epoch): list them again before a claim, or it takes nothing."""
        return self.check_epoch and self.shdr != NULL and KT_LOAD64(&self.shdr[W_EPOCH]) != self.peers_epoch

    cdef inline bint _peer_pinned(self, uint32_t v) noexcept nogil:
        cdef int j
        for j in range(self.npeers):
            if KT_LOAD32(&self.peers[j][v]) != 0:
                return True
        return False

    @property
    def validating(self):
        """Hits are checked against the shared slot generations (attached, and the
        array is complete)."""
        return self._validating()

    cdef inline bint _validating(self) noexcept nogil:
        return self.sgen != NULL and KT_LOAD64(&self.shdr[3]) == 1

    cdef inline bint _stale(self, uint32_t slot, uint64_t gen) noexcept nogil:
        return KT_LOAD64(&self.sgen[slot]) != gen

    def sweep(self, Py_ssize_t start=0, Py_ssize_t count=-1):
        """Drop the entries of buckets [start, start + count) (all with count < 0) whose
        slot no longer holds their generation (another engine evicted or dropped it), so
        a large table is swept in slices. Returns (count dropped, next start: 0 after the
        last slice)."""
        cdef uint64_t size = self.mask + 1
        cdef uint64_t b, e, k = 0
        if start < 0 or <uint64_t>start >= size:
            start = 0
        b = <uint64_t>start
        e = size if count < 0 or b + <uint64_t>count >= size else b + <uint64_t>count
        if self._validating():
            k = self._remove_where(b, e, _STALE, 0, 0)
            self.stale_dropped += k
        return <Py_ssize_t>k, (0 if e >= size else <Py_ssize_t>e)

    # -- removing every entry that matches (a failed device's, stale ones) ------------
    cdef inline bint _matches(self, uint64_t i, int what, uint32_t ndev, uint32_t dev) noexcept nogil:
        cdef Bucket *t = &self.t[i]
        if t.fp == 0:
            return False
        if what == _ON_DEVICE:
            return t.slot % ndev == dev
        return t.slot < self.capacity and self._stale(t.slot, t.gen)

    cdef uint64_t _count_where(self, uint64_t b, uint64_t e, int what, uint32_t ndev,
                               uint32_t dev) noexcept nogil:
        cdef uint64_t i, m = 0
        for i in range(b, e):
            if self._matches(i, what, ndev, dev):
                m += 1
        return m

    cdef uint64_t _remove_where(self, uint64_t b, uint64_t e, int what, uint32_t ndev,
                                uint32_t dev) except? 0:
        """Remove the entries of buckets [b, e) that match; returns the count. Collected
        by fingerprint first: a deletion shifts later buckets back, so each entry is
        found again before it goes."""
        cdef uint64_t i, k = 0, m = self._count_where(b, e, what, ndev, dev)
        cdef Py_ssize_t j
        if m == 0:
            return 0
        cdef uint64_t *fps = <uint64_t *>calloc(<size_t>m, sizeof(uint64_t))
        cdef uint32_t *fp2s = <uint32_t *>calloc(<size_t>m, sizeof(uint32_t))
        if fps == NULL or fp2s == NULL:
            free(fps)
            free(fp2s)
            raise MemoryError("KeyTable: cannot allocate the removal list")
        for i in range(b, e):
            if k < m and self._matches(i, what, ndev, dev):
                fps[k] = self.t[i].fp
                fp2s[k] = self.t[i].fp2
                k += 1
        for i in range(k):
            j = self._find(fps[i], fp2s[i])
            if j >= 0:
                self._delete_at(<uint64_t>j)
        free(fps)
        free(fp2s)
        return k

    def __len__(self):
        return self.n

    @property
    def nbytes(self):
        """The table's memory: buckets and slot records (pins not counted)."""
        return (self.mask + 1) * sizeof(Bucket) + <size_t>self.capacity * sizeof(SlotRec)

    cdef inline void _prefetch(self, uint64_t fp) noexcept nogil:
        # a 24-byte bucket straddles two cache lines one time in four: fetch both
        cdef const char *p = <const char *>&self.t[fp & self.mask]
        KT_PREFETCH(p)
        KT_PREFETCH(p + sizeof(Bucket) - 1)

    cdef inline void _prefetch_run(self, uint64_t fp) noexcept nogil:
        # A miss reads its home bucket's whole run, up to an empty bucket: 3.6 buckets on
        # average at the table's ~60% load (linear probing), 2-3 cache lines; unfetched,
        # the lines after the first were ~40% of a cold store walk (perf, 10M entries).
        # The lines of buckets i..i+4, those within the table (a run wrapping round the
        # end is read as it goes).
        cdef uint64_t i = fp & self.mask
        cdef const char *p = <const char *>&self.t[i]
        cdef uint64_t k
        KT_PREFETCH(p)
        for k in range(1, 6):
            if i + k - 1 > self.mask:
                break
            KT_PREFETCH(p + k * sizeof(Bucket) - 1)

    # -- pins: a count per slot; eviction (`claim`) never takes a pinned slot ----------
    cdef inline int _pin_slot(self, object s) except -1:
        cdef long long v = s
        if v < 0 or v >= self.capacity:
            raise ValueError(f"slot {v} outside the table's capacity {self.capacity}")
        if self.pins[v] == 0:
            self.npinned += 1
        self.pins[v] += 1
        return 0

    cdef inline int _unpin_slot(self, object s) except -1:
        cdef long long v = s
        if v < 0 or v >= self.capacity or self.pins[v] == 0:
            return 0        # not pinned (as a dict of counts would ignore it)
        self.pins[v] -= 1
        if self.pins[v] == 0:
            self.npinned -= 1
        return 0

    def pin(self, list slots):
        """Pin count += 1 for each slot (a slot may appear more than once). A slot out of
        range (or not an int) raises, and then none of them is pinned."""
        cdef object s
        cdef Py_ssize_t done = 0
        try:
            for s in slots:
                self._pin_slot(s)
                done += 1
        except BaseException:
            for s in slots[:done]:
                self._unpin_slot(s)
            raise

    def unpin(self, slots):
        """Pin count -= 1 for each slot (a list of ints, or an array('I') as a packed
        walk returns); unpinned slots are ignored."""
        cdef object s
        cdef array.array a
        cdef Py_ssize_t j
        cdef uint32_t v
        if isinstance(slots, array.array) and (<array.array>slots).ob_descr.typecode == b"I":
            a = slots
            for j in range(len(a)):
                v = a.data.as_uints[j]
                if v < self.capacity and self.pins[v] != 0:
                    self.pins[v] -= 1
                    if self.pins[v] == 0:
                        self.npinned -= 1
            return
        for s in slots:
            self._unpin_slot(s)

    def pin_count(self, long long slot):
        if slot < 0 or slot >= self.capacity:
            return 0
        return self.pins[slot]

    def pins_dict(self):
        """{slot: pin count} of every pinned slot (tests, diagnostics: scans the array)."""
        cdef dict out = {}
        cdef Py_ssize_t v
        if self.npinned:
            for v in range(self.capacity):
                if self.pins[v]:
                    out[v] = self.pins[v]
        return out

    @property
    def pinned_slots(self):
        """Slots pinned at least once."""
        return self.npinned

    cdef inline Py_ssize_t _find(self, uint64_t fp, uint32_t fp2):
        cdef uint64_t i = fp & self.mask
        cdef Bucket *b
        while True:
            b = &self.t[i]
            if b.fp == 0:
                return -1
            if b.fp == fp and b.fp2 == fp2:
                return <Py_ssize_t>i
            i = (i + 1) & self.mask

    cdef int _put(self, uint64_t fp, uint32_t fp2, uint32_t slot, uint64_t gen) except -1:
        cdef uint64_t i = fp & self.mask
        cdef Bucket *b
        while True:
            b = &self.t[i]
            if b.fp == 0:
                if self.n >= self.capacity:
                    raise OverflowError(f"KeyTable is full ({self.capacity} keys, the store's "
                                        "capacity): the index holds more keys than slots")
                b.fp = fp
                b.fp2 = fp2
                b.slot = slot
                b.gen = gen
                self.n += 1
                self._set_rec(slot, fp, gen)
                return 0
            if b.fp == fp and b.fp2 == fp2:
                if b.slot != slot:
                    self._clear_rec(b.slot, fp)
                b.slot = slot
                b.gen = gen
                self._set_rec(slot, fp, gen)
                return 0
            i = (i + 1) & self.mask

    cdef inline void _set_rec(self, uint32_t slot, uint64_t fp, uint64_t gen) noexcept nogil:
        if slot < self.capacity:
            self.rec[slot].fp = fp
            self.rec[slot].gen = gen

    cdef inline void _clear_rec(self, uint32_t slot, uint64_t fp) noexcept nogil:
        # only while the record is this entry's: the slot may name a newer entry already
        if slot < self.capacity and self.rec[slot].fp == fp:
            self.rec[slot].fp = 0
            self.rec[slot].gen = 0

    cdef void _delete_at(self, uint64_t i):
        cdef uint64_t j = i
        cdef uint64_t mask = self.mask
        self._clear_rec(self.t[i].slot, self.t[i].fp)
        while True:
            j = (j + 1) & mask
            if self.t[j].fp == 0:
                break
            if _stays(i, j, self.t[j].fp & mask):
                continue
            self.t[i] = self.t[j]
            i = j
        memset(&self.t[i], 0, sizeof(Bucket))
        self.n -= 1

    def get(self, bytes key):
        """(slot, generation) of key, or None."""
        cdef uint64_t fp
        cdef uint32_t fp2
        _fingerprint(key, &fp, &fp2)
        cdef Py_ssize_t i = self._find(fp, fp2)
        if i < 0:
            return None
        return self.t[i].slot, self.t[i].gen

    def __contains__(self, bytes key):
        cdef uint64_t fp
        cdef uint32_t fp2
        _fingerprint(key, &fp, &fp2)
        return self._find(fp, fp2) >= 0

    def put(self, bytes key, uint32_t slot, uint64_t gen):
        """Insert or replace key -> (slot, gen)."""
        cdef uint64_t fp
        cdef uint32_t fp2
        _fingerprint(key, &fp, &fp2)
        self._put(fp, fp2, slot, gen)

    def remove(self, bytes key, long long slot=-1):
        """Remove key (only while it maps to `slot`, when given). True if removed."""
        cdef uint64_t fp
        cdef uint32_t fp2
        _fingerprint(key, &fp, &fp2)
        return self._remove_fp(fp, fp2, slot)

    cdef bint _remove_fp(self, uint64_t fp, uint32_t fp2, long long slot):
        """remove() of the key whose fingerprint is (fp, fp2): no key object needed."""
        cdef Py_ssize_t i = self._find(fp, fp2)
        if i < 0 or (slot >= 0 and self.t[i].slot != <uint32_t>slot):
            return False
        self._delete_at(<uint64_t>i)
        return True

    def clear(self):
        memset(self.t, 0, (self.mask + 1) * sizeof(Bucket))
        memset(self.rec, 0, <size_t>self.capacity * sizeof(SlotRec))
        self.n = 0

    def prefix(self, list keys):
        """(slots, generations) of keys[0..i), where keys[i] is the first key not present."""
        # In batches: hash a batch and prefetch every home bucket, then probe, so the
        # batch's cache misses overlap; a miss ends the walk (misses cost one batch at most).
        cdef list slots = [], gens = []
        cdef uint64_t fps[BATCH]
        cdef uint32_t fp2s[BATCH]
        cdef Py_ssize_t n = len(keys), start = 0, stop, j, i
        cdef object k
        while start < n:
            stop = min(n, start + BATCH)
            for j in range(start, stop):
                k = keys[j]
                if not PyBytes_Check(k):
                    raise TypeError(f"KeyTable keys are bytes, got {type(k).__name__}")
                _fingerprint(<bytes>k, &fps[j - start], &fp2s[j - start])
            self._prefetch_all(fps, stop - start)
            for j in range(stop - start):
                i = self._find(fps[j], fp2s[j])
                if i < 0:
                    return slots, gens
                if self._validating() and self.t[i].slot < self.capacity and self._stale(self.t[i].slot, self.t[i].gen):
                    self._delete_at(<uint64_t>i)
                    self.stale_dropped += 1
                    return slots, gens
                slots.append(self.t[i].slot)
                gens.append(self.t[i].gen)
            start = stop
        return slots, gens

    def validate_pinned(self, list keys, list slots, list gens, bint drop=True):
        """After pinning a hit (keys, slots, gens): a full fence, then the longest prefix
        whose slots still hold their generations. The rest is unpinned and (with `drop`)
        its first entry leaves the table. Returns the count kept."""
        cdef Py_ssize_t n = len(slots), j, k
        cdef uint32_t x
        if n == 0 or not self._validating():
            return n
        for j in range(n):          # the generations' cache misses overlap
            x = slots[j]
            if x < self.capacity:
                KT_PREFETCH(&self.sgen[x])
        KT_FENCE()
        for j in range(n):
            x = slots[j]
            if x >= self.capacity or KT_LOAD64(&self.sgen[x]) != <uint64_t>gens[j]:
                for k in range(j, n):
                    self._unpin_slot(slots[k])
                if drop:
                    self.remove(keys[j], x)
                self.stale_dropped += 1
                return j
        return n

    def load(self, rows, Py_ssize_t yield_every=65536, unsigned int yield_us=100):
        """Insert every (key, value) of `rows`, value packed as the index's keys db row
        (slot u32, generation u64, tick u64, little-endian). The GIL is dropped every 1024
        rows and released for `yield_us` microseconds every `yield_every` rows, so that a
        long load in a background thread does not keep another thread (vLLM's scheduler)
        from running. Returns the count."""
        cdef Py_ssize_t count = 0
        cdef uint64_t fp
        cdef uint32_t fp2
        cdef const unsigned char *v
        cdef uint32_t slot
        cdef uint64_t gen
        cdef object k, val
        cdef int j
        for k, val in rows:
            if not PyBytes_Check(k) or not PyBytes_Check(val) or PyBytes_GET_SIZE(val) < 12:
                raise ValueError("KeyTable.load: rows must be (bytes key, packed value >= 12 bytes)")
            v = <const unsigned char *>PyBytes_AS_STRING(val)
            slot = (<uint32_t>v[0]) | (<uint32_t>v[1] << 8) | (<uint32_t>v[2] << 16) | (<uint32_t>v[3] << 24)
            gen = 0
            for j in range(7, -1, -1):
                gen = (gen << 8) | v[4 + j]
            _fingerprint(<bytes>k, &fp, &fp2)
            self._put(fp, fp2, slot, gen)
            count += 1
            if count % 1024 == 0:
                with nogil:     # a thread that waited a switch interval takes the GIL here
                    pass
            if yield_every > 0 and count % yield_every == 0:
                with nogil:
                    usleep(yield_us)
        return count

    # -- the scheduler's per-step walks over vLLM block hashes, in C -------------------
    # vLLM hands the scheduler a request's block hashes as a list of bytes; a store key is
    # hash + 4-byte big-endian KV cache group id (`kvstore.vllm.config.block_key`). These
    # walks build each key in a stack buffer, so a block that is skipped (a miss ends a
    # lookup; a block already stored is not planned again) costs no Python object at all.

    def prefix_of(self, list hashes, Py_ssize_t start, Py_ssize_t stop, uint32_t group=0,
                  bint pin=False, bint packed=False):
        """(keys, slots, generations) of the longest prefix of blocks start..stop of
        `hashes` (vLLM block hashes) whose keys (hash + group) are in the table; with `pin`
        their slots are pinned in the same walk. Only the hit keys are made as bytes.

        With `packed`: (None, slots as array('I'), generations as array('Q')): no Python
        object per block at all (the hit's keys are hashes[start:start + n] + group; the
        step thread's lookup, where 511 keys and 1,022 ints were a third of the walk).

        Software-pipelined: batch k+1 is hashed and its buckets prefetched before batch k
        is probed, so the cache misses of two batches are in flight together; batch k is
        probed whole first, prefetching each hit's pin count and shared generation, and
        only then pinned and made into keys, so those misses overlap too. A block hash
        that cannot be made a key raises only if the walk gets to its batch (a miss before
        it ends the walk, as without the pipelining); a walk that raises pins nothing.

        Run-following (module notes): once a batch's hits sat in consecutive slots (3 in
        4), the next batches check each block against the slot after the previous hit's
        (its `SlotRec`) and probe its bucket only when that fails; their buckets are not
        prefetched. A batch where more than 1 in 4 fails goes back to probing."""
        cdef list keys = [], slots = [], gens = []
        cdef uint64_t fps[2][BATCH]
        cdef uint32_t fp2s[2][BATCH]
        cdef unsigned char buf[2][BATCH][KEY_MAX]
        cdef Py_ssize_t lens[2][BATCH]
        cdef uint32_t fslot[BATCH]
        cdef uint64_t fgen[BATCH]
        cdef Py_ssize_t b, e, nb, ne, j, i, x, m
        cdef int cur = 0
        cdef bint next_bad, missed
        cdef bint follow = False        # this batch follows slot runs (else: probes)
        cdef bint have_prev = False
        cdef uint64_t prev = 0, nxt
        cdef Py_ssize_t consec, fails
        cdef array.array sa = None, ga = None
        cdef Py_ssize_t nhit = 0
        if start < 0:
            start = 0
        if stop > len(hashes):
            stop = len(hashes)
        if stop <= start:
            return (None, _array_mod.array("I"), _array_mod.array("Q")) if packed \
                else (keys, slots, gens)
        # A prompt never seen misses at its first block: one probe answers it, not two
        # batches hashed and fetched (misses cost less than hits).
        j = _make_key(hashes[start], group, buf[0][0])
        _fingerprint_raw(buf[0][0], j, &fps[0][0], &fp2s[0][0])
        if self._find(fps[0][0], fp2s[0][0]) < 0:
            self.first_misses += 1
            return (None, _array_mod.array("I"), _array_mod.array("Q")) if packed \
                else (keys, slots, gens)
        if packed:
            sa = array.clone(_U32, stop - start, False)
            ga = array.clone(_U64, stop - start, False)
        b = start
        e = min(stop, b + BATCH)
        try:
            self._hash_batch(hashes, b, e, group, buf[0], lens[0], fps[0], fp2s[0])
            while b < stop:
                nb = e
                ne = min(stop, nb + BATCH)
                next_bad = False
                if nb < ne:
                    try:       # (a following walk does not fetch buckets it may not need)
                        self._hash_batch(hashes, nb, ne, group, buf[1 - cur], lens[1 - cur],
                                         fps[1 - cur], fp2s[1 - cur], not follow)
                    except Exception:
                        next_bad = True     # raised again below if the walk gets there
                m = e - b
                missed = False
                consec = fails = 0
                for j in range(e - b):      # probe the batch; prefetch what pinning reads
                    nxt = prev + 1
                    if follow and have_prev and nxt < <uint64_t>self.capacity \
                            and self.rec[nxt].fp == fps[cur][j]:
                        fslot[j] = <uint32_t>nxt
                        fgen[j] = self.rec[nxt].gen
                        self.run_follows += 1
                    else:
                        fails += follow
                        i = self._find(fps[cur][j], fp2s[cur][j])
                        if i < 0:
                            m = j
                            missed = True
                            break
                        fslot[j] = self.t[i].slot
                        fgen[j] = self.t[i].gen
                        consec += have_prev and fslot[j] == nxt
                    prev = fslot[j]
                    have_prev = True
                    x = fslot[j]
                    if x < self.capacity:
                        if pin:
                            KT_PREFETCH_W(&self.pins[x])
                        if self.sgen != NULL:
                            KT_PREFETCH(&self.sgen[x])
                if follow:
                    follow = fails * 4 <= m
                else:
                    follow = m > 1 and consec * 4 >= (m - 1) * 3
                for j in range(m):
                    x = fslot[j]
                    if pin and x >= self.capacity:
                        raise ValueError(f"slot {x} outside the table's capacity {self.capacity}")
                    if packed:
                        sa.data.as_uints[nhit] = x
                        ga.data.as_ulonglongs[nhit] = fgen[j]
                    else:
                        keys.append(PyBytes_FromStringAndSize(<char *>buf[cur][j], lens[cur][j]))
                        slots.append(x)
                        gens.append(fgen[j])
                    nhit += 1
                    if pin:                 # every slot walked is pinned once by us
                        if self.pins[x] == 0:
                            self.npinned += 1
                        self.pins[x] += 1
                if missed:
                    break
                if next_bad:                # no miss in this batch: the next one's error
                    self._hash_batch(hashes, nb, ne, group, buf[1 - cur], lens[1 - cur],
                                     fps[1 - cur], fp2s[1 - cur])
                b, e = nb, ne
                cur = 1 - cur
        except BaseException:
            if pin:                         # the caller gets no slots: it must hold no pins
                for j in range(nhit):
                    x = sa.data.as_uints[j] if packed else slots[j]
                    self.pins[x] -= 1
                    if self.pins[x] == 0:
                        self.npinned -= 1
            raise
        if packed:
            if nhit and self._validating():
                nhit = self._checked_packed(hashes, start, group, sa, ga, nhit, pin)
            array.resize(sa, nhit)
            array.resize(ga, nhit)
            return None, sa, ga
        return self._checked(keys, slots, gens, pin)

    cdef Py_ssize_t _checked_packed(self, list hashes, Py_ssize_t start, uint32_t group,
                                    array.array sa, array.array ga, Py_ssize_t n, bint pin) except -1:
        """`_checked` of a packed hit (slots sa, generations ga, blocks start..start + n
        of hashes): the count kept. As `validate_pinned` when pinned: a full fence, then
        the longest prefix whose slots still hold their generations; the rest is unpinned
        and its first entry leaves the table (its key made from its hash)."""
        cdef Py_ssize_t j, k
        cdef uint32_t x
        cdef unsigned char buf[KEY_MAX]
        cdef Py_ssize_t klen
        cdef uint64_t fp
        cdef uint32_t fp2
        for j in range(n):          # the generations' cache misses overlap
            x = sa.data.as_uints[j]
            if x < self.capacity:
                KT_PREFETCH(&self.sgen[x])
        if pin:
            KT_FENCE()
        for j in range(n):
            x = sa.data.as_uints[j]
            if x >= self.capacity or KT_LOAD64(&self.sgen[x]) != ga.data.as_ulonglongs[j]:
                if pin:
                    for k in range(j, n):
                        self._unpin_slot(sa.data.as_uints[k])
                # Removed by its fingerprint, made from the hash in place: no object
                # (an allocation failing here would leave the kept prefix pinned).
                klen = _make_key(hashes[start + j], group, buf)
                _fingerprint_raw(buf, klen, &fp, &fp2)
                self._remove_fp(fp, fp2, x)
                self.stale_dropped += 1
                return j
        return n

    cdef tuple _checked(self, list keys, list slots, list gens, bint pin):
        """A walk's hit, cut at its first entry whose slot moved on (sharing engines)."""
        cdef Py_ssize_t n, j
        cdef uint32_t x
        if not slots or not self._validating():
            return keys, slots, gens
        if pin:
            n = self.validate_pinned(keys, slots, gens)
        else:
            n = len(slots)
            for j in range(n):
                x = slots[j]
                if x < self.capacity:
                    KT_PREFETCH(&self.sgen[x])
            for j in range(n):
                if <uint32_t>slots[j] >= self.capacity or self._stale(<uint32_t>slots[j], <uint64_t>gens[j]):
                    self.remove(keys[j], slots[j])
                    self.stale_dropped += 1
                    n = j
                    break
        if n < len(slots):
            del keys[n:], slots[n:], gens[n:]
        return keys, slots, gens

    cdef int _hash_batch(self, list hashes, Py_ssize_t b, Py_ssize_t e, uint32_t group,
                         unsigned char (*buf)[KEY_MAX], Py_ssize_t *lens, uint64_t *fps,
                         uint32_t *fp2s, bint fetch=True, KeySet skip=None) except -1:
        """Make keys b..e of `hashes` into buf, their fingerprints into fps/fp2s; with
        `fetch`, fetch their buckets (and their buckets in `skip`, the keys being stored,
        probed next by a store walk: a set of thousands of keys, as cold as the table)."""
        cdef Py_ssize_t j
        for j in range(b, e):
            lens[j - b] = _make_key(hashes[j], group, buf[j - b])
            _fingerprint_raw(buf[j - b], lens[j - b], &fps[j - b], &fp2s[j - b])
        if fetch and skip is not None:   # a store walk: mostly misses
            for j in range(e - b):
                self._prefetch_run(fps[j])
            skip._prefetch_all(fps, e - b)
        elif fetch:
            self._prefetch_all(fps, e - b)
        return 0

    cdef inline void _prefetch_all(self, const uint64_t *fps, Py_ssize_t n) noexcept nogil:
        # A loop of its own, after the batch is hashed: prefetches interleaved with the
        # hashing ran ~3x slower at 10M entries on a VM (512 cold misses: 125-135 us vs
        # 45 us), as if each prefetch's page walk held up the hashing behind it.
        cdef Py_ssize_t j
        for j in range(n):
            self._prefetch(fps[j])

    def present(self, list hashes, Py_ssize_t start, Py_ssize_t stop, uint32_t group=0):
        """bytes of stop - start flags: 1 where block j's key (hash + group) is in the
        table (a sliding-window group's hit needs the blocks of a window, not a prefix)."""
        if start < 0:
            start = 0
        if stop > len(hashes):
            stop = len(hashes)
        if stop <= start:
            return b""
        cdef bytearray out = bytearray(stop - start)
        cdef unsigned char buf[KEY_MAX]
        cdef Py_ssize_t n, j
        cdef uint64_t fp
        cdef uint32_t fp2
        for j in range(start, stop):
            n = _make_key(hashes[j], group, buf)
            _fingerprint_raw(buf, n, &fp, &fp2)
            out[j - start] = 1 if self._find(fp, fp2) >= 0 else 0
        return bytes(out)

    def plan_new(self, list hashes, Py_ssize_t start, Py_ssize_t stop, list block_ids,
                 object skip, Py_ssize_t limit, uint32_t group=0, bint packed=False):
        """Blocks start..stop of `hashes` to store: (keys, block ids, block indices) of
        those whose key is neither in the table (already stored) nor in `skip` (being
        stored: a `KeySet`, probed by the fingerprint the walk already has, or a set);
        at most `limit` of them. Their keys are added to `skip` (the caller removes the
        ones it does not keep). `block_ids` holds ints or vLLM's
        `KVCacheBlock` objects (the request's block list as vLLM keeps it: only the
        planned blocks' `block_id` is read, no id list of the whole request is made).
        With `packed` (and a `KeySet` skip), the first list holds the planned blocks'
        vLLM hashes (the objects of `hashes`) instead of keys, and the block indices are
        an array('I'): no Python object is made per block (512 new ints cost ~70 us in a
        scratch with the allocator's memory cold, 9 us warm; a walk timed alone, with the
        allocator warm, shows no difference); their keys are
        `make_keys(those, [(group, len)])`."""
        cdef list keys = [], bids = [], idx = []
        cdef array.array idxa = array.clone(_U32, 0, False) if packed else None
        cdef uint32_t ib[BATCH]
        cdef Py_ssize_t ni
        cdef uint64_t fps[BATCH]
        cdef uint32_t fp2s[BATCH]
        cdef unsigned char buf[BATCH][KEY_MAX]
        cdef Py_ssize_t lens[BATCH]
        cdef list held = [None] * BATCH   # the batch's block ids
        cdef Py_ssize_t b, e, j
        cdef object key, bid
        cdef KeySet fast = skip if type(skip) is KeySet else None
        if packed and fast is None:
            raise TypeError("plan_new(packed=True) needs a KeySet of the keys being stored")
        if start < 0:
            start = 0
        if stop > len(hashes):
            stop = len(hashes)
        if stop > len(block_ids):
            stop = len(block_ids)
        b = start
        try:
            while b < stop and len(keys) < limit:
                e = min(stop, b + BATCH)
                # vLLM's KVCacheBlock objects are as cold as the table, and each one's
                # block_id int is a second miss behind it. Pipelined: this batch's blocks
                # were fetched one batch ago; read their ids and fetch those, fetch the
                # next batch's blocks, then hash this batch (its buckets on their way)
                # and probe. 512 new blocks at 10M entries, cold caches, blocks spread over
                # the pool (a long-running engine's free queue): 260 us p50, against 401
                # without the read-ahead; consecutive blocks (a fresh pool): 149 vs 143 us
                # (docs/benchmarks.md).
                if b == start:
                    for j in range(b, e):
                        KT_PREFETCH(<const void *>PyList_GET_ITEM(block_ids, j))
                for j in range(e - b):
                    bid = <object>PyList_GET_ITEM(block_ids, b + j)
                    if not PyLong_Check(bid):
                        bid = bid.block_id
                        KT_PREFETCH(<const void *>bid)
                    held[j] = bid
                for j in range(e, min(stop, e + BATCH)):
                    KT_PREFETCH(<const void *>PyList_GET_ITEM(block_ids, j))
                self._hash_batch(hashes, b, e, group, buf, lens, fps, fp2s, True, fast)
                ni = 0
                for j in range(e - b):
                    if len(keys) >= limit:
                        break
                    if self._find(fps[j], fp2s[j]) >= 0:
                        continue
                    if fast is not None:
                        if fast._has(fps[j], fp2s[j]):
                            continue
                        if packed:
                            key = hashes[b + j]
                        else:
                            key = PyBytes_FromStringAndSize(<char *>buf[j], lens[j])
                        bids.append(held[j])
                        fast._add(fps[j], fp2s[j])
                    else:
                        key = PyBytes_FromStringAndSize(<char *>buf[j], lens[j])
                        if key in skip:
                            continue
                        bids.append(held[j])
                        skip.add(key)
                    keys.append(key)
                    if packed:
                        ib[ni] = <uint32_t>(b + j)
                        ni += 1
                    else:
                        idx.append(b + j)
                if ni:
                    array.extend_buffer(idxa, <char *>ib, ni)
                b = e
        except BaseException:
            # nothing planned: no key stays claimed
            skip.difference_update(make_keys(keys, [(group, len(keys))]) if packed else keys)
            raise
        return keys, bids, (idxa if packed else idx)

    def count_new(self, list hashes, Py_ssize_t start, Py_ssize_t stop, KeySet skip not None,
                  uint32_t group=0):
        """How many of blocks start..stop of `hashes` `plan_new` would plan with no limit:
        keys neither in the table nor in `skip`, which is only probed (nothing claimed).
        The count of an eager store's blocks a dry slot pool drops, without planning them
        (no key, no claim, no Python object per block)."""
        cdef uint64_t fps[BATCH]
        cdef uint32_t fp2s[BATCH]
        cdef unsigned char buf[BATCH][KEY_MAX]
        cdef Py_ssize_t lens[BATCH]
        cdef Py_ssize_t b, e, j, n = 0
        if start < 0:
            start = 0
        if stop > len(hashes):
            stop = len(hashes)
        b = start
        while b < stop:
            e = min(stop, b + BATCH)
            self._hash_batch(hashes, b, e, group, buf, lens, fps, fp2s, True, skip)
            for j in range(e - b):
                if self._find(fps[j], fp2s[j]) < 0 and not skip._has(fps[j], fp2s[j]):
                    n += 1
            b = e
        return n

    def claim(self, list cands, bint ready=True):
        """The index thread's eviction claim, in one C call (the step thread never waits
        on it): of (key or None, slot) candidates, take every slot that is not pinned; a
        taken slot's key leaves the table when it maps to that slot (when `ready`).
        Returns (taken slots as a set, the removed entries as one flat list: key, slot,
        generation, key, ...; flat, so the index thread allocates no tuple per eviction
        for the garbage collector to count)."""
        cdef set taken = set()
        cdef list removed = []
        cdef object key, slot
        cdef long long v
        cdef uint64_t fp
        cdef uint32_t fp2
        cdef Py_ssize_t i
        cdef uint64_t old
        for key, slot in cands:
            v = slot
            if 0 <= v < self.capacity and self.pins[v] != 0:
                continue
            if self.sgen != NULL and 0 <= v < self.capacity:
                # clear the slot's generation, then look at the other engines' pins: a
                # lookup that pinned it first is seen here; one that pins it later sees 0.
                # An engine that attached after the peers were listed is not in them:
                # W_EPOCH moved on, and nothing more is taken until they are listed again
                # (`peers_stale`; read after the pins: an engine whose attach it misses
                # pins later, and its lookup sees this 0).
                old = KT_LOAD64(&self.sgen[v])
                KT_STORE64(&self.sgen[v], 0)
                if self._peer_pinned(<uint32_t>v):
                    KT_STORE64(&self.sgen[v], old)
                    continue
                if self.check_epoch and KT_LOAD64(&self.shdr[W_EPOCH]) != self.peers_epoch:
                    KT_STORE64(&self.sgen[v], old)
                    break
            if key is not None and ready:
                _fingerprint(<bytes?>key, &fp, &fp2)
                i = self._find(fp, fp2)
                if i >= 0 and self.t[i].slot == <uint32_t>v:
                    removed.append(key)
                    removed.append(slot)
                    removed.append(self.t[i].gen)
                    self._delete_at(<uint64_t>i)
            taken.add(slot)
        return taken, removed

    def remove_many(self, list keys, list slots=None):
        """remove() for each key (only while it maps to slots[j], when given). Returns
        the count removed."""
        cdef Py_ssize_t j, n = len(keys), done = 0
        cdef uint64_t fp
        cdef uint32_t fp2
        if slots is not None and len(slots) != n:
            raise ValueError("remove_many: keys and slots differ in length")
        for j in range(n):
            _fingerprint(<bytes?>keys[j], &fp, &fp2)
            done += self._remove_fp(fp, fp2, -1 if slots is None else <long long>slots[j])
        return done

    def remove_device(self, uint32_t ndev, uint32_t dev):
        """Remove every entry whose slot lives on device `dev` of `ndev` (slot % ndev ==
        dev: a failed device's blocks leave the lookups in one C call). Pins stay (their
        loads end as failures and unpin). Returns the count removed."""
        if ndev == 0 or dev >= ndev:
            raise ValueError(f"remove_device: device {dev} of {ndev}")
        return self._remove_where(0, self.mask + 1, _ON_DEVICE, ndev, dev)

    def count_device(self, uint32_t ndev, uint32_t dev):
        """Entries whose slot lives on device `dev` of `ndev` (tests, diagnostics)."""
        if ndev == 0:
            return 0
        return self._count_where(0, self.mask + 1, _ON_DEVICE, ndev, dev)

    def put_many(self, list keys, list slots, list gens):
        """put() for each (key, slot, generation); a key already present keeps its entry.
        Returns the count inserted."""
        cdef Py_ssize_t j, n = len(keys), added = 0
        cdef uint64_t fp
        cdef uint32_t fp2
        if len(slots) != n or len(gens) != n:
            raise ValueError("put_many: keys, slots and gens differ in length")
        for j in range(n):
            _fingerprint(<bytes?>keys[j], &fp, &fp2)
            if self._find(fp, fp2) >= 0:
                continue
            self._put(fp, fp2, <uint32_t>slots[j], <uint64_t>gens[j])
            added += 1
        return added


cdef void *_huge_zeroed(size_t nbytes) noexcept:
    """Anonymous zeroed memory, asked for as huge pages (a walk makes one random access
    per key into the table and the pin counts: 4 KiB pages would add a TLB miss to most
    of them), or NULL."""
    cdef void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if p == MAP_FAILED:
        return NULL
    madvise(p, nbytes, MADV_HUGEPAGE)
    return p


cdef inline bint _stays(uint64_t i, uint64_t j, uint64_t k) noexcept nogil:
    """Backward-shift deletion of bucket i (linear probing): the entry at j, whose home
    bucket is k, stays where it is when k lies cyclically in (i, j]."""
    return (i <= j and i < k and k <= j) or (i > j and (i < k or k <= j))


cdef inline Py_ssize_t _make_key(object h, uint32_t group, unsigned char *buf) except -1:
    if not PyBytes_Check(h):
        raise TypeError(f"block hashes are bytes, got {type(h).__name__}")
    cdef Py_ssize_t n = PyBytes_GET_SIZE(h)
    if n > KEY_MAX - 4:
        raise ValueError(f"block hash of {n} bytes: at most {KEY_MAX - 4} supported")
    memcpy(buf, PyBytes_AS_STRING(h), n)
    buf[n] = (group >> 24) & 0xFF
    buf[n + 1] = (group >> 16) & 0xFF
    buf[n + 2] = (group >> 8) & 0xFF
    buf[n + 3] = group & 0xFF
    return n + 4


cdef inline void _fingerprint_raw(const unsigned char *p, Py_ssize_t n, uint64_t *fp, uint32_t *fp2) noexcept nogil:
    cdef XXH128_hash_t h = XXH3_128bits(p, <size_t>n)
    fp[0] = h.low64 if h.low64 != 0 else 1
    fp2[0] = <uint32_t>(h.high64 >> 32)


cdef struct FpEntry:
    uint64_t fp         # 0: empty
    uint32_t fp2
    uint32_t _pad


cdef class KeySet:
    """A set of store keys kept as their XXH3-128 fingerprints (the table's identity of
    a key), with the API of a Python set of bytes that the scheduler uses for the keys
    being stored (`add`, `discard`, `in`, `difference_update`, `len`). `KeyTable.plan_new`
    probes and fills it with the fingerprints its walk already made: no bytes hashed
    again, no object made for a key that is skipped. Open addressing, grown by doubling
    at 70% load, deletion by backward shift (no tombstones)."""
    cdef FpEntry *t
    cdef uint64_t mask
    cdef Py_ssize_t n

    def __cinit__(self, Py_ssize_t initial=1024):
        cdef uint64_t size = 16
        while size * 7 < <uint64_t>max(1, initial) * 10:
            size *= 2
        self.t = <FpEntry *>calloc(<size_t>size, sizeof(FpEntry))
        if self.t == NULL:
            raise MemoryError("KeySet")
        self.mask = size - 1
        self.n = 0

    def __dealloc__(self):
        free(self.t)
        self.t = NULL

    cdef inline Py_ssize_t _slot(self, uint64_t fp, uint32_t fp2) noexcept:
        """Index of fp's entry, or -(index of the empty bucket that ends its run) - 1."""
        cdef uint64_t i = fp & self.mask
        while True:
            if self.t[i].fp == 0:
                return -<Py_ssize_t>i - 1
            if self.t[i].fp == fp and self.t[i].fp2 == fp2:
                return <Py_ssize_t>i
            i = (i + 1) & self.mask

    cdef inline bint _has(self, uint64_t fp, uint32_t fp2) noexcept:
        return self._slot(fp, fp2) >= 0

    cdef inline void _prefetch_all(self, const uint64_t *fps, Py_ssize_t n) noexcept nogil:
        # the runs of n fingerprints about to be probed (`KeyTable._hash_batch`): their
        # home buckets and the three after (16-byte entries: one or two cache lines)
        cdef Py_ssize_t j
        cdef uint64_t i
        for j in range(n):
            i = fps[j] & self.mask
            KT_PREFETCH(&self.t[i])
            if i + 3 <= self.mask:
                KT_PREFETCH(<const char *>&self.t[i + 3] + sizeof(FpEntry) - 1)

    cdef int _add(self, uint64_t fp, uint32_t fp2) except -1:
        cdef Py_ssize_t i = self._slot(fp, fp2)
        if i >= 0:
            return 0
        if <uint64_t>(self.n + 1) * 10 > (self.mask + 1) * 7:
            self._grow()
            i = self._slot(fp, fp2)
        i = -i - 1
        self.t[i].fp = fp
        self.t[i].fp2 = fp2
        self.n += 1
        return 0

    cdef int _grow(self) except -1:
        cdef uint64_t old_size = self.mask + 1, size = old_size * 2, j, i
        cdef FpEntry *old = self.t
        cdef FpEntry *t = <FpEntry *>calloc(<size_t>size, sizeof(FpEntry))
        if t == NULL:
            raise MemoryError("KeySet")
        for j in range(old_size):
            if old[j].fp != 0:
                i = old[j].fp & (size - 1)
                while t[i].fp != 0:
                    i = (i + 1) & (size - 1)
                t[i] = old[j]
        self.t = t
        self.mask = size - 1
        free(old)
        return 0

    cdef bint _discard(self, uint64_t fp, uint32_t fp2) noexcept:
        cdef Py_ssize_t found = self._slot(fp, fp2)
        cdef uint64_t i, j, mask = self.mask
        if found < 0:
            return False
        i = j = <uint64_t>found
        while True:
            j = (j + 1) & mask
            if self.t[j].fp == 0:
                break
            if _stays(i, j, self.t[j].fp & mask):
                continue
            self.t[i] = self.t[j]
            i = j
        self.t[i].fp = 0
        self.t[i].fp2 = 0
        self.n -= 1
        return True

    def add(self, bytes key not None):
        cdef uint64_t fp
        cdef uint32_t fp2
        _fingerprint(key, &fp, &fp2)
        self._add(fp, fp2)

    def discard(self, bytes key not None):
        cdef uint64_t fp
        cdef uint32_t fp2
        _fingerprint(key, &fp, &fp2)
        self._discard(fp, fp2)

    def discard_fingerprints(self, const unsigned char[::1] fps):
        """discard() for every key whose fingerprint `fingerprints()` packed into `fps`
        (made on another thread: no key is hashed or freed here)."""
        cdef Py_ssize_t b, e, j, n = fps.shape[0] // FP_BYTES
        cdef uint64_t fp[BATCH]
        cdef uint32_t fp2[BATCH]
        if fps.shape[0] % FP_BYTES:
            raise ValueError(f"discard_fingerprints: {fps.shape[0]} bytes, not whole fingerprints")
        # A batch's home buckets fetched together, then discarded: the set is cold by the
        # time a commit comes back (the step's forward ran meanwhile); its misses were ~a
        # quarter of a store step's `update_connector_output` (perf on the scheduler thread,
        # 10M entries). 512 of 20K keys after 64 MiB of other traffic: p50 37-40 us, against
        # 47-59 without; of 3.5K keys (fits the caches better): 25 vs 26 us.
        b = 0
        while b < n:
            e = min(n, b + BATCH)
            for j in range(e - b):
                memcpy(&fp[j], &fps[(b + j) * FP_BYTES], 8)
                memcpy(&fp2[j], &fps[(b + j) * FP_BYTES + 8], 4)
            self._prefetch_all(fp, e - b)
            for j in range(e - b):
                self._discard(fp[j], fp2[j])
            b = e

    def difference_update(self, keys):
        cdef uint64_t fp
        cdef uint32_t fp2
        cdef object k
        for k in keys:
            _fingerprint(<bytes?>k, &fp, &fp2)
            self._discard(fp, fp2)

    def __contains__(self, key):
        cdef uint64_t fp
        cdef uint32_t fp2
        if not PyBytes_Check(key):
            return False
        _fingerprint(<bytes>key, &fp, &fp2)
        return self._has(fp, fp2)

    def __len__(self):
        return self.n

    def clear(self):
        memset(self.t, 0, (self.mask + 1) * sizeof(FpEntry))
        self.n = 0


def fingerprints(list keys):
    """The table's fingerprints of `keys` (XXH3-128: 8 + 4 bytes each), packed in one bytes
    object, for `KeySet.discard_fingerprints` on another thread."""
    cdef Py_ssize_t j, n = len(keys)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n * FP_BYTES)
    cdef char *p = PyBytes_AS_STRING(out)
    cdef uint64_t fp
    cdef uint32_t fp2
    for j in range(n):
        _fingerprint(<bytes?>keys[j], &fp, &fp2)
        memcpy(p + j * FP_BYTES, &fp, 8)
        memcpy(p + j * FP_BYTES + 8, &fp2, 4)
    return out


def keys_with_packed(list keys, object packed):
    """`keys`, then the keys of `packed` = (vLLM hashes, (group id, count) runs) when
    given: every key of a store job whose eager blocks travel packed."""
    return keys + make_keys(packed[0], packed[1]) if packed else keys


def make_keys(list hashes, list groups):
    """The store keys of a packed hit: hashes (vLLM block hashes, in order) + group id,
    `groups` giving (group id, count) runs that cover `hashes` in order. Made where the
    keys are needed (the worker's I/O thread, the index thread), not on the step thread."""
    cdef list out = []
    cdef unsigned char buf[KEY_MAX]
    cdef Py_ssize_t pos = 0, j, n, total = 0
    cdef object g, cnt
    for g, cnt in groups:
        if cnt < 0:
            raise ValueError(f"make_keys: a group run of {cnt} blocks")
        total += <Py_ssize_t>cnt
    if total != len(hashes):
        raise ValueError(f"make_keys: the group runs cover {total} blocks, there are {len(hashes)} hashes")
    for g, cnt in groups:
        for j in range(pos, pos + <Py_ssize_t>cnt):
            n = _make_key(hashes[j], <uint32_t>g, buf)
            out.append(PyBytes_FromStringAndSize(<char *>buf, n))
        pos += <Py_ssize_t>cnt
    return out


def pin_counts_add(dict pins, list slots):
    """pins[slot] += 1 for each slot (a plain dict slot -> count)."""
    cdef object s
    cdef object c
    for s in slots:
        c = pins.get(s)
        pins[s] = 1 if c is None else c + 1


def pin_counts_remove(dict pins, list slots):
    """pins[slot] -= 1 for each slot; a slot whose count reaches 0 leaves the dict."""
    cdef object s
    cdef object c
    for s in slots:
        c = pins.get(s)
        if c is None:
            continue
        if c <= 1:
            del pins[s]
        else:
            pins[s] = c - 1
