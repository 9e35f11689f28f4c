/* Keyed BLAKE2b with an 8-byte digest (RFC 7693), for lease tags: the same
   value as Python's hashlib.blake2b(data, key=key, digest_size=8), computed
   without a Python call at every grant.  The key fills the first block, so
   the state after it is computed once per key (vnl_b2_init) and each digest
   of a non-empty message starts from a copy of it. */
#ifndef VNL_BLAKE2B_H
#define VNL_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define VNL_B2_BLOCK 128
#define VNL_B2_OUT 8

typedef struct {
    uint64_t h[8];              /* state after the key block (not final) */
    unsigned char key[64];
    size_t keylen;
} vnl_b2_key;

static const uint64_t VNL_B2_IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

static const unsigned char VNL_B2_SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t vnl_b2_rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t vnl_b2_le64(const unsigned char* p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24)
        | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

#define VNL_B2_G(a, b, c, d, x, y) do { \
    v[a] = v[a] + v[b] + (x); v[d] = vnl_b2_rotr(v[d] ^ v[a], 32); \
    v[c] = v[c] + v[d];       v[b] = vnl_b2_rotr(v[b] ^ v[c], 24); \
    v[a] = v[a] + v[b] + (y); v[d] = vnl_b2_rotr(v[d] ^ v[a], 16); \
    v[c] = v[c] + v[d];       v[b] = vnl_b2_rotr(v[b] ^ v[c], 63); } while (0)

/* One compression of a 128-byte block; t: bytes hashed so far, this block
   included (ids are far below 2**64 bytes, so the counter's high word is 0). */
static void vnl_b2_compress(uint64_t h[8], const unsigned char* block, uint64_t t, int last) {
    uint64_t v[16], m[16];
    int i;
    const unsigned char* s;
    for (i = 0; i < 16; i++) m[i] = vnl_b2_le64(block + 8 * i);
    for (i = 0; i < 8; i++) { v[i] = h[i]; v[i + 8] = VNL_B2_IV[i]; }
    v[12] ^= t;
    if (last) v[14] = ~v[14];
    for (i = 0; i < 12; i++) {
        s = VNL_B2_SIGMA[i % 10];
        VNL_B2_G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        VNL_B2_G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        VNL_B2_G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        VNL_B2_G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        VNL_B2_G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        VNL_B2_G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        VNL_B2_G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        VNL_B2_G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* Parameter block word 0: digest length, key length, fanout 1, depth 1. */
static inline void vnl_b2_start(uint64_t h[8], size_t keylen) {
    int i;
    for (i = 0; i < 8; i++) h[i] = VNL_B2_IV[i];
    h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ VNL_B2_OUT;
}

/* keylen: 1..64 (the caller checks). */
static inline void vnl_b2_init(vnl_b2_key* k, const unsigned char* key, size_t keylen) {
    unsigned char block[VNL_B2_BLOCK];
    memset(block, 0, sizeof block);
    memcpy(block, key, keylen);
    memset(k->key, 0, sizeof k->key);
    memcpy(k->key, key, keylen);
    k->keylen = keylen;
    vnl_b2_start(k->h, keylen);
    vnl_b2_compress(k->h, block, VNL_B2_BLOCK, 0);
}

/* The digest's 8 bytes read little endian, as int.from_bytes(digest, "little"). */
static inline uint64_t vnl_b2_digest(const vnl_b2_key* k, const char* data, size_t n) {
    uint64_t h[8];
    unsigned char block[VNL_B2_BLOCK];
    const unsigned char* p = (const unsigned char*)data;
    uint64_t t = VNL_B2_BLOCK;
    if (n == 0) {
        /* the key block is the last one */
        memset(block, 0, sizeof block);
        memcpy(block, k->key, k->keylen);
        vnl_b2_start(h, k->keylen);
        vnl_b2_compress(h, block, VNL_B2_BLOCK, 1);
        return h[0];
    }
    memcpy(h, k->h, sizeof h);
    while (n > VNL_B2_BLOCK) {
        t += VNL_B2_BLOCK;
        vnl_b2_compress(h, p, t, 0);
        p += VNL_B2_BLOCK;
        n -= VNL_B2_BLOCK;
    }
    memset(block, 0, sizeof block);
    memcpy(block, p, n);
    vnl_b2_compress(h, block, t + n, 1);
    return h[0];
}

#endif /* VNL_BLAKE2B_H */
