/*
 * Chained block hashing for kvmesh, in C.
 *
 * Same definition as cache_store/hashing.py: block i's hash is the 16-byte
 * canonical (big-endian) XXH3-128 digest of (hash of block i-1 || the block's
 * token ids as little-endian uint32). The Python module uses this when it is
 * built and falls back to its pure-Python loop otherwise; tests check that both
 * give identical bytes.
 *
 * XXH3 is Yann Collet's xxHash (https://xxhash.com), linked from the system
 * library (Debian: libxxhash-dev).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <xxhash.h>

#define HASH_BYTES 16

/* Pack a list/tuple of ints into little-endian uint32 bytes. Returns a new
 * bytes object, or NULL with ValueError (out of range) / TypeError set. */
static PyObject *pack_sequence(PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "token ids must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) { Py_DECREF(fast); return NULL; }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = items[i];
        if (!PyLong_Check(it)) {
            PyErr_Format(PyExc_TypeError, "token id at position %zd is not an integer", i);
            goto fail;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(it, &overflow);
        if (overflow != 0 || v < 0 || v > 0xFFFFFFFFLL) {
            PyErr_SetString(PyExc_ValueError, "token ids must lie in [0, 2**32)");
            goto fail;
        }
        if (v == -1 && PyErr_Occurred()) goto fail;
        uint32_t u = (uint32_t)v;
        p[4 * i] = (unsigned char)(u & 0xFF);
        p[4 * i + 1] = (unsigned char)((u >> 8) & 0xFF);
        p[4 * i + 2] = (unsigned char)((u >> 16) & 0xFF);
        p[4 * i + 3] = (unsigned char)((u >> 24) & 0xFF);
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(fast);
    Py_DECREF(out);
    return NULL;
}

/* chain_hash(token_bytes, block_size, parent) -> list[bytes]
 * token_bytes: any contiguous buffer of little-endian uint32 token ids. */
static PyObject *chain_hash(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t block_size;
    Py_buffer parent;
    if (!PyArg_ParseTuple(args, "y*ny*", &buf, &block_size, &parent)) return NULL;
    PyObject *result = NULL;
    if (block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1");
        goto done;
    }
    Py_ssize_t step = block_size * 4;
    Py_ssize_t nblocks = buf.len / step;
    result = PyList_New(nblocks);
    if (result == NULL) goto done;
    /* scratch = prev_hash || block tokens */
    Py_ssize_t prev_len = parent.len;
    unsigned char *scratch = PyMem_Malloc((size_t)(HASH_BYTES > prev_len ? HASH_BYTES : prev_len) + (size_t)step);
    if (scratch == NULL) { Py_CLEAR(result); PyErr_NoMemory(); goto done; }
    memcpy(scratch, parent.buf, (size_t)prev_len);
    const unsigned char *src = (const unsigned char *)buf.buf;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        memcpy(scratch + prev_len, src + i * step, (size_t)step);
        XXH128_hash_t h = XXH3_128bits(scratch, (size_t)(prev_len + step));
        XXH128_canonical_t c;
        XXH128_canonicalFromHash(&c, h);
        PyObject *digest = PyBytes_FromStringAndSize((const char *)c.digest, HASH_BYTES);
        if (digest == NULL) { Py_CLEAR(result); break; }
        PyList_SET_ITEM(result, i, digest);
        memcpy(scratch, c.digest, HASH_BYTES);
        prev_len = HASH_BYTES;
    }
    PyMem_Free(scratch);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&parent);
    return result;
}

static PyObject *pack_u32(PyObject *self, PyObject *seq) {
    return pack_sequence(seq);
}

static PyMethodDef methods[] = {
    {"chain_hash", chain_hash, METH_VARARGS,
     "chain_hash(token_bytes, block_size, parent_hash) -> list of 16-byte hashes of the full blocks"},
    {"pack_u32", pack_u32, METH_O,
     "pack_u32(ints) -> bytes: little-endian uint32; ValueError outside [0, 2**32), TypeError for non-ints"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chainhash", "Chained XXH3-128 block hashing.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__chainhash(void) { return PyModule_Create(&module); }
