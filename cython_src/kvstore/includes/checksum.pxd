# The two checksums of the slot format, as C: xxHash's XXH3-64 (payload; header-only, with
# an AVX2 build picked at run time: csrc/kvstore_xxh3.h at the repository root) and zlib's CRC-32 (header), the
# same functions Python's xxhash.xxh3_64 and zlib.crc32 compute.
cdef extern from "kvstore_xxh3.h" nogil:
    unsigned long long kvstore_xxh3_64(const void *data, size_t length)

cdef extern from "<zlib.h>" nogil:
    unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int length)
