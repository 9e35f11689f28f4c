/* SipHash-1-3 of many ids of one buffer, four at a time in AVX2 lanes where
   the CPU has them (see siphash.h for the hash itself). */
#ifndef VNL_SIPHASH_X4_H
#define VNL_SIPHASH_X4_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "siphash.h"

/* One SipHash round already keeps the scalar integer units busy, so
   interleaving several ids' scalar rounds gains nothing.  On x86-64 with AVX2
   (checked at run time: the module is built for plain x86-64) four ids share
   one 256-bit register per state word, so a round of four ids takes a few
   vector instructions per step instead of four scalar ones.  Used when the
   four ids have the same number of whole 8-byte words (ids of one shape, the
   usual case); each lane's last word is built as in vnl_last. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <immintrin.h>
#define VNL_AVX2_DISPATCH 1
#define VNL_VROTL(x, b) _mm256_or_si256(_mm256_slli_epi64((x), (b)), _mm256_srli_epi64((x), 64 - (b)))
#define VNL_VROT32(x) _mm256_shuffle_epi32((x), _MM_SHUFFLE(2, 3, 0, 1))
#define VNL_VROUND(v0, v1, v2, v3, r16) do { v0 = _mm256_add_epi64(v0, v1); v1 = VNL_VROTL(v1, 13); v1 = _mm256_xor_si256(v1, v0); v0 = VNL_VROT32(v0); v2 = _mm256_add_epi64(v2, v3); v3 = _mm256_shuffle_epi8(v3, r16); v3 = _mm256_xor_si256(v3, v2); v0 = _mm256_add_epi64(v0, v3); v3 = VNL_VROTL(v3, 21); v3 = _mm256_xor_si256(v3, v0); v2 = _mm256_add_epi64(v2, v1); v1 = VNL_VROTL(v1, 17); v1 = _mm256_xor_si256(v1, v2); v2 = VNL_VROT32(v2); } while (0)
__attribute__((target("avx2")))
static void vnl_sip13_x4_avx2(const unsigned char* const* q, const Py_ssize_t* ls, size_t words,
                              const unsigned char* lim, uint64_t k0, uint64_t k1, uint64_t* out) {
    const __m256i r16 = _mm256_setr_epi8(6, 7, 0, 1, 2, 3, 4, 5, 14, 15, 8, 9, 10, 11, 12, 13,
                                         6, 7, 0, 1, 2, 3, 4, 5, 14, 15, 8, 9, 10, 11, 12, 13);
    __m256i v0 = _mm256_set1_epi64x((long long)(k0 ^ 0x736f6d6570736575ULL));
    __m256i v1 = _mm256_set1_epi64x((long long)(k1 ^ 0x646f72616e646f6dULL));
    __m256i v2 = _mm256_set1_epi64x((long long)(k0 ^ 0x6c7967656e657261ULL));
    __m256i v3 = _mm256_set1_epi64x((long long)(k1 ^ 0x7465646279746573ULL));
    __m256i m;
    size_t i, o;
    for (i = 0, o = 0; i < words; i++, o += 8) {
        m = _mm256_setr_epi64x((long long)vnl_le64(q[0] + o), (long long)vnl_le64(q[1] + o),
                               (long long)vnl_le64(q[2] + o), (long long)vnl_le64(q[3] + o));
        v3 = _mm256_xor_si256(v3, m);
        VNL_VROUND(v0, v1, v2, v3, r16);
        v0 = _mm256_xor_si256(v0, m);
    }
    m = _mm256_setr_epi64x((long long)vnl_last(q[0] + o, ls[0] & 7, ls[0], lim),
                           (long long)vnl_last(q[1] + o, ls[1] & 7, ls[1], lim),
                           (long long)vnl_last(q[2] + o, ls[2] & 7, ls[2], lim),
                           (long long)vnl_last(q[3] + o, ls[3] & 7, ls[3], lim));
    v3 = _mm256_xor_si256(v3, m);
    VNL_VROUND(v0, v1, v2, v3, r16);
    v0 = _mm256_xor_si256(v0, m);
    v2 = _mm256_xor_si256(v2, _mm256_set1_epi64x(0xff));
    VNL_VROUND(v0, v1, v2, v3, r16);
    VNL_VROUND(v0, v1, v2, v3, r16);
    VNL_VROUND(v0, v1, v2, v3, r16);
    _mm256_storeu_si256((__m256i*)out, _mm256_xor_si256(_mm256_xor_si256(v0, v1), _mm256_xor_si256(v2, v3)));
}
/* -1: not checked yet; 0/1: whether the AVX2 lanes are used (tests turn them off). */
static int vnl_avx2 = -1;
static inline int vnl_avx2_on(void) {
    if (vnl_avx2 < 0) {
        __builtin_cpu_init();
        vnl_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return vnl_avx2;
}
#else
static int vnl_avx2 = 0;
static inline int vnl_avx2_on(void) { return 0; }
#endif

/* Test hook: use the AVX2 lanes (when the CPU has them) or not; returns whether they are used. */
static inline int vnl_set_simd(int on) {
    vnl_avx2 = -1;
    if (!on || !vnl_avx2_on()) vnl_avx2 = 0;
    return vnl_avx2;
}

/* Hashes of m ids of one buffer (readable up to base + n): four at a time
   in AVX2 lanes where they have equal word counts, else one by one. */
static inline void vnl_sip13_many(const char* base, Py_ssize_t n, const Py_ssize_t* starts,
                                  const Py_ssize_t* ls, int m, uint64_t k0, uint64_t k1,
                                  uint64_t* out) {
    const unsigned char* lim = (const unsigned char*)base + n;
    int k = 0, j;
#ifdef VNL_AVX2_DISPATCH
    if (vnl_avx2_on()) {
        for (; k + 4 <= m; k += 4) {
            size_t w = (size_t)ls[k] >> 3;
            if (w == ((size_t)ls[k + 1] >> 3) && w == ((size_t)ls[k + 2] >> 3)
                    && w == ((size_t)ls[k + 3] >> 3)) {
                const unsigned char* q[4];
                for (j = 0; j < 4; j++) q[j] = (const unsigned char*)base + starts[k + j];
                vnl_sip13_x4_avx2(q, ls + k, w, lim, k0, k1, out + k);
            } else {
                for (j = k; j < k + 4; j++)
                    out[j] = vnl_sip13_in(base + starts[j], (size_t)ls[j], lim, k0, k1);
            }
        }
    }
#endif
    for (; k < m; k++)
        out[k] = vnl_sip13_in(base + starts[k], (size_t)ls[k], lim, k0, k1);
    (void)j;
}

#endif /* VNL_SIPHASH_X4_H */
