/* XXH3-64 for the slot codec: xxHash (Debian libxxhash-dev) compiled in header-only, with
 * a run-time pick of its AVX2 build where the CPU has AVX2. The portable build runs SSE2
 * on x86-64, about 21 GB/s on our VMs; the AVX2 one 25-33 GB/s (docs/ARCHITECTURE.md, "Why
 * these libraries"). The system libxxhash's own dispatcher measured at SSE2 speed here,
 * hence this instead of linking it. */
#ifndef KVSTORE_XXH3_H
#define KVSTORE_XXH3_H
#include <stddef.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#if (defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)))
#define KVSTORE_XXH3_AVX2 1
unsigned long long kvstore_xxh3_64_avx2(const void *data, size_t length);
static int kvstore_has_avx2 = -1;
static inline unsigned long long kvstore_xxh3_64(const void *data, size_t length) {
    if (kvstore_has_avx2 < 0) {
        __builtin_cpu_init();
        kvstore_has_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return kvstore_has_avx2 ? kvstore_xxh3_64_avx2(data, length) : XXH3_64bits(data, length);
}
#else
static inline unsigned long long kvstore_xxh3_64(const void *data, size_t length) {
    return XXH3_64bits(data, length);
}
#endif
#endif
