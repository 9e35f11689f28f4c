/* Comma scanner for heartbeat payloads: a 64-bit mask of the commas in 64
   bytes, consumed bit by bit, so finding the next comma is a count of
   trailing zeros rather than a memchr call per id.  The end of the span
   counts as one more comma. */
#ifndef VNL_COMMA_SCAN_H
#define VNL_COMMA_SCAN_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define VNL_SSE2 1
#endif

typedef struct {
    const unsigned char* p;
    Py_ssize_t n;
    Py_ssize_t base;
    uint64_t bits;
} vnl_scan;

static inline uint64_t vnl_comma_bits(const unsigned char* q) {
#ifdef VNL_SSE2
    const __m128i c = _mm_set1_epi8(',');
    uint64_t m0 = (uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i*)q), c));
    uint64_t m1 = (uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i*)(q + 16)), c));
    uint64_t m2 = (uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i*)(q + 32)), c));
    uint64_t m3 = (uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128((const __m128i*)(q + 48)), c));
    return m0 | (m1 << 16) | (m2 << 32) | (m3 << 48);
#else
    uint64_t bits = 0;
    int i;
    for (i = 0; i < 64; i++)
        bits |= (uint64_t)(q[i] == ',') << i;
    return bits;
#endif
}

static inline void vnl_scan_init(vnl_scan* s, const char* p, Py_ssize_t n) {
    s->p = (const unsigned char*)p;
    s->n = n;
    s->base = -64;
    s->bits = 0;
}

/* Position of the next comma, or n for the end of the span; call it again
   only while it returned < n. */
static inline Py_ssize_t vnl_scan_next(vnl_scan* s) {
    Py_ssize_t at;
    while (s->bits == 0) {
        Py_ssize_t left;
        s->base += 64;
        left = s->n - s->base;
        if (left >= 64) {
            s->bits = vnl_comma_bits(s->p + s->base);
        } else {
            unsigned char buf[64];
            memset(buf, 0, sizeof buf);
            memcpy(buf, s->p + s->base, (size_t)left);
            s->bits = vnl_comma_bits(buf) | (1ULL << left);
        }
    }
#if defined(__GNUC__) || defined(__clang__)
    at = s->base + __builtin_ctzll(s->bits);
#else
    { uint64_t b = s->bits; at = s->base; while (!(b & 1)) { b >>= 1; at++; } }
#endif
    s->bits &= s->bits - 1;
    return at;
}

#endif /* VNL_COMMA_SCAN_H */
