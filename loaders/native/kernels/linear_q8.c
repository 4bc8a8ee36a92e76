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
 * loaders/native/quantization.py lays it out so). Values lie in [-127, 127].
 *  - AVX-512: VNNI dpbusd (unsigned x signed bytes, 64 per instruction); x's sign moves onto w with a masked
 *    negate, so the unsigned operand is |x|.
 *  - AVX2: maddubs + madd with the same sign trick (|x| <= 127 and |w| <= 127 keep the 16-bit pair sums exact).
 *
 * Access order: each thread reads its weight rows one after another, front to back, so the whole product is one
 * sequential stream per thread. Reading four rows side by side (four streams of 2-6 KiB each, one per output
 * row, as the bf16 kernel does) reached only 60-70% of the streaming rate on this project's EPYC; one stream per
 * thread reaches it. Activations are reused from L1 across rows instead of from registers.
 */
#include "common.h"

#define ROWS 8 /* weight rows per tile: their bytes stay in L1 while the tile meets every chunk of x's rows */

#if defined(__AVX512F__)
#define MAXM 4

/* One weight row against NM rows of x (NM a compile-time constant, see row_1 .. row_4, so the accumulators stay
 * in registers). xa holds |x|, neg the sign bit of each x byte, per group of each row. Two accumulators per row
 * of x (even and odd groups) halve the multiply-add's dependency chain; the order is the same for any M. */
static LM_ALWAYS_INLINE void row_dot(const int8_t *xa, const __mmask64 *neg, const float *dx, int G,
                                     const int8_t *wr, float *acc_out, const int NM) {
    __m512 a0[MAXM], a1[MAXM];
    for (int m = 0; m < NM; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    int g = 0;
    for (; g + 1 < G; g += 2) {
        const __m512i w0 = _mm512_loadu_si512((const void *)(wr + (long)g * LM_GROUP));
        const __m512i w1 = _mm512_loadu_si512((const void *)(wr + (long)(g + 1) * LM_GROUP));
        lm_prefetch(wr + (long)g * LM_GROUP + LM_PREFETCH_AHEAD);
        lm_prefetch(wr + (long)(g + 1) * LM_GROUP + LM_PREFETCH_AHEAD);
        for (int m = 0; m < NM; m++) {
            const long mg = (long)m * G + g;
            const __m512i s0 = _mm512_mask_sub_epi8(w0, neg[mg], zero, w0);
            const __m512i s1 = _mm512_mask_sub_epi8(w1, neg[mg + 1], zero, w1);
            const __m512i i0 = _mm512_dpbusd_epi32(zero, _mm512_load_si512((const void *)(xa + mg * LM_GROUP)), s0);
            const __m512i i1 =
                _mm512_dpbusd_epi32(zero, _mm512_load_si512((const void *)(xa + (mg + 1) * LM_GROUP)), s1);
            a0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_set1_ps(dx[mg]), a0[m]);
            a1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_set1_ps(dx[mg + 1]), a1[m]);
        }
    }
    if (g < G) {
        const __m512i w0 = _mm512_loadu_si512((const void *)(wr + (long)g * LM_GROUP));
        for (int m = 0; m < NM; m++) {
            const long mg = (long)m * G + g;
            const __m512i s0 = _mm512_mask_sub_epi8(w0, neg[mg], zero, w0);
            const __m512i i0 = _mm512_dpbusd_epi32(zero, _mm512_load_si512((const void *)(xa + mg * LM_GROUP)), s0);
            a0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_set1_ps(dx[mg]), a0[m]);
        }
    }
    for (int m = 0; m < NM; m++) acc_out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}

/* x's per-call side tables: |x| per byte, and each group's sign bits as one 64-bit mask. */
typedef __mmask64 sign_t;
static void prepare(const int8_t *xq, long groups, int8_t *xa, sign_t *neg) {
    for (long i = 0; i < groups; i++) {
        const __m512i v = _mm512_load_si512((const void *)(xq + i * LM_GROUP));
        _mm512_store_si512((void *)(xa + i * LM_GROUP), _mm512_abs_epi8(v));
        neg[i] = _mm512_movepi8_mask(v);
    }
}

#else /* AVX2 + FMA */
#define MAXM 2

/* One group's dot product of x (|x| in xa, x itself in xs, whose signs move onto w) with weights w0|w1, exactly in
 * int32 per lane, as float. */
static LM_ALWAYS_INLINE __m256 group_dot(const int8_t *xa, const int8_t *xs, __m256i w0, __m256i w1) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i s0 = _mm256_sign_epi8(w0, _mm256_load_si256((const __m256i *)xs));
    const __m256i s1 = _mm256_sign_epi8(w1, _mm256_load_si256((const __m256i *)(xs + 32)));
    const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)xa), s0), ones);
    const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)(xa + 32)), s1), ones);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
}

/* As above; xs holds x itself (maddubs takes the sign from it), xa |x|. */
static LM_ALWAYS_INLINE void row_dot(const int8_t *xa, const int8_t *xs, const float *dx, int G, const int8_t *wr,
                                     float *acc_out, const int NM) {
    __m256 a0[MAXM], a1[MAXM];
    for (int m = 0; m < NM; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    int g = 0;
    for (; g + 1 < G; g += 2) { /* even groups into a0, odd ones into a1: two independent chains per row */
        const int8_t *wg = wr + (long)g * LM_GROUP;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)wg);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + 32));
        const __m256i w2 = _mm256_loadu_si256((const __m256i *)(wg + 64));
        const __m256i w3 = _mm256_loadu_si256((const __m256i *)(wg + 96));
        lm_prefetch(wg + LM_PREFETCH_AHEAD);
        lm_prefetch(wg + LM_GROUP + LM_PREFETCH_AHEAD);
        for (int m = 0; m < NM; m++) {
            const long mg = (long)m * G + g;
            a0[m] = _mm256_fmadd_ps(group_dot(xa + mg * LM_GROUP, xs + mg * LM_GROUP, w0, w1), _mm256_set1_ps(dx[mg]),
                                    a0[m]);
            a1[m] = _mm256_fmadd_ps(group_dot(xa + (mg + 1) * LM_GROUP, xs + (mg + 1) * LM_GROUP, w2, w3),
                                    _mm256_set1_ps(dx[mg + 1]), a1[m]);
        }
    }
    if (g < G) {
        const int8_t *wg = wr + (long)g * LM_GROUP;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)wg);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + 32));
        for (int m = 0; m < NM; m++) {
            const long mg = (long)m * G + g;
            a0[m] = _mm256_fmadd_ps(group_dot(xa + mg * LM_GROUP, xs + mg * LM_GROUP, w0, w1), _mm256_set1_ps(dx[mg]),
                                    a0[m]);
        }
    }
    for (int m = 0; m < NM; m++) acc_out[m] = lm_hsum256(_mm256_add_ps(a0[m], a1[m]));
}

typedef int8_t sign_t; /* unused on this path: maddubs reads the signs from xq itself */
static void prepare(const int8_t *xq, long groups, int8_t *xa, sign_t *neg) {
    (void)neg;
    for (long i = 0; i < groups * (LM_GROUP / 32); i++) {
        const __m256i v = _mm256_load_si256((const __m256i *)(xq + i * 32));
        _mm256_store_si256((__m256i *)(xa + i * 32), _mm256_abs_epi8(v));
    }
}
#endif

/* The products of one weight row n with rows m0 .. m0+nm-1 of x, scaled, biased and stored. */
static LM_ALWAYS_INLINE void row_out(const int8_t *xq, const int8_t *xa, const sign_t *neg, const float *dx, int G,
                                     const int8_t *wr, float wscale, float bias, int has_bias, void *y, long ldy,
                                     int x_bf16, long n, int m0, const int NM) {
    float acc[MAXM];
    const long off = (long)m0 * G;
#if defined(__AVX512F__)
    (void)xq;
    row_dot(xa + off * LM_GROUP, neg + off, dx + off, G, wr, acc, NM);
#else
    (void)neg;
    row_dot(xa + off * LM_GROUP, xq + off * LM_GROUP, dx + off, G, wr, acc, NM);
#endif
    for (int m = 0; m < NM; m++) {
        float s = acc[m] * wscale;
        if (has_bias) s += bias;
        lm_store(y, x_bf16, (long)(m0 + m) * ldy + n, s);
    }
}

/* Returns 0 on success. x: [M, K] (row stride ldx; bfloat16 if x_bf16, else float32), w: [N, ldw] int8,
 * wscale: [N] float32, bias: [N] in x's dtype or NULL, y: [M, N] (row stride ldy) in x's dtype. */
int lm_linear_q8(const void *x, long ldx, int x_bf16, const int8_t *w, long ldw, const float *wscale,
                 const void *bias, void *y, long ldy, int M, int N, int K, int threads) {
    if (M < 1 || N < 1 || K < 1 || threads < 1) return 1;
    const int G = (K + LM_GROUP - 1) / LM_GROUP;
    if (ldw < (long)G * LM_GROUP) return 2;
    const long groups = (long)M * G;
    int8_t *xq = aligned_alloc(64, (size_t)groups * LM_GROUP);
    int8_t *xa = aligned_alloc(64, (size_t)groups * LM_GROUP);
    sign_t *neg = malloc(sizeof(sign_t) * (size_t)groups);
    float *dx = malloc(sizeof(float) * (size_t)groups);
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)groups);
    if (!xq || !xa || !neg || !dx || !xsum) {
        free(xq); free(xa); free(neg); free(dx); free(xsum);
        return 3;
    }
    lm_quantize_rows(x, ldx, x_bf16, M, K, G, xq, dx, xsum);
    prepare(xq, groups, xa, neg);
    const int ntiles = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < ntiles; t++) {
        const int n0 = t * ROWS;
        const int n1 = N - n0 < ROWS ? N : n0 + ROWS;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            const int nm = M - m0 < MAXM ? M - m0 : MAXM;
            for (long n = n0; n < n1; n++) {
                const int8_t *wr = w + n * ldw;
                const float b = bias ? lm_act(bias, x_bf16, n) : 0.0f;
                const int hb = bias != NULL;
                switch (nm) { /* one instance per row count: NM must be a constant (see row_dot) */
                case 1: row_out(xq, xa, neg, dx, G, wr, wscale[n], b, hb, y, ldy, x_bf16, n, m0, 1); break;
#if MAXM > 2
                case 2: row_out(xq, xa, neg, dx, G, wr, wscale[n], b, hb, y, ldy, x_bf16, n, m0, 2); break;
                case 3: row_out(xq, xa, neg, dx, G, wr, wscale[n], b, hb, y, ldy, x_bf16, n, m0, 3); break;
                default: row_out(xq, xa, neg, dx, G, wr, wscale[n], b, hb, y, ldy, x_bf16, n, m0, 4); break;
#else
                default: row_out(xq, xa, neg, dx, G, wr, wscale[n], b, hb, y, ldy, x_bf16, n, m0, 2); break;
#endif
                }
            }
        }
    }
    free(xq); free(xa); free(neg); free(dx); free(xsum);
    return 0;
}
