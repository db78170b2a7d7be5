from libc.stdint cimport uint32_t, uint64_t

# What check_slot found; 0 is a good slot. Python turns a non-zero code into CorruptSlot
# with the full message by decoding the same bytes again (verify_parts).
cdef enum SlotCheck:
    SLOT_OK = 0
    SLOT_EMPTY = 1
    SLOT_BAD_MAGIC = 2
    SLOT_HEADER_CRC = 3
    SLOT_VERSION = 4
    SLOT_KEY_LEN = 5
    SLOT_KEY = 6
    SLOT_NUMBER = 7
    SLOT_GENERATION = 8
    SLOT_PAYLOAD_LEN = 9
    SLOT_PAYLOAD_CHECKSUM = 10

cdef uint64_t payload_hash(const char *payload, size_t n) noexcept nogil
cdef void stamp_header(char *hdr, const char *key, uint32_t key_len, uint64_t slot,
                       uint64_t generation, uint64_t payload_len, uint64_t checksum) noexcept nogil
cdef int check_slot(const char *hdr, const char *payload, const char *key, uint32_t key_len,
                    uint64_t slot, uint64_t generation, uint64_t payload_len,
                    bint check_payload) noexcept nogil

cdef class SlotFile:
    cdef:
        public str path
        int fd_
        readonly unsigned long long slot_size
        readonly unsigned long long num_slots
        readonly bint direct
        readonly bint readonly
