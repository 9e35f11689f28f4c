/* The lease table's tombstones: a multiset of (kind, 64-bit key), where kind
   says whether the key is an id's fingerprint or a tag digest, counting the
   free events of each key not yet aged out (the events themselves wait in
   the table's FIFO).  Open addressing with linear probing and backward-shift
   deletion (no deleted markers), load <= 1/2, halved when under an eighth
   full, so memory follows the live count.  Cells are placed by the key mixed
   with a per-table seed: tag digests cut to a few bits (a test knob) and ids
   that share low bits do not share a probe run. */
#ifndef VNL_TOMBSTONES_H
#define VNL_TOMBSTONES_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define VNL_TOMB_ID 1u
#define VNL_TOMB_TAG 2u
#define VNL_TOMB_MIN 16

typedef struct {
    uint64_t key;
    uint32_t count;  /* free events of this key in the FIFO */
    uint32_t kind;   /* 0: empty cell */
} vnl_tomb_cell;

typedef struct {
    vnl_tomb_cell* cells;
    size_t size;     /* a power of two, or 0 before the first insert */
    size_t live;
    uint64_t seed;
} vnl_tombs;

static inline size_t vnl_tomb_home(const vnl_tombs* t, uint64_t key, uint32_t kind) {
    uint64_t z = key ^ t->seed ^ ((uint64_t)kind << 61);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (size_t)(z ^ (z >> 31)) & (t->size - 1);
}

/* Cell of (key, kind), or -1. */
static inline long vnl_tomb_find(const vnl_tombs* t, uint64_t key, uint32_t kind) {
    size_t i, mask;
    if (t->live == 0) return -1;
    mask = t->size - 1;
    for (i = vnl_tomb_home(t, key, kind); t->cells[i].kind; i = (i + 1) & mask)
        if (t->cells[i].key == key && t->cells[i].kind == kind) return (long)i;
    return -1;
}

/* Rebuild at `size` cells (a power of two >= 2 * live); -1: out of memory
   (the map is left as it was). */
static int vnl_tomb_resize(vnl_tombs* t, size_t size) {
    vnl_tomb_cell* cells = (vnl_tomb_cell*)calloc(size, sizeof(vnl_tomb_cell));
    vnl_tomb_cell* old = t->cells;
    size_t old_size = t->size, i, j;
    if (cells == NULL) return -1;
    t->cells = cells;
    t->size = size;
    for (i = 0; i < old_size; i++) {
        if (!old[i].kind) continue;
        for (j = vnl_tomb_home(t, old[i].key, old[i].kind); cells[j].kind; j = (j + 1) & (size - 1)) {}
        cells[j] = old[i];
    }
    free(old);
    return 0;
}

/* One more free event of (key, kind); -1: out of memory (nothing changed). */
static inline int vnl_tomb_add(vnl_tombs* t, uint64_t key, uint32_t kind) {
    size_t i, mask;
    long at = vnl_tomb_find(t, key, kind);
    if (at >= 0) {
        t->cells[at].count++;
        return 0;
    }
    if (2 * (t->live + 1) > t->size
            && vnl_tomb_resize(t, t->size ? 2 * t->size : VNL_TOMB_MIN) < 0)
        return -1;
    mask = t->size - 1;
    for (i = vnl_tomb_home(t, key, kind); t->cells[i].kind; i = (i + 1) & mask) {}
    t->cells[i].key = key;
    t->cells[i].kind = kind;
    t->cells[i].count = 1;
    t->live++;
    return 0;
}

/* One free event of (key, kind) left the FIFO; returns 1 if it was the key's
   last (the key is no longer a tombstone).  The key must be present. */
static inline int vnl_tomb_forget(vnl_tombs* t, uint64_t key, uint32_t kind) {
    size_t i, j, home, mask = t->size - 1;
    long at = vnl_tomb_find(t, key, kind);
    if (at < 0) return 0;  /* cannot happen: every FIFO event was counted */
    if (--t->cells[at].count) return 0;
    /* backward-shift deletion: pull later cells of the run into the hole */
    i = (size_t)at;
    j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->cells[j].kind) break;
        home = vnl_tomb_home(t, t->cells[j].key, t->cells[j].kind);
        /* cell j may move to i if its home is not cyclically in (i, j] */
        if ((i <= j) ? (home <= i || home > j) : (home <= i && home > j)) {
            t->cells[i] = t->cells[j];
            i = j;
        }
    }
    t->cells[i].kind = 0;
    t->cells[i].count = 0;
    t->live--;
    if (t->size > VNL_TOMB_MIN && 8 * t->live < t->size)
        vnl_tomb_resize(t, t->size / 2);  /* out of memory: stay larger, still correct */
    return 1;
}

static inline void vnl_tomb_clear(vnl_tombs* t) {
    free(t->cells);
    t->cells = NULL;
    t->size = 0;
    t->live = 0;
}

#endif /* VNL_TOMBSTONES_H */
