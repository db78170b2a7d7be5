/* The AVX2 build of XXH3-64 (see kvstore_xxh3.h): this file alone is compiled for AVX2,
 * and is only called after the CPU said it has it. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC target("avx2")
#endif
#include <stddef.h>
#include <immintrin.h> /* clang's attribute pragma does not define __AVX2__ for xxhash.h */
#define XXH_INLINE_ALL
#define XXH_VECTOR 2 /* XXH_AVX2 */
#include <xxhash.h>
unsigned long long kvstore_xxh3_64_avx2(const void *data, size_t length) {
    return XXH3_64bits(data, length);
}
#ifdef __clang__
#pragma clang attribute pop
#endif
#endif
