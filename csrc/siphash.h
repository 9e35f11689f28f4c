/* SipHash-1-3 (Aumasson & Bernstein, "SipHash: a fast short-input PRF"):
   one compression round per 8-byte word, three finalization rounds, the
   variant CPython uses for str and bytes.  Words are read little-endian.

   The lease table keys it with 16 random bytes of its own, so that request
   ids cannot be crafted to collide in its index. */
#ifndef VNL_SIPHASH_H
#define VNL_SIPHASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t vnl_le64(const unsigned char* q) {
    uint64_t w;
    memcpy(&w, q, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

#define VNL_ROTL(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define VNL_SIPROUND(v0, v1, v2, v3) do { v0 += v1; v1 = VNL_ROTL(v1, 13); v1 ^= v0; v0 = VNL_ROTL(v0, 32); v2 += v3; v3 = VNL_ROTL(v3, 16); v3 ^= v2; v0 += v3; v3 = VNL_ROTL(v3, 21); v3 ^= v0; v2 += v1; v1 = VNL_ROTL(v1, 17); v1 ^= v2; v2 = VNL_ROTL(v2, 32); } while (0)
#define VNL_SIPINIT(v0, v1, v2, v3, k0, k1) do { v0 = (k0) ^ 0x736f6d6570736575ULL; v1 = (k1) ^ 0x646f72616e646f6dULL; v2 = (k0) ^ 0x6c7967656e657261ULL; v3 = (k1) ^ 0x7465646279746573ULL; } while (0)
#define VNL_SIPWORD(v0, v1, v2, v3, w) do { v3 ^= (w); VNL_SIPROUND(v0, v1, v2, v3); v0 ^= (w); } while (0)

/* The last block: the r < 8 trailing bytes at q with the length in the top
   byte.  When 8 bytes from q are readable (before lim) they are read as one
   word and masked; otherwise byte by byte. */
static inline uint64_t vnl_last(const unsigned char* q, size_t r, size_t len,
                                const unsigned char* lim) {
    uint64_t t = 0;
    if (r) {
        if (lim - q >= 8) {
            t = vnl_le64(q) & (~0ULL >> (64 - 8 * r));
        } else {
            switch (r) {
            case 7: t |= (uint64_t)q[6] << 48; /* fall through */
            case 6: t |= (uint64_t)q[5] << 40; /* fall through */
            case 5: t |= (uint64_t)q[4] << 32; /* fall through */
            case 4: t |= (uint64_t)q[3] << 24; /* fall through */
            case 3: t |= (uint64_t)q[2] << 16; /* fall through */
            case 2: t |= (uint64_t)q[1] << 8;  /* fall through */
            default: t |= (uint64_t)q[0];
            }
        }
    }
    return t | ((uint64_t)len << 56);
}

/* The hash of p[:len]; bytes up to lim (>= p + len) may be read and ignored. */
static inline uint64_t vnl_sip13_in(const char* p, size_t len, const unsigned char* lim,
                                    uint64_t k0, uint64_t k1) {
    const unsigned char* q = (const unsigned char*)p;
    uint64_t v0, v1, v2, v3, b;
    size_t i;
    VNL_SIPINIT(v0, v1, v2, v3, k0, k1);
    for (i = len >> 3; i; i--, q += 8)
        VNL_SIPWORD(v0, v1, v2, v3, vnl_le64(q));
    b = vnl_last(q, len & 7, len, lim);
    VNL_SIPWORD(v0, v1, v2, v3, b);
    v2 ^= 0xff;
    VNL_SIPROUND(v0, v1, v2, v3);
    VNL_SIPROUND(v0, v1, v2, v3);
    VNL_SIPROUND(v0, v1, v2, v3);
    return v0 ^ v1 ^ v2 ^ v3;
}

static inline uint64_t vnl_sip13(const char* p, size_t len, uint64_t k0, uint64_t k1) {
    return vnl_sip13_in(p, len, (const unsigned char*)p + len, k0, k1);
}

#endif /* VNL_SIPHASH_H */
