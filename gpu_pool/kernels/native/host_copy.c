/* Host-memory chunk copies fused with their xxh3 checksums, for the CPU data path.
 *
 * A store gathers a chunk's pieces (one per layer, K/V and pool block) into its slot and
 * checksums each layer; a restore checks each layer of a slot and scatters it into pool
 * blocks. In Python these are a copy and a separate hash pass over tens of MiB with the
 * stores going through the cache (each destination line is read before it is written).
 * Here each piece is hashed a few KiB at a time while it sits in L1 from being loaded,
 * and written with non-temporal stores, so a chunk crosses memory once each way: about
 * the traffic of a plain copy. The GIL is released for the whole call.
 *
 * The checksum is XXH3_64bits of each layer's bytes, as kvtier.chunk_format computes it
 * with the xxhash package (vendored xxhash.h, BSD-2-Clause, see LICENSE-xxhash).
 *
 * Arguments are addresses the Python wrapper (host_native.py) computed from tensors it
 * checked (bounds, layouts, dtypes); this file trusts them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM 1
#endif

/* Bytes hashed and copied per step: small enough to stay in L1 between the two. */
#define STEP 4096
/* Below this a copy goes through memcpy (streaming stores pay off on long runs). */
#define STREAM_MIN 256

static void copy_stream(char *dst, const char *src, size_t n)
{
#ifdef HAVE_STREAM
    size_t i = 0;
    if (n >= STREAM_MIN) {
        size_t lead = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, lead);
        i = lead;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

static void stream_fence(void)
{
#ifdef HAVE_STREAM
    _mm_sfence(); /* streamed lines are globally visible before the call returns */
#endif
}

/* gather_hash(dst, srcs, lens, n, per_seg, sums): the n pieces (srcs[i], lens[i]) copied
 * one after another into dst; sums[s] = xxh3 of the bytes of pieces [s*per_seg,
 * (s+1)*per_seg). Addresses are integers; srcs and lens are uint64 arrays, sums too. */
static PyObject *gather_hash(PyObject *self, PyObject *args)
{
    unsigned long long dst_a, srcs_a, lens_a, sums_a;
    Py_ssize_t n, per_seg;
    if (!PyArg_ParseTuple(args, "KKKnnK", &dst_a, &srcs_a, &lens_a, &n, &per_seg, &sums_a))
        return NULL;
    if (n < 0 || per_seg < 1 || n % per_seg) {
        PyErr_SetString(PyExc_ValueError, "gather_hash: n must be a multiple of per_seg >= 1");
        return NULL;
    }
    char *dst = (char *)(uintptr_t)dst_a;
    const uint64_t *srcs = (const uint64_t *)(uintptr_t)srcs_a;
    const uint64_t *lens = (const uint64_t *)(uintptr_t)lens_a;
    uint64_t *sums = (uint64_t *)(uintptr_t)sums_a;
    Py_BEGIN_ALLOW_THREADS
    XXH3_state_t state;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i % per_seg == 0)
            XXH3_64bits_reset(&state);
        const char *src = (const char *)(uintptr_t)srcs[i];
        size_t len = (size_t)lens[i];
        for (size_t at = 0; at < len; at += STEP) {
            size_t k = len - at < STEP ? len - at : STEP;
            XXH3_64bits_update(&state, src + at, k);
            copy_stream(dst, src + at, k);
            dst += k;
        }
        if (i % per_seg == per_seg - 1)
            sums[i / per_seg] = XXH3_64bits_digest(&state);
    }
    stream_fence();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* verify_scatter(segs, seg_len, nseg, expected, srcs, dsts, lens, per_seg) -> int: for
 * each segment s in order, xxh3 of seg_len bytes at segs[s] is compared with expected[s];
 * on a mismatch s is returned and nothing of segment s or later is copied; else its
 * per_seg pieces (srcs, dsts, lens)[s*per_seg ...] are copied (the segment is in cache
 * from its check). -1: every segment passed and was copied. */
static PyObject *verify_scatter(PyObject *self, PyObject *args)
{
    unsigned long long segs_a, exp_a, srcs_a, dsts_a, lens_a;
    Py_ssize_t seg_len, nseg, per_seg;
    if (!PyArg_ParseTuple(args, "KnnKKKKn", &segs_a, &seg_len, &nseg, &exp_a, &srcs_a, &dsts_a,
                          &lens_a, &per_seg))
        return NULL;
    if (seg_len < 0 || nseg < 0 || per_seg < 0) {
        PyErr_SetString(PyExc_ValueError, "verify_scatter: negative size");
        return NULL;
    }
    const uint64_t *segs = (const uint64_t *)(uintptr_t)segs_a;
    const uint64_t *expected = (const uint64_t *)(uintptr_t)exp_a;
    const uint64_t *srcs = (const uint64_t *)(uintptr_t)srcs_a;
    const uint64_t *dsts = (const uint64_t *)(uintptr_t)dsts_a;
    const uint64_t *lens = (const uint64_t *)(uintptr_t)lens_a;
    Py_ssize_t failed = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < nseg; s++) {
        if (XXH3_64bits((const void *)(uintptr_t)segs[s], (size_t)seg_len) != expected[s]) {
            failed = s;
            break;
        }
        for (Py_ssize_t p = s * per_seg; p < (s + 1) * per_seg; p++)
            copy_stream((char *)(uintptr_t)dsts[p], (const char *)(uintptr_t)srcs[p], (size_t)lens[p]);
    }
    stream_fence();
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(failed);
}

static PyMethodDef methods[] = {
    {"gather_hash", gather_hash, METH_VARARGS,
     "Copy pieces into one buffer, xxh3 of each run of per_seg pieces."},
    {"verify_scatter", verify_scatter, METH_VARARGS,
     "Check each segment's xxh3, then copy its pieces; the first failing segment or -1."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_host_copy", "Fused host copies and xxh3 checksums.", -1, methods,
};

PyMODINIT_FUNC PyInit__host_copy(void) { return PyModule_Create(&module); }
