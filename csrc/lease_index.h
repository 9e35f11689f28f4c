/* The lease table's C-level pieces: cell markers of its open-addressing
   tables, the bits of a slot's grant seq, and id equality. */
#ifndef VNL_LEASE_INDEX_H
#define VNL_LEASE_INDEX_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* An index or tag-table cell holds slot + 1, or one of these. */
#define VNL_EMPTY 0u
#define VNL_DELETED 0xFFFFFFFFu

/* Slot.seq: the grant seq in the low 31 bits; the top bit marks a lease whose
   request is also in a batch (the router's in_batch), so that a sweep or a
   completion need not look the id up in a Python set. */
#define VNL_IN_BATCH 0x80000000u
#define VNL_SEQ_BITS 0x7FFFFFFFu

/* Slot.flags: indexed under its tag; ambiguous (docs/PROTOCOL.md P3: an
   answer never calls its keys held). */
#define VNL_TAGGED 1u
#define VNL_AMBIGUOUS 2u

/* Equality of two n-byte strings without a call: 8-byte words, the last
   one overlapping (ids are short; memcmp's call cost more than the work). */
static inline int vnl_eq(const char* a, const char* b, size_t n) {
    uint64_t x, y;
    uint32_t u, w;
    size_t i;
    if (n >= 8) {
        for (i = 0; i + 8 < n; i += 8) {
            memcpy(&x, a + i, 8); memcpy(&y, b + i, 8);
            if (x != y) return 0;
        }
        memcpy(&x, a + n - 8, 8); memcpy(&y, b + n - 8, 8);
        return x == y;
    }
    if (n >= 4) {
        memcpy(&u, a, 4); memcpy(&w, b, 4);
        if (u != w) return 0;
        memcpy(&u, a + n - 4, 4); memcpy(&w, b + n - 4, 4);
        return u == w;
    }
    for (i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

#endif /* VNL_LEASE_INDEX_H */
