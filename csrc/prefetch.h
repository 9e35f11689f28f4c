/* Cache prefetch hint: lookups of a group of ids issue their loads before
   they need them, so that the group's cache misses overlap. */
#ifndef VNL_PREFETCH_H
#define VNL_PREFETCH_H

#if defined(__GNUC__) || defined(__clang__)
#define VNL_PREFETCH(p) __builtin_prefetch((const void*)(p))
#else
#define VNL_PREFETCH(p) ((void)0)
#endif

#endif /* VNL_PREFETCH_H */
