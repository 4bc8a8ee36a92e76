/*
 * y = x @ (s * Q)^T (+ bias) for int8 weights Q with one float32 scale s per output channel (weight-only int8),
 * float32 or bfloat16 x, bias and y, for a few rows of x.
 *
 * Why: decode reads every weight once per token, so one byte per weight instead of two (bf16) halves the bytes
 * read. To keep the arithmetic below the memory's pace, x is quantized to int8 per group of LM_GROUP inputs
 * (common.h) and each group's dot product runs on 8-bit integer multiply-adds, exactly in int32; only one
 * convert and one fused multiply-add per group and row are float. Q is read where it lies (a safetensors map).
 *
 * Q is [N, ldw] int8 with ldw >= G * LM_GROUP, G = ceil(K / LM_GROUP), zero-padded past K (the quantizer in
 * loaders/cpu_quant.py lays it out so). Values lie in [-127, 127].
 *  - AVX-512: VNNI dpbusd (unsigned x signed bytes, 64 per instruction); x's sign moves onto w with a masked
 *    negate, so the unsigned operand is |x|.
 *  - AVX2: maddubs + madd with the same sign trick (|x| <= 127 and |w| <= 127 keep the 16-bit pair sums exact).
 */
#include "common.h"

#define ROWS 4

#if defined(__AVX512F__)
#define MAXM 4

static inline void block(const int8_t *xq, const float *dx, int G, const int8_t *w, long ldw, float *out, int n0,
                         int nrows, int nm, int N) {
    __m512 acc[MAXM][ROWS];
    for (int m = 0; m < MAXM; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm512_setzero_ps();
    const int8_t *wr[ROWS];
    for (int r = 0; r < ROWS; r++) wr[r] = w + (long)(n0 + (r < nrows ? r : 0)) * ldw;
    const __m512i zero = _mm512_setzero_si512();
    for (int g = 0; g < G; g++) {
        __m512i wv[ROWS];
        for (int r = 0; r < ROWS; r++) wv[r] = _mm512_loadu_si512((const void *)(wr[r] + (long)g * LM_GROUP));
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + ((long)m * G + g) * LM_GROUP));
            const __m512i ax = _mm512_abs_epi8(xv);
            const __mmask64 neg = _mm512_movepi8_mask(xv);
            const __m512 d = _mm512_set1_ps(dx[(long)m * G + g]);
            for (int r = 0; r < ROWS; r++) {
                const __m512i sw = _mm512_mask_sub_epi8(wv[r], neg, zero, wv[r]);
                const __m512i iv = _mm512_dpbusd_epi32(zero, ax, sw);
                acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), d, acc[m][r]);
            }
        }
    }
    for (int m = 0; m < nm; m++)
        for (int r = 0; r < nrows; r++) out[(long)m * N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]);
}

#else /* AVX2 + FMA */
#define MAXM 2

static inline void block(const int8_t *xq, const float *dx, int G, const int8_t *w, long ldw, float *out, int n0,
                         int nrows, int nm, int N) {
    __m256 acc[MAXM][ROWS];
    for (int m = 0; m < MAXM; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = _mm256_setzero_ps();
    const int8_t *wr[ROWS];
    for (int r = 0; r < ROWS; r++) wr[r] = w + (long)(n0 + (r < nrows ? r : 0)) * ldw;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g = 0; g < G; g++) {
        for (int m = 0; m < MAXM; m++) {
            if (m >= nm) break;
            const int8_t *xg = xq + ((long)m * G + g) * LM_GROUP;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xg);
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xg + 32));
            const __m256i a0 = _mm256_abs_epi8(x0), a1 = _mm256_abs_epi8(x1);
            const __m256 d = _mm256_set1_ps(dx[(long)m * G + g]);
            for (int r = 0; r < ROWS; r++) {
                const int8_t *wg = wr[r] + (long)g * LM_GROUP;
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)wg);
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + 32));
                const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(w0, x0)), ones);
                const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(w1, x1)), ones);
                acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), d, acc[m][r]);
            }
        }
    }
    for (int m = 0; m < nm; m++)
        for (int r = 0; r < nrows; r++) out[(long)m * N + n0 + r] = lm_hsum256(acc[m][r]);
}
#endif

/* Returns 0 on success. x: [M, K] (row stride ldx; bfloat16 if x_bf16, else float32), w: [N, ldw] int8,
 * wscale: [N] float32, bias: [N] in x's dtype or NULL, y: [M, N] (row stride ldy) in x's dtype. */
int lm_linear_q8(const void *x, long ldx, int x_bf16, const int8_t *w, long ldw, const float *wscale,
                 const void *bias, void *y, long ldy, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return 1;
    const int G = (K + LM_GROUP - 1) / LM_GROUP;
    if (ldw < (long)G * LM_GROUP) return 2;
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
            block(xq + (long)m0 * G * LM_GROUP, dx + (long)m0 * G, G, w, ldw, out + (long)m0 * N, n0, nrows, nm, N);
        }
        for (int m = 0; m < M; m++)
            for (int r = 0; r < nrows; r++) {
                float s = out[(long)m * N + n0 + r] * wscale[n0 + r];
                if (bias) s += lm_act(bias, x_bf16, n0 + r);
                lm_store(y, x_bf16, (long)m * ldy + n0 + r, s);
            }
    }
    free(xq); free(dx); free(xsum); free(out);
    return 0;
}
