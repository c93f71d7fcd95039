/* TFRecord's framing, its checksum and the packing of records into one buffer (for
 * psflow/data/tfrecord_reader.py's and psflow/data/shuffle.py's hot paths):
 *   uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)
 * little-endian. The happy path only: a record whose checksum fails stops the framing, and the
 * caller frames the chunk again by its Python path, which names or skips the record.
 * Plain C, no Python: psflow/data/_native.c is the binding.
 */
#include <stdint.h>
#include <string.h>

#include "_native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define PSFLOW_CRC_HW 1
#endif

#define MASK_DELTA 0xA282EAD8u
#define HEADER 12
#define FOOTER 4

/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78), eight bytes at a time by eight
   tables (slicing-by-8), built once when the module loads (psflow_crc32c_init), before any
   thread can ask. */
static uint32_t crc_tables[8][256];

void psflow_crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_tables[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_tables[t][i] = (crc_tables[t - 1][i] >> 8) ^ crc_tables[0][crc_tables[t - 1][i] & 0xFF];
}

static uint32_t crc_soft(uint32_t crc, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = crc_tables[7][lo & 0xFF] ^ crc_tables[6][(lo >> 8) & 0xFF] ^
              crc_tables[5][(lo >> 16) & 0xFF] ^ crc_tables[4][lo >> 24] ^
              crc_tables[3][hi & 0xFF] ^ crc_tables[2][(hi >> 8) & 0xFF] ^
              crc_tables[1][(hi >> 16) & 0xFF] ^ crc_tables[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc_tables[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

#ifdef PSFLOW_CRC_HW
/* SSE4.2's crc32 instruction computes the same polynomial. */
__attribute__((target("sse4.2"))) static uint32_t crc_hard(uint32_t crc, const uint8_t *p,
                                                          size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}
#endif

static int crc_use_hard(void) {
#ifdef PSFLOW_CRC_HW
    static int cached = -1;
    if (cached < 0) cached = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    return cached;
#else
    return 0;
#endif
}

uint32_t psflow_crc32c(const uint8_t *p, size_t n, int soft) {
    uint32_t crc = 0xFFFFFFFFu;
#ifdef PSFLOW_CRC_HW
    if (!soft && crc_use_hard()) return crc_hard(crc, p, n) ^ 0xFFFFFFFFu;
#endif
    (void)soft;
    return crc_soft(crc, p, n) ^ 0xFFFFFFFFu;
}

static uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + MASK_DELTA; }

static uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v; /* little-endian hosts only: psflow/data/native.py calls this on no other */
}

int64_t psflow_tfrecord_frame(const uint8_t *buf, int64_t pos, int64_t end, int verify,
                              int64_t index, int64_t shard, int64_t count, int64_t offset,
                              int64_t *starts, int64_t *lengths, int64_t cap, int64_t *stop) {
    int64_t n = 0;
    while (n < cap && end - pos >= HEADER + FOOTER) {
        uint64_t length;
        memcpy(&length, buf + pos, 8);
        if (length > (uint64_t)(end - pos - HEADER - FOOTER)) break; /* incomplete (or corrupt) */
        const uint8_t *data = buf + pos + HEADER;
        if (verify) {
            if (masked(psflow_crc32c(buf + pos, 8, 0)) != load_u32(buf + pos + 8)) return -1;
            int keep = count <= 0 || ((index + n + offset) % count) == shard;
            if (keep && masked(psflow_crc32c(data, (size_t)length, 0)) != load_u32(data + length))
                return -1;
        }
        starts[n] = pos + HEADER;
        lengths[n] = (int64_t)length;
        n++;
        pos += HEADER + (int64_t)length + FOOTER;
    }
    *stop = pos;
    return n;
}

void psflow_pack_records(const int64_t *addrs, const int64_t *lengths, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; i++) {
        memcpy(out, (const uint8_t *)(uintptr_t)addrs[i], (size_t)lengths[i]);
        out += lengths[i];
    }
}
