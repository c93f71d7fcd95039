/* psflow.data._native: the data layer's compiled byte work, bound to Python. Each concern is
 * its own plain-C file (_farmhash.c, _example.c, _tfrecord.c; _native.h declares them); this file only
 * parses arguments and releases the GIL. No torch, no numpy C API: the Python side
 * (psflow/data/native.py) passes raw addresses of numpy arrays it has checked (dtype,
 * contiguity, bounds).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "_native.h"

#define PTR(T, p) ((T *)(uintptr_t)(p))

/* fingerprint64(data, offsets, n, out): out[i] = Fingerprint64 of data[offsets[i]:offsets[i+1]]
   (the caller checks the offsets). */
static PyObject *py_fingerprint64(PyObject *self, PyObject *args) {
    Py_ssize_t data_, offsets_, n, out_;
    if (!PyArg_ParseTuple(args, "nnnn", &data_, &offsets_, &n, &out_)) return NULL;
    const uint8_t *data = PTR(uint8_t, data_);
    const int64_t *offsets = PTR(int64_t, offsets_);
    uint64_t *out = PTR(uint64_t, out_);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = psflow_fingerprint64(data + offsets[i], (size_t)(offsets[i + 1] - offsets[i]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* parse_fixed(buf, starts, lengths, n, names, name_off, name_len, kinds, sizes, nf, outs):
   psflow_parse_fixed's arguments as addresses (see _native.h); -1 or the first record that
   was not in the plain form. */
static PyObject *py_parse_fixed(PyObject *self, PyObject *args) {
    Py_ssize_t buf_, starts_, lengths_, n, names_, off_, len_, kinds_, sizes_, nf, outs_;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnn", &buf_, &starts_, &lengths_, &n, &names_, &off_,
                          &len_, &kinds_, &sizes_, &nf, &outs_))
        return NULL;
    uint8_t *seen = (uint8_t *)malloc((size_t)(nf > 0 ? nf : 1));
    if (!seen) return PyErr_NoMemory();
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = psflow_parse_fixed(PTR(uint8_t, buf_), PTR(int64_t, starts_), PTR(int64_t, lengths_),
                             n, PTR(uint8_t, names_), PTR(int64_t, off_), PTR(int64_t, len_),
                             PTR(int64_t, kinds_), PTR(int64_t, sizes_), nf,
                             PTR(uint8_t *const, outs_), seen);
    Py_END_ALLOW_THREADS
    free(seen);
    return PyLong_FromLongLong((long long)bad);
}

/* crc32c(data, n, soft): CRC32C of n bytes at data. */
static PyObject *py_crc32c(PyObject *self, PyObject *args) {
    Py_ssize_t data_, n;
    int soft;
    if (!PyArg_ParseTuple(args, "nnp", &data_, &n, &soft)) return NULL;
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = psflow_crc32c(PTR(uint8_t, data_), (size_t)n, soft);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(crc);
}

/* frame(buf, pos, end, verify, index, shard, count, offset, starts, lengths, cap):
   (records framed or -1, the offset after them); see _native.h. */
static PyObject *py_frame(PyObject *self, PyObject *args) {
    Py_ssize_t buf_, pos, end, index, shard, count, offset, starts_, lengths_, cap;
    int verify;
    if (!PyArg_ParseTuple(args, "nnnpnnnnnnn", &buf_, &pos, &end, &verify, &index, &shard,
                          &count, &offset, &starts_, &lengths_, &cap))
        return NULL;
    int64_t n, stop = pos;
    Py_BEGIN_ALLOW_THREADS
    n = psflow_tfrecord_frame(PTR(uint8_t, buf_), pos, end, verify, index, shard, count, offset,
                              PTR(int64_t, starts_), PTR(int64_t, lengths_), cap, &stop);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("LL", (long long)n, (long long)stop);
}

/* pack(addrs, lengths, n, out): the n records one after another into out. */
static PyObject *py_pack(PyObject *self, PyObject *args) {
    Py_ssize_t addrs_, lengths_, n, out_;
    if (!PyArg_ParseTuple(args, "nnnn", &addrs_, &lengths_, &n, &out_)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    psflow_pack_records(PTR(int64_t, addrs_), PTR(int64_t, lengths_), n, PTR(uint8_t, out_));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fingerprint64", py_fingerprint64, METH_VARARGS, "FarmHash Fingerprint64 of each string."},
    {"parse_fixed", py_parse_fixed, METH_VARARGS,
     "Examples' fixed-length numeric features; -1 or the first record not in the plain form."},
    {"crc32c", py_crc32c, METH_VARARGS, "CRC32C of a buffer (google-crc32c's value)."},
    {"frame", py_frame, METH_VARARGS,
     "TFRecord's complete records of a buffer, checksums verified; -1 at the first that fails."},
    {"pack", py_pack, METH_VARARGS, "Records at given addresses, one after another into one buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    psflow_crc32c_init();
    return PyModule_Create(&module);
}
