# Sequentially consistent atomics on words that several threads or processes share (a
# KeyTable's pins and slot generations, the MAP_SHARED files of `_sharedmap`).
from libc.stdint cimport uint32_t, uint64_t

cdef extern from *:
    """
    #define KT_LOAD64(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
    #define KT_STORE64(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
    #define KT_ADD64(p, v) __atomic_add_fetch((p), (v), __ATOMIC_SEQ_CST)
    #define KT_LOAD32(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
    #define KT_ADD32(p, v) __atomic_add_fetch((p), (v), __ATOMIC_SEQ_CST)
    #define KT_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
    """
    uint64_t KT_LOAD64(uint64_t *p) nogil
    void KT_STORE64(uint64_t *p, uint64_t v) nogil
    uint64_t KT_ADD64(uint64_t *p, uint64_t v) nogil
    uint32_t KT_LOAD32(uint32_t *p) nogil
    uint32_t KT_ADD32(uint32_t *p, uint32_t v) nogil
    void KT_FENCE() nogil
