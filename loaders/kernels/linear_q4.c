/*
 * y = x @ W^T (+ bias) for 4-bit weights with one float16 scale per group of LM_GROUP inputs of each output
 * channel: W[n, k] = s[n, k / LM_GROUP] * (q[n, k] - 8), q in 0..15. float32 or bfloat16 x, bias and y.
 *
 * Why: a quarter of bf16's bytes per weight (plus 2 bytes of scale per 64 weights). As in linear_q8.c, x is
 * quantized to int8 per group (common.h), so a group's dot product is exact integer arithmetic; the "- 8" is
 * folded in as -8 * sum(x group), seeded into the integer accumulator, and the group's two scales multiply its
 * converted sum once.
 *
 * Packed layout (loaders/cpu_quant.py writes it): row n holds G groups of 32 bytes; byte j of group g holds
 * q[n, 64g + j] in its low nibble and q[n, 64g + 32 + j] in its high nibble, so one AND and one shift give two
 * runs of 32 consecutive weights. Padding past K holds 8 (a zero weight) and meets zero activations anyway.
 *  - AVX-512: both runs in one zmm, one VNNI dpbusd per group (q is the unsigned operand, x the signed one);
 *  - AVX2: maddubs + madd per run (q <= 15 keeps the 16-bit pair sums exact).
 */
#include "common.h"

#define ROWS 4

#if defined(__AVX512F__)
#define MAXM 4

static inline void block(const int8_t *xq, const float *dx, const int32_t *xsum, int G, const uint8_t *w, long ldw,
                         const uint16_t *sc, long lds, float *out, int n0, int nrows, int nm, int N) {
    __m512 acc[MAXM][ROWS];
    for (int m = 0; m < MAXM; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_setzero_ps();
    const uint8_t *wr[ROWS];
    const uint16_t *sr[ROWS];
    for (int r = 0; r < ROWS; r++) {
        const long n = n0 + (r < nrows ? r : 0);
        wr[r] = w + n * ldw;
        sr[r] = sc + n * lds;
    }
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int g = 0; g < G; g++) {
        __m512i qv[ROWS];
        float ws[ROWS];
        for (int r = 0; r < ROWS; r++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wr[r] + (long)g * (LM_GROUP / 2)));
            const __m256i lo = _mm256_and_si256(v, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            qv[r] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            ws[r] = _cvtsh_ss(sr[r][g]);
        }
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            const long mg = (long)m * G + g;
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + mg * LM_GROUP));
            const __m512i seed = _mm512_zextsi128_si512(_mm_cvtsi32_si128(-8 * xsum[mg]));
            const float d = dx[mg];
            for (int r = 0; r < ROWS; r++) {
                const __m512i iv = _mm512_dpbusd_epi32(seed, qv[r], xv);
                acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), _mm512_set1_ps(ws[r] * d), acc[m][r]);
            }
        }
    }
    for (int m = 0; m < nm; m++)
        for (int r = 0; r < nrows; r++) out[(long)m * N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]);
}

#else /* AVX2 + FMA + F16C */
#define MAXM 2

static inline void block(const int8_t *xq, const float *dx, const int32_t *xsum, int G, const uint8_t *w, long ldw,
                         const uint16_t *sc, long lds, float *out, int n0, int nrows, int nm, int N) {
    __m256 acc[MAXM][ROWS];
    for (int m = 0; m < MAXM; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm256_setzero_ps();
    const uint8_t *wr[ROWS];
    const uint16_t *sr[ROWS];
    for (int r = 0; r < ROWS; r++) {
        const long n = n0 + (r < nrows ? r : 0);
        wr[r] = w + n * ldw;
        sr[r] = sc + n * lds;
    }
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g = 0; g < G; g++) {
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            const long mg = (long)m * G + g;
            const int8_t *xg = xq + mg * LM_GROUP;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xg);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xg + 32));
            const __m256i seed = _mm256_setr_epi32(-8 * xsum[mg], 0, 0, 0, 0, 0, 0, 0);
            const float d = dx[mg];
            for (int r = 0; r < ROWS; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wr[r] + (long)g * (LM_GROUP / 2)));
                const __m256i lo = _mm256_and_si256(v, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), ones),
                                             _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), ones));
                p = _mm256_add_epi32(p, seed);
                const float s = _cvtsh_ss(sr[r][g]) * d;
                acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s), acc[m][r]);
            }
        }
    }
    for (int m = 0; m < nm; m++)
        for (int r = 0; r < nrows; r++) out[(long)m * N + n0 + r] = lm_hsum256(acc[m][r]);
}
#endif

/* Returns 0 on success. x: [M, K] (row stride ldx; bfloat16 if x_bf16, else float32), w: [N, ldw] packed bytes
 * (ldw >= G * LM_GROUP / 2), scales: [N, lds] float16 (lds >= G), bias: [N] in x's dtype or NULL, y: [M, N] (row
 * stride ldy) in x's dtype. */
int lm_linear_q4(const void *x, long ldx, int x_bf16, const uint8_t *w, long ldw, const uint16_t *scales, long lds,
                 const void *bias, void *y, long ldy, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return 1;
    const int G = (K + LM_GROUP - 1) / LM_GROUP;
    if (ldw < (long)G * (LM_GROUP / 2) || lds < G) return 2;
    int8_t *xq = aligned_alloc(64, (size_t)M * G * LM_GROUP);
    float *dx = malloc(sizeof(float) * (size_t)M * G);
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)M * G);
    float *out = malloc(sizeof(float) * (size_t)M * N);
    if (!xq || !dx || !xsum || !out) {
        free(xq); free(dx); free(xsum); free(out);
        return 3;
    }
    lm_quantize_rows(x, ldx, x_bf16, M, K, G, xq, dx, xsum);
    const int nblocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < nblocks; b++) {
        const int n0 = b * ROWS;
        const int nrows = N - n0 < ROWS ? N - n0 : ROWS;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            const int nm = M - m0 < MAXM ? M - m0 : MAXM;
            block(xq + (long)m0 * G * LM_GROUP, dx + (long)m0 * G, xsum + (long)m0 * G, G, w, ldw, scales, lds,
                  out + (long)m0 * N, n0, nrows, nm, N);
        }
        for (int m = 0; m < M; m++)
            for (int r = 0; r < nrows; r++) {
                float s = out[(long)m * N + n0 + r];
                if (bias) s += lm_act(bias, x_bf16, n0 + r);
                lm_store(y, x_bf16, (long)m * ldy + n0 + r, s);
            }
    }
    free(xq); free(dx); free(xsum); free(out);
    return 0;
}
