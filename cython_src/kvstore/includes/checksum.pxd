# The two checksums of the slot format, as C: xxHash's XXH3-64 (payload) and zlib's CRC-32
# (header). xxhash.h is used header-only (XXH_INLINE_ALL, set by setup.py), so nothing of
# xxHash is linked; CRC-32 is zlib's, the same function Python's zlib.crc32 calls.
cdef extern from "<xxhash.h>" nogil:
    unsigned long long XXH3_64bits(const void *data, size_t length)

cdef extern from "<zlib.h>" nogil:
    unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int length)
