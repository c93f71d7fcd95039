/* tf.train.Example records of fixed-length numeric features, decoded straight into arrays
 * (psflow/data/features.py's fast path for int64 and float32 FixedLenFeatures):
 *   Example { Features features = 1; }  Features { map<string, Feature> feature = 1; }
 *   Feature { oneof { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
 *   each list { repeated <value> value = 1 [packed]; }.
 * The plain wire form only: anything else (a field the plain form lacks, a repeated wanted
 * feature, an unpacked or split list, another list kind or count, a missing feature) fails the
 * record, and the caller decodes the batch by its general path, which follows protobuf.
 * Plain C, no Python: psflow/data/_native.c is the binding.
 */
#include <stdint.h>
#include <string.h>

#include "_native.h"

#define EX_MEMO 256 /* a record's first entries whose features are remembered by place */

/* A varint at *p (before end) into *v; 0 when malformed or past end. */
static int ex_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    uint64_t value = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        value |= (uint64_t)(b & 0x7F) << shift;
        if (b < 0x80) {
            *v = value;
            return 1;
        }
    }
    return 0;
}

/* ex_varint for a tag or a length, mostly one byte: that byte without the loop. */
static inline int ex_small(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    if (*p < end && **p < 0x80) {
        *v = *(*p)++;
        return 1;
    }
    return ex_varint(p, end, v);
}

/* A length-delimited field's payload at *p: [*p, *payload_end) within end. */
static int ex_len(const uint8_t **p, const uint8_t *end, const uint8_t **payload_end) {
    uint64_t n;
    if (!ex_small(p, end, &n) || n > (uint64_t)(end - *p)) return 0;
    *payload_end = *p + n;
    return 1;
}

/* Whether [p, end) is a well-formed list of kind (an unwanted feature's, skipped but checked
   as protobuf would parse it). */
static int ex_valid_list(int kind, const uint8_t *p, const uint8_t *end) {
    while (p < end) {
        uint64_t tag, v;
        const uint8_t *e;
        if (!ex_varint(&p, end, &tag)) return 0;
        if (tag == 0x0A) { /* length-delimited: a bytes value, or packed numbers */
            if (!ex_len(&p, end, &e)) return 0;
            if (kind == EX_LIST_FLOAT && (e - p) % 4) return 0;
            if (kind == EX_LIST_INT64)
                while (p < e)
                    if (!ex_varint(&p, e, &v)) return 0;
            p = e;
        } else if (tag == 0x0D && kind == EX_LIST_FLOAT) { /* one unpacked float */
            if (end - p < 4) return 0;
            p += 4;
        } else if (tag == 0x08 && kind == EX_LIST_INT64) { /* one unpacked int64 */
            if (!ex_varint(&p, end, &v)) return 0;
        } else {
            return 0;
        }
    }
    return 1;
}

/* Whether the len bytes at a and b are equal (keys are short: no call to memcmp). */
static inline int ex_same(const uint8_t *a, const uint8_t *b, int64_t len) {
    for (int64_t k = 0; k < len; k++)
        if (a[k] != b[k]) return 0;
    return 1;
}

/* The wanted feature a key names, or -1. *memo: what the entry at the same place of the last
   record named (a writer keeps one order, often not the spec's: sorted keys), tried first, then
   set to this answer. */
static int64_t ex_find(const uint8_t *key, int64_t len, const uint8_t *names,
                       const int64_t *name_off, const int64_t *name_len, int64_t nf,
                       int64_t *memo) {
    int64_t f = *memo;
    if (f >= 0 && name_len[f] == len && ex_same(names + name_off[f], key, len)) return f;
    for (f = 0; f < nf; f++)
        if (name_len[f] == len && ex_same(names + name_off[f], key, len)) break;
    if (f == nf) f = -1;
    *memo = f;
    return f;
}

/* Record i's wanted features into outs; 0 when it is not in the plain form (see above). */
static int ex_record(const uint8_t *p, const uint8_t *end, int64_t i, const uint8_t *names,
                     const int64_t *name_off, const int64_t *name_len, const int64_t *kinds,
                     const int64_t *sizes, int64_t nf, uint8_t *const *outs, uint8_t *seen,
                     int64_t *memo) {
    int64_t found = 0, features = 0, entry = 0, spare = -1;
    memset(seen, 0, (size_t)nf);
    while (p < end) {
        uint64_t tag;
        const uint8_t *fend;
        if (!ex_small(&p, end, &tag) || tag != 0x0A || ++features > 1) return 0;
        if (!ex_len(&p, end, &fend)) return 0;
        while (p < fend) { /* map entries */
            const uint8_t *eend, *kend, *vend, *lend, *pend;
            uint64_t etag, ktag, vtag, ltag, ptag;
            if (!ex_small(&p, fend, &etag) || etag != 0x0A || !ex_len(&p, fend, &eend)) return 0;
            if (!ex_small(&p, eend, &ktag) || ktag != 0x0A || !ex_len(&p, eend, &kend)) return 0;
            const uint8_t *key = p;
            int64_t klen = kend - p;
            p = kend;
            if (p == eend) return 0; /* no value: an empty Feature */
            if (!ex_small(&p, eend, &vtag) || vtag != 0x12 || !ex_len(&p, eend, &vend)) return 0;
            if (vend != eend) return 0;
            int64_t f = ex_find(key, klen, names, name_off, name_len, nf,
                                entry < EX_MEMO ? memo + entry : &spare);
            entry++;
            if (p == vend) return 0; /* an empty Feature (no list) */
            if (!ex_small(&p, vend, &ltag) || (ltag & 7) != 2 || !ex_len(&p, vend, &lend)) return 0;
            if (lend != vend) return 0; /* another field after the list */
            int kind = (int)(ltag >> 3);
            if (f < 0) {
                if (kind < EX_LIST_BYTES || kind > EX_LIST_INT64 || !ex_valid_list(kind, p, lend))
                    return 0;
                p = lend;
                continue;
            }
            if (seen[f] || kind != kinds[f]) return 0;
            seen[f] = 1;
            found++;
            int64_t size = sizes[f];
            if (p == lend) { /* an empty list */
                if (size) return 0;
                continue;
            }
            if (!ex_small(&p, lend, &ptag) || ptag != 0x0A || !ex_len(&p, lend, &pend)) return 0;
            if (pend != lend) return 0; /* more than one packed run */
            if (kind == EX_LIST_FLOAT) {
                if (pend - p != 4 * size) return 0;
                memcpy(outs[f] + (size_t)(i * size * 4), p, (size_t)(4 * size));
            } else {
                int64_t *out = (int64_t *)(void *)(outs[f] + (size_t)(i * size * 8));
                int64_t count = 0;
                while (p < pend) {
                    uint64_t v;
                    if (count == size || !ex_varint(&p, pend, &v)) return 0;
                    out[count++] = (int64_t)v;
                }
                if (count != size) return 0;
            }
            p = pend;
        }
        p = fend;
    }
    return found == nf;
}

int64_t psflow_parse_fixed(const uint8_t *buf, const int64_t *starts, const int64_t *lengths,
                           int64_t n, const uint8_t *names, const int64_t *name_off,
                           const int64_t *name_len, const int64_t *kinds, const int64_t *sizes,
                           int64_t nf, uint8_t *const *outs, uint8_t *seen) {
    int64_t memo[EX_MEMO];
    for (int k = 0; k < EX_MEMO; k++) memo[k] = -1;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *p = buf + starts[i];
        if (!ex_record(p, p + lengths[i], i, names, name_off, name_len, kinds, sizes, nf, outs,
                       seen, memo))
            return i;
    }
    return -1;
}
