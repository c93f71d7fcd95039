/* Initial rows of embedding tables (psflow/sparse/init.py), the integer half in C: each value
 * of row `id` is a counter-based hash (splitmix64) of (seed, id, column pair), made two uniform
 * numbers for Box-Muller. torch computes the logarithm, square root, sine and cosine of those
 * uniforms (the vectorised maths of its own build, so that a row is the same bits on either
 * path), and psflow_normals_* makes the normals of them and places them, cast, into the rows.
 * Every step here is exact or one correctly rounded IEEE operation (integer arithmetic, an
 * integer below 2**33 made a double, a multiplication), so it equals torch's int64 and float64
 * ops to the bit. Plain C, no Python: psflow/sparse/_kernels.c is the binding.
 */
#include <stddef.h>
#include <stdint.h>

#include "_kernels.h"

#define PAIR_STEP 0xD1B54A32D192ED03ULL

void psflow_splitmix64(const int64_t *in, ptrdiff_t n, int64_t *out) {
    for (ptrdiff_t i = 0; i < n; i++) out[i] = (int64_t)psflow_mix64((uint64_t)in[i]);
}

void psflow_initial_uniforms(const int64_t *ids, ptrdiff_t n, int64_t seed_key, ptrdiff_t pairs,
                             f64 angle, f64 *u1, f64 *u2) {
    for (ptrdiff_t i = 0; i < n; i++) {
        uint64_t key = psflow_mix64((uint64_t)ids[i] ^ (uint64_t)seed_key);
        f64 *a = u1 + i * pairs, *b = u2 + i * pairs;
        for (ptrdiff_t p = 0; p < pairs; p++) {
            uint64_t h = psflow_mix64(key + (uint64_t)(p + 1) * PAIR_STEP);
            a[p] = (f64)((h >> 32) + 1) * 0x1p-32; /* in (0, 1]: the logarithm never sees 0 */
            b[p] = (f64)(h & 0xFFFFFFFFULL) * angle;
        }
    }
}

/* The normals of a row's pairs, cast to the rows' type, from torch's sqrt(log(u1) * -2) and
 * cos(u2) and sin(u2): r = root * std, out[i, 2p] = cos[i, p] * r and out[i, 2p + 1] = sin[i, p]
 * * r while below dim (an odd dim drops the last sine). torch's own are its build's vectorised
 * maths (its sqrt is MKL's, not always the correctly rounded one); the products here are IEEE
 * multiplications in torch's order (mul_(std), mul_(r)), with no contraction into fused
 * multiply-adds (-ffp-contract=off): torch's bits, three tensor operations less. */
#define NORMALS(T)                                                                           \
    void psflow_normals_##T(T *out, const f64 *root, const f64 *c, const f64 *s, ptrdiff_t n, \
                            ptrdiff_t pairs, ptrdiff_t dim, f64 std) {                       \
        for (ptrdiff_t i = 0; i < n; i++) {                                                  \
            T *row = out + i * dim;                                                          \
            const f64 *ri = root + i * pairs, *ci = c + i * pairs, *si = s + i * pairs;      \
            for (ptrdiff_t p = 0; p < pairs; p++) {                                          \
                f64 r = ri[p] * std;                                                         \
                row[2 * p] = (T)(ci[p] * r);                                                 \
                if (2 * p + 1 < dim) row[2 * p + 1] = (T)(si[p] * r);                        \
            }                                                                                \
        }                                                                                    \
    }

NORMALS(f32)
NORMALS(f64)
