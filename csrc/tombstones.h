/* The lease table's tombstones: a multiset of (kind, 64-bit key), where kind
   says whether the key is an id's fingerprint or a tag digest, counting the
   free events of each key not yet aged out (the events themselves wait in
   the table's FIFO).  Open addressing with linear probing and backward-shift
   deletion, load <= 1/2, halved when under an eighth full, so memory follows
   the live count.  Cells are placed by the key mixed with a per-table seed:
   tag digests cut to a few bits (a test knob) and ids that share low bits do
   not share a probe run.

   Resizing is incremental: a dead decode instance's leases expire in
   bursts of thousands, each freeing two keys, and rebuilding a table of a
   hundred thousand keys in one call stalled the step that crossed the
   threshold (milliseconds of cache misses and page faults).  A resize
   allocates the new table and keeps the old one; each later add or forget
   first moves VNL_TOMB_STEP cells of the old table, in index order, into the
   new one.  While both exist the new table is searched first, then the old
   one, where a cell below the cursor has already moved (and its copy there
   is stale), and a key that runs out of events before it moves is marked
   VNL_TOMB_GONE so probe runs through it still work.  Moving 16 cells per
   operation empties the old table before the new one can pass half full:
   growing from S cells starts at S/2 keys and is done after S/16 operations;
   shrinking to S/2 starts under S/8 keys and is done after S/16.

   The new table's pages are made resident ahead of time as well: calloc
   zeroed a table of megabytes in one call (glibc serves it from the heap once
   earlier frees raised its mmap threshold), and a lazily mapped one had the
   random writes of the first operations after the resize fault in every
   page at once (two thousand page faults in one step, most of that step's
   time).  Large tables are mapped directly (zero pages, nothing written up
   front), and from three eighths full a large table maps its successor and
   every eighth add writes one of its pages, so by seven sixteenths full
   every page is resident. */
#ifndef VNL_TOMBSTONES_H
#define VNL_TOMBSTONES_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#define VNL_TOMB_ID 1u
#define VNL_TOMB_TAG 2u
#define VNL_TOMB_GONE 3u  /* only in the old table: no events left, not moved */
#define VNL_TOMB_MIN 16
#define VNL_TOMB_STEP 16  /* old cells moved per operation while resizing */
#define VNL_TOMB_PAGE 4096
/* Tables from this many cells are mapped directly and get their successor
   ready (smaller ones fault little). */
#define VNL_TOMB_LARGE (16 * VNL_TOMB_PAGE / sizeof(vnl_tomb_cell))
#define VNL_TOMB_PREPARE_EVERY 8  /* adds per page of the successor written */

typedef struct {
    uint64_t key;
    uint32_t count;  /* free events of this key in the FIFO */
    uint32_t kind;   /* 0: empty cell */
} vnl_tomb_cell;

typedef struct {
    vnl_tomb_cell* cells;  /* where keys are added */
    size_t size;           /* a power of two, or 0 before the first insert */
    size_t live;           /* keys with events, in both tables */
    size_t here;           /* of them, keys in `cells` */
    vnl_tomb_cell* old;    /* while resizing: the previous table, else NULL */
    size_t old_size;
    size_t cursor;         /* old cells below it have moved */
    vnl_tomb_cell* next;   /* the grown table, allocated ahead, else NULL */
    size_t next_size;
    size_t next_touched;   /* bytes of `next` written so far */
    size_t next_adds;      /* adds since `next` was mapped */
    uint64_t seed;
} vnl_tombs;

/* `n` zeroed cells (NULL: out of memory); large tables are mapped, so their
   pages cost nothing until written. */
static vnl_tomb_cell* vnl_tomb_alloc(size_t n) {
    void* p;
    if (n < VNL_TOMB_LARGE) return (vnl_tomb_cell*)calloc(n, sizeof(vnl_tomb_cell));
    p = mmap(NULL, n * sizeof(vnl_tomb_cell), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : (vnl_tomb_cell*)p;
}

static void vnl_tomb_release(vnl_tomb_cell* cells, size_t n) {
    if (cells == NULL) return;
    if (n < VNL_TOMB_LARGE) free(cells);
    else munmap(cells, n * sizeof(vnl_tomb_cell));
}

static inline size_t vnl_tomb_home(const vnl_tombs* t, size_t size, uint64_t key, uint32_t kind) {
    uint64_t z = key ^ t->seed ^ ((uint64_t)kind << 61);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return (size_t)(z ^ (z >> 31)) & (size - 1);
}

/* The cell holding (key, kind) in `cells` (size a power of two), or NULL. */
static inline vnl_tomb_cell* vnl_tomb_probe(const vnl_tombs* t, vnl_tomb_cell* cells, size_t size,
                                            uint64_t key, uint32_t kind) {
    size_t i, mask = size - 1;
    for (i = vnl_tomb_home(t, size, key, kind); cells[i].kind; i = (i + 1) & mask)
        if (cells[i].key == key && cells[i].kind == kind) return &cells[i];
    return NULL;
}

/* The live cell of (key, kind) in the old table (not yet moved), or NULL. */
static inline vnl_tomb_cell* vnl_tomb_probe_old(const vnl_tombs* t, uint64_t key, uint32_t kind) {
    vnl_tomb_cell* c = vnl_tomb_probe(t, t->old, t->old_size, key, kind);
    return (c != NULL && (size_t)(c - t->old) >= t->cursor) ? c : NULL;
}

/* Whether (key, kind) has events. */
static inline int vnl_tomb_has(const vnl_tombs* t, uint64_t key, uint32_t kind) {
    if (t->live == 0) return 0;
    if (t->here && vnl_tomb_probe(t, t->cells, t->size, key, kind) != NULL) return 1;
    return t->old != NULL && vnl_tomb_probe_old(t, key, kind) != NULL;
}

/* Place a cell known to be absent from `cells` (which has room). */
static inline void vnl_tomb_place(vnl_tombs* t, const vnl_tomb_cell* cell) {
    size_t i, mask = t->size - 1;
    for (i = vnl_tomb_home(t, t->size, cell->key, cell->kind); t->cells[i].kind; i = (i + 1) & mask) {}
    t->cells[i] = *cell;
    t->here++;
}

/* Move up to `n` old cells (SIZE_MAX: all); free the old table once empty. */
static void vnl_tomb_migrate(vnl_tombs* t, size_t n) {
    const vnl_tomb_cell* c;
    while (n-- && t->cursor < t->old_size) {
        c = &t->old[t->cursor++];
        if (c->kind == VNL_TOMB_ID || c->kind == VNL_TOMB_TAG) vnl_tomb_place(t, c);
    }
    if (t->cursor == t->old_size) {
        vnl_tomb_release(t->old, t->old_size);
        t->old = NULL;
        t->old_size = 0;
        t->cursor = 0;
    }
}

/* After an add: from 3/8 full, have the grown table mapped and, every
   VNL_TOMB_PREPARE_EVERY adds, write one more of its pages (a zero: the
   write only makes the page resident). */
static inline void vnl_tomb_prepare(vnl_tombs* t) {
    if (t->size < VNL_TOMB_LARGE || t->old != NULL || 8 * t->live < 3 * t->size) return;
    if (t->next == NULL) {
        t->next = vnl_tomb_alloc(2 * t->size);
        if (t->next == NULL) return;  /* the resize will try again */
        t->next_size = 2 * t->size;
        t->next_touched = t->next_adds = 0;
    }
    if (++t->next_adds % VNL_TOMB_PREPARE_EVERY == 0
            && t->next_touched < t->next_size * sizeof(vnl_tomb_cell)) {
        ((volatile char*)t->next)[t->next_touched] = 0;
        t->next_touched += VNL_TOMB_PAGE;
    }
}

/* Start moving to a table of `size` cells (a power of two >= 2 * live);
   -1: out of memory (the map is left as it was).  The first table is made
   directly. */
static int vnl_tomb_resize(vnl_tombs* t, size_t size) {
    vnl_tomb_cell* cells;
    if (t->old != NULL) vnl_tomb_migrate(t, SIZE_MAX);  /* not reached by the bounds above */
    if (t->next != NULL && t->next_size == size) {
        cells = t->next;
    } else {
        cells = vnl_tomb_alloc(size);
        if (cells == NULL) return -1;
        vnl_tomb_release(t->next, t->next_size);
    }
    t->next = NULL;
    t->next_size = 0;
    if (t->here) {
        t->old = t->cells;
        t->old_size = t->size;
        t->cursor = 0;
    } else {
        vnl_tomb_release(t->cells, t->size);
    }
    t->cells = cells;
    t->size = size;
    t->here = 0;
    return 0;
}

/* Remove the cell at `at` from `cells`: pull later cells of its run into the
   hole (backward-shift deletion: no deleted markers). */
static void vnl_tomb_unplace(vnl_tombs* t, size_t at) {
    size_t i = at, j = at, home, mask = t->size - 1;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->cells[j].kind) break;
        home = vnl_tomb_home(t, t->size, t->cells[j].key, t->cells[j].kind);
        /* cell j may move to i if its home is not cyclically in (i, j] */
        if ((i <= j) ? (home <= i || home > j) : (home <= i && home > j)) {
            t->cells[i] = t->cells[j];
            i = j;
        }
    }
    t->cells[i].kind = 0;
    t->cells[i].count = 0;
    t->here--;
}

/* One more free event of (key, kind); -1: out of memory (nothing changed). */
static inline int vnl_tomb_add(vnl_tombs* t, uint64_t key, uint32_t kind) {
    vnl_tomb_cell* c;
    vnl_tomb_cell cell;
    if (t->old != NULL) vnl_tomb_migrate(t, VNL_TOMB_STEP);
    c = t->here ? vnl_tomb_probe(t, t->cells, t->size, key, kind) : NULL;
    if (c == NULL && t->old != NULL) c = vnl_tomb_probe_old(t, key, kind);
    if (c != NULL) {
        c->count++;
        return 0;
    }
    if (2 * (t->live + 1) > t->size
            && vnl_tomb_resize(t, t->size ? 2 * t->size : VNL_TOMB_MIN) < 0)
        return -1;
    cell.key = key;
    cell.kind = kind;
    cell.count = 1;
    vnl_tomb_place(t, &cell);
    t->live++;
    vnl_tomb_prepare(t);
    return 0;
}

/* One free event of (key, kind) left the FIFO; returns 1 if it was the key's
   last (the key is no longer a tombstone).  The key must be present. */
static inline int vnl_tomb_forget(vnl_tombs* t, uint64_t key, uint32_t kind) {
    vnl_tomb_cell* c;
    if (t->live == 0) return 0;  /* cannot happen: every FIFO event was counted */
    if (t->old != NULL) vnl_tomb_migrate(t, VNL_TOMB_STEP);
    c = t->here ? vnl_tomb_probe(t, t->cells, t->size, key, kind) : NULL;
    if (c != NULL) {
        if (--c->count) return 0;
        vnl_tomb_unplace(t, (size_t)(c - t->cells));
    } else {
        c = t->old != NULL ? vnl_tomb_probe_old(t, key, kind) : NULL;
        if (c == NULL) return 0;  /* cannot happen, as above */
        if (--c->count) return 0;
        c->kind = VNL_TOMB_GONE;
    }
    t->live--;
    if (t->old == NULL && t->size > VNL_TOMB_MIN && 8 * t->live < t->size)
        vnl_tomb_resize(t, t->size / 2);  /* out of memory: stay larger, still correct */
    return 1;
}

static inline void vnl_tomb_clear(vnl_tombs* t) {
    vnl_tomb_release(t->cells, t->size);
    vnl_tomb_release(t->old, t->old_size);
    vnl_tomb_release(t->next, t->next_size);
    t->cells = t->old = t->next = NULL;
    t->size = t->old_size = t->cursor = t->next_size = t->next_touched = t->next_adds = 0;
    t->live = t->here = 0;
}

#endif /* VNL_TOMBSTONES_H */
