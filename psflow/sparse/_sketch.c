/* A hashed table's admission counts (psflow/sparse/hashed.py, HashedRows._admit): a count-min
 * sketch with conservative update. Row d of the sketch counts id x in cell
 * (splitmix64(x + salts[d]) & (width - 1)) of its `width`; an id's estimate is the least of its
 * cells, and a push raises each of its cells to the id's new estimate, no further.
 *
 * The torch reference reads every id's cells before it writes any (one gather, then one
 * scatter_reduce with "amax"), so two ids of one push that share a cell both see its old count.
 * The two passes below keep that order: the counts first, then the raises. Integer arithmetic
 * throughout, so the sketch and the counts equal torch's to the bit. Plain C, no Python:
 * psflow/sparse/_kernels.c is the binding.
 */
#include <stddef.h>
#include <stdint.h>

#include "_kernels.h"

void psflow_sketch_count(const int64_t *ids, ptrdiff_t n, int32_t *sketch, int64_t width,
                         const int64_t *salts, ptrdiff_t depth, int32_t min_count,
                         int32_t *count) {
    const uint64_t mask = (uint64_t)width - 1;
    for (ptrdiff_t i = 0; i < n; i++) {
        int32_t least = INT32_MAX;
        for (ptrdiff_t d = 0; d < depth; d++) {
            uint64_t cell = psflow_mix64((uint64_t)ids[i] + (uint64_t)salts[d]) & mask;
            int32_t c = sketch[d * width + (int64_t)cell];
            if (c < least) least = c;
        }
        /* Counts saturate at min_count (all admission needs), so least + 1 cannot overflow. */
        int32_t next = least + 1;
        count[i] = next < min_count ? next : min_count;
    }
    for (ptrdiff_t i = 0; i < n; i++) {
        for (ptrdiff_t d = 0; d < depth; d++) {
            uint64_t cell = psflow_mix64((uint64_t)ids[i] + (uint64_t)salts[d]) & mask;
            int32_t *c = &sketch[d * width + (int64_t)cell];
            if (*c < count[i]) *c = count[i];
        }
    }
}
