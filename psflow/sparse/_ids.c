/* Ids and where they live: the partition of ids to shards (psflow/sparse/partition.py's
 * Partition, in C), a request's ids checked on the ps, a batch's ids grouped by shard on the
 * worker, and a hashed table's id map (psflow/sparse/idmap.py). Plain C, no Python:
 * psflow/sparse/_kernels.c is the binding, _kernels.h declares these.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_kernels.h"

/* The shard of an id: Partition.shard_of (psflow/sparse/partition.py). */
static inline int64_t shard_of(int64_t id, int div, int64_t num_shards, int64_t q, int64_t r,
                               int64_t boundary) {
    if (num_shards == 1) return 0;
    if (!div) {
        /* A power of two: the low bits (also for a negative id: two's complement gives the
         * non-negative remainder, as Python's %), without a 64-bit division's 20-40 cycles. */
        if ((num_shards & (num_shards - 1)) == 0) return id & (num_shards - 1);
        int64_t s = id % num_shards;
        return s < 0 ? s + num_shards : s;
    }
    return id < boundary ? id / (q + 1) : r + (id - boundary) / (q > 0 ? q : 1);
}

static inline int64_t floor_div(int64_t a, int64_t b) {
    int64_t d = a / b;
    return (a % b != 0 && (a < 0) != (b < 0)) ? d - 1 : d;
}

static inline int64_t floor_mod(int64_t a, int64_t b) {
    int64_t m = a % b;
    return (m != 0 && (m < 0) != (b < 0)) ? m + b : m;
}

/* Each id's row in its shard's storage, as Partition.local_index (Python's floor division and
 * remainder): mod, id // S (a shift for a power of two); div, the id's place in its range.
 * torch's floor_divide of a request's 2,048 ids took 9-35 us; this loop about 1-2. */
void psflow_local_index(const int64_t *ids, ptrdiff_t n, int div, long long shards, long long q,
                        long long r, long long boundary, int64_t *out) {
    if (shards == 1) {
        memcpy(out, ids, (size_t)n * sizeof(int64_t));
    } else if (!div && (shards & (shards - 1)) == 0) {
        const int shift = __builtin_ctzll((unsigned long long)shards);
        for (ptrdiff_t i = 0; i < n; i++) out[i] = ids[i] >> shift; /* floor, also below 0 */
    } else if (!div) {
        for (ptrdiff_t i = 0; i < n; i++) out[i] = floor_div(ids[i], shards);
    } else {
        const int64_t short_q = q > 0 ? q : 1;
        for (ptrdiff_t i = 0; i < n; i++) {
            const int64_t id = ids[i];
            out[i] = id < boundary ? floor_mod(id, q + 1) : floor_mod(id - boundary, short_q);
        }
    }
}

/* A request's ids, checked in one pass (psflow/sparse/rows.py's Rows.check_ids says what): each
 * in [0, num_embeddings) (num_embeddings < 0: a hashed table, any id), on `shard` of
 * `num_shards` (mod: id mod S, non-negative as Python's; div: TensorFlow's ranges, the first
 * `boundary` ids in r ranges of q + 1, the rest in ranges of q), and none twice (an
 * open-addressing set of twice as many slots: set, used). Returns 0 when all are good, else 1
 * out of range | 2 another shard's | 3 twice, and the position of the first such id in *at_
 * (else -1). */
int psflow_check_ids(const int64_t *ids, ptrdiff_t n, long long num_embeddings, int div,
                     int num_shards, int shard, long long q, long long r, long long boundary,
                     ptrdiff_t slots, int64_t *set, unsigned char *used, ptrdiff_t *at_) {
    int code = 0;
    ptrdiff_t at = -1;
    for (ptrdiff_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (num_embeddings >= 0 && (id < 0 || id >= num_embeddings)) {
            code = 1;
        } else if (shard_of(id, div, num_shards, q, r, boundary) != shard) {
            code = 2;
        }
        if (code) {
            at = i;
            break;
        }
        uint64_t h = ((uint64_t)id * 0x9E3779B97F4A7C15ull) >> 20;
        for (ptrdiff_t k = (ptrdiff_t)(h & (uint64_t)(slots - 1));; k = (k + 1) & (slots - 1)) {
            if (!used[k]) {
                used[k] = 1;
                set[k] = id;
                break;
            }
            if (set[k] == id) {
                code = 3;
                break;
            }
        }
        if (code) {
            at = i;
            break;
        }
    }
    *at_ = at;
    return code;
}

/* A batch's ids (any order, repeats) -> its unique ids grouped by shard, shard 0's first, each
 * shard's in the order they first appear (`unique`, *m_ says how many), where each id of the
 * batch is among them (`positions`), and how many each shard has (`counts`). One pass with an
 * open-addressing map id -> first-appearance number (keys, vals), then the numbers are placed
 * by shard: what torch.unique, then a split by shard (remainder, a stable argsort, a count, a
 * gather per shard) does in seven operations. With `limit` >= 0 (a fixed table's size), an id
 * outside [0, limit) stops it: GROUP_IDS_OUT_OF_RANGE, that id in *id_, for the caller to name
 * its table. An id no shard holds (outside a div table): GROUP_IDS_NO_SHARD, that id in *id_
 * (the outputs are then left half-written: scratch the caller drops). */
int psflow_group_ids(const int64_t *ids, ptrdiff_t n, int div, long long num_shards, long long q,
                     long long r, long long boundary, long long limit, int64_t *unique,
                     int64_t *positions, int64_t *counts, ptrdiff_t slots, int64_t *keys,
                     int64_t *vals, int64_t *first, int64_t *place, int64_t *start, ptrdiff_t *m_,
                     int64_t *id_) {
    ptrdiff_t m = 0, bad = -1;
    int64_t bad_id = 0, outside = 0;
    int out_of_range = 0;
    for (ptrdiff_t k = 0; k < slots; k++) vals[k] = -1;
    for (ptrdiff_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (limit >= 0 && (id < 0 || id >= limit)) {
            out_of_range = 1;
            outside = id;
            break;
        }
        uint64_t h = ((uint64_t)id * 0x9E3779B97F4A7C15ull) >> 20;
        ptrdiff_t k = (ptrdiff_t)(h & (uint64_t)(slots - 1));
        while (vals[k] >= 0 && keys[k] != id) k = (k + 1) & (slots - 1);
        if (vals[k] < 0) {
            keys[k] = id;
            vals[k] = m;
            first[m++] = id;
        }
        positions[i] = vals[k];
    }
    for (ptrdiff_t u = 0; u < m && !out_of_range; u++) {
        int64_t s = shard_of(first[u], div, num_shards, q, r, boundary);
        if (s < 0 || s >= num_shards) { /* an id outside a div table's range */
            bad = u;
            break;
        }
        counts[s]++;
        place[u] = s; /* its shard, for now: its place below */
    }
    if (bad < 0 && !out_of_range) {
        for (int64_t s = 0; s < num_shards; s++) start[s + 1] = start[s] + counts[s];
        for (ptrdiff_t u = 0; u < m; u++) {
            place[u] = start[place[u]]++;
            unique[place[u]] = first[u];
        }
        for (ptrdiff_t i = 0; i < n; i++) positions[i] = place[positions[i]];
    }
    bad_id = bad >= 0 ? first[bad] : 0;
    *m_ = m;
    if (bad >= 0) {
        *id_ = bad_id;
        return GROUP_IDS_NO_SHARD;
    }
    if (out_of_range) {
        *id_ = outside;
        return GROUP_IDS_OUT_OF_RANGE;
    }
    *id_ = 0;
    return GROUP_IDS_OK;
}

/* -- a hashed table's id map (psflow/sparse/idmap.py): open addressing, linear probing ----------
   keys[c], vals[c] per cell c: vals -1 empty, -2 a removed entry (probed past, reusable), else
   the slot of id keys[c]. An id's first cell is splitmix64(id) & mask, as idmap.py's. */

#define IDMAP_EMPTY (-1)

static inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* How many ids ahead psflow_idmap_find and psflow_idmap_put ask for an id's first cell: a map
   larger than the caches costs two misses an id (its key and its slot), which asking early
   overlaps (a request's 11,700 ids mapped from a 1M-id table: 29 ns an id without, 22 with,
   the map not in cache). */
#define FIND_AHEAD 16

static inline void ask_cell(const int64_t *keys, const int64_t *vals, long long mask, int64_t id) {
    uint64_t cell = splitmix64((uint64_t)id) & (uint64_t)mask;
    __builtin_prefetch(vals + cell, 0, 0);
    __builtin_prefetch(keys + cell, 0, 0);
}

/* out[i] = the cell of ids[i] (with slots: its slot), -1 where it is absent. out may be ids
   (each id is read before its place in out is written). */
void psflow_idmap_find(const int64_t *keys, const int64_t *vals, long long mask,
                       const int64_t *ids, ptrdiff_t n, int64_t *out, int slots) {
    for (ptrdiff_t i = 0; i < n; i++) {
        if (i + FIND_AHEAD < n) ask_cell(keys, vals, mask, ids[i + FIND_AHEAD]);
        uint64_t pos = splitmix64((uint64_t)ids[i]) & (uint64_t)mask;
        int64_t found = -1;
        for (long long k = 0; k <= mask; k++) {
            int64_t v = vals[pos];
            if (v == IDMAP_EMPTY) break;
            if (v >= 0 && keys[pos] == ids[i]) {
                found = slots ? v : (int64_t)pos;
                break;
            }
            pos = (pos + 1) & (uint64_t)mask;
        }
        out[i] = found;
    }
}

/* A request's ids to their rows in storage: copied from src into out, checked as
   psflow_check_ids checks them, then each replaced by its row: a hashed table's through its id
   map (keys not NULL), a fixed table's by its partition; with absent_ok, an id the map does not
   hold is left at -1. Returns 0, else why (1 out of range, 2 another shard's, 3 twice, 5 not
   held, 6 a row past `rows`: a bug) with the position in *at. */
int psflow_map_ids(const void *src, ptrdiff_t n, long long num_embeddings, int div,
                   int num_shards, int shard, long long q, long long r, long long boundary,
                   const int64_t *keys, const int64_t *vals, long long mask, ptrdiff_t rows,
                   int absent_ok, ptrdiff_t slots, int64_t *set, unsigned char *used,
                   int64_t *out, ptrdiff_t *at) {
    memcpy(out, src, (size_t)n * sizeof(int64_t));
    memset(used, 0, (size_t)slots);
    int code = psflow_check_ids(out, n, num_embeddings, div, num_shards, shard, q, r, boundary,
                                slots, set, used, at);
    if (code != 0) return code;
    if (keys != NULL) /* in place: each id is read before its slot is written */
        psflow_idmap_find(keys, vals, mask, out, n, out, 1);
    else if (num_shards != 1) /* else each id is its row (no memcpy onto itself) */
        psflow_local_index(out, n, div, num_shards, q, r, boundary, out);
    for (ptrdiff_t i = 0; i < n; i++) {
        if (out[i] >= 0 && out[i] < rows) continue;
        if (keys != NULL && out[i] == -1 && absent_ok) continue; /* left at -1 */
        *at = i;
        return keys != NULL && out[i] == -1 ? 5 : 6;
    }
    return 0;
}

/* Adds each id (unique, absent, with room for all: the caller keeps the load at most a half)
   at its slot, in the first empty or removed cell from its home. Returns how many removed cells
   it reused, or -1 when a probe found no room. */
long long psflow_idmap_put(int64_t *keys, int64_t *vals, long long mask, const int64_t *ids,
                           const int64_t *slots, ptrdiff_t n) {
    long long reused = 0;
    for (ptrdiff_t i = 0; i < n && reused >= 0; i++) {
        if (i + FIND_AHEAD < n) ask_cell(keys, vals, mask, ids[i + FIND_AHEAD]);
        uint64_t pos = splitmix64((uint64_t)ids[i]) & (uint64_t)mask;
        long long k = 0;
        while (k <= mask && vals[pos] >= 0) {
            pos = (pos + 1) & (uint64_t)mask;
            k++;
        }
        if (k > mask) {
            reused = -1;
            break;
        }
        reused += vals[pos] != IDMAP_EMPTY;
        keys[pos] = ids[i];
        vals[pos] = slots[i];
    }
    return reused;
}

/* Moves every id one map holds (keys, vals, mask) into another's cells, empty and with room for
   them all (a rebuild), a block of cells at a time: each block's ids gathered, then put with
   their cells asked for ahead as psflow_idmap_put asks. Returns how many it moved, or -1 when a
   probe found no room. */
long long psflow_idmap_move(const int64_t *keys, const int64_t *vals, long long mask,
                            int64_t *to_keys, int64_t *to_vals, long long to_mask) {
    enum { BLOCK = 1024 };
    int64_t ids[BLOCK], slots[BLOCK];
    long long moved = 0;
    for (long long c = 0; c <= mask;) {
        ptrdiff_t k = 0;
        for (; c <= mask && k < BLOCK; c++) {
            if (vals[c] < 0) continue;
            ids[k] = keys[c];
            slots[k++] = vals[c];
        }
        if (psflow_idmap_put(to_keys, to_vals, to_mask, ids, slots, k) < 0) return -1;
        moved += k;
    }
    return moved;
}

