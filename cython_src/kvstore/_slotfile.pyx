# cython: language_level=3
"""Fixed-slot block files and the slot header format.

Owns one preallocated file of `num_slots` slots of `slot_size` bytes (a 4096-byte header
followed by the payload rounded up to 4096, so every transfer is O_DIRECT-aligned by
construction), and the encoding, decoding and verification of slot headers and payload
checksums. It never decides which key lives in which slot (the index does) and never
submits I/O itself (the Ring does).

Header (little-endian, documented in docs/FORMAT.md):
    0   8s   magic b"KVSTSLOT"
    8   u16  format version (1)
    10  u16  key length (<= 128)
    12  u32  flags (0)
    16  u64  slot number
    24  u64  generation
    32  u64  payload length in bytes
    40  u64  payload checksum: xxh3_64 of the payload bytes
    48  128s key (zero padded)
    176 u32  header checksum: crc32 of bytes [0, 176)
    180..4095 zero
"""
import os
import struct
import sys
import zlib

import xxhash

from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from kvstore.includes.checksum cimport crc32, kvstore_xxh3_64
from kvstore.includes.format cimport KVS_ALIGN, KVS_HEADER_SIZE
from kvstore.errors import CorruptSlot, KVStoreError

if sys.byteorder != "little":  # the C codec below stores native integers
    raise ImportError("kvstore's slot format codec supports little-endian hosts only")

HEADER_SIZE = KVS_HEADER_SIZE   # the one definition: includes/format.pxd
ALIGN = KVS_ALIGN
MAGIC = b"KVSTSLOT"
FORMAT_VERSION = 1
MAX_KEY = 128
_HDR = struct.Struct("<8sHHIQQQQ128s")
_CRC = struct.Struct("<I")
HEADER_USED = _HDR.size + _CRC.size  # 180
assert _HDR.size == 176


def slot_size_for(payload_bytes: int) -> int:
    """Bytes one slot occupies: the 4096-byte header plus the payload rounded to 4096."""
    if payload_bytes <= 0:
        raise ValueError(f"payload size must be > 0, got {payload_bytes}")
    return HEADER_SIZE + (payload_bytes + ALIGN - 1) // ALIGN * ALIGN


def payload_checksum(data) -> int:
    """xxh3_64 of a payload (any buffer)."""
    return xxhash.xxh3_64_intdigest(data)


# --- the same format in C, for the I/O path (the ring calls these without the GIL) -----
# Field offsets of the header struct above ("<8sHHIQQQQ128s" + crc32).
cdef enum:
    _OFF_VERSION = 8
    _OFF_KEYLEN = 10
    _OFF_FLAGS = 12
    _OFF_SLOT = 16
    _OFF_GEN = 24
    _OFF_PLEN = 32
    _OFF_CSUM = 40
    _OFF_KEY = 48
    _OFF_CRC = 176

cdef const char *_MAGIC = b"KVSTSLOT"


cdef uint64_t payload_hash(const char *payload, size_t n) noexcept nogil:
    return kvstore_xxh3_64(payload, n)


cdef void stamp_header(char *hdr, const char *key, uint32_t key_len, uint64_t slot,
                       uint64_t generation, uint64_t payload_len, uint64_t checksum) noexcept nogil:
    """encode_header in C: the caller guarantees key_len <= 128 and 4096 bytes at hdr."""
    cdef uint16_t version = 1
    cdef uint16_t klen = <uint16_t>key_len
    cdef uint32_t crc
    memset(hdr, 0, KVS_HEADER_SIZE)
    memcpy(hdr, _MAGIC, 8)
    memcpy(hdr + _OFF_VERSION, &version, 2)
    memcpy(hdr + _OFF_KEYLEN, &klen, 2)
    memcpy(hdr + _OFF_SLOT, &slot, 8)
    memcpy(hdr + _OFF_GEN, &generation, 8)
    memcpy(hdr + _OFF_PLEN, &payload_len, 8)
    memcpy(hdr + _OFF_CSUM, &checksum, 8)
    memcpy(hdr + _OFF_KEY, key, key_len)
    crc = <uint32_t>crc32(0, <const unsigned char *>hdr, _OFF_CRC)
    memcpy(hdr + _OFF_CRC, &crc, 4)


cdef inline uint64_t _u64(const char *p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef int check_slot(const char *hdr, const char *payload, const char *key, uint32_t key_len,
                    uint64_t slot, uint64_t generation, uint64_t payload_len,
                    bint check_payload) noexcept nogil:
    """verify_slot in C, in the same order of checks; returns a SlotCheck code."""
    cdef uint16_t version, klen
    cdef uint32_t crc
    cdef int i
    if memcmp(hdr, _MAGIC, 8) != 0:
        for i in range(8):
            if hdr[i] != 0:
                return SLOT_BAD_MAGIC
        return SLOT_EMPTY
    memcpy(&crc, hdr + _OFF_CRC, 4)
    if crc != <uint32_t>crc32(0, <const unsigned char *>hdr, _OFF_CRC):
        return SLOT_HEADER_CRC
    memcpy(&version, hdr + _OFF_VERSION, 2)
    if version != 1:
        return SLOT_VERSION
    memcpy(&klen, hdr + _OFF_KEYLEN, 2)
    if klen > 128:
        return SLOT_KEY_LEN
    if klen != key_len or memcmp(hdr + _OFF_KEY, key, key_len) != 0:
        return SLOT_KEY
    if _u64(hdr + _OFF_SLOT) != slot:
        return SLOT_NUMBER
    if _u64(hdr + _OFF_GEN) != generation:
        return SLOT_GENERATION
    if _u64(hdr + _OFF_PLEN) != payload_len:
        return SLOT_PAYLOAD_LEN
    if check_payload and kvstore_xxh3_64(payload, payload_len) != _u64(hdr + _OFF_CSUM):
        return SLOT_PAYLOAD_CHECKSUM
    return SLOT_OK


def stamp_into(buf, bytes key, unsigned long long slot, unsigned long long generation,
               unsigned long long payload_len, payload):
    """Test/tool entry to the C encoder: header for `payload` into the first 4096 bytes of
    `buf` (must equal encode_header(..., payload_checksum(payload)))."""
    if len(key) > MAX_KEY:
        raise ValueError(f"key of {len(key)} bytes exceeds the {MAX_KEY}-byte header field")
    cdef unsigned char[::1] h = memoryview(buf).cast("B")
    cdef const unsigned char[::1] p = memoryview(payload).cast("B")
    if h.shape[0] < HEADER_SIZE or <unsigned long long>p.shape[0] < payload_len:
        raise ValueError("header buffer must hold 4096 bytes and payload payload_len bytes")
    stamp_header(<char *>&h[0], key, len(key), slot, generation, payload_len,
                 payload_hash(<const char *>&p[0], payload_len))


def check_code(header, payload, bytes key, unsigned long long slot, unsigned long long generation,
               unsigned long long payload_len, bint check_payload=True) -> int:
    """Test entry to the C checker: its SlotCheck code (0 = good) for these bytes."""
    cdef const unsigned char[::1] h = memoryview(header).cast("B")
    cdef const unsigned char[::1] p = memoryview(payload).cast("B")
    if h.shape[0] < HEADER_SIZE or (check_payload and <unsigned long long>p.shape[0] < payload_len):
        raise ValueError("header must be 4096 bytes and payload payload_len bytes")
    return check_slot(<const char *>&h[0], <const char *>&p[0], key, len(key), slot, generation,
                      payload_len, check_payload)


class SlotHeader:
    """A decoded slot header."""
    __slots__ = ("key", "slot", "generation", "payload_len", "payload_checksum", "flags")

    def __init__(self, key, slot, generation, payload_len, payload_checksum, flags=0):
        self.key = key
        self.slot = slot
        self.generation = generation
        self.payload_len = payload_len
        self.payload_checksum = payload_checksum
        self.flags = flags

    def __repr__(self):
        return (f"SlotHeader(key={self.key.hex()}, slot={self.slot}, generation={self.generation}, "
                f"payload_len={self.payload_len})")


def encode_header(buf, bytes key, unsigned long long slot, unsigned long long generation,
                  unsigned long long payload_len, unsigned long long checksum):
    """Write a header into the first 4096 bytes of the writable buffer `buf`."""
    if len(key) > MAX_KEY:
        raise ValueError(f"key of {len(key)} bytes exceeds the {MAX_KEY}-byte header field")
    mv = memoryview(buf).cast("B")
    if mv.nbytes < HEADER_SIZE:
        raise ValueError("header buffer must hold 4096 bytes")
    body = _HDR.pack(MAGIC, FORMAT_VERSION, len(key), 0, slot, generation, payload_len,
                     checksum, key)
    mv[:_HDR.size] = body
    mv[_HDR.size:HEADER_USED] = _CRC.pack(zlib.crc32(body))
    mv[HEADER_USED:HEADER_SIZE] = bytes(HEADER_SIZE - HEADER_USED)


def decode_header(buf, slot=None):
    """Parse and check a header (magic, version, lengths, header checksum).

    Raises CorruptSlot with the reason; never returns a header that failed a check.
    """
    mv = memoryview(buf).cast("B")
    if mv.nbytes < HEADER_USED:
        raise CorruptSlot(f"slot {slot}: header truncated ({mv.nbytes} bytes)", slot=slot)
    body = bytes(mv[:_HDR.size])
    magic, version, key_len, flags, hslot, gen, plen, csum, key = _HDR.unpack(body)
    if magic != MAGIC:
        if magic == bytes(8):
            raise CorruptSlot(f"slot {slot}: empty (never written)", slot=slot)
        raise CorruptSlot(f"slot {slot}: bad magic {magic!r}", slot=slot)
    (crc,) = _CRC.unpack(bytes(mv[_HDR.size:HEADER_USED]))
    if crc != zlib.crc32(body):
        raise CorruptSlot(f"slot {slot}: header checksum mismatch", slot=slot)
    if version != FORMAT_VERSION:
        raise CorruptSlot(f"slot {slot}: unsupported slot format version {version}", slot=slot)
    if key_len > MAX_KEY:
        raise CorruptSlot(f"slot {slot}: key length {key_len} > {MAX_KEY}", slot=slot)
    return SlotHeader(bytes(key[:key_len]), hslot, gen, plen, csum, flags)


def verify_slot(buf, bytes key, unsigned long long slot, unsigned long long generation,
                unsigned long long payload_len, bint check_payload=True):
    """Check a slot image (header + payload) read for `key`; raise CorruptSlot if wrong."""
    mv = memoryview(buf).cast("B")
    if check_payload and HEADER_SIZE + payload_len > <unsigned long long>mv.nbytes:
        raise CorruptSlot(f"slot {slot}: image shorter than its payload", key=key, slot=slot)
    return verify_parts(mv[:HEADER_SIZE], mv[HEADER_SIZE:HEADER_SIZE + payload_len] if check_payload
                        else None, key, slot, generation, payload_len, check_payload)


def verify_parts(header, payload, bytes key, unsigned long long slot, unsigned long long generation,
                 unsigned long long payload_len, bint check_payload=True):
    """verify_slot for a header and a payload held apart (reads into caller memory)."""
    try:
        h = decode_header(header, slot)
    except CorruptSlot as exc:
        exc.key = key
        raise
    if h.key != key:
        raise CorruptSlot(f"slot {slot}: holds key {h.key.hex()[:16]}.., expected {key.hex()[:16]}..",
                          key=key, slot=slot)
    if h.slot != slot:
        raise CorruptSlot(f"slot {slot}: header says slot {h.slot}", key=key, slot=slot)
    if h.generation != generation:
        raise CorruptSlot(f"slot {slot}: generation {h.generation}, expected {generation} "
                          "(stale or torn write)", key=key, slot=slot)
    if h.payload_len != payload_len:
        raise CorruptSlot(f"slot {slot}: payload length {h.payload_len}, expected {payload_len}",
                          key=key, slot=slot)
    if check_payload:
        pv = memoryview(payload).cast("B")
        if <unsigned long long>pv.nbytes < payload_len:
            raise CorruptSlot(f"slot {slot}: image shorter than its payload", key=key, slot=slot)
        if xxhash.xxh3_64_intdigest(pv[:payload_len]) != h.payload_checksum:
            raise CorruptSlot(f"slot {slot}: payload checksum mismatch", key=key, slot=slot)
    return h


def _direct_refused_message(path):
    return (f"the filesystem holding {os.path.dirname(path) or '.'} refuses O_DIRECT "
            "(open returned EINVAL); put the store on a filesystem that supports it "
            "(ext4, xfs, btrfs, tmpfs) or use page-cache mode: io_mode='page_cache' "
            "(CLI: --page-cache)")


cdef class SlotFile:
    """One preallocated file of fixed-size slots; slot i lives at offset i * slot_size.

    Opened with O_NOFOLLOW (a symlink is refused) and O_DIRECT unless direct=False.
    `create=True` makes a new 0600 file and preallocates it with fallocate, so running out
    of space shows up at creation, not as a late ENOSPC while serving. `close()` is
    idempotent; using a closed SlotFile raises.
    """

    def __cinit__(self, str path, unsigned long long slot_size, unsigned long long num_slots,
                  *, bint direct=True, bint create=False, bint readonly=False):
        self.fd_ = -1
        self.path = path
        if slot_size == 0 or slot_size % ALIGN:
            raise ValueError(f"slot_size {slot_size} must be a positive multiple of {ALIGN}")
        if num_slots == 0:
            raise ValueError("num_slots must be > 0")
        self.slot_size = slot_size
        self.num_slots = num_slots
        self.direct = direct
        self.readonly = readonly and not create
        flags = os.O_CLOEXEC | os.O_NOFOLLOW
        flags |= os.O_RDONLY if self.readonly else os.O_RDWR
        if direct:
            flags |= os.O_DIRECT
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        size = slot_size * num_slots
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno == 22 and direct:
                if create:
                    # Some filesystems (ramfs) create the inode before refusing O_DIRECT;
                    # O_EXCL guarantees it is ours, so leave nothing behind.
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                raise KVStoreError(_direct_refused_message(path)) from exc
            if exc.errno == 40:  # ELOOP: O_NOFOLLOW met a symlink
                raise KVStoreError(f"refusing to open slot file {path}: it is a symlink") from exc
            if exc.errno == 2 and not create:
                raise KVStoreError(f"slot file {path} is missing; run `kvstore fsck --repair` "
                                   "to drop the entries that lived in it") from exc
            raise
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno == 28:
                        raise OSError(28, f"no space to preallocate {size} bytes for slot file "
                                      f"{path}; lower the store capacity", path) from exc
                    raise
            else:
                actual = os.fstat(fd).st_size
                if actual != size:
                    raise KVStoreError(
                        f"slot file {path} is {actual} bytes, expected {size} "
                        f"({num_slots} slots of {slot_size}); it was truncated or belongs to "
                        "another layout: run `kvstore fsck` on the store")
        except BaseException:
            os.close(fd)
            if create:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise
        self.fd_ = fd

    def __dealloc__(self):
        if self.fd_ >= 0:
            os.close(self.fd_)
            self.fd_ = -1

    def close(self):
        """Close the file (idempotent)."""
        if self.fd_ >= 0:
            fd = self.fd_
            self.fd_ = -1
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self) -> bool:
        return self.fd_ < 0

    @property
    def fd(self) -> int:
        if self.fd_ < 0:
            raise KVStoreError(f"slot file {self.path} is closed")
        return self.fd_

    @property
    def size(self) -> int:
        return self.slot_size * self.num_slots

    def offset(self, unsigned long long index):
        """File offset of slot `index` of this file."""
        if index >= self.num_slots:
            raise IndexError(f"slot {index} out of range for {self.path} ({self.num_slots} slots)")
        return index * self.slot_size

    def __repr__(self):
        return (f"SlotFile({self.path!r}, slots={self.num_slots}, slot_size={self.slot_size}, "
                f"{'direct' if self.direct else 'page_cache'}{', closed' if self.fd_ < 0 else ''})")
