/* The plain-C functions of psflow.data._native, one concern a file, bound to Python in
 * _native.c: _farmhash.c (TensorFlow's string hash), _example.c (Example records of
 * fixed-length numeric features), _tfrecord.c (TFRecord's framing and checksum, records packed
 * into one buffer). */
#ifndef PSFLOW_DATA_NATIVE_H
#define PSFLOW_DATA_NATIVE_H

#include <stddef.h>
#include <stdint.h>

/* FarmHash's Fingerprint64 of the n bytes at s (tensorflow::Fingerprint64). */
uint64_t psflow_fingerprint64(const uint8_t *s, size_t n);

/* The list kinds of a Feature (its oneof's field numbers), as psflow/data/fastparse.py's. */
#define EX_LIST_BYTES 1
#define EX_LIST_FLOAT 2
#define EX_LIST_INT64 3

/* Records buf[starts[i] : starts[i] + lengths[i]] for i < n (the caller checks the bounds);
 * wanted feature f named names[name_off[f] : + name_len[f]], a list of kind kinds[f]
 * (EX_LIST_FLOAT or EX_LIST_INT64) of sizes[f] values, written to the array at outs[f] (row i
 * at i * sizes[f]); seen: nf bytes of scratch. Returns -1 when every record was decoded, else
 * the first that was not in the plain form (_example.c says which that is). */
int64_t psflow_parse_fixed(const uint8_t *buf, const int64_t *starts, const int64_t *lengths,
                           int64_t n, const uint8_t *names, const int64_t *name_off,
                           const int64_t *name_len, const int64_t *kinds, const int64_t *sizes,
                           int64_t nf, uint8_t *const *outs, uint8_t *seen);

/* Builds psflow_crc32c's tables: once, when the module loads. */
void psflow_crc32c_init(void);

/* CRC32C of the n bytes at p (google-crc32c's value); soft: the table path even where the
 * CPU has the instruction. */
uint32_t psflow_crc32c(const uint8_t *p, size_t n, int soft);

/* Frames the complete records of buf[pos:end), at most cap: record k's data at starts[k],
 * lengths[k]; *stop: the offset after the last. With verify, every header checksum and the
 * data checksum of each record kept ((index + k + offset) % count == shard; every record when
 * count <= 0). Returns the records framed, or -1 at the first checksum that fails. */
int64_t psflow_tfrecord_frame(const uint8_t *buf, int64_t pos, int64_t end, int verify,
                              int64_t index, int64_t shard, int64_t count, int64_t offset,
                              int64_t *starts, int64_t *lengths, int64_t cap, int64_t *stop);

/* The n records at addresses addrs[i] of lengths[i] bytes, one after another into out. */
void psflow_pack_records(const int64_t *addrs, const int64_t *lengths, int64_t n, uint8_t *out);

#endif
