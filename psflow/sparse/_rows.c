/* Row kernels for embedding tables: fused row-wise optimizer updates on the ps, the gather of
 * rows (a lookup, a forward pass) and its gradient. Plain C, no Python: psflow/sparse/_kernels.c
 * is the binding, _kernels.h declares these.
 *
 * torch applies a row-wise update as a chain of index operations (gather the rows' state,
 * compute, scatter back), each one a pass over the touched rows: on a real table those rows
 * are scattered through hundreds of megabytes, and every pass misses the cache again. Here
 * each row is read and written once, with its state beside it, in the order of torch's own
 * arithmetic (psflow/sparse/optim.py is the reference; tests/unit/test_sparse_optim.py checks
 * both against the single-process references).
 *
 * The binding checks every index against the row count (psflow_first_bad) before any of these
 * touches memory.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_kernels.h"

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

/* The rows of a step lie scattered through the table: each is a fresh cache miss, and nothing
 * predicts the next. Asking for row i + AHEAD's lines while row i is computed overlaps those
 * misses (2,048 rows of a 1M x 64 float32 Adagrad shard: see kernels.py). */
#define AHEAD 16

static inline void prefetch_row(const void *row, ptrdiff_t bytes) {
    for (ptrdiff_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b, 1, 0);
}

#define PREFETCH(T, base, i)                                                                 \
    if ((i) + AHEAD < n) prefetch_row(base + index[(i) + AHEAD] * dim, dim * (ptrdiff_t)sizeof(T))

/* w -= lr * g */
#define SGD(T)                                                                               \
    CLONES                                                                                   \
    void psflow_sgd_##T(T *w, const int64_t *index, const T *g, ptrdiff_t n, ptrdiff_t dim,  \
                        T alpha) {                                                           \
        for (ptrdiff_t i = 0; i < n; i++) {                                                  \
            PREFETCH(T, w, i);                                                               \
            T *wr = w + index[i] * dim;                                                      \
            const T *gr = g + i * dim;                                                       \
            for (ptrdiff_t j = 0; j < dim; j++) wr[j] = wr[j] + alpha * gr[j];               \
        }                                                                                    \
    }

/* sum += g^2; w += (g / (sqrt(sum) + eps)) * -lr */
#define ADAGRAD(T, SQRT)                                                                     \
    CLONES                                                                                   \
    void psflow_adagrad_##T(T *w, T *sum, const int64_t *index, const T *g, ptrdiff_t n,     \
                            ptrdiff_t dim, T neg_lr, T eps) {                                \
        for (ptrdiff_t i = 0; i < n; i++) {                                                  \
            PREFETCH(T, w, i);                                                               \
            PREFETCH(T, sum, i);                                                             \
            T *wr = w + index[i] * dim, *sr = sum + index[i] * dim;                          \
            const T *gr = g + i * dim;                                                       \
            for (ptrdiff_t j = 0; j < dim; j++) {                                            \
                T s = sr[j] + gr[j] * gr[j];                                                 \
                sr[j] = s;                                                                   \
                wr[j] = wr[j] + (gr[j] / (SQRT(s) + eps)) * neg_lr;                          \
            }                                                                                \
        }                                                                                    \
    }

/* TorchRec's RowWiseAdagrad (FBGEMM's exact row-wise Adagrad): one accumulator a row, the mean
 * of the row's squared gradient, so a row's state is one number instead of `dim`:
 * sum += mean(g^2); w += g * (-lr / (sqrt(sum) + eps)), the step once a row as FBGEMM's CPU
 * kernel takes it (no division an element). The mean's sum in an order torch's ops repeat
 * (psflow/sparse/optim.py, _mean_square): LANES running sums, element j into sum j % LANES, a
 * row's elements in order (a short row's missing ones 0, which adds nothing), then the LANES
 * sums halved pairwise. */
#define LANES 8
#define ROWWISE_ADAGRAD(T, SQRT)                                                             \
    CLONES                                                                                   \
    void psflow_rowwise_adagrad_##T(T *w, T *sum, const int64_t *index, const T *g,          \
                                    ptrdiff_t n, ptrdiff_t dim, T neg_lr, T eps) {           \
        for (ptrdiff_t i = 0; i < n; i++) {                                                  \
            PREFETCH(T, w, i);                                                               \
            if (i + AHEAD < n) __builtin_prefetch(sum + index[i + AHEAD], 1, 0);             \
            T *wr = w + index[i] * dim;                                                      \
            const T *gr = g + i * dim;                                                       \
            T lane[LANES] = {0};                                                             \
            ptrdiff_t j = 0;                                                                 \
            for (; j + LANES <= dim; j += LANES)                                             \
                for (int k = 0; k < LANES; k++) lane[k] = lane[k] + gr[j + k] * gr[j + k];   \
            for (int k = 0; j + k < dim; k++) lane[k] = lane[k] + gr[j + k] * gr[j + k];     \
            for (int half = LANES / 2; half > 0; half /= 2)                                  \
                for (int k = 0; k < half; k++) lane[k] = lane[k] + lane[k + half];           \
            const T s = sum[index[i]] + lane[0] / (T)dim;                                    \
            sum[index[i]] = s;                                                               \
            const T step = neg_lr / (SQRT(s) + eps);                                         \
            for (j = 0; j < dim; j++) wr[j] = wr[j] + gr[j] * step;                          \
        }                                                                                    \
    }

/* torch.optim.SparseAdam with a step count per row: m += (g - m)(1 - b1);
 * v += (g^2 - v)(1 - b2); w -= m / (sqrt(v) + eps) * (lr * sqrt(1 - b2^t) / (1 - b1^t)),
 * the step size in double as torch computes it, then rounded to T. */
#define ADAM(T, SQRT)                                                                        \
    CLONES                                                                                   \
    void psflow_adam_##T(T *w, T *m, T *v, int64_t *step, const int64_t *index, const T *g,  \
                         ptrdiff_t n, ptrdiff_t dim, double lr, double b1, double b2,        \
                         T eps) {                                                            \
        const T c1 = (T)(1.0 - b1), c2 = (T)(1.0 - b2);                                      \
        for (ptrdiff_t i = 0; i < n; i++) {                                                  \
            PREFETCH(T, w, i);                                                               \
            PREFETCH(T, m, i);                                                               \
            PREFETCH(T, v, i);                                                               \
            const int64_t r = index[i];                                                      \
            const int64_t t = ++step[r];                                                     \
            const T size = (T)(sqrt(1.0 - pow(b2, (double)t)) / (1.0 - pow(b1, (double)t)) * lr); \
            T *wr = w + r * dim, *mr = m + r * dim, *vr = v + r * dim;                       \
            const T *gr = g + i * dim;                                                       \
            for (ptrdiff_t j = 0; j < dim; j++) {                                            \
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
    void psflow_ftrl_##T(T *w, T *accum, T *linear, const int64_t *index, const T *g,        \
                         ptrdiff_t n, ptrdiff_t dim, T lr, T l1, T two_l2, T neg_power,      \
                         int sqrt_power) {                                                   \
        for (ptrdiff_t i = 0; i < n; i++) {                                                  \
            PREFETCH(T, w, i);                                                               \
            PREFETCH(T, accum, i);                                                           \
            PREFETCH(T, linear, i);                                                          \
            const int64_t r = index[i];                                                      \
            T *wr = w + r * dim, *ar = accum + r * dim, *lr_ = linear + r * dim;             \
            const T *gr = g + i * dim;                                                       \
            for (ptrdiff_t j = 0; j < dim; j++) {                                            \
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

SGD(f32)
SGD(f64)
ADAGRAD(f32, sqrtf)
ADAGRAD(f64, sqrt)
ROWWISE_ADAGRAD(f32, sqrtf)
ROWWISE_ADAGRAD(f64, sqrt)
ADAM(f32, sqrtf)
ADAM(f64, sqrt)
FTRL(f32, sqrtf, powf, fabsf)
FTRL(f64, sqrt, pow, fabs)

/* out[i] = src[index[i]] for rows of `bytes` bytes (any dtype): a lookup's rows. */
void psflow_gather_rows(char *out, const char *src, const int64_t *index, ptrdiff_t n,
                        ptrdiff_t bytes) {
    for (ptrdiff_t i = 0; i < n; i++) {
        if (i + AHEAD < n) prefetch_row(src + index[i + AHEAD] * bytes, bytes);
        memcpy(out + i * bytes, src + index[i] * bytes, (size_t)bytes);
    }
}

void psflow_gather_held(char *out, const char *src, const int64_t *index, ptrdiff_t n,
                        ptrdiff_t bytes) {
    for (ptrdiff_t i = 0; i < n; i++) {
        if (i + AHEAD < n && index[i + AHEAD] >= 0)
            prefetch_row(src + index[i + AHEAD] * bytes, bytes);
        if (index[i] >= 0) memcpy(out + i * bytes, src + index[i] * bytes, (size_t)bytes);
    }
}

void psflow_put_rows(char *dst, const char *src, const int64_t *index, ptrdiff_t n,
                     ptrdiff_t bytes) {
    for (ptrdiff_t i = 0; i < n; i++) memcpy(dst + index[i] * bytes, src + i * bytes, (size_t)bytes);
}

void psflow_fill_rows(char *dst, const int64_t *index, ptrdiff_t n, const char *row,
                      ptrdiff_t bytes) {
    for (ptrdiff_t i = 0; i < n; i++) memcpy(dst + index[i] * bytes, row, (size_t)bytes);
}

/* out[i] = row index[i] of rows held in parts: part p holds rows [starts[p], starts[p + 1]) at
 * srcs[p] (each shard's rows where they came in, a lane of shared memory: no copy joins them
 * first). */
static inline const char *part_row(const char *const *srcs, const int64_t *starts,
                                   ptrdiff_t parts, int64_t row, ptrdiff_t bytes) {
    ptrdiff_t p = parts - 1;
    while (p > 0 && row < starts[p]) p--;
    return srcs[p] + (row - starts[p]) * bytes;
}

/* No prefetch here, unlike a table's gathers: the parts are a step's replies, a few hundred KB
 * the caches hold, and finding each row's part twice (for the prefetch, then the copy) cost
 * more than the copy (13,312 rows of 64 bytes from 4 parts: 169 us with it, 51 without, 38 with
 * the width known when compiled, one core, in cache). */
#define GATHER_PARTS_OF(WIDTH)                                                                   \
    for (ptrdiff_t i = 0; i < n; i++)                                                            \
        memcpy(out + i * (WIDTH), part_row(srcs, starts, parts, index[i], WIDTH), (size_t)(WIDTH));

void psflow_gather_parts(char *out, const char *const *srcs, const int64_t *starts,
                         ptrdiff_t parts, const int64_t *index, ptrdiff_t n, ptrdiff_t bytes) {
    switch (bytes) {  /* a memcpy of a constant size is a few moves, of a variable one a call */
    case 64: GATHER_PARTS_OF(64) break;  /* 16 float32s: DLRM's and DeepRec's rows */
    case 128: GATHER_PARTS_OF(128) break;
    case 256: GATHER_PARTS_OF(256) break;  /* 64 float32s */
    default: GATHER_PARTS_OF(bytes)
    }
}

/* 1 when none of the n float32 (float64) values at p is an infinity or a NaN, whose exponent
 * bits are all ones: one pass with no early exit, a comparison a value OR-ed into one flag,
 * which the compiler makes vectors of (a gradient check at the speed of reading it). */
CLONES int psflow_finite_f32(const uint32_t *p, ptrdiff_t n) {
    unsigned bad = 0;
    for (ptrdiff_t i = 0; i < n; i++) bad |= (p[i] & 0x7F800000u) == 0x7F800000u;
    return !bad;
}

CLONES int psflow_finite_f64(const uint64_t *p, ptrdiff_t n) {
    unsigned bad = 0;
    for (ptrdiff_t i = 0; i < n; i++)
        bad |= (p[i] & 0x7FF0000000000000ull) == 0x7FF0000000000000ull;
    return !bad;
}

/* out = zeros(rows, dim), then out[index[i]] += src[i]: the gradient of a gather (rows used
 * several times add up). `out` comes uninitialised: a row's first use writes it (0 + src, so
 * a -0.0 comes out 0.0, as the sum into zeros gives), later uses add, and only rows no index
 * names are zeroed at the end: no pass over the whole output before the scatter (a lookup's
 * 4,096 x 64 float32 gradient: 1 MB of memset saved). `seen`: `rows` zeroed bytes. */
#define SCATTER_ADD(T)                                                                       \
    CLONES                                                                                   \
    void psflow_scatter_add_##T(T *out, const T *src, const int64_t *index, ptrdiff_t n,     \
                                ptrdiff_t dim, ptrdiff_t rows, unsigned char *seen) {        \
        for (ptrdiff_t i = 0; i < n; i++) {                                                  \
            T *o = out + index[i] * dim;                                                     \
            const T *r = src + i * dim;                                                      \
            if (seen[index[i]]) {                                                            \
                for (ptrdiff_t j = 0; j < dim; j++) o[j] += r[j];                            \
            } else {                                                                         \
                seen[index[i]] = 1;                                                          \
                for (ptrdiff_t j = 0; j < dim; j++) o[j] = (T)0 + r[j];                      \
            }                                                                                \
        }                                                                                    \
        for (ptrdiff_t u = 0; u < rows; u++)                                                 \
            if (!seen[u]) memset(out + u * dim, 0, (size_t)dim * sizeof(T));                 \
    }
SCATTER_ADD(f32)
SCATTER_ADD(f64)
