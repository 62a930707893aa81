/* Per-layer xxh3 checksums of a chunk's payload, the GIL released.
 *
 * kvtier checksums every layer of every chunk it stores and checks them before any byte is
 * used. With the xxhash package the hash holds the GIL, so the restore workers that check
 * chunks beside a copy to a GPU (and the store workers that checksum what a GPU copied
 * into a slot) run one at a time whatever the cores: here they run together.
 *
 * The checksum is XXH3_64bits of each layer's bytes, the xxhash package's xxh3_64 with
 * its default seed (vendored xxhash.h, BSD-2-Clause, see LICENSE-xxhash). Addresses come
 * from kvtier/layer_sums.py, which checked them against the buffer's length.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

/* hash(addr, seg_len, nseg, sums): sums[s] = xxh3 of seg_len bytes at addr + s * seg_len. */
static PyObject *hash_layers(PyObject *self, PyObject *args)
{
    unsigned long long addr, sums_a;
    Py_ssize_t seg_len, nseg;
    if (!PyArg_ParseTuple(args, "KnnK", &addr, &seg_len, &nseg, &sums_a))
        return NULL;
    if (seg_len < 0 || nseg < 0) {
        PyErr_SetString(PyExc_ValueError, "hash: negative size");
        return NULL;
    }
    const char *base = (const char *)(uintptr_t)addr;
    uint64_t *sums = (uint64_t *)(uintptr_t)sums_a;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < nseg; s++)
        sums[s] = XXH3_64bits(base + s * seg_len, (size_t)seg_len);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* verify(addr, seg_len, nseg, expected) -> the first segment whose xxh3 differs, or -1. */
static PyObject *verify_layers(PyObject *self, PyObject *args)
{
    unsigned long long addr, exp_a;
    Py_ssize_t seg_len, nseg;
    if (!PyArg_ParseTuple(args, "KnnK", &addr, &seg_len, &nseg, &exp_a))
        return NULL;
    if (seg_len < 0 || nseg < 0) {
        PyErr_SetString(PyExc_ValueError, "verify: negative size");
        return NULL;
    }
    const char *base = (const char *)(uintptr_t)addr;
    const uint64_t *expected = (const uint64_t *)(uintptr_t)exp_a;
    Py_ssize_t failed = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < nseg; s++) {
        if (XXH3_64bits(base + s * seg_len, (size_t)seg_len) != expected[s]) {
            failed = s;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(failed);
}

static PyMethodDef methods[] = {
    {"hash", hash_layers, METH_VARARGS, "xxh3 of each of nseg segments of seg_len bytes."},
    {"verify", verify_layers, METH_VARARGS,
     "The first of nseg segments whose xxh3 is not the expected one, or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_layer_sums", "Per-layer xxh3 checksums, the GIL released.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__layer_sums(void) { return PyModule_Create(&module); }
