/*
 * y = x @ (S * W)^T (+ bias) for FP8 e4m3fn weights W as FP8 checkpoints store them (compressed-tensors
 * float-quantized, DeepSeek-V3 / Qwen3-FP8 block-wise), float32 or bfloat16 x, bias and y, for a few rows of x.
 *
 * Why: decode reads every weight once per token. Dequantizing FP8 at load doubles (bf16) or quadruples (fp32) the
 * bytes each token reads; this kernel reads the stored byte per weight where it lies (a safetensors map, for a
 * disk layer too) and converts it in registers, so FP8 decodes at the pace of our int8.
 *
 * Conversion: an e4m3fn byte b (sign, 4 exponent bits with bias 7, 3 mantissa bits) as the float16 bits
 * ((b & 0x80) << 8) | ((b & 0x7F) << 7) is exactly b's value times 2^-8, subnormals included: the exponent field
 * keeps its value and float16's bias is 8 more. Those bits are (sign-extend(b) << 7) & 0xBF80 (bit 14 takes the
 * sign copy, which the mask clears), two integer instructions per vector after the widening load; F16C's
 * cvtph2ps then gives float32, and the 2^8 is folded into the scale. Codes 0x7F / 0xFF are e4m3fn's NaN; here
 * they read as +-480. Quantizers never write them (the largest finite value is 448), so they are not handled.
 *
 * Scales: weight (n, k) is multiplied by scale[(n / bn) * lds + k / bk] (float32): per output channel (bn = 1,
 * bk >= K), per tensor (bn >= N, bk >= K), or per block (bn x bk, 128 x 128 in the checkpoints that ship it).
 * Each row's products are summed per span of bk inputs and each span's sum is multiplied by its scale, so a block
 * scale costs one multiply-add per span; bk must be a multiple of 64 unless one span covers the row.
 *
 * Float arithmetic throughout (no activation quantization, unlike linear_q8.c): x is converted to float32 once
 * per call, zero-padded to whole vectors; W's row tail is read with a masked load (AVX-512) or copied into a
 * zeroed buffer (AVX2), so nothing is read past a row's K bytes. Each row's result depends on that row alone:
 * rows of x are taken MAXM at a time, each with its own accumulators, in the same order for any M.
 *  - AVX-512: 64 weights per step: two 32-byte loads widened to 16-bit, two shift+and, four cvtph2ps, four
 *    accumulators per row of x.
 *  - AVX2: 32 weights per step from one 32-byte load, converted by integer shifts straight to float32 bits (see
 *    fp8_dwords: Zen 3 spends two cycles per 8 weights in cvtph2ps, which held this path to 0.7x our int8), x laid
 *    out to match once per call, four accumulators per row. F16C remains for lm_dequantize_fp8.
 * As in linear_q8.c, each thread reads its weight rows one after another, front to back.
 *
 * lm_dequantize_fp8 converts rows of the same weight to float32 or bfloat16 for torch's GEMM, which runs prompts
 * (compute-bound, where a blocked GEMM beats this loop): the same conversion, vectorised and threaded.
 */
#include "common.h"

#define ROWS 8 /* weight rows per tile (see linear_q8.c) */

#if defined(__AVX512F__)
#define MAXM 4
#define STEP 64 /* weights per main-loop step */

/* 32 e4m3fn bytes as two vectors of 16 float32 values, each 2^-8 times the weight. */
static LM_ALWAYS_INLINE void fp8x32(__m256i b, __m512 *lo, __m512 *hi) {
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), _mm512_set1_epi16((short)0xBF80));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

/* Products of weight inputs [k0, k1) of one row with NM rows of x (float32, row stride ldx), as one vector of
 * partial sums per row of x. k1 - k0 is a multiple of STEP except for the row's last span. */
static LM_ALWAYS_INLINE void span_dot(const float *xf, long ldx, const uint8_t *wr, int k0, int k1, __m512 *sum,
                                      const int NM) {
    __m512 a0[MAXM], a1[MAXM], a2[MAXM], a3[MAXM];
    for (int m = 0; m < NM; m++) a0[m] = a1[m] = a2[m] = a3[m] = _mm512_setzero_ps();
    int k = k0;
    for (; k + STEP <= k1; k += STEP) {
        __m512 f0, f1, f2, f3;
        fp8x32(_mm256_loadu_si256((const __m256i *)(wr + k)), &f0, &f1);
        fp8x32(_mm256_loadu_si256((const __m256i *)(wr + k + 32)), &f2, &f3);
        lm_prefetch(wr + k + LM_PREFETCH_AHEAD);
        for (int m = 0; m < NM; m++) {
            const float *xr = xf + m * ldx + k;
            a0[m] = _mm512_fmadd_ps(f0, _mm512_load_ps(xr), a0[m]);
            a1[m] = _mm512_fmadd_ps(f1, _mm512_load_ps(xr + 16), a1[m]);
            a2[m] = _mm512_fmadd_ps(f2, _mm512_load_ps(xr + 32), a2[m]);
            a3[m] = _mm512_fmadd_ps(f3, _mm512_load_ps(xr + 48), a3[m]);
        }
    }
    for (; k < k1; k += 32) { /* the row's tail: at most 63 weights, masked so nothing past k1 is read */
        const int n = k1 - k < 32 ? k1 - k : 32;
        const __mmask32 mask = n == 32 ? 0xFFFFFFFFu : (__mmask32)((1u << n) - 1u);
        __m512 f0, f1;
        fp8x32(_mm256_maskz_loadu_epi8(mask, (const void *)(wr + k)), &f0, &f1);
        for (int m = 0; m < NM; m++) { /* x is zero past K, and masked-out weights are zero */
            const float *xr = xf + m * ldx + k;
            a0[m] = _mm512_fmadd_ps(f0, _mm512_load_ps(xr), a0[m]);
            a1[m] = _mm512_fmadd_ps(f1, _mm512_load_ps(xr + 16), a1[m]);
        }
    }
    for (int m = 0; m < NM; m++) sum[m] = _mm512_add_ps(_mm512_add_ps(a0[m], a1[m]), _mm512_add_ps(a2[m], a3[m]));
}

#define SPAN_UNSHIFT 256.0f /* the 2^8 fp8x32 left out (exact) */
#define Y_UNSHIFT 1.0f

/* Row m of x as float32, zero from K to ldxf. */
static void lay_out_x(const void *x, long ldx, int x_bf16, int m, int K, float *dst, long ldxf) {
    for (int k = 0; k < K; k++) dst[k] = lm_act(x, x_bf16, (long)m * ldx + k);
    for (long k = K; k < ldxf; k++) dst[k] = 0.0f;
}

typedef __m512 vec_t;
#define VZERO _mm512_setzero_ps
#define VFMA(a, s, c) _mm512_fmadd_ps(a, _mm512_set1_ps(s), c)
#define VSUM _mm512_reduce_add_ps

/* bfloat16 x where the CPU has VBMI (Ice Lake, Sapphire Rapids, Zen 4): every e4m3 value is exactly a bfloat16
 * (4 significant bits, exponents 2^-9 .. 2^8), so the weights become bf16 by two 128-entry byte tables (vpermt2b,
 * indexed by the byte's low 7 bits; the sign bit is copied over) and meet x in AVX512-BF16 dot products: 64 weights
 * in about 8 instructions instead of 18. unpacklo/hi interleave the two table bytes within each 128-bit lane, so x
 * is laid out in that order once per call (xb). The products and float32 sums are those of the float path; only
 * the order of summation differs (pairs, then lanes). A CPU without VBMI takes the float path for bf16 x too. */
#define VBMI_FN __attribute__((target("avx512vbmi"))) LM_ALWAYS_INLINE

typedef struct {
    __m512i lo0, lo1, hi0, hi1; /* low and high bytes of the bf16 bits of e4m3 magnitudes 0..63 and 64..127 */
} bf16_tables;

static bf16_tables make_tables(void) {
    uint8_t lo[128], hi[128];
    for (int i = 0; i < 128; i++) {
        const float v = _cvtsh_ss((unsigned short)(i << 7)) * 256.0f; /* exact; its low 16 bits are zero */
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        lo[i] = (uint8_t)(u >> 16);
        hi[i] = (uint8_t)(u >> 24);
    }
    bf16_tables t;
    t.lo0 = _mm512_loadu_si512((const void *)lo);
    t.lo1 = _mm512_loadu_si512((const void *)(lo + 64));
    t.hi0 = _mm512_loadu_si512((const void *)hi);
    t.hi1 = _mm512_loadu_si512((const void *)(hi + 64));
    return t;
}

/* 64 e4m3 bytes as two vectors of 32 bf16 weights, in unpack order (see above). */
static VBMI_FN void fp8x64_bf16(const bf16_tables *t, __m512i v, __m512bh *w0, __m512bh *w1) {
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, v, t->lo1);
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, v, t->hi1);
    hi = _mm512_ternarylogic_epi32(hi, v, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (v & 0x80) */
    *w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    *w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

/* As span_dot, for bf16 x in unpack order (xb, row stride ldx in elements). */
static VBMI_FN void span_dot_bf16(const bf16_tables *t, const uint16_t *xb, long ldx, const uint8_t *wr, int k0,
                                  int k1, __m512 *sum, const int NM) {
    __m512 a0[MAXM], a1[MAXM], a2[MAXM], a3[MAXM];
    for (int m = 0; m < NM; m++) a0[m] = a1[m] = a2[m] = a3[m] = _mm512_setzero_ps();
    int k = k0;
    for (; k + 128 <= k1; k += 128) { /* four independent chains: a dot product's latency stays hidden */
        const __m512i v0 = _mm512_loadu_si512((const void *)(wr + k));
        const __m512i v1 = _mm512_loadu_si512((const void *)(wr + k + 64));
        lm_prefetch(wr + k + LM_PREFETCH_AHEAD);
        lm_prefetch(wr + k + 64 + LM_PREFETCH_AHEAD);
        __m512bh w0, w1, w2, w3;
        fp8x64_bf16(t, v0, &w0, &w1);
        fp8x64_bf16(t, v1, &w2, &w3);
        for (int m = 0; m < NM; m++) {
            const uint16_t *xr = xb + m * ldx + k;
            a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_load_si512((const void *)xr));
            a1[m] = _mm512_dpbf16_ps(a1[m], w1, (__m512bh)_mm512_load_si512((const void *)(xr + 32)));
            a2[m] = _mm512_dpbf16_ps(a2[m], w2, (__m512bh)_mm512_load_si512((const void *)(xr + 64)));
            a3[m] = _mm512_dpbf16_ps(a3[m], w3, (__m512bh)_mm512_load_si512((const void *)(xr + 96)));
        }
    }
    for (; k < k1; k += 64) {
        const int n = k1 - k < 64 ? k1 - k : 64;
        const __m512i v = n == 64 ? _mm512_loadu_si512((const void *)(wr + k))
                                  : _mm512_maskz_loadu_epi8((__mmask64)((1ULL << n) - 1ULL), (const void *)(wr + k));
        lm_prefetch(wr + k + LM_PREFETCH_AHEAD);
        __m512bh w0, w1;
        fp8x64_bf16(t, v, &w0, &w1);
        for (int m = 0; m < NM; m++) {
            const uint16_t *xr = xb + m * ldx + k;
            a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_load_si512((const void *)xr));
            a1[m] = _mm512_dpbf16_ps(a1[m], w1, (__m512bh)_mm512_load_si512((const void *)(xr + 32)));
        }
    }
    for (int m = 0; m < NM; m++) sum[m] = _mm512_add_ps(_mm512_add_ps(a0[m], a1[m]), _mm512_add_ps(a2[m], a3[m]));
}

static __attribute__((target("avx512vbmi"))) LM_ALWAYS_INLINE void row_out_bf16(
    const bf16_tables *t, const uint16_t *xb, long ldxb, const uint8_t *wr, const float *sr, int bk, int K, float bias,
    void *y, long ldy, long n, int m0, const int NM) {
    __m512 tot[MAXM], sum[MAXM];
    for (int m = 0; m < NM; m++) tot[m] = _mm512_setzero_ps();
    for (int k0 = 0, s = 0; k0 < K; k0 += bk, s++) {
        const int k1 = K - k0 < bk ? K : k0 + bk;
        span_dot_bf16(t, xb + (long)m0 * ldxb, ldxb, wr, k0, k1, sum, NM);
        for (int m = 0; m < NM; m++) tot[m] = _mm512_fmadd_ps(sum[m], _mm512_set1_ps(sr[s]), tot[m]);
    }
    for (int m = 0; m < NM; m++) lm_store(y, 1, (long)(m0 + m) * ldy + n, _mm512_reduce_add_ps(tot[m]) + bias);
}

/* The whole product for bf16 x on the table path: x laid out in unpack order, then the tiles as lm_linear_fp8's. */
static __attribute__((target("avx512vbmi"))) int linear_fp8_bf16(const uint16_t *x, long ldx, const uint8_t *w,
                                                                 long ldw, const float *scale, long lds, int bn,
                                                                 int bk, const void *bias, void *y, long ldy, int M,
                                                                 int N, int K, int threads) {
    const long ldxb = ((long)K + 63) / 64 * 64;
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)M * (size_t)ldxb);
    if (!xb) return 3;
    uint16_t ia[32], ib[32]; /* chunk of 64: [lane L: 16L..16L+7 for L = 0..3], then [16L+8..16L+15] */
    for (int j = 0; j < 32; j++) {
        ia[j] = (uint16_t)((j >> 3) * 16 + (j & 7));
        ib[j] = (uint16_t)(ia[j] + 8);
    }
    const __m512i va = _mm512_loadu_si512((const void *)ia), vb = _mm512_loadu_si512((const void *)ib);
    for (int m = 0; m < M; m++) {
        uint16_t *dst = xb + (long)m * ldxb;
        const uint16_t *src = x + (long)m * ldx;
        for (long c = 0; c < ldxb; c += 64) {
            const long left = K - c; /* zeros past K: masked loads read nothing there */
            const __mmask32 m0 = left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << left) - 1u);
            const __mmask32 m1 = left >= 64 ? 0xFFFFFFFFu : left <= 32 ? 0u : (__mmask32)((1u << (left - 32)) - 1u);
            const __m512i x0 = _mm512_maskz_loadu_epi16(m0, (const void *)(src + c));
            const __m512i x1 = _mm512_maskz_loadu_epi16(m1, (const void *)(src + c + 32));
            _mm512_store_si512((void *)(dst + c), _mm512_permutex2var_epi16(x0, va, x1));
            _mm512_store_si512((void *)(dst + c + 32), _mm512_permutex2var_epi16(x0, vb, x1));
        }
    }
    const bf16_tables t = make_tables();
    const int ntiles = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int tile = 0; tile < ntiles; tile++) {
        const int n0 = tile * ROWS;
        const int n1 = N - n0 < ROWS ? N : n0 + ROWS;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            const int nm = M - m0 < MAXM ? M - m0 : MAXM;
            for (long n = n0; n < n1; n++) {
                const uint8_t *wr = w + n * ldw;
                const float *sr = scale + (n / bn) * lds;
                const float b = bias ? lm_bf16_to_f32(((const uint16_t *)bias)[n]) : 0.0f;
                switch (nm) {
                case 1: row_out_bf16(&t, xb, ldxb, wr, sr, bk, K, b, y, ldy, n, m0, 1); break;
                case 2: row_out_bf16(&t, xb, ldxb, wr, sr, bk, K, b, y, ldy, n, m0, 2); break;
                case 3: row_out_bf16(&t, xb, ldxb, wr, sr, bk, K, b, y, ldy, n, m0, 3); break;
                default: row_out_bf16(&t, xb, ldxb, wr, sr, bk, K, b, y, ldy, n, m0, 4); break;
                }
            }
        }
    }
    free(xb);
    return 0;
}

static int table_path(void) {
    static int has = -1; /* benign race: every thread computes the same answer */
    if (has < 0) has = __builtin_cpu_supports("avx512vbmi") ? 1 : 0;
    return has;
}

#else /* AVX2 + FMA + F16C */
#define MAXM 2
#define STEP 32
#define SPAN_UNSHIFT 1.0f   /* each span's sum is multiplied by its scale alone */
#define Y_UNSHIFT 0x1p56f   /* the products' 2^-56: 2^-120 from the weights times x's 2^64 (fp8_dwords) */

/* 32 e4m3fn bytes (one load, as 8 dwords of 4 bytes) as four vectors of 8 float32 values, each 2^-120 times the
 * weight: byte j of every dword moved to the top byte (a left shift, none for j = 3), then an arithmetic shift right
 * by 4 leaves the sign at bit 31 (copies in 27-30, which the mask clears) and the byte's exponent and mantissa at
 * bits 20-26, float32's low 4 exponent bits and top 3 mantissa bits. For exponent e >= 1 that float is
 * 2^(e-127) (1 + m/8), the weight's 2^(e-7) (1 + m/8) times 2^-120; for e = 0 it is the denormal 2^-126 m/8, the
 * subnormal weight 2^-6 m/8 times 2^-120 again. So 7 shifts and 4 ands per 32 weights, where cvtph2ps costs Zen 3
 * two cycles per 8. Vector j holds weights 4i + j (i = 0..7) of the 32, so x is laid out in that order once per
 * call (lay_out_x), and held times 2^64 so that the products are 2^-56 times their value, far from float32's
 * denormals; row_out multiplies the 2^56 back. */
static LM_ALWAYS_INLINE void fp8_dwords(__m256i v, __m256 *f0, __m256 *f1, __m256 *f2, __m256 *f3) {
    const __m256i mask = _mm256_set1_epi32((int)0x87F00000u);
    *f0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 4), mask));
    *f1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 4), mask));
    *f2 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 4), mask));
    *f3 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(v, 4), mask));
}

/* Row m of x as float32 times 2^64, each chunk of 32 inputs in fp8_dwords' order (dst[c + 8j + i] = x[c + 4i + j]),
 * zero from K to ldxf. */
static void lay_out_x(const void *x, long ldx, int x_bf16, int m, int K, float *dst, long ldxf) {
    const float up = 0x1p64f;
    for (long c = 0; c < ldxf; c += STEP)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 8; i++) {
                const long k = c + 4 * i + j;
                dst[c + 8 * j + i] = k < K ? lm_act(x, x_bf16, (long)m * ldx + k) * up : 0.0f;
            }
}

/* 16 e4m3fn bytes as two vectors of 8 float32 values, each 2^-8 times the weight, in order (dequantize_row). */
static LM_ALWAYS_INLINE void fp8x16(__m128i b, __m256 *lo, __m256 *hi) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xBF80));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

static LM_ALWAYS_INLINE void step32(const uint8_t *wk, const float *xf, long ldx, int k, __m256 *a0, __m256 *a1,
                                    __m256 *a2, __m256 *a3, const int NM) {
    __m256 f0, f1, f2, f3;
    fp8_dwords(_mm256_loadu_si256((const __m256i *)wk), &f0, &f1, &f2, &f3);
    for (int m = 0; m < NM; m++) {
        const float *xr = xf + m * ldx + k;
        a0[m] = _mm256_fmadd_ps(f0, _mm256_load_ps(xr), a0[m]);
        a1[m] = _mm256_fmadd_ps(f1, _mm256_load_ps(xr + 8), a1[m]);
        a2[m] = _mm256_fmadd_ps(f2, _mm256_load_ps(xr + 16), a2[m]);
        a3[m] = _mm256_fmadd_ps(f3, _mm256_load_ps(xr + 24), a3[m]);
    }
}

static LM_ALWAYS_INLINE void span_dot(const float *xf, long ldx, const uint8_t *wr, int k0, int k1, __m256 *sum,
                                      const int NM) {
    __m256 a0[MAXM], a1[MAXM], a2[MAXM], a3[MAXM];
    for (int m = 0; m < NM; m++) a0[m] = a1[m] = a2[m] = a3[m] = _mm256_setzero_ps();
    int k = k0;
    for (; k + STEP <= k1; k += STEP) {
        lm_prefetch(wr + k + LM_PREFETCH_AHEAD);
        step32(wr + k, xf, ldx, k, a0, a1, a2, a3, NM);
    }
    if (k < k1) { /* the row's tail, copied so nothing past k1 is read */
        uint8_t tail[STEP] = {0};
        memcpy(tail, wr + k, (size_t)(k1 - k));
        step32(tail, xf, ldx, k, a0, a1, a2, a3, NM);
    }
    for (int m = 0; m < NM; m++) sum[m] = _mm256_add_ps(_mm256_add_ps(a0[m], a1[m]), _mm256_add_ps(a2[m], a3[m]));
}

typedef __m256 vec_t;
#define VZERO _mm256_setzero_ps
#define VFMA(a, s, c) _mm256_fmadd_ps(a, _mm256_set1_ps(s), c)
#define VSUM lm_hsum256
#endif

/* One weight row n against rows m0 .. m0+NM-1 of x: every span's sums times its scale, then bias, stored. */
static LM_ALWAYS_INLINE void row_out(const float *xf, long ldxf, const uint8_t *wr, const float *sr, int bk, int K,
                                     float bias, void *y, long ldy, int y_bf16, long n, int m0, const int NM) {
    vec_t tot[MAXM], sum[MAXM];
    for (int m = 0; m < NM; m++) tot[m] = VZERO();
    for (int k0 = 0, s = 0; k0 < K; k0 += bk, s++) {
        const int k1 = K - k0 < bk ? K : k0 + bk;
        span_dot(xf + (long)m0 * ldxf, ldxf, wr, k0, k1, sum, NM);
        const float scale = sr[s] * SPAN_UNSHIFT;
        for (int m = 0; m < NM; m++) tot[m] = VFMA(sum[m], scale, tot[m]);
    }
    for (int m = 0; m < NM; m++) lm_store(y, y_bf16, (long)(m0 + m) * ldy + n, VSUM(tot[m]) * Y_UNSHIFT + bias);
}

/* Returns 0 on success. x: [M, K] (row stride ldx; bfloat16 if x_bf16, else float32); w: [N, ldw] e4m3fn bytes
 * (ldw >= K); scale: float32, row n / bn of it at scale + (n / bn) * lds, one value per span of bk inputs; bias:
 * [N] in x's dtype or NULL; y: [M, N] (row stride ldy) in x's dtype. */
int lm_linear_fp8(const void *x, long ldx, int x_bf16, const uint8_t *w, long ldw, const float *scale, long lds,
                  int bn, int bk, const void *bias, void *y, long ldy, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1 || bn < 1 || bk < 1) return 1;
    if (ldw < K) return 2;
    if (bk < K && bk % STEP) return 4;
    if (bk > K) bk = K;
#if defined(__AVX512F__)
    if (x_bf16 && table_path())
        return linear_fp8_bf16((const uint16_t *)x, ldx, w, ldw, scale, lds, bn, bk, bias, y, ldy, M, N, K, threads);
#endif
    const long ldxf = ((long)K + 63) / 64 * 64; /* whole vectors of every width, zero past K */
    float *xf = aligned_alloc(64, sizeof(float) * (size_t)M * (size_t)ldxf);
    if (!xf) return 3;
    for (int m = 0; m < M; m++) lay_out_x(x, ldx, x_bf16, m, K, xf + (long)m * ldxf, ldxf);
    const int ntiles = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < ntiles; t++) {
        const int n0 = t * ROWS;
        const int n1 = N - n0 < ROWS ? N : n0 + ROWS;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            const int nm = M - m0 < MAXM ? M - m0 : MAXM;
            for (long n = n0; n < n1; n++) {
                const uint8_t *wr = w + n * ldw;
                const float *sr = scale + (n / bn) * lds;
                const float b = bias ? lm_act(bias, x_bf16, n) : 0.0f;
                switch (nm) { /* one instance per row count: NM must be a constant (see linear_q8.c) */
                case 1: row_out(xf, ldxf, wr, sr, bk, K, b, y, ldy, x_bf16, n, m0, 1); break;
#if MAXM > 2
                case 2: row_out(xf, ldxf, wr, sr, bk, K, b, y, ldy, x_bf16, n, m0, 2); break;
                case 3: row_out(xf, ldxf, wr, sr, bk, K, b, y, ldy, x_bf16, n, m0, 3); break;
                default: row_out(xf, ldxf, wr, sr, bk, K, b, y, ldy, x_bf16, n, m0, 4); break;
#else
                default: row_out(xf, ldxf, wr, sr, bk, K, b, y, ldy, x_bf16, n, m0, 2); break;
#endif
                }
            }
        }
    }
    free(xf);
    return 0;
}

/* One e4m3fn byte as float32, 2^-8 times its value (the scalar form of the conversion above). */
static LM_ALWAYS_INLINE float fp8_scaled_down(uint8_t b) {
    return _cvtsh_ss((unsigned short)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7)));
}

/* Row wr's K weights times their scales (sr: the row's spans of bk inputs) as float32 into dst. */
static void dequantize_row(const uint8_t *wr, const float *sr, int bk, int K, float *dst) {
    for (int k0 = 0, s = 0; k0 < K; k0 += bk, s++) {
        const int k1 = K - k0 < bk ? K : k0 + bk;
        const float scale = sr[s] * 256.0f;
        int k = k0;
#if defined(__AVX512F__)
        const __m512 vs = _mm512_set1_ps(scale);
        for (; k + 32 <= k1; k += 32) {
            __m512 f0, f1;
            fp8x32(_mm256_loadu_si256((const __m256i *)(wr + k)), &f0, &f1);
            _mm512_storeu_ps(dst + k, _mm512_mul_ps(f0, vs));
            _mm512_storeu_ps(dst + k + 16, _mm512_mul_ps(f1, vs));
        }
#else
        const __m256 vs = _mm256_set1_ps(scale);
        for (; k + 16 <= k1; k += 16) {
            __m256 f0, f1;
            fp8x16(_mm_loadu_si128((const __m128i *)(wr + k)), &f0, &f1);
            _mm256_storeu_ps(dst + k, _mm256_mul_ps(f0, vs));
            _mm256_storeu_ps(dst + k + 8, _mm256_mul_ps(f1, vs));
        }
#endif
        for (; k < k1; k++) dst[k] = fp8_scaled_down(wr[k]) * scale;
    }
}

/* Rows n0 .. n0+R-1 of the weight lm_linear_fp8 takes, dequantized: out[r, k] = W[n0 + r, k] * its scale, as
 * float32 or (out_bf16) bfloat16 rounded to nearest even, row stride ldo. The same values as torch's
 * weight.float() * scale (the 2^8 moves between two exact factors). Prompts multiply it with torch's GEMM. */
int lm_dequantize_fp8(const uint8_t *w, long ldw, const float *scale, long lds, int bn, int bk, int n0, int R, int K,
                      void *out, long ldo, int out_bf16, int threads) {
    if (R < 1 || K < 1 || n0 < 0 || bn < 1 || bk < 1 || threads < 1 || ldw < K) return 1;
    if (bk > K) bk = K;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *tmp = out_bf16 ? malloc(sizeof(float) * (size_t)K) : NULL;
        if (out_bf16 && !tmp) failed = 1;
#pragma omp for schedule(static)
        for (int r = 0; r < R; r++) {
            const long n = (long)n0 + r;
            if (failed) continue;
            const float *sr = scale + (n / bn) * lds;
            if (!out_bf16) {
                dequantize_row(w + n * ldw, sr, bk, K, (float *)out + r * ldo);
                continue;
            }
            dequantize_row(w + n * ldw, sr, bk, K, tmp);
            uint16_t *o = (uint16_t *)out + r * ldo;
            for (int k = 0; k < K; k++) o[k] = lm_f32_to_bf16(tmp[k]);
        }
        free(tmp);
    }
    return failed ? 3 : 0;
}
