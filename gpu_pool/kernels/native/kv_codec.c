/* KV codecs at rest on the host, in native code: kvtier.kv_codecs's encode and decode of
 * one layer of KV, [2 (K, V), tokens, heads, head_dim], bit for bit as its torch reference
 * computes them (tests compare the two), at memory speed rather than the reference's
 * few hundred MB/s (a torch op per step, each a pass over the layer).
 *
 * Every codec shares one power-of-two scale per group of values, stored as its signed
 * exponent (one byte):
 *   fp8  : e4m3 values, a group is GROUP values of a head's vector (or the whole vector);
 *   int8 : int8 values in [-127, 127], a group is a head's vector;
 *   int4 : values in [-7, 7] stored + 8 in nibbles (even channel low), keys grouped per
 *          channel over GROUP tokens, values per token over GROUP channels.
 * Exponents: the smallest e with amax / 2**e <= qmax, no lower than the KV dtype's floor
 * (decoded values stay exact in it); a value that would round past the dtype's largest
 * finite one is rounded toward zero instead.
 *
 * Decoding checks what only a foreign writer could put there (an exponent of -128, an fp8
 * NaN, an int4 nibble of 0, a value past the dtype's range) and reports it; bytes are
 * trusted otherwise (their checksums were checked before). The GIL is released. Arguments
 * are addresses the Python wrapper (kv_codecs.py) computed from tensors it checked.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define GROUP 32
enum { CODEC_FP8 = 1, CODEC_INT8 = 2, CODEC_INT4 = 3 };
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { OK = 0, BAD_INPUT = 1, BAD_EXPONENT = 2, BAD_VALUE = 3, OUT_OF_RANGE = 4, NO_MEMORY = 5 };

static float fp8_lut[256];

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Round to nearest even for |x| < 2**22 (the default rounding mode does it; no libm call,
 * no branch: loops of it vectorize). */
static inline float round_even(float x)
{
    const float magic = 12582912.0f; /* 1.5 * 2**23 */
    return copysignf((fabsf(x) + magic) - magic, x);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 0)
        return bits_f32(sign) + (sign ? -1.0f : 1.0f) * (float)mant * 5.9604644775390625e-8f;
    if (exp == 31)
        return bits_f32(sign | 0x7F800000 | (mant << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

/* Round to nearest even; -1 where the value rounds past 65504. */
static inline int f32_to_f16(float f, uint16_t *out)
{
    uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
    if (ax >= 0x477FF000)
        return -1;
    if (ax < 0x38800000) { /* below 2**-14: a subnormal in units of 2**-24 */
        *out = (uint16_t)(sign | (uint32_t)round_even(bits_f32(ax) * 16777216.0f));
        return 0;
    }
    uint32_t r = ax + 0x0FFF + ((ax >> 13) & 1);
    *out = (uint16_t)(sign | ((r >> 13) - (112u << 10)));
    return 0;
}

/* Round to nearest even; 1 where the value rounds to an infinity. */
static inline int f32_to_bf16(float f, uint16_t *out)
{
    uint32_t x = f32_bits(f);
    uint32_t r = (x + 0x7FFF + ((x >> 16) & 1)) >> 16;
    *out = (uint16_t)r; /* stored either way: a branch-free loop vectorizes */
    return (r & 0x7F80) == 0x7F80;
}

/* |v| <= 448, round to nearest even (subnormals in units of 2**-9). */
static inline uint8_t f32_to_e4m3(float v)
{
    uint32_t x = f32_bits(v), sign = (x >> 24) & 0x80, ax = x & 0x7FFFFFFF;
    uint32_t sub = (uint32_t)round_even(bits_f32(ax) * 512.0f); /* below 2**-6: units of 2**-9 */
    uint32_t r = ax + 0x7FFFF + ((ax >> 20) & 1);
    uint32_t normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7);
    return (uint8_t)(sign | (ax < 0x3C800000 ? sub : normal));
}

/* e4m3 to float without a table (branch-free: loops of it vectorize); 0x7F/0xFF (NaN)
 * give 480, so callers check for them apart. */
static inline float e4m3_to_f32(uint8_t c)
{
    uint32_t sign = (uint32_t)(c & 0x80) << 24, e = (c >> 3) & 0xF, m = c & 7;
    float normal = bits_f32(sign | ((e + 120) << 23) | (m << 20));
    float sub = bits_f32(sign | f32_bits((float)m * 0.001953125f)); /* m * 2**-9 */
    return e ? normal : sub;
}

static void init_fp8_lut(void)
{
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 0xF, m = c & 7;
        float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
        if ((c & 0x7F) == 0x7F)
            v = NAN;
        fp8_lut[c] = (c & 0x80) ? -v : v;
    }
}

#define INLINE static inline __attribute__((always_inline))

INLINE float load(const void *src, int dt, size_t i)
{
    if (dt == DT_F32)
        return ((const float *)src)[i];
    uint16_t h = ((const uint16_t *)src)[i];
    return dt == DT_BF16 ? bits_f32((uint32_t)h << 16) : f16_to_f32(h);
}

/* Store v as dt; sets *bad where v is not finite or past dt's range. */
INLINE void store(void *dst, int dt, size_t i, float v, int *bad)
{
    *bad |= !isfinite(v);
    if (dt == DT_F32) {
        ((float *)dst)[i] = v;
        return;
    }
    *bad |= dt == DT_BF16 ? f32_to_bf16(v, (uint16_t *)dst + i) : f32_to_f16(v, (uint16_t *)dst + i);
}

/* Store v, finite and within dt's range, as dt (no checks: a branch-free loop). */
INLINE void store_fast(void *dst, int dt, size_t i, float v)
{
    if (dt == DT_F32) {
        ((float *)dst)[i] = v;
    } else if (dt == DT_BF16) { /* a decoded value is exact in bf16: its low bits are 0 */
        ((uint16_t *)dst)[i] = (uint16_t)(f32_bits(v) >> 16);
    } else {
        f32_to_f16(v, (uint16_t *)dst + i);
    }
}

/* 2**k for k in [-127, 127], exactly (a multiply by it is ldexpf's result). */
INLINE float pow2(int k)
{
    return k >= -126 ? bits_f32((uint32_t)(k + 127) << 23) : bits_f32(0x00400000u);
}

static const int quantum[3] = {-149, -133, -24}; /* log2 of each dtype's smallest step */
static const float fmax_of[3] = {3.4028234663852886e38f, 3.3895313892515355e38f, 65504.0f};

/* The group's exponent (see the top of the file). */
INLINE int exponent(float amax, float qmax, int floor_)
{
    int lo = floor_ > -127 ? floor_ : -127;
    if (!(amax > 0))
        return lo > 127 ? 127 : lo;
    int exp;
    float mant = frexpf(amax / qmax, &exp);
    int e = exp - (mant == 0.5f);
    return e < lo ? lo : (e > 127 ? 127 : e);
}

/* To the nearest integer in [-qmax, qmax], toward zero where it would decode past the
 * dtype's largest value (limit, in units of the scale). */
INLINE float round_within(float s, float qmax, float limit)
{
    float q = round_even(s);
    q = q < -qmax ? -qmax : q;
    q = q > qmax ? qmax : q;
    float toward_zero = (float)(int)s;
    return fabsf(q) > limit ? toward_zero : q;
}

/* One layer of n = 2*T*H*D values: vals (values), ek/ev (exponents of K and V). */
INLINE int encode_layer(int codec, int dt, const void *src, Py_ssize_t T, Py_ssize_t H,
                        Py_ssize_t D, uint8_t *vals, int8_t *ek, int8_t *ev)
{
    const size_t half = (size_t)T * H * D;
    const float fmax = fmax_of[dt];
    int bad = 0;
    for (size_t i = 0; i < 2 * half; i++)
        bad |= !isfinite(load(src, dt, i));
    if (bad)
        return BAD_INPUT;
    if (codec == CODEC_FP8 || codec == CODEC_INT8) {
        const Py_ssize_t g = codec == CODEC_INT8 ? D : (D % GROUP ? D : GROUP);
        const float qmax = codec == CODEC_FP8 ? 448.0f : 127.0f;
        const int floor_ = quantum[dt] + (codec == CODEC_FP8 ? 9 : 0);
        const size_t groups = 2 * half / (size_t)g;
        for (size_t k = 0; k < groups; k++) {
            size_t base = k * (size_t)g;
            float amax = 0.0f;
            for (Py_ssize_t j = 0; j < g; j++) {
                float a = fabsf(load(src, dt, base + j));
                amax = a > amax ? a : amax;
            }
            int e = exponent(amax, qmax, floor_);
            int8_t *eo = k < groups / 2 ? ek + k : ev + (k - groups / 2);
            *eo = (int8_t)e;
            const float limit = ldexpf(fmax, -e), inv = pow2(-e);
            if (codec == CODEC_FP8) {
                for (Py_ssize_t j = 0; j < g; j++) {
                    float s = load(src, dt, base + j) * inv;
                    s = s < -qmax ? -qmax : (s > qmax ? qmax : s);
                    uint8_t c = f32_to_e4m3(s);
                    vals[base + j] = (uint8_t)(c - (fabsf(fp8_lut[c]) > limit));
                }
            } else {
                for (Py_ssize_t j = 0; j < g; j++)
                    vals[base + j] = (uint8_t)(int8_t)round_within(
                        load(src, dt, base + j) * inv, qmax, limit);
            }
        }
        return OK;
    }
    /* int4: keys per channel over gt tokens, values per token over gd channels */
    const Py_ssize_t gt = T % GROUP ? T : GROUP, gd = D % GROUP ? D : GROUP, HD = H * D;
    const int floor_ = quantum[dt];
    float *amax = malloc(sizeof(float) * 2 * (size_t)HD);
    int8_t *q = malloc((size_t)2 * half);
    if (!amax || !q) {
        free(amax);
        free(q);
        return NO_MEMORY;
    }
    float *inv = amax + HD;
    for (Py_ssize_t t0 = 0; t0 < T; t0 += gt) {
        for (Py_ssize_t c = 0; c < HD; c++)
            amax[c] = 0.0f;
        for (Py_ssize_t t = t0; t < t0 + gt; t++)
            for (Py_ssize_t c = 0; c < HD; c++) {
                float a = fabsf(load(src, dt, (size_t)t * HD + c));
                amax[c] = a > amax[c] ? a : amax[c];
            }
        for (Py_ssize_t c = 0; c < HD; c++) {
            int e = exponent(amax[c], 7.0f, floor_);
            ek[(t0 / gt) * HD + c] = (int8_t)e;
            amax[c] = ldexpf(fmax, -e); /* now the limit */
            inv[c] = pow2(-e);
        }
        for (Py_ssize_t t = t0; t < t0 + gt; t++)
            for (Py_ssize_t c = 0; c < HD; c++) {
                size_t i = (size_t)t * HD + c;
                q[i] = (int8_t)round_within(load(src, dt, i) * inv[c], 7.0f, amax[c]);
            }
    }
    for (size_t k = 0; k < half / (size_t)gd; k++) {
        size_t base = half + k * (size_t)gd;
        float m = 0.0f;
        for (Py_ssize_t j = 0; j < gd; j++) {
            float a = fabsf(load(src, dt, base + j));
            m = a > m ? a : m;
        }
        int e = exponent(m, 7.0f, floor_);
        ev[k] = (int8_t)e;
        const float limit = ldexpf(fmax, -e), s = pow2(-e);
        for (Py_ssize_t j = 0; j < gd; j++)
            q[base + j] = (int8_t)round_within(load(src, dt, base + j) * s, 7.0f, limit);
    }
    for (size_t i = 0; i < half; i++)
        vals[i] = (uint8_t)((q[2 * i] + 8) | ((q[2 * i + 1] + 8) << 4));
    free(amax);
    free(q);
    return OK;
}

/* One group of fp8 values decoded and scaled into out (in range: no checks); whether one
 * is a NaN. Inlined with its trip count, so a group of GROUP is one straight vector run.
 * Into bf16 with a scale of 2**k, k >= -119, a normal value's bits are its own shifted with
 * k added to the exponent (integer lanes, no float round trip); a subnormal one (m * 2**-9)
 * is m times 2**(k - 9), exact. */
INLINE int fp8_group(const uint8_t *in, char *out, int dt, float scale, size_t g)
{
    int nan = 0;
    const int k = (int)((f32_bits(scale) >> 23) & 0xFF) - 127;
    if (dt == DT_BF16 && k >= -119) {
        const uint16_t bias = (uint16_t)((120 + k) << 7);
        const float sub_scale = scale * 0.001953125f; /* 2**(k - 9) */
        uint16_t *o = (uint16_t *)out;
        for (size_t j = 0; j < g; j++) {
            const uint16_t c = in[j], em = c & 0x7F;
            nan |= em == 0x7F;
            const uint16_t normal = (uint16_t)((em << 4) + bias);
            const uint16_t sub = (uint16_t)(f32_bits((float)(c & 7) * sub_scale) >> 16);
            o[j] = (uint16_t)((c & 0x80) << 8) | (em >= 8 ? normal : sub);
        }
        return nan;
    }
    for (size_t j = 0; j < g; j++) {
        nan |= (in[j] & 0x7F) == 0x7F;
        store_fast(out, dt, j, e4m3_to_f32(in[j]) * scale);
    }
    return nan;
}

/* Rows [t0, t1) of K (kv 0) or V (kv 1) of one layer decoded into dst, contiguous
 * ([t1 - t0, H, D]): a pool block's piece. Every codec's groups lie within a token's row
 * but int4 keys', whose exponents are indexed by the row's token group. */
INLINE int decode_rows(int codec, int dt, const uint8_t *vals, const int8_t *ek,
                       const int8_t *ev, Py_ssize_t T, Py_ssize_t H, Py_ssize_t D, int kv,
                       Py_ssize_t t0, Py_ssize_t t1, void *dst)
{
    const size_t HD = (size_t)H * D, half = (size_t)T * HD, n = (size_t)(t1 - t0) * HD;
    const size_t at = (kv ? half : 0) + (size_t)t0 * HD; /* first value, in the layer */
    int bad = 0, bad_value = 0;
    if (codec == CODEC_FP8 || codec == CODEC_INT8) {
        const size_t g = codec == CODEC_INT8 ? (size_t)D : (D % GROUP ? (size_t)D : GROUP);
        const int8_t *e = (kv ? ev : ek) + ((size_t)t0 * HD) / g;
        const float qmax = codec == CODEC_FP8 ? 448.0f : 127.0f;
        for (size_t k = 0; k < n / g; k++) {
            if (e[k] < -127)
                return BAD_EXPONENT;
            const float scale = pow2(e[k]);
            const uint8_t *in = vals + at + k * g;
            char *out = (char *)dst + k * g * (dt == DT_F32 ? 4 : 2);
            if (qmax * scale < fmax_of[dt]) {
                if (codec == CODEC_FP8 && g == GROUP) /* a constant trip count: no remainder */
                    bad_value |= fp8_group(in, out, dt, scale, GROUP);
                else if (codec == CODEC_FP8)
                    bad_value |= fp8_group(in, out, dt, scale, g);
                else
                    for (size_t j = 0; j < g; j++)
                        store_fast(out, dt, j, (float)(int8_t)in[j] * scale);
            } else {
                for (size_t j = 0; j < g; j++) {
                    float v = codec == CODEC_FP8 ? fp8_lut[in[j]] : (float)(int8_t)in[j];
                    bad_value |= codec == CODEC_FP8 && (in[j] & 0x7F) == 0x7F;
                    store(out, dt, j, v * scale, &bad);
                }
            }
        }
        return bad_value ? BAD_VALUE : (bad ? OUT_OF_RANGE : OK);
    }
    const Py_ssize_t gt = T % GROUP ? T : GROUP, gd = D % GROUP ? D : GROUP;
    const uint8_t *in = vals + at / 2; /* HD is even: a row starts on a byte */
    for (size_t i = 0; i < n / 2; i++)
        bad_value |= (in[i] & 0xF) == 0 || (in[i] >> 4) == 0;
    if (bad_value)
        return BAD_VALUE;
    if (!kv) { /* keys: a scale per channel, the same for a group of gt tokens */
        float *scales = malloc(sizeof(float) * HD);
        if (!scales)
            return NO_MEMORY;
        int safe = 0;
        for (Py_ssize_t t = t0; t < t1; t++) {
            if (t == t0 || t % gt == 0) {
                const int8_t *e = ek + (size_t)(t / gt) * HD;
                int emax = -127;
                for (size_t c = 0; c < HD; c++) {
                    if (e[c] < -127) {
                        free(scales);
                        return BAD_EXPONENT;
                    }
                    emax = e[c] > emax ? e[c] : emax;
                    scales[c] = pow2(e[c]);
                }
                safe = 7.0f * pow2(emax) < fmax_of[dt];
            }
            const uint8_t *row = in + (size_t)(t - t0) * HD / 2;
            char *out = (char *)dst + (size_t)(t - t0) * HD * (dt == DT_F32 ? 4 : 2);
            if (safe) {
                for (size_t c = 0; c < HD / 2; c++) {
                    store_fast(out, dt, 2 * c, (float)((int)(row[c] & 0xF) - 8) * scales[2 * c]);
                    store_fast(out, dt, 2 * c + 1, (float)((int)(row[c] >> 4) - 8) * scales[2 * c + 1]);
                }
            } else {
                for (size_t c = 0; c < HD / 2; c++) {
                    store(out, dt, 2 * c, (float)((int)(row[c] & 0xF) - 8) * scales[2 * c], &bad);
                    store(out, dt, 2 * c + 1, (float)((int)(row[c] >> 4) - 8) * scales[2 * c + 1],
                          &bad);
                }
            }
        }
        free(scales);
        return bad ? OUT_OF_RANGE : OK;
    }
    const int8_t *e = ev + ((size_t)t0 * HD) / (size_t)gd;
    for (size_t k = 0; k < n / (size_t)gd; k++) {
        if (e[k] < -127)
            return BAD_EXPONENT;
        const float scale = pow2(e[k]);
        if (7.0f * scale < fmax_of[dt]) {
            char *out = (char *)dst + k * (size_t)gd * (dt == DT_F32 ? 4 : 2);
            const uint8_t *grp = in + k * (size_t)gd / 2;
            for (Py_ssize_t j = 0; j < gd / 2; j++) {
                store_fast(out, dt, 2 * j, (float)((int)(grp[j] & 0xF) - 8) * scale);
                store_fast(out, dt, 2 * j + 1, (float)((int)(grp[j] >> 4) - 8) * scale);
            }
            continue;
        }
        for (Py_ssize_t j = 0; j < gd; j += 2) {
            uint8_t byte = in[(k * (size_t)gd + (size_t)j) / 2];
            store(dst, dt, k * (size_t)gd + (size_t)j, (float)((int)(byte & 0xF) - 8) * scale, &bad);
            store(dst, dt, k * (size_t)gd + (size_t)j + 1, (float)((int)(byte >> 4) - 8) * scale,
                  &bad);
        }
    }
    return bad ? OUT_OF_RANGE : OK;
}

static int decode_rows_any(int codec, int dt, const uint8_t *vals, const int8_t *ek,
                           const int8_t *ev, Py_ssize_t T, Py_ssize_t H, Py_ssize_t D, int kv,
                           Py_ssize_t t0, Py_ssize_t t1, void *dst)
{
    switch (dt) {
    case DT_F32: return decode_rows(codec, DT_F32, vals, ek, ev, T, H, D, kv, t0, t1, dst);
    case DT_BF16: return decode_rows(codec, DT_BF16, vals, ek, ev, T, H, D, kv, t0, t1, dst);
    default: return decode_rows(codec, DT_F16, vals, ek, ev, T, H, D, kv, t0, t1, dst);
    }
}

/* The three output dtypes as constants, so each loop is compiled for its own. */
static int encode_any(int codec, int dt, const void *src, Py_ssize_t T, Py_ssize_t H,
                      Py_ssize_t D, uint8_t *vals, int8_t *ek, int8_t *ev)
{
    switch (dt) {
    case DT_F32: return encode_layer(codec, DT_F32, src, T, H, D, vals, ek, ev);
    case DT_BF16: return encode_layer(codec, DT_BF16, src, T, H, D, vals, ek, ev);
    default: return encode_layer(codec, DT_F16, src, T, H, D, vals, ek, ev);
    }
}

/* One whole layer: its K rows, then its V rows. */
static int decode_any(int codec, int dt, const uint8_t *vals, const int8_t *ek,
                      const int8_t *ev, Py_ssize_t T, Py_ssize_t H, Py_ssize_t D, void *dst)
{
    int status = decode_rows_any(codec, dt, vals, ek, ev, T, H, D, 0, 0, T, dst);
    if (status != OK)
        return status;
    char *v = (char *)dst + (size_t)T * H * D * (dt == DT_F32 ? 4 : 2);
    return decode_rows_any(codec, dt, vals, ek, ev, T, H, D, 1, 0, T, v);
}

/* encode(codec, dtype, src, T, H, D, vals, ek, ev) -> status */
static PyObject *py_encode(PyObject *self, PyObject *args)
{
    int codec, dt;
    unsigned long long src, vals, ek, ev;
    Py_ssize_t T, H, D;
    if (!PyArg_ParseTuple(args, "iiKnnnKKK", &codec, &dt, &src, &T, &H, &D, &vals, &ek, &ev))
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = encode_any(codec, dt, (const void *)(uintptr_t)src, T, H, D,
                          (uint8_t *)(uintptr_t)vals, (int8_t *)(uintptr_t)ek, (int8_t *)(uintptr_t)ev);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

/* decode(codec, dtype, vals, ek, ev, T, H, D, dst) -> status */
static PyObject *py_decode(PyObject *self, PyObject *args)
{
    int codec, dt;
    unsigned long long vals, ek, ev, dst;
    Py_ssize_t T, H, D;
    if (!PyArg_ParseTuple(args, "iiKKKnnnK", &codec, &dt, &vals, &ek, &ev, &T, &H, &D, &dst))
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decode_any(codec, dt, (const uint8_t *)(uintptr_t)vals, (const int8_t *)(uintptr_t)ek,
                          (const int8_t *)(uintptr_t)ev, T, H, D, (void *)(uintptr_t)dst);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

/* decode_layers(codec, dtype, src, layers, step, k_at, v_at, T, H, D, dst, dst_step) ->
 * status: layers laid out one after another, each of step bytes (its values at 0, its
 * exponents of K at k_at and of V at v_at), decoded into dst, one layer each dst_step
 * bytes: a chunk whose layers were encoded apart, in one call. */
static PyObject *py_decode_layers(PyObject *self, PyObject *args)
{
    int codec, dt;
    unsigned long long src, dst;
    Py_ssize_t layers, step, k_at, v_at, T, H, D, dst_step;
    if (!PyArg_ParseTuple(args, "iiKnnnnnnnKn", &codec, &dt, &src, &layers, &step, &k_at, &v_at,
                          &T, &H, &D, &dst, &dst_step))
        return NULL;
    int status = OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t l = 0; l < layers && status == OK; l++) {
        const uint8_t *at = (const uint8_t *)(uintptr_t)src + l * step;
        status = decode_any(codec, dt, at, (const int8_t *)(at + k_at), (const int8_t *)(at + v_at),
                            T, H, D, (char *)(uintptr_t)dst + l * dst_step);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

/* verify_decode_scatter(codec, dtype, src, layers, step, k_at, v_at, T, H, D, expected,
 * pieces, per_layer) -> (layer, status): for each layer in order, the xxh3 of its step
 * stored bytes is compared with expected[layer] (on a mismatch: (layer, -1), nothing of it
 * or after it written), then its per_layer pieces, each four uint64 (kv, t0, t1, dst), are
 * decoded into place (a decode error: (layer, status)). (-1, 0): all written. The layer is
 * in cache from its check when it is decoded: the stored bytes cross memory once. */
static PyObject *py_verify_decode_scatter(PyObject *self, PyObject *args)
{
    int codec, dt;
    unsigned long long src, expected_a, pieces_a;
    Py_ssize_t layers, step, k_at, v_at, T, H, D, per_layer;
    if (!PyArg_ParseTuple(args, "iiKnnnnnnnKKn", &codec, &dt, &src, &layers, &step, &k_at,
                          &v_at, &T, &H, &D, &expected_a, &pieces_a, &per_layer))
        return NULL;
    const uint64_t *expected = (const uint64_t *)(uintptr_t)expected_a;
    const uint64_t *pieces = (const uint64_t *)(uintptr_t)pieces_a;
    Py_ssize_t failed = -1;
    int status = OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t l = 0; l < layers; l++) {
        const uint8_t *at = (const uint8_t *)(uintptr_t)src + l * step;
        if (XXH3_64bits(at, (size_t)step) != expected[l]) {
            failed = l;
            status = -1;
            break;
        }
        for (Py_ssize_t p = 0; p < per_layer && status == OK; p++) {
            const uint64_t *pc = pieces + 4 * (l * per_layer + p);
            status = decode_rows_any(codec, dt, at, (const int8_t *)(at + k_at),
                                     (const int8_t *)(at + v_at), T, H, D, (int)pc[0],
                                     (Py_ssize_t)pc[1], (Py_ssize_t)pc[2], (void *)(uintptr_t)pc[3]);
        }
        if (status != OK) {
            failed = l;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(ni)", failed, status);
}

static PyMethodDef methods[] = {
    {"verify_decode_scatter", py_verify_decode_scatter, METH_VARARGS,
     "Check each layer's xxh3, then decode its pieces into place; (layer, status)."},
    {"decode_layers", py_decode_layers, METH_VARARGS,
     "Decode layers encoded apart, one after another; 0 or an error status."},
    {"encode", py_encode, METH_VARARGS, "Encode one layer of KV; 0 or an error status."},
    {"decode", py_decode, METH_VARARGS, "Decode one layer of KV; 0 or an error status."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kv_codec", "KV codecs at rest (kvtier.kv_codecs), native.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__kv_codec(void)
{
    init_fp8_lut();
    return PyModule_Create(&module);
}
