/* Which rows a full hashed table evicts: the least recently updated, by their update counts.
 * Plain C, no Python: psflow/sparse/_kernels.c is the binding, _kernels.h declares it.
 *
 * torch.topk of k among a table's n counts took 77 ms for k = 262,144 of n = 4M (random counts,
 * one thread): it keeps a heap or sorts. Here a radix select: one pass for the counts' least
 * and greatest, one for a histogram of their top 16 bits (above the least), one that gathers
 * the rows of every bucket up to the one that holds the k-th, and a stable radix sort of what
 * was gathered by count (so rows of one count stay in slot order). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"

enum { TOP_BITS = 16, DIGIT_BITS = 11 };

static int bit_length(uint64_t x) {
    int b = 0;
    while (x) {
        b++;
        x >>= 1;
    }
    return b;
}

/* Sorts m (key, slot) pairs by key, stably, 11 bits a pass over the key's `bits` bits; `tmp_*`
 * hold m each. The sorted pairs end in key/slot (copied back when the passes are odd). */
static void radix_sort(uint64_t *key, int64_t *slot, uint64_t *tmp_key, int64_t *tmp_slot,
                       ptrdiff_t m, int bits) {
    ptrdiff_t count[1 << DIGIT_BITS];
    uint64_t *k_in = key, *k_out = tmp_key;
    int64_t *s_in = slot, *s_out = tmp_slot;
    int passes = 0;
    for (int shift = 0; shift < bits; shift += DIGIT_BITS, passes++) {
        memset(count, 0, sizeof(count));
        for (ptrdiff_t i = 0; i < m; i++) count[(k_in[i] >> shift) & ((1 << DIGIT_BITS) - 1)]++;
        ptrdiff_t at = 0;
        for (int d = 0; d < (1 << DIGIT_BITS); d++) {
            ptrdiff_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (ptrdiff_t i = 0; i < m; i++) {
            ptrdiff_t to = count[(k_in[i] >> shift) & ((1 << DIGIT_BITS) - 1)]++;
            k_out[to] = k_in[i];
            s_out[to] = s_in[i];
        }
        uint64_t *kt = k_in;
        k_in = k_out;
        k_out = kt;
        int64_t *st = s_in;
        s_in = s_out;
        s_out = st;
    }
    if (passes % 2) {
        memcpy(key, k_in, (size_t)m * sizeof(uint64_t));
        memcpy(slot, s_in, (size_t)m * sizeof(int64_t));
    }
}

/* The k (0 < k <= n) least of n update counts (each >= 0) with their slots, in order of count
   and, for equal counts, of slot. Returns 0, or -1 when memory ran out (nothing written). */
int psflow_least_recent(const int64_t *ticks, ptrdiff_t n, ptrdiff_t k, int64_t *out_slots,
                        int64_t *out_ticks) {
    if (k <= 0 || k > n) return 0;
    int64_t lo = ticks[0], hi = ticks[0];
    for (ptrdiff_t i = 1; i < n; i++) {
        lo = ticks[i] < lo ? ticks[i] : lo;
        hi = ticks[i] > hi ? ticks[i] : hi;
    }
    int bits = bit_length((uint64_t)hi - (uint64_t)lo);
    int shift = bits > TOP_BITS ? bits - TOP_BITS : 0;
    ptrdiff_t *hist = calloc((size_t)1 << TOP_BITS, sizeof(ptrdiff_t));
    if (hist == NULL) return -1;
    for (ptrdiff_t i = 0; i < n; i++) hist[((uint64_t)ticks[i] - (uint64_t)lo) >> shift]++;
    ptrdiff_t m = 0;
    uint64_t last = 0; /* the bucket that holds the k-th */
    while (m + hist[last] < k) m += hist[last++];
    m += hist[last];
    free(hist);
    uint64_t *key = malloc((size_t)m * 2 * sizeof(uint64_t));
    int64_t *slot = malloc((size_t)m * 2 * sizeof(int64_t));
    if (key == NULL || slot == NULL) {
        free(key);
        free(slot);
        return -1;
    }
    ptrdiff_t got = 0;
    for (ptrdiff_t i = 0; i < n && got < m; i++) {
        uint64_t d = (uint64_t)ticks[i] - (uint64_t)lo;
        if ((d >> shift) <= last) {
            key[got] = d;
            slot[got++] = i;
        }
    }
    radix_sort(key, slot, key + m, slot + m, m, bit_length(((last + 1) << shift) - 1));
    for (ptrdiff_t i = 0; i < k; i++) {
        out_slots[i] = slot[i];
        out_ticks[i] = (int64_t)(key[i] + (uint64_t)lo);
    }
    free(key);
    free(slot);
    return 0;
}
