/* psflow.sparse._kernels: row kernels for embedding tables, bound to Python. Each concern is
 * its own plain-C file (_kernels.h declares them): _rows.c, the fused row-wise optimizer
 * updates on the ps, the gather of rows (a lookup, a forward pass) and its gradient; _ids.c, the
 * partition of ids to shards and a hashed table's id map; _init.c, the hashes of new rows'
 * initial values. This file only parses arguments,
 * checks indices, allocates scratch and releases the GIL. psflow's other compiled code
 * (FarmHash, the Example parser) is the data layer's, in psflow/data/_native.c: nothing here
 * reads bytes off a file.
 *
 * The Python side (psflow/sparse/kernels.py) passes raw pointers of contiguous CPU tensors it
 * has checked (dtype, shape, contiguity); each function still checks every index against the
 * row count before it touches memory, and returns the position of the first bad one. The GIL
 * is released while a kernel runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"

#define PTR(T, p) ((T *)(uintptr_t)(p))

/* The cells of an open-addressing set or map for n ids: a power of two, at least twice n. */
static Py_ssize_t hash_slots(Py_ssize_t n) {
    Py_ssize_t slots = 16;
    while (slots < 2 * n) slots *= 2;
    return slots;
}

/* -1 when every index is in [-1, rows), else the position of the first that is not: the check
 * of a gather that leaves a row at -1 as it is (psflow_gather_held). */
static Py_ssize_t first_bad_held(const int64_t *index, Py_ssize_t n, Py_ssize_t rows) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (index[i] < -1 || index[i] >= rows) return i;
    }
    return -1;
}

/* gather(out, src, index, n, bytes, rows, held=False): out[i] = src[index[i]]; with held, a row
 * at -1 is left as it is (psflow_gather_held); -1 or the first bad index (nothing written). */
static PyObject *py_gather(PyObject *self, PyObject *args) {
    Py_ssize_t out, src, index, n, bytes, rows;
    int held = 0;
    if (!PyArg_ParseTuple(args, "nnnnnn|p", &out, &src, &index, &n, &bytes, &rows, &held))
        return NULL;
    Py_ssize_t bad = held ? first_bad_held(PTR(int64_t, index), n, rows)
                          : psflow_first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    if (held)
        psflow_gather_held(PTR(char, out), PTR(const char, src), PTR(int64_t, index), n, bytes);
    else
        psflow_gather_rows(PTR(char, out), PTR(const char, src), PTR(int64_t, index), n, bytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

/* put_rows(dst, src, index, n, bytes, rows): dst[index[i]] = src[i]; -1 or the first bad index
 * (then nothing was written). */
static PyObject *py_put_rows(PyObject *self, PyObject *args) {
    Py_ssize_t dst, src, index, n, bytes, rows;
    if (!PyArg_ParseTuple(args, "nnnnnn", &dst, &src, &index, &n, &bytes, &rows)) return NULL;
    Py_ssize_t bad = psflow_first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    psflow_put_rows(PTR(char, dst), PTR(const char, src), PTR(int64_t, index), n, bytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

/* fill_rows(dst, index, n, row, bytes, rows): dst[index[i]] = row; -1 or the first bad index. */
static PyObject *py_fill_rows(PyObject *self, PyObject *args) {
    Py_ssize_t dst, index, n, row, bytes, rows;
    if (!PyArg_ParseTuple(args, "nnnnnn", &dst, &index, &n, &row, &bytes, &rows)) return NULL;
    Py_ssize_t bad = psflow_first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    psflow_fill_rows(PTR(char, dst), PTR(int64_t, index), n, PTR(const char, row), bytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

/* (out, srcs: int64 pointers, starts: int64 first rows, parts, index, n, bytes, rows) */
static PyObject *py_gather_parts(PyObject *self, PyObject *args) {
    Py_ssize_t out, srcs, starts, parts, index, n, bytes, rows;
    if (!PyArg_ParseTuple(args, "nnnnnnnn", &out, &srcs, &starts, &parts, &index, &n, &bytes,
                          &rows))
        return NULL;
    Py_ssize_t bad = psflow_first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    psflow_gather_parts(PTR(char, out), PTR(const char *const, srcs), PTR(int64_t, starts),
                        parts, PTR(int64_t, index), n, bytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

static PyObject *py_scatter_add(PyObject *self, PyObject *args) {
    int f64_;
    Py_ssize_t out, src, index, n, dim, rows;
    if (!PyArg_ParseTuple(args, "pnnnnnn", &f64_, &out, &src, &index, &n, &dim, &rows))
        return NULL;
    Py_ssize_t bad = psflow_first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    unsigned char *seen = calloc(rows > 0 ? (size_t)rows : 1, 1);
    if (seen == NULL) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    if (f64_)
        psflow_scatter_add_f64(PTR(f64, out), PTR(f64, src), PTR(int64_t, index), n, dim, rows,
                               seen);
    else
        psflow_scatter_add_f32(PTR(f32, out), PTR(f32, src), PTR(int64_t, index), n, dim, rows,
                               seen);
    Py_END_ALLOW_THREADS
    free(seen);
    return PyLong_FromLong(-1);
}

/* Each: (double: 0 float32 / 1 float64, pointers..., n, dim, rows, settings...) -> -1 or the
 * position of the first index outside [0, rows) (then nothing was changed). */

static PyObject *py_sgd(PyObject *self, PyObject *args) {
    int f64_;
    Py_ssize_t w, index, g, n, dim, rows;
    double lr;
    if (!PyArg_ParseTuple(args, "pnnnnnnd", &f64_, &w, &index, &g, &n, &dim, &rows, &lr))
        return NULL;
    Py_ssize_t bad = psflow_first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    if (f64_) psflow_sgd_f64(PTR(f64, w), PTR(int64_t, index), PTR(f64, g), n, dim, -lr);
    else psflow_sgd_f32(PTR(f32, w), PTR(int64_t, index), PTR(f32, g), n, dim, (f32)-lr);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

/* Adagrad and RowWiseAdagrad take the same arguments (their state: a sum an element, or a row). */
typedef void adagrad_f32_fn(f32 *, f32 *, const int64_t *, const f32 *, ptrdiff_t, ptrdiff_t,
                            f32, f32);
typedef void adagrad_f64_fn(f64 *, f64 *, const int64_t *, const f64 *, ptrdiff_t, ptrdiff_t,
                            f64, f64);

static PyObject *adagrad_of(PyObject *args, adagrad_f32_fn *f32_fn, adagrad_f64_fn *f64_fn) {
    int f64_;
    Py_ssize_t w, sum, index, g, n, dim, rows;
    double lr, eps;
    if (!PyArg_ParseTuple(args, "pnnnnnnndd", &f64_, &w, &sum, &index, &g, &n, &dim, &rows, &lr,
                          &eps))
        return NULL;
    Py_ssize_t bad = psflow_first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    if (f64_)
        f64_fn(PTR(f64, w), PTR(f64, sum), PTR(int64_t, index), PTR(f64, g), n, dim, -lr, eps);
    else
        f32_fn(PTR(f32, w), PTR(f32, sum), PTR(int64_t, index), PTR(f32, g), n, dim, (f32)-lr,
               (f32)eps);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

static PyObject *py_adagrad(PyObject *self, PyObject *args) {
    return adagrad_of(args, psflow_adagrad_f32, psflow_adagrad_f64);
}

static PyObject *py_rowwise_adagrad(PyObject *self, PyObject *args) {
    return adagrad_of(args, psflow_rowwise_adagrad_f32, psflow_rowwise_adagrad_f64);
}

static PyObject *py_adam(PyObject *self, PyObject *args) {
    int f64_;
    Py_ssize_t w, m, v, step, index, g, n, dim, rows;
    double lr, b1, b2, eps;
    if (!PyArg_ParseTuple(args, "pnnnnnnnnndddd", &f64_, &w, &m, &v, &step, &index, &g, &n,
                          &dim, &rows, &lr, &b1, &b2, &eps))
        return NULL;
    Py_ssize_t bad = psflow_first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    if (f64_)
        psflow_adam_f64(PTR(f64, w), PTR(f64, m), PTR(f64, v), PTR(int64_t, step),
                        PTR(int64_t, index), PTR(f64, g), n, dim, lr, b1, b2, eps);
    else
        psflow_adam_f32(PTR(f32, w), PTR(f32, m), PTR(f32, v), PTR(int64_t, step),
                        PTR(int64_t, index), PTR(f32, g), n, dim, lr, b1, b2, (f32)eps);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

static PyObject *py_ftrl(PyObject *self, PyObject *args) {
    int f64_;
    Py_ssize_t w, accum, linear, index, g, n, dim, rows;
    double lr, l1, l2, lr_power;
    if (!PyArg_ParseTuple(args, "pnnnnnnnndddd", &f64_, &w, &accum, &linear, &index, &g, &n,
                          &dim, &rows, &lr, &l1, &l2, &lr_power))
        return NULL;
    Py_ssize_t bad = psflow_first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    int sqrt_power = lr_power == -0.5;
    Py_BEGIN_ALLOW_THREADS
    if (f64_)
        psflow_ftrl_f64(PTR(f64, w), PTR(f64, accum), PTR(f64, linear), PTR(int64_t, index),
                        PTR(f64, g), n, dim, lr, l1, 2 * l2, -lr_power, sqrt_power);
    else
        psflow_ftrl_f32(PTR(f32, w), PTR(f32, accum), PTR(f32, linear), PTR(int64_t, index),
                        PTR(f32, g), n, dim, (f32)lr, (f32)l1, (f32)(2 * l2), (f32)-lr_power,
                        sqrt_power);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

/* (ids, n, div, shards, q, r, boundary, out): each id's row in its shard's storage, as
 * Partition.local_index (psflow_local_index in _ids.c). */
static PyObject *py_local_index(PyObject *self, PyObject *args) {
    Py_ssize_t ids_, n, out_;
    long long shards, q, r, boundary;
    int div;
    if (!PyArg_ParseTuple(args, "nnpLLLLn", &ids_, &n, &div, &shards, &q, &r, &boundary, &out_))
        return NULL;
    const int64_t *ids = PTR(int64_t, ids_);
    int64_t *out = PTR(int64_t, out_);
    Py_BEGIN_ALLOW_THREADS
    psflow_local_index(ids, n, div, shards, q, r, boundary, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* (ids, n, num_embeddings, div, num_shards, shard, q, r, boundary): a request's ids checked in
 * one pass (psflow_check_ids in _ids.c). Returns (0, -1) when all are good, else (1 out of
 * range | 2 another shard's | 3 twice, the position of the first such id). */
static PyObject *py_check_ids(PyObject *self, PyObject *args) {
    Py_ssize_t ids_, n;
    long long num_embeddings, q, r, boundary;
    int div, num_shards, shard;
    if (!PyArg_ParseTuple(args, "nnLpiiLLL", &ids_, &n, &num_embeddings, &div, &num_shards, &shard,
                          &q, &r, &boundary))
        return NULL;
    const int64_t *ids = PTR(int64_t, ids_);
    Py_ssize_t slots = hash_slots(n);
    int64_t *set = malloc((size_t)slots * sizeof(int64_t));
    unsigned char *used = calloc((size_t)slots, 1);
    if (set == NULL || used == NULL) {
        free(set);
        free(used);
        return PyErr_NoMemory();
    }
    int code;
    Py_ssize_t at;
    Py_BEGIN_ALLOW_THREADS
    code = psflow_check_ids(ids, n, num_embeddings, div, num_shards, shard, q, r, boundary, slots,
                            set, used, &at);
    Py_END_ALLOW_THREADS
    free(set);
    free(used);
    return Py_BuildValue("in", code, at);
}

/* (ids, n, div, num_shards, q, r, boundary, limit, unique, positions, counts): a batch's unique
 * ids grouped by shard (psflow_group_ids in _ids.c). Returns (how many unique ids, 0); with
 * `limit` >= 0 (a fixed table's size), an id outside [0, limit) gives (-1, that id), for the
 * caller to name its table. An id no shard holds (outside a div table) raises IndexError (the
 * outputs are then left half-written: scratch the caller drops). */
static PyObject *py_group_ids(PyObject *self, PyObject *args) {
    Py_ssize_t ids_, n, unique_, positions_, counts_;
    int div;
    long long num_shards, q, r, boundary, limit;
    if (!PyArg_ParseTuple(args, "nnpLLLLLnnn", &ids_, &n, &div, &num_shards, &q, &r, &boundary,
                          &limit, &unique_, &positions_, &counts_))
        return NULL;
    const int64_t *ids = PTR(int64_t, ids_);
    int64_t *unique = PTR(int64_t, unique_), *positions = PTR(int64_t, positions_);
    int64_t *counts = PTR(int64_t, counts_);
    Py_ssize_t slots = hash_slots(n);
    int64_t *keys = malloc((size_t)slots * sizeof(int64_t));
    int64_t *vals = malloc((size_t)slots * sizeof(int64_t));
    int64_t *first = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t)); /* number -> id */
    int64_t *place = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t)); /* number -> slot */
    int64_t *start = calloc((size_t)num_shards + 1, sizeof(int64_t));
    if (!keys || !vals || !first || !place || !start) {
        free(keys), free(vals), free(first), free(place), free(start);
        return PyErr_NoMemory();
    }
    int outcome;
    Py_ssize_t m;
    int64_t id;
    Py_BEGIN_ALLOW_THREADS
    outcome = psflow_group_ids(ids, n, div, num_shards, q, r, boundary, limit, unique, positions,
                               counts, slots, keys, vals, first, place, start, &m, &id);
    Py_END_ALLOW_THREADS
    free(keys), free(vals), free(first), free(place), free(start);
    if (outcome == GROUP_IDS_NO_SHARD) {
        PyErr_Format(PyExc_IndexError, "id %lld is outside the table's shards", (long long)id);
        return NULL;
    }
    if (outcome == GROUP_IDS_OUT_OF_RANGE)
        return Py_BuildValue("nL", (Py_ssize_t)-1, (long long)id);
    return Py_BuildValue("nL", m, 0LL);
}

/* idmap_find(keys, vals, mask, ids, n, out, slots): out[i] = the cell of ids[i] (with slots:
   its slot), -1 where it is absent (the map's layout: _ids.c). */
static PyObject *py_idmap_find(PyObject *self, PyObject *args) {
    Py_ssize_t keys_, vals_, ids_, n, out_;
    long long mask;
    int slots;
    if (!PyArg_ParseTuple(args, "nnLnnnp", &keys_, &vals_, &mask, &ids_, &n, &out_, &slots))
        return NULL;
    const int64_t *keys = PTR(int64_t, keys_), *vals = PTR(int64_t, vals_);
    const int64_t *ids = PTR(int64_t, ids_);
    int64_t *out = PTR(int64_t, out_);
    Py_BEGIN_ALLOW_THREADS
    psflow_idmap_find(keys, vals, mask, ids, n, out, slots);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("");
}

/* idmap_put(keys, vals, mask, ids, slots, n): adds each id (unique, absent, with room for all:
   the caller keeps the load at most a half) in the first empty or removed cell from its home.
   Returns how many removed cells it reused, or -1 when a probe found no room. */
static PyObject *py_idmap_put(PyObject *self, PyObject *args) {
    Py_ssize_t keys_, vals_, ids_, slots_, n;
    long long mask;
    if (!PyArg_ParseTuple(args, "nnLnnn", &keys_, &vals_, &mask, &ids_, &slots_, &n)) return NULL;
    int64_t *keys = PTR(int64_t, keys_), *vals = PTR(int64_t, vals_);
    const int64_t *ids = PTR(int64_t, ids_), *slots = PTR(int64_t, slots_);
    long long reused;
    Py_BEGIN_ALLOW_THREADS
    reused = psflow_idmap_put(keys, vals, mask, ids, slots, n);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(reused);
}

/* idmap_move(keys, vals, mask, to_keys, to_vals, to_mask): every id of one map put into another's
   empty cells, with room for them all (a rebuild). Returns how many, or -1 when a probe found
   no room. */
static PyObject *py_idmap_move(PyObject *self, PyObject *args) {
    Py_ssize_t keys_, vals_, to_keys_, to_vals_;
    long long mask, to_mask, moved;
    if (!PyArg_ParseTuple(args, "nnLnnL", &keys_, &vals_, &mask, &to_keys_, &to_vals_, &to_mask))
        return NULL;
    const int64_t *keys = PTR(int64_t, keys_), *vals = PTR(int64_t, vals_);
    int64_t *to_keys = PTR(int64_t, to_keys_), *to_vals = PTR(int64_t, to_vals_);
    Py_BEGIN_ALLOW_THREADS
    moved = psflow_idmap_move(keys, vals, mask, to_keys, to_vals, to_mask);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(moved);
}

/* least_recent(ticks, n, k, out_slots, out_ticks): the k least of n update counts and their
   slots, in order of count then slot. Returns 0, or -1 when memory ran out. */
static PyObject *py_least_recent(PyObject *self, PyObject *args) {
    Py_ssize_t ticks_, n, k, slots_, out_;
    int done;
    if (!PyArg_ParseTuple(args, "nnnnn", &ticks_, &n, &k, &slots_, &out_)) return NULL;
    const int64_t *ticks = PTR(int64_t, ticks_);
    int64_t *slots = PTR(int64_t, slots_), *out = PTR(int64_t, out_);
    Py_BEGIN_ALLOW_THREADS
    done = psflow_least_recent(ticks, n, k, slots, out);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(done);
}

/* finite(double, p, n): whether none of the n float32 (float64) values at p is an infinity
 * or a NaN. */
static PyObject *py_finite(PyObject *self, PyObject *args) {
    int f64_;
    Py_ssize_t p, n;
    int ok;
    if (!PyArg_ParseTuple(args, "pnn", &f64_, &p, &n)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ok = f64_ ? psflow_finite_f64(PTR(const uint64_t, p), n)
              : psflow_finite_f32(PTR(const uint32_t, p), n);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

/* splitmix64(in, n, out): the finaliser of each int64 (bits as uint64), into out. */
static PyObject *py_splitmix64(PyObject *self, PyObject *args) {
    Py_ssize_t in, n, out;
    if (!PyArg_ParseTuple(args, "nnn", &in, &n, &out)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    psflow_splitmix64(PTR(int64_t, in), n, PTR(int64_t, out));
    Py_END_ALLOW_THREADS
    return Py_BuildValue("");
}

/* initial_uniforms(ids, n, seed_key, pairs, angle, u1, u2): the uniforms of initial rows. */
static PyObject *py_initial_uniforms(PyObject *self, PyObject *args) {
    Py_ssize_t ids, n, pairs, u1, u2;
    long long seed_key;
    double angle;
    if (!PyArg_ParseTuple(args, "nnLndnn", &ids, &n, &seed_key, &pairs, &angle, &u1, &u2))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    psflow_initial_uniforms(PTR(int64_t, ids), n, seed_key, pairs, angle, PTR(f64, u1),
                            PTR(f64, u2));
    Py_END_ALLOW_THREADS
    return Py_BuildValue("");
}

/* normals(double, out, root, c, s, n, pairs, dim, std): the normals made of torch's
 * sqrt(log(u1) * -2), cos(u2) and sin(u2), placed, cast, into the rows. */
static PyObject *py_normals(PyObject *self, PyObject *args) {
    int f64_;
    Py_ssize_t out, root, c, s, n, pairs, dim;
    double std;
    if (!PyArg_ParseTuple(args, "pnnnnnnnd", &f64_, &out, &root, &c, &s, &n, &pairs, &dim, &std))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (f64_)
        psflow_normals_f64(PTR(f64, out), PTR(f64, root), PTR(f64, c), PTR(f64, s), n, pairs, dim,
                           std);
    else
        psflow_normals_f32(PTR(f32, out), PTR(f64, root), PTR(f64, c), PTR(f64, s), n, pairs, dim,
                           std);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("");
}

/* sketch_count(ids, n, sketch, width, salts, depth, min_count, count): one push of each id
 * counted in a hashed table's admission sketch; each one's estimate into count (int32). */
static PyObject *py_sketch_count(PyObject *self, PyObject *args) {
    Py_ssize_t ids, n, sketch, salts, depth, count;
    long long width;
    int min_count;
    if (!PyArg_ParseTuple(args, "nnnLnnin", &ids, &n, &sketch, &width, &salts, &depth,
                          &min_count, &count))
        return NULL;
    if (width < 1 || (width & (width - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "sketch_count: the width must be a power of two");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    psflow_sketch_count(PTR(int64_t, ids), n, PTR(int32_t, sketch), width, PTR(int64_t, salts),
                        depth, min_count, PTR(int32_t, count));
    Py_END_ALLOW_THREADS
    return Py_BuildValue("");
}

/* How a request's job finds its ids' rows (psflow_map_ids): the table's partition, or its id
 * map, and the rows it holds. */
typedef struct {
    Py_ssize_t rows, keys, vals;
    long long num_embeddings, q, r, boundary, mask;
    int div, num_shards, shard;
} rule_t;

static int map_job(const rule_t *u, const char *src, Py_ssize_t n, int absent_ok, int64_t *set,
                   unsigned char *used, int64_t *out, Py_ssize_t *at) {
    return psflow_map_ids(src, n, u->num_embeddings, u->div, u->num_shards, u->shard, u->q, u->r,
                          u->boundary, u->keys ? PTR(const int64_t, u->keys) : NULL,
                          PTR(const int64_t, u->vals), u->mask, u->rows, absent_ok, hash_slots(n),
                          set, used, out, at);
}

/* The phases of lookup_rows and apply_rows: 1 maps the ids (copied out of the request, checked,
 * their rows in storage written to `local`, a buffer of every job's count of int64, one job after
 * another); 2 gathers or applies the rows `local` names (the first's: in the same call, or a
 * caller's that mapped them earlier); 4, with 2, only the rows' marks (the caller applies the
 * updates, in stripes); 8, with 1, leaves an id a hashed table does not hold at -1 instead of
 * refusing it, and with 2 in lookup_rows, leaves the row of a -1 as it is (the caller fills it:
 * an initial row); apply_rows is never given a -1 to apply (the caller makes those rows first).
 * Nothing is written to a table or a reply unless every job's ids are good, and the second
 * phase first checks every row it is given against the storage (why 6, nothing written).
 * Each returns (-1, 0, -1) when done, else (job, why, position): why 1 out of range, 2 another
 * shard's, 3 twice, 4 the job does not fit its buffers, 5 an id a hashed table does not hold
 * (the Python path makes its row), 6 a row past the storage (a bug, named as one). */
#define MAP 1
#define RUN 2
#define MARKS_ONLY 4
#define ABSENT_OK 8

/* What every job of lookup_rows and apply_rows begins with (the first member of its job_t):
 * its ids, where they lie in the request, their count, and how to find their rows. */
typedef struct {
    const char *ids;
    Py_ssize_t n;
    rule_t u;
} head_t;

#define HEAD(jobs, stride, i) ((const head_t *)((const char *)(jobs) + (size_t)(i) * (stride)))

/* Before a binding releases the GIL: `local` holds `total` ids, and the scratch of
 * psflow_map_ids for jobs of at most `most` ids (freed by the caller). 0, or -1 with the error
 * set. */
static int prepare(const char *name, const Py_buffer *local, Py_ssize_t total, Py_ssize_t most,
                   int64_t **set, unsigned char **used) {
    if (local->len / 8 < total) {
        PyErr_Format(PyExc_ValueError, "%s: `local` is smaller than the ids", name);
        return -1;
    }
    Py_ssize_t slots = hash_slots(most);
    *set = malloc((size_t)slots * sizeof(int64_t));
    *used = malloc((size_t)slots);
    if (*set == NULL || *used == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* The first phase over every job (with MAP), and the second's check of every row it is given
 * (with RUN; -1 too with held_ok: a lookup's row left for the caller), before anything is
 * written: the first failing job, with *why and *at, or -1. */
static Py_ssize_t map_and_check(const void *jobs, size_t stride, Py_ssize_t count, int phases,
                                int held_ok, int64_t *set, unsigned char *used, int64_t *local,
                                int *why, Py_ssize_t *at) {
    int64_t *mine = local;
    for (Py_ssize_t i = 0; i < count && (phases & MAP); i++) {
        const head_t *h = HEAD(jobs, stride, i);
        *why = map_job(&h->u, h->ids, h->n, phases & ABSENT_OK, set, used, mine, at);
        if (*why != 0) return i;
        mine += h->n;
    }
    mine = local;
    for (Py_ssize_t i = 0; i < count && (phases & RUN); i++) {
        const head_t *h = HEAD(jobs, stride, i);
        *at = held_ok ? first_bad_held(mine, h->n, h->u.rows)
                      : psflow_first_bad(mine, h->n, h->u.rows);
        if (*at >= 0) {
            *why = 6;
            return i;
        }
        mine += h->n;
    }
    return -1;
}


/* lookup_rows(jobs, local, phases): each job is (src, src_off, n, dst, dst_off, values, rows,
 * row_bytes, num_embeddings, div, num_shards, shard, q, r, boundary, keys, vals, mask): n int64
 * ids at byte src_off of buffer src, looked up in a table's shard (values: its rows' address,
 * row_bytes each; keys 0 for a fixed table, else its id map's keys, vals and mask), their rows
 * gathered to byte dst_off of buffer dst (which may overlay the ids: they are copied out
 * first). */
#define LOOKUP_FIELDS 18
static PyObject *py_lookup_rows(PyObject *self, PyObject *args) {
    PyObject *jobs;
    Py_buffer local_buf;
    int phases;
    if (!PyArg_ParseTuple(args, "O!w*i", &PyList_Type, &jobs, &local_buf, &phases)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(jobs);
    typedef struct {
        head_t h;
        Py_buffer src, dst;
        Py_ssize_t src_off, dst_off, values, row_bytes;
    } job_t;
    job_t *job = calloc((size_t)(count ? count : 1), sizeof(job_t));
    if (job == NULL) {
        PyBuffer_Release(&local_buf);
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    int64_t *set = NULL;
    unsigned char *used = NULL;
    Py_ssize_t held = 0, total = 0, most = 0, failed = -1, at = -1;
    int why = 0;
    for (; held < count; held++) {
        job_t *j = &job[held];
        PyObject *t = PyList_GET_ITEM(jobs, held);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != LOOKUP_FIELDS) {
            PyErr_SetString(PyExc_TypeError, "lookup_rows: each job is a tuple of 18");
            goto done;
        }
        rule_t *u = &j->h.u;
        if (!PyArg_ParseTuple(t, "y*nnw*nnnnLpiiLLLnnL", &j->src, &j->src_off, &j->h.n, &j->dst,
                              &j->dst_off, &j->values, &u->rows, &j->row_bytes,
                              &u->num_embeddings, &u->div, &u->num_shards, &u->shard, &u->q,
                              &u->r, &u->boundary, &u->keys, &u->vals, &u->mask))
            goto done;
        Py_ssize_t n = j->h.n;
        j->h.ids = (const char *)j->src.buf + j->src_off;
        int fits = n >= 0 && j->row_bytes > 0 && j->src_off >= 0 && j->dst_off >= 0 &&
                   j->src_off <= j->src.len && j->dst_off <= j->dst.len &&
                   n <= (j->src.len - j->src_off) / 8 &&
                   n <= (j->dst.len - j->dst_off) / j->row_bytes;
        if (!fits && failed < 0) {
            failed = held;
            why = 4;
        }
        total += n;
        if (n > most) most = n;
    }
    if (failed < 0 && prepare("lookup_rows", &local_buf, total, most, &set, &used) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    int64_t *local = (int64_t *)local_buf.buf;
    if (failed < 0)
        failed = map_and_check(job, sizeof(job_t), count, phases, phases & ABSENT_OK, set,
                               used, local, &why, &at);
    for (Py_ssize_t i = 0; i < count && failed < 0 && (phases & RUN); i++) {
        job_t *j = &job[i];
        if (phases & ABSENT_OK)
            psflow_gather_held((char *)j->dst.buf + j->dst_off, PTR(const char, j->values),
                               local, j->h.n, j->row_bytes);
        else
            psflow_gather_rows((char *)j->dst.buf + j->dst_off, PTR(const char, j->values),
                               local, j->h.n, j->row_bytes);
        local += j->h.n;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nin", failed, why, failed < 0 ? (Py_ssize_t)-1 : at);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&job[i].src);
        PyBuffer_Release(&job[i].dst);
    }
    PyBuffer_Release(&local_buf);
    free(job);
    free(set);
    free(used);
    return result;
}

/* Row-wise `kind`'s update (0 SGD, 1 Adagrad, 2 Adam, 3 FTRL, 4 RowWiseAdagrad; h1..h4 its
 * settings, in the order of py_sgd .. py_ftrl, py_rowwise_adagrad's as py_adagrad's) of the n rows
 * at `local` with the gradients at g. */
static void update_rows(int kind, int f64_, Py_ssize_t w, Py_ssize_t s1, Py_ssize_t s2,
                        Py_ssize_t s3, const int64_t *local, const char *g, ptrdiff_t n,
                        ptrdiff_t dim, double h1, double h2, double h3, double h4) {
    if (f64_) {
        const f64 *g64 = (const f64 *)g;
        switch (kind) {
        case 0: psflow_sgd_f64(PTR(f64, w), local, g64, n, dim, -h1); break;
        case 1: psflow_adagrad_f64(PTR(f64, w), PTR(f64, s1), local, g64, n, dim, -h1, h2); break;
        case 4:
            psflow_rowwise_adagrad_f64(PTR(f64, w), PTR(f64, s1), local, g64, n, dim, -h1, h2);
            break;
        case 2:
            psflow_adam_f64(PTR(f64, w), PTR(f64, s1), PTR(f64, s2), PTR(int64_t, s3), local, g64,
                            n, dim, h1, h2, h3, h4);
            break;
        default:
            psflow_ftrl_f64(PTR(f64, w), PTR(f64, s1), PTR(f64, s2), local, g64, n, dim, h1, h2,
                            2 * h3, -h4, h4 == -0.5);
        }
        return;
    }
    const f32 *g32 = (const f32 *)g;
    switch (kind) {
    case 0: psflow_sgd_f32(PTR(f32, w), local, g32, n, dim, (f32)-h1); break;
    case 1:
        psflow_adagrad_f32(PTR(f32, w), PTR(f32, s1), local, g32, n, dim, (f32)-h1, (f32)h2);
        break;
    case 4:
        psflow_rowwise_adagrad_f32(PTR(f32, w), PTR(f32, s1), local, g32, n, dim, (f32)-h1,
                                   (f32)h2);
        break;
    case 2:
        psflow_adam_f32(PTR(f32, w), PTR(f32, s1), PTR(f32, s2), PTR(int64_t, s3), local, g32, n,
                        dim, h1, h2, h3, (f32)h4);
        break;
    default:
        psflow_ftrl_f32(PTR(f32, w), PTR(f32, s1), PTR(f32, s2), local, g32, n, dim, (f32)h1,
                        (f32)h2, (f32)(2 * h3), (f32)-h4, h4 == -0.5);
    }
}

/* apply_rows(jobs, local, phases): each job is (ids, ids_off, n, grads, grads_off, kind, f64, w,
 * s1, s2, s3, rows, dim, num_embeddings, div, num_shards, shard, q, r, boundary, h1, h2, h3, h4,
 * keys, vals, mask, stamps, stamp, changed, times, time): n int64 ids at byte ids_off of buffer
 * ids, their gradients (n x dim, f64 or f32) at byte grads_off of buffer grads, applied to a
 * table's shard (w: its rows; s1..s3: its optimizer state, as the kernels above take them; the id
 * map as in lookup_rows) by row-wise `kind` (as update_rows takes it; h1..h4 its settings). Each
 * updated row's int64 at `stamps` is set to `stamp`, its byte at `changed` (the rows an export
 * tracks) to 1, and its double at `times` (a hashed table's time to live: when it was last
 * updated) to `time`, where those are not 0. */
#define APPLY_FIELDS 32
static PyObject *py_apply_rows(PyObject *self, PyObject *args) {
    PyObject *jobs;
    Py_buffer local_buf;
    int phases;
    if (!PyArg_ParseTuple(args, "O!w*i", &PyList_Type, &jobs, &local_buf, &phases)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(jobs);
    typedef struct {
        head_t h;
        Py_buffer ids, grads;
        Py_ssize_t ids_off, grads_off, w, s1, s2, s3, dim, stamps, changed, times;
        long long stamp;
        int kind, f64_;
        double h1, h2, h3, h4, time;
    } job_t;
    job_t *job = calloc((size_t)(count ? count : 1), sizeof(job_t));
    if (job == NULL) {
        PyBuffer_Release(&local_buf);
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    int64_t *set = NULL;
    unsigned char *used = NULL;
    Py_ssize_t held = 0, total = 0, most = 0, failed = -1, at = -1;
    int why = 0;
    for (; held < count; held++) {
        job_t *j = &job[held];
        PyObject *t = PyList_GET_ITEM(jobs, held);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != APPLY_FIELDS) {
            PyErr_SetString(PyExc_TypeError, "apply_rows: each job is a tuple of 32");
            goto done;
        }
        rule_t *u = &j->h.u;
        if (!PyArg_ParseTuple(t, "y*nny*nipnnnnnnLpiiLLLddddnnLnLnnd", &j->ids, &j->ids_off,
                              &j->h.n, &j->grads, &j->grads_off, &j->kind, &j->f64_, &j->w,
                              &j->s1, &j->s2, &j->s3, &u->rows, &j->dim, &u->num_embeddings,
                              &u->div, &u->num_shards, &u->shard, &u->q, &u->r, &u->boundary,
                              &j->h1, &j->h2, &j->h3, &j->h4, &u->keys, &u->vals, &u->mask,
                              &j->stamps, &j->stamp, &j->changed, &j->times, &j->time))
            goto done;
        Py_ssize_t n = j->h.n, item = j->f64_ ? 8 : 4;
        j->h.ids = (const char *)j->ids.buf + j->ids_off;
        int fits = n >= 0 && j->dim > 0 && j->kind >= 0 && j->kind <= 4 && j->ids_off >= 0 &&
                   j->grads_off >= 0 && j->ids_off <= j->ids.len &&
                   j->grads_off <= j->grads.len && n <= (j->ids.len - j->ids_off) / 8 &&
                   n <= (j->grads.len - j->grads_off) / (j->dim * item);
        if (!fits && failed < 0) {
            failed = held;
            why = 4;
        }
        total += n;
        if (n > most) most = n;
    }
    if (failed < 0 && prepare("apply_rows", &local_buf, total, most, &set, &used) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    int64_t *local = (int64_t *)local_buf.buf;
    if (failed < 0)
        failed = map_and_check(job, sizeof(job_t), count, phases, 0, set, used, local,
                               &why, &at);
    for (Py_ssize_t i = 0; i < count && failed < 0 && (phases & RUN); i++) {
        job_t *j = &job[i];
        const char *g = (const char *)j->grads.buf + j->grads_off;
        ptrdiff_t n = j->h.n, dim = j->dim;
        if (!(phases & MARKS_ONLY))
            update_rows(j->kind, j->f64_, j->w, j->s1, j->s2, j->s3, local, g, n, dim, j->h1,
                        j->h2, j->h3, j->h4);
        if (j->stamps)
            for (ptrdiff_t k = 0; k < n; k++) PTR(int64_t, j->stamps)[local[k]] = j->stamp;
        if (j->changed)
            for (ptrdiff_t k = 0; k < n; k++) PTR(unsigned char, j->changed)[local[k]] = 1;
        if (j->times)
            for (ptrdiff_t k = 0; k < n; k++) PTR(double, j->times)[local[k]] = j->time;
        local += n;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("nin", failed, why, failed < 0 ? (Py_ssize_t)-1 : at);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&job[i].ids);
        PyBuffer_Release(&job[i].grads);
    }
    PyBuffer_Release(&local_buf);
    free(job);
    free(set);
    free(used);
    return result;
}

static PyMethodDef methods[] = {
    {"sgd", py_sgd, METH_VARARGS, "Row-wise SGD in place; -1 or the first bad index."},
    {"adagrad", py_adagrad, METH_VARARGS, "Row-wise Adagrad in place; -1 or the first bad index."},
    {"rowwise_adagrad", py_rowwise_adagrad, METH_VARARGS,
     "TorchRec's RowWiseAdagrad (one accumulator a row) in place; -1 or the first bad index."},
    {"adam", py_adam, METH_VARARGS, "Row-wise lazy Adam in place; -1 or the first bad index."},
    {"ftrl", py_ftrl, METH_VARARGS, "Row-wise FTRL-Proximal in place; -1 or the first bad index."},
    {"group_ids", py_group_ids, METH_VARARGS, "A batch's unique ids grouped by shard; how many."},
    {"local_index", py_local_index, METH_VARARGS, "Each id's row in its shard's storage."},
    {"check_ids", py_check_ids, METH_VARARGS, "A request's ids: (0, -1) or (reason, position)."},
    {"lookup_rows", py_lookup_rows, METH_VARARGS,
     "A lookup's ids checked and its rows gathered, buffer to buffer: (-1, 0, -1) or a refusal."},
    {"apply_rows", py_apply_rows, METH_VARARGS,
     "A push's row gradients checked and applied, from its buffers: (-1, 0, -1) or a refusal."},
    {"gather", py_gather, METH_VARARGS, "out[i] = src[index[i]]; -1 or the first bad index."},
    {"gather_parts", py_gather_parts, METH_VARARGS,
     "out[i] = row index[i] of rows held in parts; -1 or the first bad index."},
    {"put_rows", py_put_rows, METH_VARARGS, "dst[index[i]] = src[i]; -1 or the first bad index."},
    {"fill_rows", py_fill_rows, METH_VARARGS, "dst[index[i]] = row; -1 or the first bad index."},
    {"scatter_add", py_scatter_add, METH_VARARGS, "out[index[i]] += src[i]; -1 or the first bad."},
    {"idmap_find", py_idmap_find, METH_VARARGS, "Each id's cell (or slot) in an id map, or -1."},
    {"idmap_put", py_idmap_put, METH_VARARGS, "Adds ids to an id map; removed cells reused."},
    {"idmap_move", py_idmap_move, METH_VARARGS, "Every id of one id map put into another's."},
    {"least_recent", py_least_recent, METH_VARARGS, "The k least update counts, in order."},
    {"finite", py_finite, METH_VARARGS, "Whether no float32 (float64) value is inf or NaN."},
    {"splitmix64", py_splitmix64, METH_VARARGS, "splitmix64's finaliser of each int64."},
    {"initial_uniforms", py_initial_uniforms, METH_VARARGS, "The uniforms of initial rows."},
    {"normals", py_normals, METH_VARARGS, "Initial rows' normals made and placed, cast."},
    {"sketch_count", py_sketch_count, METH_VARARGS, "One push of each id counted in a sketch."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
