/* Row kernels for embedding tables: fused row-wise optimizer updates on the ps, the gather of
 * rows (a lookup, a forward pass) with its gradient, the partition of ids to shards, and a
 * hashed table's id map. psflow's other compiled code (FarmHash, the Example parser) is the
 * data layer's, in psflow/data/_native.c: nothing here reads bytes off a file.
 *
 * torch applies a row-wise update as a chain of index operations (gather the rows' state,
 * compute, scatter back), each one a pass over the touched rows: on a real table those rows
 * are scattered through hundreds of megabytes, and every pass misses the cache again. Here
 * each row is read and written once, with its state beside it, in the order of torch's own
 * arithmetic (psflow/sparse/optim.py is the reference; tests/unit/test_sparse_optim.py checks
 * both against the single-process references).
 *
 * The Python side (psflow/sparse/kernels.py) passes raw pointers of contiguous CPU tensors it
 * has checked (dtype, shape, contiguity); each function still checks every index against the
 * row count before it touches memory, and returns the position of the first bad one. The GIL
 * is released while a kernel runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The update loops in two builds, chosen when the module loads by what the CPU has: AVX2 (8
 * floats a vector) and the x86-64 baseline (SSE2, 4). An update's sqrt and division are the
 * step's arithmetic: a hot 2,048 x 64 float32 Adagrad update took 90 us with SSE2 and 48 us
 * with AVX2 (AVX-512: 45). Every operation stays an IEEE one, correctly rounded, with no
 * contraction into fused multiply-adds (-ffp-contract=off), so both builds give the same bits.
 * Only where GCC and glibc make the choice at load time (an ifunc); one build elsewhere. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* -1 when every index is in [0, rows), else the position of the first that is not. */
static Py_ssize_t first_bad(const int64_t *index, Py_ssize_t n, Py_ssize_t rows) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (index[i] < 0 || index[i] >= rows) return i;
    }
    return -1;
}

/* The rows of a step lie scattered through the table: each is a fresh cache miss, and nothing
 * predicts the next. Asking for row i + AHEAD's lines while row i is computed overlaps those
 * misses (2,048 rows of a 1M x 64 float32 Adagrad shard: see kernels.py). */
#define AHEAD 16

static inline void prefetch_row(const void *row, Py_ssize_t bytes) {
    for (Py_ssize_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b, 1, 0);
}

#define PREFETCH(T, base, i)                                                                 \
    if ((i) + AHEAD < n) prefetch_row(base + index[(i) + AHEAD] * dim, dim * (Py_ssize_t)sizeof(T))

/* w -= lr * g */
#define SGD(T)                                                                               \
    CLONES                                                                                   \
    static void sgd_##T(T *w, const int64_t *index, const T *g, Py_ssize_t n, Py_ssize_t dim, \
                        T alpha) {                                                           \
        for (Py_ssize_t i = 0; i < n; i++) {                                                 \
            PREFETCH(T, w, i);                                                               \
            T *wr = w + index[i] * dim;                                                      \
            const T *gr = g + i * dim;                                                       \
            for (Py_ssize_t j = 0; j < dim; j++) wr[j] = wr[j] + alpha * gr[j];              \
        }                                                                                    \
    }

/* sum += g^2; w += (g / (sqrt(sum) + eps)) * -lr */
#define ADAGRAD(T, SQRT)                                                                     \
    CLONES                                                                                   \
    static void adagrad_##T(T *w, T *sum, const int64_t *index, const T *g, Py_ssize_t n,    \
                            Py_ssize_t dim, T neg_lr, T eps) {                               \
        for (Py_ssize_t i = 0; i < n; i++) {                                                 \
            PREFETCH(T, w, i);                                                               \
            PREFETCH(T, sum, i);                                                             \
            T *wr = w + index[i] * dim, *sr = sum + index[i] * dim;                          \
            const T *gr = g + i * dim;                                                       \
            for (Py_ssize_t j = 0; j < dim; j++) {                                           \
                T s = sr[j] + gr[j] * gr[j];                                                 \
                sr[j] = s;                                                                   \
                wr[j] = wr[j] + (gr[j] / (SQRT(s) + eps)) * neg_lr;                          \
            }                                                                                \
        }                                                                                    \
    }

/* torch.optim.SparseAdam with a step count per row: m += (g - m)(1 - b1);
 * v += (g^2 - v)(1 - b2); w -= m / (sqrt(v) + eps) * (lr * sqrt(1 - b2^t) / (1 - b1^t)),
 * the step size in double as torch computes it, then rounded to T. */
#define ADAM(T, SQRT)                                                                        \
    CLONES                                                                                   \
    static void adam_##T(T *w, T *m, T *v, int64_t *step, const int64_t *index, const T *g,  \
                         Py_ssize_t n, Py_ssize_t dim, double lr, double b1, double b2,      \
                         T eps) {                                                            \
        const T c1 = (T)(1.0 - b1), c2 = (T)(1.0 - b2);                                      \
        for (Py_ssize_t i = 0; i < n; i++) {                                                 \
            PREFETCH(T, w, i);                                                               \
            PREFETCH(T, m, i);                                                               \
            PREFETCH(T, v, i);                                                               \
            const int64_t r = index[i];                                                      \
            const int64_t t = ++step[r];                                                     \
            const T size = (T)(sqrt(1.0 - pow(b2, (double)t)) / (1.0 - pow(b1, (double)t)) * lr); \
            T *wr = w + r * dim, *mr = m + r * dim, *vr = v + r * dim;                       \
            const T *gr = g + i * dim;                                                       \
            for (Py_ssize_t j = 0; j < dim; j++) {                                           \
                T mj = mr[j] + (gr[j] - mr[j]) * c1;                                         \
                T vj = vr[j] + (gr[j] * gr[j] - vr[j]) * c2;                                 \
                mr[j] = mj;                                                                  \
                vr[j] = vj;                                                                  \
                wr[j] = wr[j] - (mj / (SQRT(vj) + eps)) * size;                              \
            }                                                                                \
        }                                                                                    \
    }

/* TensorFlow's ApplyFtrl (training_ops.cc), per row, as psflow/sparse/optim.py's _ftrl. */
#define FTRL(T, SQRT, POW, FABS)                                                             \
    CLONES                                                                                   \
    static void ftrl_##T(T *w, T *accum, T *linear, const int64_t *index, const T *g,        \
                         Py_ssize_t n, Py_ssize_t dim, T lr, T l1, T two_l2, T neg_power,    \
                         int sqrt_power) {                                                   \
        for (Py_ssize_t i = 0; i < n; i++) {                                                 \
            PREFETCH(T, w, i);                                                               \
            PREFETCH(T, accum, i);                                                           \
            PREFETCH(T, linear, i);                                                          \
            const int64_t r = index[i];                                                      \
            T *wr = w + r * dim, *ar = accum + r * dim, *lr_ = linear + r * dim;             \
            const T *gr = g + i * dim;                                                       \
            for (Py_ssize_t j = 0; j < dim; j++) {                                           \
                T a = ar[j], gj = gr[j];                                                     \
                T na = a + gj * gj;                                                          \
                T new_p = sqrt_power ? SQRT(na) : POW(na, neg_power);                        \
                T old_p = sqrt_power ? SQRT(a) : POW(a, neg_power);                          \
                T lin = (lr_[j] + gj) - ((new_p - old_p) / lr) * wr[j];                      \
                lr_[j] = lin;                                                                \
                T sign = (T)((lin > 0) - (lin < 0));                                         \
                T x = sign * l1 - lin;                                                       \
                T y = new_p / lr + two_l2;                                                   \
                wr[j] = FABS(lin) > l1 ? x / y : (T)0;                                       \
                ar[j] = na;                                                                  \
            }                                                                                \
        }                                                                                    \
    }

typedef double f64;
typedef float f32;
SGD(f32)
SGD(f64)
ADAGRAD(f32, sqrtf)
ADAGRAD(f64, sqrt)
ADAM(f32, sqrtf)
ADAM(f64, sqrt)
FTRL(f32, sqrtf, powf, fabsf)
FTRL(f64, sqrt, pow, fabs)

#define PTR(T, p) ((T *)(uintptr_t)(p))

/* out[i] = src[index[i]] for rows of `bytes` bytes (any dtype): a lookup's rows. */
static void gather_rows(char *out, const char *src, const int64_t *index, Py_ssize_t n,
                        Py_ssize_t bytes) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) prefetch_row(src + index[i + AHEAD] * bytes, bytes);
        memcpy(out + i * bytes, src + index[i] * bytes, (size_t)bytes);
    }
}

/* out[i] = row index[i] of rows held in parts: part p holds rows [starts[p], starts[p + 1]) at
 * srcs[p] (each shard's rows where they came in, a lane of shared memory: no copy joins them
 * first). */
static inline const char *part_row(const char *const *srcs, const int64_t *starts,
                                   Py_ssize_t parts, int64_t row, Py_ssize_t bytes) {
    Py_ssize_t p = parts - 1;
    while (p > 0 && row < starts[p]) p--;
    return srcs[p] + (row - starts[p]) * bytes;
}

static void gather_parts(char *out, const char *const *srcs, const int64_t *starts,
                         Py_ssize_t parts, const int64_t *index, Py_ssize_t n, Py_ssize_t bytes) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) prefetch_row(part_row(srcs, starts, parts, index[i + AHEAD], bytes), bytes);
        memcpy(out + i * bytes, part_row(srcs, starts, parts, index[i], bytes), (size_t)bytes);
    }
}

/* out = zeros(rows, dim), then out[index[i]] += src[i]: the gradient of a gather (rows used
 * several times add up). `out` comes uninitialised: a row's first use writes it (0 + src, so
 * a -0.0 comes out 0.0, as the sum into zeros gives), later uses add, and only rows no index
 * names are zeroed at the end: no pass over the whole output before the scatter (a lookup's
 * 4,096 x 64 float32 gradient: 1 MB of memset saved). `seen`: `rows` zeroed bytes. */
#define SCATTER_ADD(T)                                                                       \
    CLONES                                                                                   \
    static void scatter_add_##T(T *out, const T *src, const int64_t *index, Py_ssize_t n,    \
                                Py_ssize_t dim, Py_ssize_t rows, unsigned char *seen) {      \
        for (Py_ssize_t i = 0; i < n; i++) {                                                 \
            T *o = out + index[i] * dim;                                                     \
            const T *r = src + i * dim;                                                      \
            if (seen[index[i]]) {                                                            \
                for (Py_ssize_t j = 0; j < dim; j++) o[j] += r[j];                           \
            } else {                                                                         \
                seen[index[i]] = 1;                                                          \
                for (Py_ssize_t j = 0; j < dim; j++) o[j] = (T)0 + r[j];                     \
            }                                                                                \
        }                                                                                    \
        for (Py_ssize_t u = 0; u < rows; u++)                                                \
            if (!seen[u]) memset(out + u * dim, 0, (size_t)dim * sizeof(T));                 \
    }
SCATTER_ADD(f32)
SCATTER_ADD(f64)

static PyObject *py_gather(PyObject *self, PyObject *args) {
    Py_ssize_t out, src, index, n, bytes, rows;
    if (!PyArg_ParseTuple(args, "nnnnnn", &out, &src, &index, &n, &bytes, &rows)) return NULL;
    Py_ssize_t bad = first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    gather_rows(PTR(char, out), PTR(const char, src), PTR(int64_t, index), n, bytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

/* (out, srcs: int64 pointers, starts: int64 first rows, parts, index, n, bytes, rows) */
static PyObject *py_gather_parts(PyObject *self, PyObject *args) {
    Py_ssize_t out, srcs, starts, parts, index, n, bytes, rows;
    if (!PyArg_ParseTuple(args, "nnnnnnnn", &out, &srcs, &starts, &parts, &index, &n, &bytes,
                          &rows))
        return NULL;
    Py_ssize_t bad = first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    gather_parts(PTR(char, out), PTR(const char *const, srcs), PTR(int64_t, starts), parts,
                 PTR(int64_t, index), n, bytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

static PyObject *py_scatter_add(PyObject *self, PyObject *args) {
    int f64_;
    Py_ssize_t out, src, index, n, dim, rows;
    if (!PyArg_ParseTuple(args, "pnnnnnn", &f64_, &out, &src, &index, &n, &dim, &rows))
        return NULL;
    Py_ssize_t bad = first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    unsigned char *seen = calloc(rows > 0 ? (size_t)rows : 1, 1);
    if (seen == NULL) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    if (f64_) scatter_add_f64(PTR(f64, out), PTR(f64, src), PTR(int64_t, index), n, dim, rows, seen);
    else scatter_add_f32(PTR(f32, out), PTR(f32, src), PTR(int64_t, index), n, dim, rows, seen);
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
    Py_ssize_t bad = first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    if (f64_) sgd_f64(PTR(f64, w), PTR(int64_t, index), PTR(f64, g), n, dim, -lr);
    else sgd_f32(PTR(f32, w), PTR(int64_t, index), PTR(f32, g), n, dim, (f32)-lr);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

static PyObject *py_adagrad(PyObject *self, PyObject *args) {
    int f64_;
    Py_ssize_t w, sum, index, g, n, dim, rows;
    double lr, eps;
    if (!PyArg_ParseTuple(args, "pnnnnnnndd", &f64_, &w, &sum, &index, &g, &n, &dim, &rows, &lr,
                          &eps))
        return NULL;
    Py_ssize_t bad = first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    if (f64_)
        adagrad_f64(PTR(f64, w), PTR(f64, sum), PTR(int64_t, index), PTR(f64, g), n, dim, -lr,
                    eps);
    else
        adagrad_f32(PTR(f32, w), PTR(f32, sum), PTR(int64_t, index), PTR(f32, g), n, dim,
                    (f32)-lr, (f32)eps);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

static PyObject *py_adam(PyObject *self, PyObject *args) {
    int f64_;
    Py_ssize_t w, m, v, step, index, g, n, dim, rows;
    double lr, b1, b2, eps;
    if (!PyArg_ParseTuple(args, "pnnnnnnnnndddd", &f64_, &w, &m, &v, &step, &index, &g, &n,
                          &dim, &rows, &lr, &b1, &b2, &eps))
        return NULL;
    Py_ssize_t bad = first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    Py_BEGIN_ALLOW_THREADS
    if (f64_)
        adam_f64(PTR(f64, w), PTR(f64, m), PTR(f64, v), PTR(int64_t, step), PTR(int64_t, index),
                 PTR(f64, g), n, dim, lr, b1, b2, eps);
    else
        adam_f32(PTR(f32, w), PTR(f32, m), PTR(f32, v), PTR(int64_t, step), PTR(int64_t, index),
                 PTR(f32, g), n, dim, lr, b1, b2, (f32)eps);
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
    Py_ssize_t bad = first_bad(PTR(int64_t, index), n, rows);
    if (bad >= 0) return PyLong_FromSsize_t(bad);
    int sqrt_power = lr_power == -0.5;
    Py_BEGIN_ALLOW_THREADS
    if (f64_)
        ftrl_f64(PTR(f64, w), PTR(f64, accum), PTR(f64, linear), PTR(int64_t, index),
                 PTR(f64, g), n, dim, lr, l1, 2 * l2, -lr_power, sqrt_power);
    else
        ftrl_f32(PTR(f32, w), PTR(f32, accum), PTR(f32, linear), PTR(int64_t, index),
                 PTR(f32, g), n, dim, (f32)lr, (f32)l1, (f32)(2 * l2), (f32)-lr_power,
                 sqrt_power);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

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
static PyObject *py_local_index(PyObject *self, PyObject *args) {
    Py_ssize_t ids_, n, out_;
    long long shards, q, r, boundary;
    int div;
    if (!PyArg_ParseTuple(args, "nnpLLLLn", &ids_, &n, &div, &shards, &q, &r, &boundary, &out_))
        return NULL;
    const int64_t *ids = PTR(int64_t, ids_);
    int64_t *out = PTR(int64_t, out_);
    Py_BEGIN_ALLOW_THREADS
    if (shards == 1) {
        memcpy(out, ids, (size_t)n * sizeof(int64_t));
    } else if (!div && (shards & (shards - 1)) == 0) {
        const int shift = __builtin_ctzll((unsigned long long)shards);
        for (Py_ssize_t i = 0; i < n; i++) out[i] = ids[i] >> shift; /* floor, also below 0 */
    } else if (!div) {
        for (Py_ssize_t i = 0; i < n; i++) out[i] = floor_div(ids[i], shards);
    } else {
        const int64_t short_q = q > 0 ? q : 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t id = ids[i];
            out[i] = id < boundary ? floor_mod(id, q + 1) : floor_mod(id - boundary, short_q);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* A request's ids, checked in one pass (psflow/sparse/rows.py's Rows.check_ids says what): each
 * in [0, num_embeddings) (num_embeddings < 0: a hashed table, any id), on `shard` of
 * `num_shards` (mod: id mod S, non-negative as Python's; div: TensorFlow's ranges, the first
 * `boundary` ids in r ranges of q + 1, the rest in ranges of q), and none twice (an open-addressing set
 * of twice as many slots). Returns (0, -1) when all are good, else (1 out of range | 2 another
 * shard's | 3 twice, the position of the first such id). */
static PyObject *py_check_ids(PyObject *self, PyObject *args) {
    Py_ssize_t ids_, n;
    long long num_embeddings, q, r, boundary;
    int div, num_shards, shard;
    if (!PyArg_ParseTuple(args, "nnLpiiLLL", &ids_, &n, &num_embeddings, &div, &num_shards, &shard,
                          &q, &r, &boundary))
        return NULL;
    const int64_t *ids = PTR(int64_t, ids_);
    Py_ssize_t slots = 16;
    while (slots < 2 * n) slots *= 2;
    int64_t *set = malloc((size_t)slots * sizeof(int64_t));
    unsigned char *used = calloc((size_t)slots, 1);
    if (set == NULL || used == NULL) {
        free(set);
        free(used);
        return PyErr_NoMemory();
    }
    int code = 0;
    Py_ssize_t at = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
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
        for (Py_ssize_t k = (Py_ssize_t)(h & (uint64_t)(slots - 1));; k = (k + 1) & (slots - 1)) {
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
    Py_END_ALLOW_THREADS
    free(set);
    free(used);
    return Py_BuildValue("in", code, at);
}

/* A batch's ids (any order, repeats) -> its unique ids grouped by shard, shard 0's first, each
 * shard's in the order they first appear (`unique`, returns how many), where each id of the
 * batch is among them (`positions`), and how many each shard has (`counts`). One pass with an
 * open-addressing map id -> first-appearance number, then the numbers are placed by shard:
 * what torch.unique, then a split by shard (remainder, a stable argsort, a count, a gather per
 * shard) does in seven operations. With `limit` >= 0 (a fixed table's size), an id outside
 * [0, limit) stops it: returns (-1, that id), for the caller to name its table. Else returns
 * (how many unique ids, 0). An id no shard holds (outside a div table) raises IndexError (the
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
    Py_ssize_t slots = 16;
    while (slots < 2 * n) slots *= 2;
    int64_t *keys = malloc((size_t)slots * sizeof(int64_t));
    int64_t *vals = malloc((size_t)slots * sizeof(int64_t));
    int64_t *first = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t)); /* number -> id */
    int64_t *place = malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t)); /* number -> slot */
    int64_t *start = calloc((size_t)num_shards + 1, sizeof(int64_t));
    if (!keys || !vals || !first || !place || !start) {
        free(keys), free(vals), free(first), free(place), free(start);
        return PyErr_NoMemory();
    }
    Py_ssize_t m = 0, bad = -1;
    int64_t bad_id = 0, outside = 0;
    int out_of_range = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < slots; k++) vals[k] = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (limit >= 0 && (id < 0 || id >= limit)) {
            out_of_range = 1;
            outside = id;
            break;
        }
        uint64_t h = ((uint64_t)id * 0x9E3779B97F4A7C15ull) >> 20;
        Py_ssize_t k = (Py_ssize_t)(h & (uint64_t)(slots - 1));
        while (vals[k] >= 0 && keys[k] != id) k = (k + 1) & (slots - 1);
        if (vals[k] < 0) {
            keys[k] = id;
            vals[k] = m;
            first[m++] = id;
        }
        positions[i] = vals[k];
    }
    for (Py_ssize_t u = 0; u < m && !out_of_range; u++) {
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
        for (Py_ssize_t u = 0; u < m; u++) {
            place[u] = start[place[u]]++;
            unique[place[u]] = first[u];
        }
        for (Py_ssize_t i = 0; i < n; i++) positions[i] = place[positions[i]];
    }
    bad_id = bad >= 0 ? first[bad] : 0;
    Py_END_ALLOW_THREADS
    free(keys), free(vals), free(first), free(place), free(start);
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "id %lld is outside the table's shards", (long long)bad_id);
        return NULL;
    }
    if (out_of_range) return Py_BuildValue("nL", (Py_ssize_t)-1, (long long)outside);
    return Py_BuildValue("nL", m, 0LL);
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

/* idmap_find(keys, vals, mask, ids, n, out, slots): out[i] = the cell of ids[i] (with slots:
   its slot), -1 where it is absent. */
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
    for (Py_ssize_t i = 0; i < n; i++) {
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
    long long reused = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && reused >= 0; i++) {
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
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(reused);
}

static PyMethodDef methods[] = {
    {"sgd", py_sgd, METH_VARARGS, "Row-wise SGD in place; -1 or the first bad index."},
    {"adagrad", py_adagrad, METH_VARARGS, "Row-wise Adagrad in place; -1 or the first bad index."},
    {"adam", py_adam, METH_VARARGS, "Row-wise lazy Adam in place; -1 or the first bad index."},
    {"ftrl", py_ftrl, METH_VARARGS, "Row-wise FTRL-Proximal in place; -1 or the first bad index."},
    {"group_ids", py_group_ids, METH_VARARGS, "A batch's unique ids grouped by shard; how many."},
    {"local_index", py_local_index, METH_VARARGS, "Each id's row in its shard's storage."},
    {"check_ids", py_check_ids, METH_VARARGS, "A request's ids: (0, -1) or (reason, position)."},
    {"gather", py_gather, METH_VARARGS, "out[i] = src[index[i]]; -1 or the first bad index."},
    {"gather_parts", py_gather_parts, METH_VARARGS,
     "out[i] = row index[i] of rows held in parts; -1 or the first bad index."},
    {"scatter_add", py_scatter_add, METH_VARARGS, "out[index[i]] += src[i]; -1 or the first bad."},
    {"idmap_find", py_idmap_find, METH_VARARGS, "Each id's cell (or slot) in an id map, or -1."},
    {"idmap_put", py_idmap_put, METH_VARARGS, "Adds ids to an id map; removed cells reused."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
