/*
 * y = x @ W^T (+ bias) for 4-bit weights with one float16 scale per group of LM_GROUP inputs of each output
 * channel: W[n, k] = s[n, k / LM_GROUP] * (q[n, k] - 8), q in 0..15. float32 or bfloat16 x, bias and y.
 * lm_linear_q4z takes a float16 zero point z[n, g] per group in place of the 8 (repacked GPTQ/AWQ layers).
 *
 * Why: a quarter of bf16's bytes per weight (plus 2 bytes of scale per 64 weights). As in linear_q8.c, x is
 * quantized to int8 per group (common.h), so a group's dot product sum(q * x) is exact integer arithmetic. The
 * "- 8" comes out of the sum: row n's result is sum_g s[n, g] * dx[g] * (sum(q * x)_g - 8 * sum(x)_g), and the
 * second part, sum_g (8 * s[n, g]) * (-dx[g] * sum(x)_g), is one float dot product over the groups, done 16 (8 on
 * AVX2) groups per instruction next to the scales.
 *
 * Packed layout (loaders/native/quantization.py writes it): row n holds G groups of 32 bytes; byte j of group g holds
 * q[n, 64g + j] in its low nibble and q[n, 64g + 32 + j] in its high nibble, so one AND and one shift give two
 * runs of 32 consecutive weights. Padding past K holds 8 (a zero weight) and meets zero activations anyway.
 *  - AVX-512: one 64-byte load holds two groups (g, g+1); its low nibbles meet a copy of x laid out per pair as
 *    [x_g[0:32], x_g+1[0:32]], its high nibbles [x_g[32:64], x_g+1[32:64]] (built once per call), two VNNI
 *    dpbusd leave group g's sum in lanes 0-7 and g+1's in lanes 8-15, and one multiply-add applies both groups'
 *    scales (a permute of the 16 scales converted at once).
 *  - AVX2: maddubs + madd per run of 32 (q <= 15 keeps the 16-bit pair sums exact), one group per step.
 * As in linear_q8.c, each thread reads its weight rows front to back: one sequential stream per thread.
 */
#include "common.h"

#define ROWS 8 /* weight rows per tile: their bytes stay in L1 while the tile meets every chunk of x's rows */

#if defined(__AVX512F__)
#define MAXM 4
#define CHUNK 16 /* groups whose scales are converted at once: one zmm of floats */

/* One weight row against NM rows of x (NM constant, see linear_q8.c). xp: x in pair layout, Gp groups per x row
 * (G rounded up to CHUNK; dx and dxs zero past G); dxs[g] = -8 * dx[g] * sum(x)_g. */
static LM_ALWAYS_INLINE void row_dot(const int8_t *xp, const float *dx, const float *dxs, int G, int Gp,
                                     const uint8_t *wr, const uint16_t *sr, const uint16_t *zr, float *acc_out,
                                     const int NM) {
    __m512 a0[MAXM], a1[MAXM], corr[MAXM];
    for (int m = 0; m < NM; m++) a0[m] = a1[m] = corr[m] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i zero = _mm512_setzero_si512();
    const __m512i first_pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int c0 = 0; c0 < G; c0 += CHUNK) {
        const int ng = G - c0 < CHUNK ? G - c0 : CHUNK;
        const __m512 ws = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << ng) - 1u), sr + c0));
        /* scale times zero point: 8 for the symmetric layout (exact), else the group's own (zeros, fp16) */
        const __m512 wz = _mm512_mul_ps(
            ws, zr ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << ng) - 1u), zr + c0))
                   : _mm512_set1_ps(8.0f));
        __m512 sc[MAXM];
        for (int m = 0; m < NM; m++) {
            sc[m] = _mm512_mul_ps(ws, _mm512_load_ps(dx + (long)m * Gp + c0));
            corr[m] = _mm512_fmadd_ps(wz, _mm512_load_ps(dxs + (long)m * Gp + c0), corr[m]);
        }
        __m512i idx = first_pair;
        int j = 0;
        for (; j + 1 < ng; j += 2) {
            const __m512i v = _mm512_loadu_si512((const void *)(wr + (long)(c0 + j) * (LM_GROUP / 2)));
            lm_prefetch(wr + (long)(c0 + j) * (LM_GROUP / 2) + LM_PREFETCH_AHEAD);
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int m = 0; m < NM; m++) {
                const int8_t *xg = xp + ((long)m * Gp + c0 + j) * LM_GROUP;
                __m512i iv = _mm512_dpbusd_epi32(zero, lo, _mm512_load_si512((const void *)xg));
                iv = _mm512_dpbusd_epi32(iv, hi, _mm512_load_si512((const void *)(xg + LM_GROUP)));
                const __m512 s = _mm512_permutexvar_ps(idx, sc[m]);
                if (j & 2)
                    a1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), s, a1[m]);
                else
                    a0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), s, a0[m]);
            }
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(2));
        }
        if (j < ng) { /* an odd last group: its 32 bytes alone, the pair's second half of x is zero */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wr + (long)(c0 + j) * (LM_GROUP / 2)));
            const __m256i lo = _mm256_and_si256(v, _mm512_castsi512_si256(low));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm512_castsi512_si256(low));
            const __m512i lo5 = _mm512_zextsi256_si512(lo), hi5 = _mm512_zextsi256_si512(hi);
            for (int m = 0; m < NM; m++) {
                const int8_t *xg = xp + ((long)m * Gp + c0 + j) * LM_GROUP;
                __m512i iv = _mm512_dpbusd_epi32(zero, lo5, _mm512_load_si512((const void *)xg));
                iv = _mm512_dpbusd_epi32(iv, hi5, _mm512_load_si512((const void *)(xg + LM_GROUP)));
                const __m512 s = _mm512_permutexvar_ps(idx, sc[m]);
                a0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), s, a0[m]);
            }
        }
    }
    for (int m = 0; m < NM; m++)
        acc_out[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[m], a1[m]), corr[m]));
}

/* The pair layout of one x row's int8 groups: per pair, 64 bytes of first halves, then 64 of second halves. */
static void lay_out_row(const int8_t *xq, int G, int Gp, int8_t *xp) {
    memset(xp, 0, (size_t)Gp * LM_GROUP);
    for (int g = 0; g < G; g++) {
        int8_t *dst = xp + (long)(g & ~1) * LM_GROUP + (g & 1) * (LM_GROUP / 2);
        memcpy(dst, xq + (long)g * LM_GROUP, LM_GROUP / 2);
        memcpy(dst + LM_GROUP, xq + (long)g * LM_GROUP + LM_GROUP / 2, LM_GROUP / 2);
    }
}

#else /* AVX2 + FMA + F16C */
#define MAXM 2
#define CHUNK 8

static LM_ALWAYS_INLINE void row_dot(const int8_t *xp, const float *dx, const float *dxs, int G, int Gp,
                                     const uint8_t *wr, const uint16_t *sr, const uint16_t *zr, float *acc_out,
                                     const int NM) {
    __m256 a0[MAXM], a1[MAXM], corr[MAXM];
    for (int m = 0; m < NM; m++) a0[m] = a1[m] = corr[m] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int c0 = 0; c0 < G; c0 += CHUNK) {
        const int ng = G - c0 < CHUNK ? G - c0 : CHUNK;
        uint16_t tail[CHUNK] = {0}, ztail[CHUNK] = {0};
        const uint16_t *s16 = sr + c0, *z16 = zr ? zr + c0 : NULL;
        if (ng < CHUNK) {
            memcpy(tail, s16, sizeof(uint16_t) * (size_t)ng);
            s16 = tail;
            if (z16) {
                memcpy(ztail, z16, sizeof(uint16_t) * (size_t)ng);
                z16 = ztail;
            }
        }
        const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s16));
        const __m256 wz = _mm256_mul_ps(
            ws, z16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)z16)) : _mm256_set1_ps(8.0f));
        /* each group's combined scale, read back one at a time as a broadcast load (a load port, not a shuffle) */
        float sc[MAXM][CHUNK] __attribute__((aligned(32)));
        for (int m = 0; m < NM; m++) {
            _mm256_store_ps(sc[m], _mm256_mul_ps(ws, _mm256_load_ps(dx + (long)m * Gp + c0)));
            corr[m] = _mm256_fmadd_ps(wz, _mm256_load_ps(dxs + (long)m * Gp + c0), corr[m]);
        }
        for (int j = 0; j < ng; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wr + (long)(c0 + j) * (LM_GROUP / 2)));
            if (!(j & 1)) lm_prefetch(wr + (long)(c0 + j) * (LM_GROUP / 2) + LM_PREFETCH_AHEAD); /* one per line */
            const __m256i lo = _mm256_and_si256(v, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int m = 0; m < NM; m++) {
                const int8_t *xg = xp + ((long)m * Gp + c0 + j) * LM_GROUP;
                const __m256i x0 = _mm256_load_si256((const __m256i *)xg);
                const __m256i x1 = _mm256_load_si256((const __m256i *)(xg + 32));
                /* the two runs' 16-bit pair sums are at most 2 * 15 * 127 each, so their sum fits 16 bits */
                const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
                const __m256i p = _mm256_madd_epi16(p16, ones);
                const __m256 s = _mm256_broadcast_ss(&sc[m][j]);
                if (j & 1)
                    a1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, a1[m]);
                else
                    a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, a0[m]);
            }
        }
    }
    for (int m = 0; m < NM; m++) acc_out[m] = lm_hsum256(_mm256_add_ps(_mm256_add_ps(a0[m], a1[m]), corr[m]));
}

/* AVX2 reads x's groups as they are (the first 32 values against the low nibbles, the next 32 the high). */
static void lay_out_row(const int8_t *xq, int G, int Gp, int8_t *xp) {
    memset(xp, 0, (size_t)Gp * LM_GROUP);
    memcpy(xp, xq, (size_t)G * LM_GROUP);
}
#endif

static LM_ALWAYS_INLINE void row_out(const int8_t *xp, const float *dx, const float *dxs, int G, int Gp,
                                     const uint8_t *wr, const uint16_t *sr, const uint16_t *zr, float bias,
                                     int has_bias, void *y, long ldy, int x_bf16, long n, int m0, const int NM) {
    float acc[MAXM];
    const long off = (long)m0 * Gp;
    row_dot(xp + off * LM_GROUP, dx + off, dxs + off, G, Gp, wr, sr, zr, acc, NM);
    for (int m = 0; m < NM; m++) {
        float s = acc[m];
        if (has_bias) s += bias;
        lm_store(y, x_bf16, (long)(m0 + m) * ldy + n, s);
    }
}

/* Returns 0 on success. x: [M, K] (row stride ldx; bfloat16 if x_bf16, else float32), w: [N, ldw] packed bytes
 * (ldw >= G * LM_GROUP / 2), scales: [N, lds] float16 (lds >= G), bias: [N] in x's dtype or NULL, y: [M, N] (row
 * stride ldy) in x's dtype. */
static int linear_q4(const void *x, long ldx, int x_bf16, const uint8_t *w, long ldw, const uint16_t *scales,
                     long lds, const uint16_t *zeros, long ldz, const void *bias, void *y, long ldy, int M, int N,
                     int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return 1;
    const int G = (K + LM_GROUP - 1) / LM_GROUP;
    if (ldw < (long)G * (LM_GROUP / 2) || lds < G || (zeros && ldz < G)) return 2;
    const int Gp = (G + CHUNK - 1) / CHUNK * CHUNK;
    int8_t *xq = aligned_alloc(64, (size_t)M * G * LM_GROUP);
    int8_t *xp = aligned_alloc(64, (size_t)M * Gp * LM_GROUP);
    float *dxr = malloc(sizeof(float) * (size_t)M * G);
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)M * G);
    float *dx = aligned_alloc(64, sizeof(float) * (size_t)M * Gp);
    float *dxs = aligned_alloc(64, sizeof(float) * (size_t)M * Gp);
    if (!xq || !xp || !dxr || !xsum || !dx || !dxs) {
        free(xq); free(xp); free(dxr); free(xsum); free(dx); free(dxs);
        return 3;
    }
    lm_quantize_rows(x, ldx, x_bf16, M, K, G, xq, dxr, xsum);
    for (int m = 0; m < M; m++) {
        lay_out_row(xq + (long)m * G * LM_GROUP, G, Gp, xp + (long)m * Gp * LM_GROUP);
        for (int g = 0; g < Gp; g++) {
            const long i = (long)m * G + g;
            dx[(long)m * Gp + g] = g < G ? dxr[i] : 0.0f;
            dxs[(long)m * Gp + g] = g < G ? -dxr[i] * (float)xsum[i] : 0.0f; /* times scale * zero: the "- z" */
        }
    }
    const int ntiles = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < ntiles; t++) {
        const int n0 = t * ROWS;
        const int n1 = N - n0 < ROWS ? N : n0 + ROWS;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            const int nm = M - m0 < MAXM ? M - m0 : MAXM;
            for (long n = n0; n < n1; n++) {
                const uint8_t *wr = w + n * ldw;
                const uint16_t *sr = scales + n * lds;
                const uint16_t *zr = zeros ? zeros + n * ldz : NULL;
                const float b = bias ? lm_act(bias, x_bf16, n) : 0.0f;
                const int hb = bias != NULL;
                switch (nm) { /* one instance per row count: NM must be a constant (see row_dot) */
                case 1: row_out(xp, dx, dxs, G, Gp, wr, sr, zr, b, hb, y, ldy, x_bf16, n, m0, 1); break;
#if MAXM > 2
                case 2: row_out(xp, dx, dxs, G, Gp, wr, sr, zr, b, hb, y, ldy, x_bf16, n, m0, 2); break;
                case 3: row_out(xp, dx, dxs, G, Gp, wr, sr, zr, b, hb, y, ldy, x_bf16, n, m0, 3); break;
                default: row_out(xp, dx, dxs, G, Gp, wr, sr, zr, b, hb, y, ldy, x_bf16, n, m0, 4); break;
#else
                default: row_out(xp, dx, dxs, G, Gp, wr, sr, zr, b, hb, y, ldy, x_bf16, n, m0, 2); break;
#endif
                }
            }
        }
    }
    free(xq); free(xp); free(dxr); free(xsum); free(dx); free(dxs);
    return 0;
}

/* The symmetric layout: W[n, k] = s[n, g] * (q - 8). */
int lm_linear_q4(const void *x, long ldx, int x_bf16, const uint8_t *w, long ldw, const uint16_t *scales, long lds,
                 const void *bias, void *y, long ldy, int M, int N, int K, int threads) {
    return linear_q4(x, ldx, x_bf16, w, ldw, scales, lds, NULL, 0, bias, y, ldy, M, N, K, threads);
}

/* With a zero point per group (GPTQ, AWQ, compressed-tensors asymmetric): W[n, k] = s[n, g] * (q - z[n, g]),
 * zeros: [N, ldz] float16 (small integers, exact). */
int lm_linear_q4z(const void *x, long ldx, int x_bf16, const uint8_t *w, long ldw, const uint16_t *scales, long lds,
                  const uint16_t *zeros, long ldz, const void *bias, void *y, long ldy, int M, int N, int K,
                  int threads) {
    if (!zeros) return 2;
    return linear_q4(x, ldx, x_bf16, w, ldw, scales, lds, zeros, ldz, bias, y, ldy, M, N, K, threads);
}
