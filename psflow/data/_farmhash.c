/* FarmHash's Fingerprint64 (its "na" 64-bit hash), TensorFlow's string hash: what
 * tf.strings.to_hash_bucket_fast computes before its modulo (psflow/data/hashing.py). Written
 * from FarmHash's description of farmhashna::Hash64 (Google, MIT licence), checked against
 * TensorFlow's output in tests/unit/test_hashing.py. Multiplications wrap modulo 2**64, as in
 * C++. Plain C, no Python: psflow/data/_native.c is the binding.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_native.h"

static const uint64_t FH_K0 = 0xc3a5c85c97cb3127ull;
static const uint64_t FH_K1 = 0xb492b66fbe98f273ull;
static const uint64_t FH_K2 = 0x9ae16a3b2f90404full;

static inline uint64_t fh_load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t fh_load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t fh_rotr(uint64_t v, unsigned by) { return by ? (v >> by) | (v << (64 - by)) : v; }

static inline uint64_t fh_mix(uint64_t v) { return v ^ (v >> 47); }

static inline uint64_t fh_pair(uint64_t u, uint64_t v, uint64_t mul) {
    uint64_t a = fh_mix((u ^ v) * mul);
    uint64_t b = fh_mix((v ^ a) * mul);
    return b * mul;
}

/* Two 64-bit halves of a quick hash of 32 bytes at p and the seeds a, b. */
static inline void fh_weak32(const uint8_t *p, uint64_t a, uint64_t b, uint64_t *lo, uint64_t *hi) {
    const uint64_t w = fh_load64(p), x = fh_load64(p + 8), y = fh_load64(p + 16),
                   z = fh_load64(p + 24);
    a += w;
    b = fh_rotr(b + a + z, 21);
    const uint64_t c = a;
    a += x + y;
    b += fh_rotr(a, 44);
    *lo = a + z;
    *hi = b + c;
}

static uint64_t fh_short(const uint8_t *s, size_t n) { /* 0 to 16 bytes */
    if (n >= 8) {
        const uint64_t mul = FH_K2 + n * 2, a = fh_load64(s) + FH_K2, b = fh_load64(s + n - 8);
        return fh_pair(fh_rotr(b, 37) * mul + a, (fh_rotr(a, 25) + b) * mul, mul);
    }
    if (n >= 4) {
        const uint64_t mul = FH_K2 + n * 2;
        return fh_pair(n + (fh_load32(s) << 3), fh_load32(s + n - 4), mul);
    }
    if (n > 0) {
        const uint32_t y = (uint32_t)s[0] + ((uint32_t)s[n >> 1] << 8);
        const uint32_t z = (uint32_t)n + ((uint32_t)s[n - 1] << 2);
        return fh_mix((uint64_t)y * FH_K2 ^ (uint64_t)z * FH_K0) * FH_K2;
    }
    return FH_K2;
}

static uint64_t fh_medium(const uint8_t *s, size_t n) { /* 17 to 32 bytes */
    const uint64_t mul = FH_K2 + n * 2, a = fh_load64(s) * FH_K1, b = fh_load64(s + 8);
    const uint64_t c = fh_load64(s + n - 8) * mul, d = fh_load64(s + n - 16) * FH_K2;
    return fh_pair(fh_rotr(a + b, 43) + fh_rotr(c, 30) + d, a + fh_rotr(b + FH_K2, 18) + c, mul);
}

static uint64_t fh_long(const uint8_t *s, size_t n) { /* 33 to 64 bytes */
    const uint64_t mul = FH_K2 + n * 2, a = fh_load64(s) * FH_K2, b = fh_load64(s + 8);
    const uint64_t c = fh_load64(s + n - 8) * mul, d = fh_load64(s + n - 16) * FH_K2;
    const uint64_t y = fh_rotr(a + b, 43) + fh_rotr(c, 30) + d;
    const uint64_t z = fh_pair(y, a + fh_rotr(b + FH_K2, 18) + c, mul);
    const uint64_t e = fh_load64(s + 16) * mul, f = fh_load64(s + 24);
    const uint64_t g = (y + fh_load64(s + n - 32)) * mul, h = (z + fh_load64(s + n - 24)) * mul;
    return fh_pair(fh_rotr(e + f, 43) + fh_rotr(g, 30) + h, e + fh_rotr(f + a, 18) + g, mul);
}

uint64_t psflow_fingerprint64(const uint8_t *s, size_t n) {
    if (n <= 16) return fh_short(s, n);
    if (n <= 32) return fh_medium(s, n);
    if (n <= 64) return fh_long(s, n);
    /* Over 64 bytes: 64 at a time, then the last 64 (which may overlap the previous block). */
    const uint64_t seed = 81;
    uint64_t x = seed, y = seed * FH_K1 + 113, z = fh_mix(y * FH_K2 + 113) * FH_K2;
    uint64_t v0 = 0, v1 = 0, w0 = 0, w1 = 0, t;
    x = x * FH_K2 + fh_load64(s);
    const uint8_t *const end = s + ((n - 1) / 64) * 64;
    const uint8_t *const last = s + n - 64;
    do {
        x = fh_rotr(x + y + v0 + fh_load64(s + 8), 37) * FH_K1;
        y = fh_rotr(y + v1 + fh_load64(s + 48), 42) * FH_K1;
        x ^= w1;
        y += v0 + fh_load64(s + 40);
        z = fh_rotr(z + w0, 33) * FH_K1;
        fh_weak32(s, v1 * FH_K1, x + w0, &v0, &v1);
        fh_weak32(s + 32, z + w1, y + fh_load64(s + 16), &w0, &w1);
        t = z, z = x, x = t;
        s += 64;
    } while (s != end);
    const uint64_t mul = FH_K1 + ((z & 0xff) << 1);
    s = last;
    w0 += (n - 1) & 63;
    v0 += w0;
    w0 += v0;
    x = fh_rotr(x + y + v0 + fh_load64(s + 8), 37) * mul;
    y = fh_rotr(y + v1 + fh_load64(s + 48), 42) * mul;
    x ^= w1 * 9;
    y += v0 * 9 + fh_load64(s + 40);
    z = fh_rotr(z + w0, 33) * mul;
    fh_weak32(s, v1 * mul, x + w0, &v0, &v1);
    fh_weak32(s + 32, z + w1, y + fh_load64(s + 16), &w0, &w1);
    t = z, z = x, x = t;
    return fh_pair(fh_pair(v0, w0, mul) + fh_mix(y) * FH_K0 + z, fh_pair(v1, w1, mul) + x, mul);
}
