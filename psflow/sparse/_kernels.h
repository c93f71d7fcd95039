/* The plain-C functions of psflow.sparse._kernels, one concern a file, bound to Python in
 * _kernels.c: _rows.c (row gathers, their gradient, the row-wise optimizer updates), _ids.c
 * (ids partitioned to shards, a request's ids checked, a batch's grouped, a hashed table's id
 * map), _init.c (initial rows' uniforms), _sketch.c (a hashed table's admission counts). No
 * Python here: the binding parses the arguments, checks the indices
 * (psflow_first_bad), allocates any scratch and releases the GIL around each call. Sizes and
 * counts are ptrdiff_t (Py_ssize_t's type).
 */
#ifndef PSFLOW_SPARSE_KERNELS_H
#define PSFLOW_SPARSE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

typedef double f64;
typedef float f32;

/* -1 when every index is in [0, rows), else the position of the first that is not: the
 * binding's check before any kernel below touches memory (inline there, as it was). */
static inline ptrdiff_t psflow_first_bad(const int64_t *index, ptrdiff_t n, ptrdiff_t rows) {
    for (ptrdiff_t i = 0; i < n; i++) {
        if (index[i] < 0 || index[i] >= rows) return i;
    }
    return -1;
}

/* -- _rows.c ------------------------------------------------------------------------------ */

/* out[i] = src[index[i]] for rows of `bytes` bytes (any dtype): a lookup's rows. With
 * psflow_gather_held, a row whose index is -1 (an id a hashed table does not hold) is left as it
 * is, for the caller to fill. */
void psflow_gather_rows(char *out, const char *src, const int64_t *index, ptrdiff_t n,
                        ptrdiff_t bytes);
void psflow_gather_held(char *out, const char *src, const int64_t *index, ptrdiff_t n,
                        ptrdiff_t bytes);

/* dst[index[i]] = src[i] (index_copy_), and dst[index[i]] = row (index_fill_), for rows of
 * `bytes` bytes: a hashed table's new rows and their marks. */
void psflow_put_rows(char *dst, const char *src, const int64_t *index, ptrdiff_t n,
                     ptrdiff_t bytes);
void psflow_fill_rows(char *dst, const int64_t *index, ptrdiff_t n, const char *row,
                      ptrdiff_t bytes);

/* 1 when none of the n values at p is an infinity or a NaN (float32, float64 as their bits). */
int psflow_finite_f32(const uint32_t *p, ptrdiff_t n);
int psflow_finite_f64(const uint64_t *p, ptrdiff_t n);

/* out[i] = row index[i] of rows held in parts: part p holds rows [starts[p], starts[p + 1]) at
 * srcs[p]. */
void psflow_gather_parts(char *out, const char *const *srcs, const int64_t *starts,
                         ptrdiff_t parts, const int64_t *index, ptrdiff_t n, ptrdiff_t bytes);

/* out = zeros(rows, dim), then out[index[i]] += src[i]; `out` may come uninitialised, `seen`:
 * `rows` zeroed bytes. */
void psflow_scatter_add_f32(f32 *out, const f32 *src, const int64_t *index, ptrdiff_t n,
                            ptrdiff_t dim, ptrdiff_t rows, unsigned char *seen);
void psflow_scatter_add_f64(f64 *out, const f64 *src, const int64_t *index, ptrdiff_t n,
                            ptrdiff_t dim, ptrdiff_t rows, unsigned char *seen);

/* The row-wise updates, in place on rows index[i] (every index in range: psflow_first_bad
 * first) with gradient row i of g; _rows.c gives each one's arithmetic. */
void psflow_sgd_f32(f32 *w, const int64_t *index, const f32 *g, ptrdiff_t n, ptrdiff_t dim,
                    f32 alpha);
void psflow_sgd_f64(f64 *w, const int64_t *index, const f64 *g, ptrdiff_t n, ptrdiff_t dim,
                    f64 alpha);
void psflow_adagrad_f32(f32 *w, f32 *sum, const int64_t *index, const f32 *g, ptrdiff_t n,
                        ptrdiff_t dim, f32 neg_lr, f32 eps);
void psflow_adagrad_f64(f64 *w, f64 *sum, const int64_t *index, const f64 *g, ptrdiff_t n,
                        ptrdiff_t dim, f64 neg_lr, f64 eps);
void psflow_rowwise_adagrad_f32(f32 *w, f32 *sum, const int64_t *index, const f32 *g,
                                ptrdiff_t n, ptrdiff_t dim, f32 neg_lr, f32 eps);
void psflow_rowwise_adagrad_f64(f64 *w, f64 *sum, const int64_t *index, const f64 *g,
                                ptrdiff_t n, ptrdiff_t dim, f64 neg_lr, f64 eps);
void psflow_adam_f32(f32 *w, f32 *m, f32 *v, int64_t *step, const int64_t *index, const f32 *g,
                     ptrdiff_t n, ptrdiff_t dim, double lr, double b1, double b2, f32 eps);
void psflow_adam_f64(f64 *w, f64 *m, f64 *v, int64_t *step, const int64_t *index, const f64 *g,
                     ptrdiff_t n, ptrdiff_t dim, double lr, double b1, double b2, f64 eps);
void psflow_ftrl_f32(f32 *w, f32 *accum, f32 *linear, const int64_t *index, const f32 *g,
                     ptrdiff_t n, ptrdiff_t dim, f32 lr, f32 l1, f32 two_l2, f32 neg_power,
                     int sqrt_power);
void psflow_ftrl_f64(f64 *w, f64 *accum, f64 *linear, const int64_t *index, const f64 *g,
                     ptrdiff_t n, ptrdiff_t dim, f64 lr, f64 l1, f64 two_l2, f64 neg_power,
                     int sqrt_power);

/* -- _ids.c ------------------------------------------------------------------------------- */

/* Each id's row in its shard's storage (Partition.local_index), into out. */
void psflow_local_index(const int64_t *ids, ptrdiff_t n, int div, long long shards, long long q,
                        long long r, long long boundary, int64_t *out);

/* A request's ids checked in one pass; set, used: scratch of `slots` cells (a power of two of
 * at least 2n), used zeroed. Returns 0 when all are good, else 1 out of range | 2 another
 * shard's | 3 twice, with the position of the first such id in *at. */
int psflow_check_ids(const int64_t *ids, ptrdiff_t n, long long num_embeddings, int div,
                     int num_shards, int shard, long long q, long long r, long long boundary,
                     ptrdiff_t slots, int64_t *set, unsigned char *used, ptrdiff_t *at);

/* psflow_group_ids's outcomes. */
#define GROUP_IDS_OK 0
#define GROUP_IDS_OUT_OF_RANGE 1 /* an id outside [0, limit): *id */
#define GROUP_IDS_NO_SHARD 2     /* an id no shard holds (outside a div table): *id */

/* A batch's unique ids grouped by shard (unique, positions, counts: _ids.c says what); keys,
 * vals: `slots` cells (a power of two of at least 2n); first, place: n cells (at least 1);
 * start: num_shards + 1 zeroed. *m: how many unique ids. */
int psflow_group_ids(const int64_t *ids, ptrdiff_t n, int div, long long num_shards, long long q,
                     long long r, long long boundary, long long limit, int64_t *unique,
                     int64_t *positions, int64_t *counts, ptrdiff_t slots, int64_t *keys,
                     int64_t *vals, int64_t *first, int64_t *place, int64_t *start, ptrdiff_t *m,
                     int64_t *id);

/* out[i] = the cell of ids[i] (with slots: its slot), -1 where it is absent. */
void psflow_idmap_find(const int64_t *keys, const int64_t *vals, long long mask,
                       const int64_t *ids, ptrdiff_t n, int64_t *out, int slots);

/* Adds each id at its slot; how many removed cells it reused, or -1 when a probe found no
 * room. */
long long psflow_idmap_put(int64_t *keys, int64_t *vals, long long mask, const int64_t *ids,
                           const int64_t *slots, ptrdiff_t n);

/* Moves every id one map holds into another's empty cells; how many, or -1 when a probe found
 * no room. */
long long psflow_idmap_move(const int64_t *keys, const int64_t *vals, long long mask,
                            int64_t *to_keys, int64_t *to_vals, long long to_mask);

/* A request's ids copied from src into out, checked (psflow_check_ids) and mapped to their rows
 * in storage: through a hashed table's id map (keys not NULL) or a fixed table's partition.
 * With absent_ok, an id the map does not hold is left at -1. set, used: scratch of `slots` cells
 * (a power of two of at least 2n). Returns 0, else 1 out of range | 2 another shard's | 3 twice
 * | 5 not held | 6 a row past `rows`, the position in *at. */
int psflow_map_ids(const void *src, ptrdiff_t n, long long num_embeddings, int div,
                   int num_shards, int shard, long long q, long long r, long long boundary,
                   const int64_t *keys, const int64_t *vals, long long mask, ptrdiff_t rows,
                   int absent_ok, ptrdiff_t slots, int64_t *set, unsigned char *used,
                   int64_t *out, ptrdiff_t *at);

/* -- _init.c ------------------------------------------------------------------------------ */

/* splitmix64's finaliser of x + golden: psflow/sparse/init.py's splitmix64 on one value, the
 * hash of initial rows and of the admission sketch. */
static inline uint64_t psflow_mix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* out[i] = splitmix64's finaliser of in[i] + golden (bits as uint64). */
void psflow_splitmix64(const int64_t *in, ptrdiff_t n, int64_t *out);

/* The uniforms of ids' initial rows, [n, pairs] each: u1 in (0, 1], u2 = [0, 2**32) * angle. */
void psflow_initial_uniforms(const int64_t *ids, ptrdiff_t n, int64_t seed_key, ptrdiff_t pairs,
                             f64 angle, f64 *u1, f64 *u2);

/* The normals of initial rows from torch's sqrt(log(u1) * -2), cos(u2) and sin(u2) ([n, pairs]
 * each): out[i, 2p] = cos * r, out[i, 2p + 1] = sin * r (while below dim), r = root * std, cast
 * to out's type. */
void psflow_normals_f32(f32 *out, const f64 *root, const f64 *c, const f64 *s, ptrdiff_t n,
                        ptrdiff_t pairs, ptrdiff_t dim, f64 std);
void psflow_normals_f64(f64 *out, const f64 *root, const f64 *c, const f64 *s, ptrdiff_t n,
                        ptrdiff_t pairs, ptrdiff_t dim, f64 std);

/* -- _sketch.c ---------------------------------------------------------------------------- */

/* One push of each of n unique ids counted in a count-min sketch of `depth` rows of `width`
 * int32 cells (a power of two): count[i] is id i's estimate after it, at most min_count. */
void psflow_sketch_count(const int64_t *ids, ptrdiff_t n, int32_t *sketch, int64_t width,
                         const int64_t *salts, ptrdiff_t depth, int32_t min_count,
                         int32_t *count);

/* The k least of n update counts with their slots, in order of count then slot (_evict.c);
 * 0, or -1 when memory ran out. */
int psflow_least_recent(const int64_t *ticks, ptrdiff_t n, ptrdiff_t k, int64_t *out_slots,
                        int64_t *out_ticks);

#endif
