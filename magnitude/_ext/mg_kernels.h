/* mg_kernels.h: the quantized compute kernels of Magnitude, plain C, header-only.
 *
 * Weights stay in their GGUF block format (Q4_0 18 B, Q4_1 20 B, Q8_0 34 B per 32 values).
 * Activations are quantized per 32-block to int8 (Q8_0 / Q8_1, exactly ggml's reference
 * quantizers). Every dot product is an int32 sum inside a block; the two block scales are applied
 * once per block, in the same float order on every path:
 *
 *     acc += (d_w * d_x) * (float)sumi            Q4_0, Q8_0
 *     acc += (d_w * d_x) * (float)sumi + m_w * s_x   Q4_1
 *
 * with the blocks of a row taken in order. The SIMD paths keep that order by putting one OUTPUT
 * ROW in each float lane (8 rows per pass), so their results are bit-identical to the scalar
 * path, not merely close. The int32 sums are exact on every path.
 *
 * No -march=native: each SIMD path is compiled for its own target (GCC target pragmas below) and
 * chosen at run time from cpuid; MAGNITUDE_KERNEL=scalar|avx2|avxvnni|avx512vnni forces one.
 * Nothing here starts threads: callers split rows across their own OpenMP threads. The only
 * mutable state is the selected path (an int, set once at start-up or by mg_set_kernel_path).
 *
 * Trap: this file is `static`, so every extension module that includes it has its OWN copy of
 * the selected path. Only kernels.pyx includes it (the executor's op table is compiled into
 * that module), so there is one.
 */
#ifndef MG_SIMD_PASS /* ---------------------------------------------------------------------- */
#ifndef MG_KERNELS_H
#define MG_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* MG_NO_SIMD: build the portable scalar path only (what non-x86 and non-GCC compilers get) */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__)) && \
    !defined(MG_NO_SIMD)
#define MG_X86 1
#include <immintrin.h>
#else
#define MG_X86 0
#endif

enum { MG_Q4_0 = 2, MG_Q4_1 = 3, MG_Q8_0 = 8 }; /* ggml type ids */
enum { MG_PATH_SCALAR = 0, MG_PATH_AVX2 = 1, MG_PATH_AVXVNNI = 2, MG_PATH_AVX512VNNI = 3 };
enum { MG_QK = 32 };

/* bytes per 32-value block of a weight type, 0 if unknown */
static inline int64_t mg_block_bytes(int qtype) {
    return qtype == MG_Q4_0 ? 18 : qtype == MG_Q4_1 ? 20 : qtype == MG_Q8_0 ? 34 : 0;
}
/* bytes per activation block paired with a weight type: Q8_1 for Q4_1, Q8_0 otherwise */
static inline int64_t mg_act_block_bytes(int qtype) { return qtype == MG_Q4_1 ? 36 : 34; }

static inline void mg_barrier(void) { _Pragma("omp barrier") }

/* ---- IEEE half <-> float, exact and portable (F16C gives the same bits) ---- */

static inline uint32_t mg_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float mg_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t mg_rd16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h; }

static inline float mg_h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 31) return mg_u2f(sign | 0x7f800000u | (man << 13));
    if (exp == 0) { /* zero or subnormal: man * 2^-24 is exact in float */
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    return mg_u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

/* round to nearest even, like F16C and numpy's astype(float16). The float arithmetic does the
   rounding, so this must not be compiled with -ffast-math. */
static inline uint16_t mg_f2h(float f) {
    const float to_inf = mg_u2f(0x77800000u), to_zero = mg_u2f(0x08800000u); /* 2^112, 2^-110 */
    float base = (fabsf(f) * to_inf) * to_zero;
    uint32_t w = mg_f2u(f), shl1 = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1 & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = mg_u2f((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = mg_f2u(base);
    uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}

static void mg_f32_to_f16(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = mg_f2h(x[i]);
}

/* ---- activation quantizers: ggml's quantize_row_q8_0_ref / q8_1_ref, byte for byte ---- */

static inline float mg_absmax32(const float *x) {
    float amax = 0.0f;
    for (int j = 0; j < MG_QK; j++) {
        float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* roundf (half away from zero), spelled out so it vectorises; exact for |v| < 2^23 */
static inline float mg_round_away(float v) {
    float t = truncf(v);
    float r = fabsf(v - t) >= 0.5f ? t + copysignf(1.0f, v) : t;
    return r;
}

static inline int mg_quantize_block(const float *x, int8_t *q, float *d_out) {
    float d = mg_absmax32(x) / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f; /* ggml multiplies by 1/d, it does not divide */
    int sum = 0;
    for (int j = 0; j < MG_QK; j++) {
        /* the clamp changes nothing when 1/d is finite (|x*id| rounds to <= 127) but keeps the
           cast defined when d is a float subnormal and 1/d overflows (ggml's reference is UB) */
        float v = fminf(fmaxf(x[j] * id, -127.0f), 127.0f);
        q[j] = (int8_t)mg_round_away(v);
        sum += q[j];
    }
    *d_out = d;
    return sum;
}

typedef int (*mg_block_quantizer)(const float *x, int8_t *q, float *d_out);

/* Q8_0 / Q8_1 rows from a block quantizer (scalar or SIMD: they give the same bytes) */
static inline void mg_quantize_rows(mg_block_quantizer quantize, int q8_1, const float *x,
                                    uint8_t *out, int64_t n) {
    int64_t bb = q8_1 ? 36 : 34;
    for (int64_t b = 0; b < n / MG_QK; b++) {
        uint8_t *o = out + b * bb;
        float d;
        int sum = quantize(x + b * MG_QK, (int8_t *)(o + bb - MG_QK), &d);
        uint16_t h[2] = {mg_f2h(d), mg_f2h((float)sum * d)}; /* s from the f32 d, as ggml */
        memcpy(o, h, q8_1 ? 4 : 2);
    }
}

/* ---- scalar block dot products: the reference every SIMD path must reproduce exactly ---- */

static inline int32_t mg_sumi_q4_1(const uint8_t *qs, const int8_t *x) {
    int32_t s = 0;
    for (int j = 0; j < 16; j++) s += (qs[j] & 15) * x[j] + (qs[j] >> 4) * x[j + 16];
    return s;
}
static inline int32_t mg_sumi_q4_0(const uint8_t *qs, const int8_t *x) {
    int32_t s = 0;
    for (int j = 0; j < 16; j++) s += ((qs[j] & 15) - 8) * x[j] + ((qs[j] >> 4) - 8) * x[j + 16];
    return s;
}
static inline int32_t mg_sumi_q8_0(const int8_t *w, const int8_t *x) {
    int32_t s = 0;
    for (int j = 0; j < 32; j++) s += w[j] * x[j];
    return s;
}

/* int32 sum of block b of a weight row against block b of an activation row */
static inline int32_t mg_block_sumi(int qtype, const uint8_t *w, const uint8_t *x, int64_t b) {
    if (qtype == MG_Q4_1) return mg_sumi_q4_1(w + b * 20 + 4, (const int8_t *)(x + b * 36 + 4));
    if (qtype == MG_Q4_0) return mg_sumi_q4_0(w + b * 18 + 2, (const int8_t *)(x + b * 34 + 2));
    return mg_sumi_q8_0((const int8_t *)(w + b * 34 + 2), (const int8_t *)(x + b * 34 + 2));
}

/* one block's float contribution; the exact expression every path evaluates */
static inline float mg_block_term(int qtype, const uint8_t *w, const uint8_t *x, int64_t b,
                                  int32_t sumi) {
    int64_t wb = mg_block_bytes(qtype), xb = mg_act_block_bytes(qtype);
    float dw = mg_h2f(mg_rd16(w + b * wb)), dx = mg_h2f(mg_rd16(x + b * xb));
    if (qtype == MG_Q4_1) {
        float mw = mg_h2f(mg_rd16(w + b * wb + 2)), sx = mg_h2f(mg_rd16(x + b * xb + 2));
        return (dw * dx) * (float)sumi + mw * sx;
    }
    return (dw * dx) * (float)sumi;
}

static float mg_dot_row_scalar(int qtype, const uint8_t *w, const uint8_t *x, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) acc += mg_block_term(qtype, w, x, b, mg_block_sumi(qtype, w, x, b));
    return acc;
}

static void mg_matmul_scalar(int qtype, const uint8_t *w, int64_t row_bytes, int64_t cols,
                             const uint8_t *xq, int64_t xq_stride, int64_t T, float *y,
                             int64_t ldy, int64_t r0, int64_t r1) {
    int64_t nb = cols / MG_QK;
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = r0; r < r1; r++)
            y[t * ldy + r] = mg_dot_row_scalar(qtype, w + r * row_bytes, xq + t * xq_stride, nb);
}

/* ---- float helpers, scalar (they are a small share of the time) ---- */

static void mg_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

static void mg_rope(float *x, int64_t n_heads, int64_t head_dim, int64_t pos, float freq_base) {
    for (int64_t i = 0; i < head_dim / 2; i++) {
        /* double: theta reaches pos (thousands of radians) where float loses the angle */
        double theta = (double)pos * pow((double)freq_base, -2.0 * (double)i / (double)head_dim);
        float c = (float)cos(theta), s = (float)sin(theta);
        for (int64_t h = 0; h < n_heads; h++) {
            float *p = x + h * head_dim + 2 * i;
            float a = p[0], b = p[1];
            p[0] = a * c - b * s;
            p[1] = a * s + b * c;
        }
    }
}

static void mg_softmax_scalar(float *x, int64_t n) {
    if (n <= 0) return;
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

static void mg_silu_mul_scalar(const float *g, const float *u, float *y, int64_t n) {
    /* g / (1 + e^-g): for g << 0 e^-g is inf and the quotient a correct -0 */
    for (int64_t i = 0; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void mg_add(const float *a, const float *b, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = a[i] + b[i];
}

static void mg_dequant_row(int qtype, const uint8_t *row, float *y, int64_t n) {
    for (int64_t b = 0; b < n / MG_QK; b++) {
        float *o = y + b * MG_QK;
        if (qtype == MG_Q8_0) {
            const uint8_t *p = row + b * 34;
            float d = mg_h2f(mg_rd16(p));
            for (int j = 0; j < 32; j++) o[j] = d * (float)(int8_t)p[2 + j];
        } else if (qtype == MG_Q4_0) {
            const uint8_t *p = row + b * 18;
            float d = mg_h2f(mg_rd16(p));
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)((p[2 + j] & 15) - 8);
                o[j + 16] = d * (float)((p[2 + j] >> 4) - 8);
            }
        } else if (qtype == MG_Q4_1) {
            const uint8_t *p = row + b * 20;
            float d = mg_h2f(mg_rd16(p)), m = mg_h2f(mg_rd16(p + 2));
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)(p[4 + j] & 15) + m;
                o[j + 16] = d * (float)(p[4 + j] >> 4) + m;
            }
        }
    }
}

/* attention pieces: one K row dot and one V row axpy, f32 or f16 cache */
static float mg_dot_kv_scalar(const float *q, const void *k, int f16, int64_t n) {
    float s = 0.0f;
    if (f16) {
        const uint16_t *kh = (const uint16_t *)k;
        for (int64_t i = 0; i < n; i++) s += q[i] * mg_h2f(kh[i]);
    } else {
        const float *kf = (const float *)k;
        for (int64_t i = 0; i < n; i++) s += q[i] * kf[i];
    }
    return s;
}
static void mg_axpy_kv_scalar(float a, const void *v, int f16, float *out, int64_t n) {
    if (f16) {
        const uint16_t *vh = (const uint16_t *)v;
        for (int64_t i = 0; i < n; i++) out[i] += a * mg_h2f(vh[i]);
    } else {
        const float *vf = (const float *)v;
        for (int64_t i = 0; i < n; i++) out[i] += a * vf[i];
    }
}

/* ---- the SIMD paths: the second half of this file, compiled once per target ---- */
#if MG_X86
#define MG_SIMD_PASS 1

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define MG_SFX(name) name##_avx2
/* u8 x s8 -> 8 x int32 sums of 4: two instructions without VNNI. No overflow: the pairs stay
   within 2*128*127 < 2^15 for our operands (nibbles, |w8|, activations in [-127, 127]). */
#define MG_DPBUSD(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#define MG_DPBUSD_ACC(acc, u, s) _mm256_add_epi32((acc), MG_DPBUSD(u, s))
#include "mg_kernels.h"
#undef MG_DPBUSD
#undef MG_DPBUSD_ACC
#undef MG_SFX
#undef MG_VNNI
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avxvnni,avx2,fma,f16c")
#define MG_SFX(name) name##_avxvnni
#define MG_VNNI 1
#define MG_DPBUSD(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (s))
#define MG_DPBUSD_ACC(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#include "mg_kernels.h"
#undef MG_DPBUSD
#undef MG_DPBUSD_ACC
#undef MG_SFX
#undef MG_VNNI
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#define MG_SFX(name) name##_avx512vnni
#define MG_VNNI 1
#define MG_DPBUSD(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#define MG_DPBUSD_ACC(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#include "mg_kernels.h"
#undef MG_DPBUSD
#undef MG_DPBUSD_ACC
#undef MG_SFX
#undef MG_VNNI
#pragma GCC pop_options

#undef MG_SIMD_PASS
#endif /* MG_X86 */

/* ---- path selection ---- */

static int mg_cpu_features(void) {
#if MG_X86
    int f = 0;
    __builtin_cpu_init();
    int base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (base) f |= 1;
    if (base && __builtin_cpu_supports("avxvnni")) f |= 2;
    if (base && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        f |= 4;
    return f;
#else
    return 0;
#endif
}

static int mg_path_supported(int path) {
    if (path == MG_PATH_SCALAR) return 1;
    if (path < 0 || path > MG_PATH_AVX512VNNI) return 0;
    return (mg_cpu_features() >> (path - 1)) & 1;
}

static int mg_best_path(void) {
    for (int p = MG_PATH_AVX512VNNI; p > MG_PATH_SCALAR; p--)
        if (mg_path_supported(p)) return p;
    return MG_PATH_SCALAR;
}

/* MAGNITUDE_KERNEL as a path: -1 unset/auto, -2 unknown name, -3 not supported by this CPU */
static int mg_env_kernel_path(void) {
    const char *e = getenv("MAGNITUDE_KERNEL");
    if (!e || !*e || !strcmp(e, "auto")) return -1;
    static const char *names[] = {"scalar", "avx2", "avxvnni", "avx512vnni"};
    for (int p = 0; p < 4; p++)
        if (!strcmp(e, names[p])) return mg_path_supported(p) ? p : -3;
    return -2;
}

static int mg_path_state = -1;

static int mg_kernel_path(void) {
    int p = mg_path_state;
    if (p < 0) { /* first use; the wrapper module calls this at import, before any threads */
        p = mg_env_kernel_path();
        if (p < 0) p = mg_best_path();
        mg_path_state = p;
    }
    return p;
}

static int mg_set_kernel_path(int path) {
    if (!mg_path_supported(path)) return -1;
    mg_path_state = path;
    return 0;
}

static void mg_matmul(int qtype, const uint8_t *w, int64_t row_bytes, int64_t cols,
                      const uint8_t *xq, int64_t xq_stride, int64_t T, float *y, int64_t ldy,
                      int64_t r0, int64_t r1) {
    if (mg_block_bytes(qtype) == 0 || r1 <= r0 || T <= 0) return; /* the wrapper validates */
#if MG_X86
    /* the SIMD paths gather 8 rows' scales with int32 offsets */
    if (row_bytes <= (int64_t)1 << 27) {
        switch (mg_kernel_path()) {
        case MG_PATH_AVX2:
            mg_matmul_avx2(qtype, w, row_bytes, cols, xq, xq_stride, T, y, ldy, r0, r1);
            return;
        case MG_PATH_AVXVNNI:
            mg_matmul_avxvnni(qtype, w, row_bytes, cols, xq, xq_stride, T, y, ldy, r0, r1);
            return;
        case MG_PATH_AVX512VNNI:
            mg_matmul_avx512vnni(qtype, w, row_bytes, cols, xq, xq_stride, T, y, ldy, r0, r1);
            return;
        }
    }
#endif
    mg_matmul_scalar(qtype, w, row_bytes, cols, xq, xq_stride, T, y, ldy, r0, r1);
}

/* test hook: the per-block int32 sums of weight row 0 against activation row 0 (nb of them),
   as the selected path computes them (8 rows are needed per SIMD pass: w must hold 8 rows) */
static void mg_block_sums(int qtype, const uint8_t *w, int64_t row_bytes, const uint8_t *x,
                          int64_t nb, int32_t *out) {
#if MG_X86
    switch (mg_kernel_path()) {
    case MG_PATH_AVX2: mg_block_sums8_avx2(qtype, w, row_bytes, x, nb, out); return;
    case MG_PATH_AVXVNNI: mg_block_sums8_avxvnni(qtype, w, row_bytes, x, nb, out); return;
    case MG_PATH_AVX512VNNI: mg_block_sums8_avx512vnni(qtype, w, row_bytes, x, nb, out); return;
    }
#endif
    for (int64_t r = 0; r < 8; r++)
        for (int64_t b = 0; b < nb; b++)
            out[r * nb + b] = mg_block_sumi(qtype, w + r * row_bytes, x, b);
}

/* Q8_0 (q8_1 == 0) or Q8_1 rows with the selected path's block quantizer */
static void mg_quantize(const float *x, uint8_t *out, int64_t n, int q8_1) {
#if MG_X86
    if (mg_kernel_path() != MG_PATH_SCALAR) {
        mg_quantize_rows(mg_quantize_block_avx2, q8_1, x, out, n);
        return;
    }
#endif
    mg_quantize_rows(mg_quantize_block, q8_1, x, out, n);
}

static void mg_quantize_q8_0(const float *x, uint8_t *out, int64_t n) { mg_quantize(x, out, n, 0); }
static void mg_quantize_q8_1(const float *x, uint8_t *out, int64_t n) { mg_quantize(x, out, n, 1); }

static void mg_silu_mul(const float *g, const float *u, float *y, int64_t n) {
#if MG_X86
    if (mg_kernel_path() != MG_PATH_SCALAR) {
        mg_silu_mul_avx2(g, u, y, n);
        return;
    }
#endif
    mg_silu_mul_scalar(g, u, y, n);
}

static void mg_softmax(float *x, int64_t n) {
#if MG_X86
    if (n > 0 && mg_kernel_path() != MG_PATH_SCALAR) {
        mg_softmax_avx2(x, n);
        return;
    }
#endif
    mg_softmax_scalar(x, n);
}

static void mg_attention(const float *q, const void *k_cache, const void *v_cache, int kv_f16,
                         int64_t kv_stride, int64_t n_pos, int64_t n_head, int64_t n_kv_head,
                         int64_t head_dim, float scale, float *out, float *scratch, int64_t h0,
                         int64_t h1) {
#if MG_X86
    int simd = mg_kernel_path() != MG_PATH_SCALAR;
#endif
    int64_t group = n_head / n_kv_head;
    int64_t esize = kv_f16 ? 2 : 4;
    for (int64_t h = h0; h < h1; h++) {
        const float *qh = q + h * head_dim;
        float *oh = out + h * head_dim;
        int64_t off = (h / group) * head_dim; /* element offset of this head's kv head */
        const char *k = (const char *)k_cache + off * esize;
        const char *v = (const char *)v_cache + off * esize;
#if MG_X86
        if (simd && head_dim % 8 == 0 && head_dim <= 128) {
            mg_attention_head_avx2(qh, k, v, kv_f16, kv_stride * esize, n_pos, head_dim, scale,
                                   oh, scratch);
            continue;
        }
#endif
        for (int64_t p = 0; p < n_pos; p++)
            scratch[p] = scale * mg_dot_kv_scalar(qh, k + p * kv_stride * esize, kv_f16, head_dim);
        mg_softmax_scalar(scratch, n_pos);
        for (int64_t i = 0; i < head_dim; i++) oh[i] = 0.0f;
        for (int64_t p = 0; p < n_pos; p++)
            mg_axpy_kv_scalar(scratch[p], v + p * kv_stride * esize, kv_f16, oh, head_dim);
    }
}

#endif /* MG_KERNELS_H */

#else /* MG_SIMD_PASS: one SIMD path; MG_SFX names it, MG_DPBUSD(_ACC) its u8 x s8 dot ---- */

/* Lane order of every 8-row vector below: rows 0 2 4 6 1 3 5 7. It falls out of the hadd tree
   that reduces row pairs (mg_sumi8); gathering the scales in the same order keeps rows and scales together, and
   MG_UNPERM puts rows back in order on the way out. */
#define MG_LANE_ROWS 0, 2, 4, 6, 1, 3, 5, 7
#define MG_UNPERM 0, 4, 1, 5, 2, 6, 3, 7

/* 8 vectors of 8 int32 -> one vector whose lane i is the sum of v[i] */
static inline __m256i MG_SFX(mg_hsum8)(const __m256i *v) {
    __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    /* ab: [v0..v3 sums of lanes 0-3 | v0..v3 sums of lanes 4-7], cd the same for v4..v7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                            _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* One block of 8 weight rows, loaded and unpacked once, then used by every token of a tile.
   Rows 2j and 2j+1 sit side by side in one ymm ([row 2j | row 2j+1], 16 values each): lo[j]
   holds values 0-15 of the block, hi[j] values 16-31, so one dpbusd serves two rows and the
   lanes come out half reduced (three hadds finish 8 rows, in MG_LANE_ROWS order).
   Q4: lo/hi are the nibbles. Q8_0: lo/hi are |w| (the u8 operand) and slo/shi w itself, whose
   sign goes onto x (ggml's sign trick); with VNNI, x + 128 is the u8 operand instead. */
typedef struct {
    __m256i lo[4], hi[4];
    __m256i slo[4], shi[4]; /* Q8_0 */
    __m256i wsum128;        /* Q8_0 with VNNI: 128 * sum(w) per row, lane order */
    __m256 d, m;            /* scales and Q4_1 mins, lane order */
} MG_SFX(mg_wblk8);

/* the fp16 d (| m << 16) of one block in 8 rows, one gather, rows in lane order */
static inline void MG_SFX(mg_scales8)(const uint8_t *wp, __m256i idx, __m256 *d, __m256 *m) {
    __m256i g = _mm256_i32gather_epi32((const int *)wp, idx, 1);
    __m256i lo16 = _mm256_and_si256(g, _mm256_set1_epi32(0xffff)), hi16 = _mm256_srli_epi32(g, 16);
    /* packus interleaves 128-bit halves: [d0-3 m0-3 | d4-7 m4-7] -> [d0-7 | m0-7] */
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo16, hi16), 0xd8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(p));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(p, 1));
}

static inline void MG_SFX(mg_load_wblk8)(int qtype, const uint8_t *wp, int64_t rb, __m256i idx,
                                         MG_SFX(mg_wblk8) *k) {
    MG_SFX(mg_scales8)(wp, idx, &k->d, &k->m);
    if (qtype == MG_Q8_0) {
        for (int j = 0; j < 4; j++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(wp + 2 * j * rb + 2));
            __m256i b = _mm256_loadu_si256((const __m256i *)(wp + (2 * j + 1) * rb + 2));
            k->slo[j] = _mm256_permute2x128_si256(a, b, 0x20);
            k->shi[j] = _mm256_permute2x128_si256(a, b, 0x31);
            k->lo[j] = _mm256_abs_epi8(k->slo[j]);
            k->hi[j] = _mm256_abs_epi8(k->shi[j]);
        }
#ifdef MG_VNNI
        __m256i one = _mm256_set1_epi8(1), v[4];
        for (int j = 0; j < 4; j++)
            v[j] = MG_DPBUSD_ACC(MG_DPBUSD(one, k->slo[j]), one, k->shi[j]);
        k->wsum128 = _mm256_slli_epi32(
            _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3])), 7);
#endif
        return;
    }
    const uint8_t *qs = wp + (qtype == MG_Q4_1 ? 4 : 2);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; j++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(qs + 2 * j * rb));
        __m128i b = _mm_loadu_si128((const __m128i *)(qs + (2 * j + 1) * rb));
        __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
        k->lo[j] = _mm256_and_si256(q, m4);
        k->hi[j] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
}

/* int32 sums of one block, 8 rows (lane order) against one activation block */
static inline __m256i MG_SFX(mg_sumi8)(int qtype, const MG_SFX(mg_wblk8) *k, const uint8_t *xp) {
    int off = qtype == MG_Q4_1 ? 4 : 2;
    __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xp + off)));
    __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xp + off + 16)));
    __m256i v[4];
    if (qtype == MG_Q8_0) {
#ifdef MG_VNNI
        /* x + 128 is the u8 operand and w the s8 one: sum (x+128) w - 128 sum w, exact in int32
           and one sign op per row cheaper than the sign trick (no int16 pair sums to overflow,
           unlike AVX2's maddubs, which keeps the sign trick) */
        __m256i bias = _mm256_set1_epi8((char)0x80);
        __m256i ulo = _mm256_xor_si256(xlo, bias), uhi = _mm256_xor_si256(xhi, bias);
        for (int j = 0; j < 4; j++)
            v[j] = MG_DPBUSD_ACC(MG_DPBUSD(ulo, k->slo[j]), uhi, k->shi[j]);
        return _mm256_sub_epi32(
            _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3])),
            k->wsum128);
#else
        for (int j = 0; j < 4; j++)
            v[j] = MG_DPBUSD_ACC(MG_DPBUSD(k->lo[j], _mm256_sign_epi8(xlo, k->slo[j])), k->hi[j],
                                 _mm256_sign_epi8(xhi, k->shi[j]));
#endif
    } else
        for (int j = 0; j < 4; j++)
            v[j] = MG_DPBUSD_ACC(MG_DPBUSD(k->lo[j], xlo), k->hi[j], xhi); /* [2j: 4 | 2j+1: 4] */
    /* hadd pairs lanes within 128-bit halves: three of them finish all 8 rows, in lane order */
    __m256i sum = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    if (qtype == MG_Q4_0) { /* sum (q-8)x = sum qx - 8 sum x: one sum x serves all 8 rows */
        __m256i sx = MG_DPBUSD_ACC(MG_DPBUSD(_mm256_set1_epi8(1), xlo), _mm256_set1_epi8(1), xhi);
        __m128i h = _mm256_castsi256_si128(sx); /* both halves hold the same sums */
        h = _mm_hadd_epi32(h, h);
        h = _mm_hadd_epi32(h, h);
        sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * _mm_cvtsi128_si32(h)));
    }
    return sum;
}

/* the block's float term for 8 rows: the same expression, operation for operation, as
   mg_block_term (no FMA), so every lane equals the scalar path's value bit for bit */
static inline __m256 MG_SFX(mg_term8)(int qtype, __m256 d, __m256 m, const uint8_t *xp,
                                      __m256i sumi) {
    __m256 dx = _mm256_set1_ps(_cvtsh_ss(mg_rd16(xp))); /* F16C: same bits as mg_h2f */
    __m256 t = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sumi));
    if (qtype == MG_Q4_1)
        t = _mm256_add_ps(t, _mm256_mul_ps(m, _mm256_set1_ps(_cvtsh_ss(mg_rd16(xp + 2)))));
    return t;
}

/* The decode GEMV for 8 rows: the same sums, straight from memory. Going through mg_wblk8 here
   measured 20-30% slower for Q4 at T = 1 (the unpacked block is not kept in registers), so the
   single-token path reads the weights directly. Each activation block load serves 8 rows. */
static inline __m256i MG_SFX(mg_sumi8_direct)(int qtype, const uint8_t *wp, int64_t rb,
                                              const uint8_t *xp) {
    if (qtype == MG_Q8_0) {
        static const int order[8] = {MG_LANE_ROWS};
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xp + 2)), s[8];
        for (int i = 0; i < 8; i++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(wp + order[i] * rb + 2));
            s[i] = MG_DPBUSD(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
        }
        return MG_SFX(mg_hsum8)(s);
    }
    int off = qtype == MG_Q4_1 ? 4 : 2;
    const uint8_t *qs = wp + off;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xp + off)));
    __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xp + off + 16)));
    __m256i v[4];
    for (int j = 0; j < 4; j++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(qs + 2 * j * rb));
        __m128i b = _mm_loadu_si128((const __m128i *)(qs + (2 * j + 1) * rb));
        __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        v[j] = MG_DPBUSD_ACC(MG_DPBUSD(lo, xlo), hi, xhi);
    }
    __m256i sum = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    if (qtype == MG_Q4_0) {
        __m256i sx = MG_DPBUSD_ACC(MG_DPBUSD(_mm256_set1_epi8(1), xlo), _mm256_set1_epi8(1), xhi);
        __m128i h = _mm256_castsi256_si128(sx);
        h = _mm_hadd_epi32(h, h);
        h = _mm_hadd_epi32(h, h);
        sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * _mm_cvtsi128_si32(h)));
    }
    return sum;
}

static inline __attribute__((always_inline)) void MG_SFX(mg_gemv8)(
        int qtype, const uint8_t *w, int64_t rb, const uint8_t *x, int64_t nb, const float *xs,
        float *y) { /* xs: mg_act_scales of x, or NULL to convert them here */
    int64_t wb = mg_block_bytes(qtype), xb = mg_act_block_bytes(qtype);
    __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(MG_LANE_ROWS), _mm256_set1_epi32((int)rb));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wp = w + b * wb, *xp = x + b * xb;
        /* The 8 rows of a group are 8*rb contiguous bytes and groups follow each other, so
           the matrix is read front to back: keep a prefetch pointer 32 KB ahead of the group,
           8*wb bytes per block step. Short rows (576 values: 360 bytes) give the hardware
           prefetcher too little to lock on to; this took the 211 matmuls of a SmolLM2 decode
           step from 12.8 to 5.4-7.2 ms on one core (16 KB: 7.0, 64 KB: 6.2-8.5, 128 KB: 8.2).
           Prefetches past the matrix end are harmless. */
        for (int64_t o = b * 8 * wb; o < (b + 1) * 8 * wb; o += 64)
            _mm_prefetch((const char *)(w + 32768 + o), _MM_HINT_T1);
        __m256i si = MG_SFX(mg_sumi8_direct)(qtype, wp, rb, xp);
        __m256 d, m;
        MG_SFX(mg_scales8)(wp, idx, &d, &m);
        if (!xs) {
            acc = _mm256_add_ps(acc, MG_SFX(mg_term8)(qtype, d, m, xp, si));
            continue;
        }
        /* mg_term8 with the activation scales already in f32 */
        __m256 t = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(xs + 2 * b)),
                                 _mm256_cvtepi32_ps(si));
        if (qtype == MG_Q4_1) t = _mm256_add_ps(t, _mm256_mul_ps(m, _mm256_broadcast_ss(xs + 2 * b + 1)));
        acc = _mm256_add_ps(acc, t);
    }
    _mm256_storeu_ps(y, _mm256_permutevar8x32_ps(acc, _mm256_setr_epi32(MG_UNPERM)));
}

#define MG_XS_BLOCKS 512
#define MG_NT 32 /* tokens per tile (accumulators in L1); measured vs 8/16/64: 0.48/0.41/0.39 ns, 32: 0.37 */

/* y[t*ldy + r] for 8 rows (from w) and nt <= MG_NT activation rows (from xq, stride xs).
   Blocks outer, tokens inner: each weight block is loaded and unpacked once per tile, and each
   row still sums its blocks in order. The prefill GEMM; T == 1 goes to mg_gemv8. */
static inline __attribute__((always_inline)) void MG_SFX(mg_tile8)(
        int qtype, const uint8_t *w, int64_t rb, const uint8_t *xq, int64_t xs, int64_t nt,
        int64_t nb, const float *sc, float *y, int64_t ldy) {
    int64_t wb = mg_block_bytes(qtype), xb = mg_act_block_bytes(qtype);
    __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(MG_LANE_ROWS), _mm256_set1_epi32((int)rb));
    __m256 acc[MG_NT];
    for (int64_t t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    MG_SFX(mg_wblk8) k;
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t o = b * 8 * wb; o < (b + 1) * 8 * wb; o += 64) /* as in mg_gemv8 */
            _mm_prefetch((const char *)(w + 32768 + o), _MM_HINT_T1);
        MG_SFX(mg_load_wblk8)(qtype, w + b * wb, rb, idx, &k);
        for (int64_t t = 0; t < nt; t++) {
            const uint8_t *xp = xq + t * xs + b * xb;
            __m256i si = MG_SFX(mg_sumi8)(qtype, &k, xp);
            if (!sc) {
                acc[t] = _mm256_add_ps(acc[t], MG_SFX(mg_term8)(qtype, k.d, k.m, xp, si));
                continue;
            }
            const float *st = sc + 2 * (t * nb + b); /* mg_term8 with f32 activation scales */
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(k.d, _mm256_broadcast_ss(st)),
                                     _mm256_cvtepi32_ps(si));
            if (qtype == MG_Q4_1) v = _mm256_add_ps(v, _mm256_mul_ps(k.m, _mm256_broadcast_ss(st + 1)));
            acc[t] = _mm256_add_ps(acc[t], v);
        }
    }
    for (int64_t t = 0; t < nt; t++)
        _mm256_storeu_ps(y + t * ldy, _mm256_permutevar8x32_ps(acc[t], _mm256_setr_epi32(MG_UNPERM)));
}

static void MG_SFX(mg_block_sums8)(int qtype, const uint8_t *w, int64_t rb, const uint8_t *x,
                                   int64_t nb, int32_t *out) {
    static const int order[8] = {MG_LANE_ROWS};
    int64_t wb = mg_block_bytes(qtype), xb = mg_act_block_bytes(qtype);
    __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(MG_LANE_ROWS), _mm256_set1_epi32((int)rb));
    MG_SFX(mg_wblk8) k;
    for (int64_t b = 0; b < nb; b++) {
        int32_t s[8];
        MG_SFX(mg_load_wblk8)(qtype, w + b * wb, rb, idx, &k);
        _mm256_storeu_si256((__m256i *)s, MG_SFX(mg_sumi8)(qtype, &k, x + b * xb));
        for (int i = 0; i < 8; i++) out[order[i] * nb + b] = s[i];
    }
}

/* the activation scales (d, and s for Q8_1) of T rows as f32: out[2*(t*nb + b) + {0, 1}] */
static inline void MG_SFX(mg_act_scales)(int qtype, const uint8_t *xq, int64_t xq_stride,
                                         int64_t T, int64_t nb, float *out) {
    int64_t xb = mg_act_block_bytes(qtype);
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *xp = xq + t * xq_stride + b * xb;
            out[2 * (t * nb + b)] = _cvtsh_ss(mg_rd16(xp));
            out[2 * (t * nb + b) + 1] = _cvtsh_ss(mg_rd16(xp + 2)); /* unused for Q8_0 */
        }
}

/* rows [r0, r1): 8 at a time, one token (GEMV) or tiles of MG_NT tokens (GEMM) */
static inline __attribute__((always_inline)) void MG_SFX(mg_rows)(
        int qtype, const uint8_t *w, int64_t row_bytes, int64_t nb, const uint8_t *xq,
        int64_t xq_stride, int64_t T, float *y, int64_t ldy, int64_t r0, int64_t r1) {
    /* The activation scales in f32, converted once per call instead of once per 8-row group
       (GEMV 10%, GEMM 15% faster). Decode keeps them on the stack; prefill allocates (a NULL
       from malloc, or very long rows, only means converting them in the inner loop). */
    float xs_stack[2 * MG_XS_BLOCKS];
    float *sc = NULL;
    if (T == 1 && nb <= MG_XS_BLOCKS) sc = xs_stack;
    else if (T > 1) sc = (float *)malloc((size_t)(2 * T * nb) * sizeof(float));
    if (sc) MG_SFX(mg_act_scales)(qtype, xq, xq_stride, T, nb, sc);
    int64_t r = r0;
    if (T == 1)
        for (; r + 8 <= r1; r += 8)
            MG_SFX(mg_gemv8)(qtype, w + r * row_bytes, row_bytes, xq, nb, sc, y + r);
    for (; r + 8 <= r1; r += 8)
        for (int64_t t = 0; t < T; t += MG_NT)
            MG_SFX(mg_tile8)(qtype, w + r * row_bytes, row_bytes, xq + t * xq_stride, xq_stride,
                             T - t < MG_NT ? T - t : MG_NT, nb, sc ? sc + 2 * t * nb : NULL,
                             y + t * ldy + r, ldy);
    if (r < r1 && r1 >= 8) {
        /* the last < 8 rows: run the 8-row pass on rows [r1-8, r1) (they exist, and a row's
           result does not depend on its group) into a scratch tile, keep rows [r, r1) */
        float tmp[MG_NT * 8];
        const uint8_t *wl = w + (r1 - 8) * row_bytes;
        for (int64_t t = 0; t < T; t += MG_NT) {
            int64_t nt = T - t < MG_NT ? T - t : MG_NT;
            MG_SFX(mg_tile8)(qtype, wl, row_bytes, xq + t * xq_stride, xq_stride, nt, nb,
                             sc ? sc + 2 * t * nb : NULL, tmp, 8);
            for (int64_t i = 0; i < nt; i++)
                for (int64_t q = r; q < r1; q++) y[(t + i) * ldy + q] = tmp[i * 8 + q - (r1 - 8)];
        }
        r = r1;
    }
    for (; r < r1; r++) /* fewer than 8 rows in the whole matrix */
        for (int64_t t = 0; t < T; t++)
            y[t * ldy + r] = mg_dot_row_scalar(qtype, w + r * row_bytes, xq + t * xq_stride, nb);
    if (sc != xs_stack) free(sc);
}

static void MG_SFX(mg_matmul)(int qtype, const uint8_t *w, int64_t row_bytes, int64_t cols,
                              const uint8_t *xq, int64_t xq_stride, int64_t T, float *y,
                              int64_t ldy, int64_t r0, int64_t r1) {
    int64_t nb = cols / MG_QK;
    /* constant qtypes: the compiler builds one loop per type with no type tests inside */
    switch (qtype) {
    case MG_Q4_1: MG_SFX(mg_rows)(MG_Q4_1, w, row_bytes, nb, xq, xq_stride, T, y, ldy, r0, r1); break;
    case MG_Q4_0: MG_SFX(mg_rows)(MG_Q4_0, w, row_bytes, nb, xq, xq_stride, T, y, ldy, r0, r1); break;
    case MG_Q8_0: MG_SFX(mg_rows)(MG_Q8_0, w, row_bytes, nb, xq, xq_stride, T, y, ldy, r0, r1); break;
    }
}

#if !defined(MG_KV_DONE)
#define MG_KV_DONE 1 /* the attention helpers need only AVX2+F16C: define them in the first pass */
/* mg_quantize_block, 32 values at a time: the same float operations lane by lane (the
   absmax is exact in any order, x*id and the clamp are one rounding each, the rounding is
   mg_round_away's), so the bytes equal the scalar quantizer's */
static int MG_SFX(mg_quantize_block)(const float *x, int8_t *q, float *d_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax); /* NaN lanes lose, as in C */
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float d = _mm_cvtss_f32(m) / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i qi[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        __m256 t = _mm256_mul_ps(v[i], _mm256_set1_ps(id));
        t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
        __m256 tr = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __m256 frac = _mm256_andnot_ps(sign, _mm256_sub_ps(t, tr));
        __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
        __m256 one = _mm256_or_ps(_mm256_and_ps(t, sign), _mm256_set1_ps(1.0f)); /* copysign */
        qi[i] = _mm256_cvttps_epi32(_mm256_add_ps(tr, _mm256_and_ps(up, one)));
        total = _mm256_add_epi32(total, qi[i]);
    }
    /* packs interleave 128-bit lanes; the permute puts the 32 values back in order */
    __m256i q16a = _mm256_packs_epi32(qi[0], qi[1]), q16b = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i q8 = _mm256_packs_epi16(q16a, q16b);
    q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, q8);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *d_out = d;
    return _mm_cvtsi128_si32(s4);
}

static inline float MG_SFX(mg_hsum_ps)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 MG_SFX(mg_load8_kv)(const void *p, int f16, int64_t i) {
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

static float MG_SFX(mg_dot_kv)(const float *q, const void *k, int f16, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), MG_SFX(mg_load8_kv)(k, f16, i), acc);
    float s = MG_SFX(mg_hsum_ps)(acc);
    for (; i < n; i++)
        s += q[i] * (f16 ? mg_h2f(((const uint16_t *)k)[i]) : ((const float *)k)[i]);
    return s;
}

/* 8 float vectors -> one vector whose lane i is the sum of v[i] */
static inline __m256 MG_SFX(mg_hsum8_ps)(const __m256 *v) {
    __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* e^x, Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial; within 2 ulp of expf
   (tested to 1e-6 relative through softmax and silu). Below -87.33 (e^x < 2^-126) it returns
   0 where expf gives a subnormal, and above 88 it returns inf (expf overflows at 88.72): both
   are invisible in softmax (largest term 1) and in silu (g / (1 + e^-g) is ~0 there). */
static inline __m256 MG_SFX(mg_exp)(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33f), hi = _mm256_set1_ps(88.0f);
    __m256 small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), big = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_andnot_ps(small, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), big);
}

static void MG_SFX(mg_silu_mul)(const float *g, const float *u, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = MG_SFX(mg_exp)(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void MG_SFX(mg_softmax)(float *x, int64_t n) {
    float mx = x[0];
    for (int64_t i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    __m256 m = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = MG_SFX(mg_exp)(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    double sum = MG_SFX(mg_hsum_ps)(acc);
    for (; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    __m256 inv = _mm256_set1_ps((float)(1.0 / sum));
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    for (; i < n; i++) x[i] *= (float)(1.0 / sum);
}

/* One head of attention, head_dim a multiple of 8 up to 128: scores 8 positions at a time (one
   reduction per 8 dot products), then the weighted V rows summed in registers. */
static void MG_SFX(mg_attention_head)(const float *qh, const char *k, const char *v, int f16,
                                      int64_t row_bytes, int64_t n_pos, int64_t hd, float scale,
                                      float *oh, float *scratch) {
    int64_t nc = hd / 8, p = 0;
    __m256 qv[16];
    for (int64_t c = 0; c < nc; c++) qv[c] = _mm256_loadu_ps(qh + 8 * c);
    for (; p + 8 <= n_pos; p += 8) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) {
            const void *kp = k + (p + i) * row_bytes;
            acc[i] = _mm256_mul_ps(qv[0], MG_SFX(mg_load8_kv)(kp, f16, 0));
            for (int64_t c = 1; c < nc; c++)
                acc[i] = _mm256_fmadd_ps(qv[c], MG_SFX(mg_load8_kv)(kp, f16, 8 * c), acc[i]);
        }
        _mm256_storeu_ps(scratch + p, _mm256_mul_ps(_mm256_set1_ps(scale), MG_SFX(mg_hsum8_ps)(acc)));
    }
    for (; p < n_pos; p++) scratch[p] = scale * MG_SFX(mg_dot_kv)(qh, k + p * row_bytes, f16, hd);
    MG_SFX(mg_softmax)(scratch, n_pos);
    __m256 o[16];
    for (int64_t c = 0; c < nc; c++) o[c] = _mm256_setzero_ps();
    for (p = 0; p < n_pos; p++) {
        __m256 a = _mm256_set1_ps(scratch[p]);
        const void *vp = v + p * row_bytes;
        for (int64_t c = 0; c < nc; c++) o[c] = _mm256_fmadd_ps(a, MG_SFX(mg_load8_kv)(vp, f16, 8 * c), o[c]);
    }
    for (int64_t c = 0; c < nc; c++) _mm256_storeu_ps(oh + 8 * c, o[c]);
}
#endif /* MG_KV_DONE */

#endif /* MG_SIMD_PASS */
