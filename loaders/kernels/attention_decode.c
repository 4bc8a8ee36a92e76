/*
 * Attention over the slot cache for rows of one or more query tokens: each query token attends the keys of its
 * own row that the mask lets through (decode rows: one token per sequence; prompt rows in half precision: several).
 *
 * Why its own kernel: at a decode step each (row, head) attends with one query over a few hundred keys, a tiny,
 * memory-bound job. torch's CPU scaled_dot_product_attention pays a blocked flash-attention set-up per (row, head)
 * and, in bfloat16, conversions per block; at 16 rows of the 100M Llama it took ~12-17% of a decode step, several
 * times the time its reads of K and V need. Here each (row, KV head) is one task: its G = H / KV query heads (GQA)
 * read the pair's keys and values once, in place, in the cache's own dtype, with float32 sums.
 *
 * Per task: scores s[g][j] = (q_g . k_j) * scale for the keys the mask lets through (the others are not read at
 * all), a softmax per query head (max, exp, sum), then o_g = sum_j p[g][j] v_j / sum_j p[g][j]. A row's result depends
 * on its own data only, in a fixed order, whatever rows share the call and whichever thread runs it, so a row's
 * output does not depend on its batch.
 *
 * Several query tokens per row (a prompt) make one task per (row, KV head, query token), each computed exactly as a
 * decode row's task, over the keys that token's mask row lets through. So a token's output depends on its own
 * query and its own row's keys only, whether its prompt runs alone, batched or packed end to end with others, and
 * however it is cut into chunks: in bfloat16 this is what keeps a row's greedy tokens independent of its
 * neighbours (torch's SDPA blocks its sums by position in the whole key sequence, which packing shifts).
 *
 * Layouts (strides in elements; every last dimension is contiguous):
 *   q    [B, H, T, D]   strides (qsb, qsh, qst)
 *   k, v [B, KV, L, D]  strides (ksb, ksh, kst) and (vsb, vsh, vst)
 *   mask [B, T, L] bytes, strides (msb, mst) (0: masked, else attended); NULL: every key is attended
 *   out  [B, T, H, D]   strides (osb, ost, osh)
 * q, k, v and out are all float32 (bf16 = 0) or all bfloat16 (bf16 = 1).
 * Returns 0, or a negative code for shapes it does not take (the caller then uses torch).
 */
#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Largest head size and query-heads-per-KV-head group taken (buffers are sized per task from these). */
#define LM_ATTN_MAX_D 256
#define LM_ATTN_MAX_G 64

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vec;
static LM_ALWAYS_INLINE vec vzero(void) { return _mm512_setzero_ps(); }
static LM_ALWAYS_INLINE vec vset1(float f) { return _mm512_set1_ps(f); }
static LM_ALWAYS_INLINE vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static LM_ALWAYS_INLINE vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static LM_ALWAYS_INLINE float vsum(vec a) { return _mm512_reduce_add_ps(a); }
static LM_ALWAYS_INLINE vec vloadf(const float *p) { return _mm512_loadu_ps(p); }
static LM_ALWAYS_INLINE void vstoref(float *p, vec a) { _mm512_storeu_ps(p, a); }
/* n (1..16) elements of a float32 or bfloat16 row as floats, zeros past n. */
static LM_ALWAYS_INLINE vec vload(const void *p, long i, int bf16, int n) {
    const __mmask16 m = n >= VW ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    if (bf16) {
        const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}
#else
#define VW 8
typedef __m256 vec;
static LM_ALWAYS_INLINE vec vzero(void) { return _mm256_setzero_ps(); }
static LM_ALWAYS_INLINE vec vset1(float f) { return _mm256_set1_ps(f); }
static LM_ALWAYS_INLINE vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static LM_ALWAYS_INLINE vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static LM_ALWAYS_INLINE float vsum(vec a) { return lm_hsum256(a); }
static LM_ALWAYS_INLINE vec vloadf(const float *p) { return _mm256_loadu_ps(p); }
static LM_ALWAYS_INLINE void vstoref(float *p, vec a) { _mm256_storeu_ps(p, a); }
/* 8 elements (the AVX2 path takes head sizes that are multiples of 8 only; n is always 8 here). */
static LM_ALWAYS_INLINE vec vload(const void *p, long i, int bf16, int n) {
    (void)n;
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}
#endif

/* exp(x) for x <= 0 (scores minus their maximum), lm_exp of common.h; inputs below -87 give exactly 0 (a weight
 * under float32's normal range). */
static LM_ALWAYS_INLINE void exp_block(float *s, int n) {
    for (int j = 0; j < n; j++) { /* branch-free, so the compiler vectorises it */
        const int keep = s[j] > -87.0f;
        const float e = lm_exp(keep ? s[j] : -87.0f);
        s[j] = keep ? e : 0.0f;
    }
}

/* Keys (or values) per block: a bf16 block is widened to float32 once, then read by every query head. */
#define KB 32

/* Rows at[t0 .. t0+nb) of a [L, D] matrix (row stride st elements) as float32 row pointers: bf16 rows widened
 * into wide (nb rows of Dp floats), float32 rows read where they lie. */
static LM_ALWAYS_INLINE void block_rows(const void *base, long row0, long st, const int *at, int t0, int nb, int D,
                                        int Dp, int bf16, float *wide, const float **rows) {
    for (int c = 0; c < nb; c++) {
        const long first = row0 + (long)at[t0 + c] * st;
        if (!bf16) {
            rows[c] = (const float *)base + first;
            continue;
        }
        float *w = wide + (long)c * Dp;
        for (int i = 0; i < Dp; i += VW) vstoref(w + i, vload(base, first + i, 1, D - i));
        rows[c] = w;
    }
}

/* One (row, KV head) task. buf holds G*Dp query floats, G*L scores, KB*Dp widened rows and G*Dp output sums;
 * at holds the attended keys' positions. */
static void attend(const void *q, long qrow, long qsh, const void *k, long krow, long kst, const void *v, long vrow,
                   long vst, const uint8_t *mrow, void *out, long orow, long osh, int G, int L, int D, float scale,
                   int bf16, float *buf, int *at) {
    const int Dp = (D + VW - 1) / VW * VW;
    float *qf = buf, *s = qf + (long)G * Dp, *wide = s + (long)G * L, *acc = wide + (long)KB * Dp;
    const float *rows[KB];
    const size_t es = bf16 ? 2 : 4;
    /* only the keys the mask lets through are read at all: what masked positions hold never matters */
    int n = 0;
    if (!mrow) {
        for (int j = 0; j < L; j++) at[n++] = j;
    } else {
        int j = 0;
        for (; j + 8 <= L; j += 8) { /* a packed prompt's mask rows are mostly zeros: skip them 8 at a time */
            uint64_t word;
            memcpy(&word, mrow + j, sizeof word);
            if (!word) continue;
            for (int e = 0; e < 8; e++)
                if (mrow[j + e]) at[n++] = j + e;
        }
        for (; j < L; j++)
            if (mrow[j]) at[n++] = j;
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < Dp; i += VW) vstoref(qf + (long)g * Dp + i, vload(q, qrow + g * qsh + i, bf16, D - i));

    /* scores s[g][t] of the t-th attended key; one lm_reduce4 sums four keys' products */
    for (int t0 = 0; t0 < n; t0 += KB) {
        const int nb = n - t0 < KB ? n - t0 : KB;
        if (t0 + KB < n) /* the next block's keys, while this one computes */
            for (int c = 0; c < KB && t0 + KB + c < n; c++)
                for (long b = 0; b < (long)D * (long)es; b += 64)
                    lm_prefetch((const char *)k + (krow + (long)at[t0 + KB + c] * kst) * es + b);
        block_rows(k, krow, kst, at, t0, nb, D, Dp, bf16, wide, rows);
        for (int g = 0; g < G; g++) {
            const float *qg = qf + (long)g * Dp;
            float *sg = s + (long)g * L + t0;
            int c = 0;
            for (; c + 4 <= nb; c += 4) {
                vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
                for (int i = 0; i < Dp; i += VW) {
                    const vec x = vloadf(qg + i);
                    a0 = vfma(x, vload(rows[c], i, 0, D - i), a0);
                    a1 = vfma(x, vload(rows[c + 1], i, 0, D - i), a1);
                    a2 = vfma(x, vload(rows[c + 2], i, 0, D - i), a2);
                    a3 = vfma(x, vload(rows[c + 3], i, 0, D - i), a3);
                }
                float r[4];
                _mm_storeu_ps(r, lm_reduce4(a0, a1, a2, a3));
                for (int e = 0; e < 4; e++) sg[c + e] = r[e] * scale;
            }
            for (; c < nb; c++) {
                vec a = vzero();
                for (int i = 0; i < Dp; i += VW) a = vfma(vloadf(qg + i), vload(rows[c], i, 0, D - i), a);
                sg[c] = vsum(a) * scale;
            }
        }
    }

    /* softmax per query head, unnormalised: p = exp(s - max), divided by their sum at the end */
    float inv[LM_ATTN_MAX_G];
    for (int g = 0; g < G; g++) {
        float *sg = s + (long)g * L, mx = -INFINITY, total = 0.0f;
        for (int t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
        for (int t = 0; t < n; t++) sg[t] -= mx;
        exp_block(sg, n);
        for (int t = 0; t < n; t++) total += sg[t];
        inv[g] = total > 0.0f ? 1.0f / total : 0.0f; /* nothing attended: the output is zero */
    }

    /* the weighted sum of the values, block by block, in four partial sums per head-size chunk */
    for (long i = 0; i < (long)G * Dp; i += VW) vstoref(acc + i, vzero());
    for (int t0 = 0; t0 < n; t0 += KB) {
        const int nb = n - t0 < KB ? n - t0 : KB;
        block_rows(v, vrow, vst, at, t0, nb, D, Dp, bf16, wide, rows);
        for (int g = 0; g < G; g++) {
            const float *pg = s + (long)g * L + t0;
            for (int i = 0; i < Dp; i += VW) {
                vec a0 = vloadf(acc + (long)g * Dp + i), a1 = vzero(), a2 = vzero(), a3 = vzero();
                int c = 0;
                for (; c + 4 <= nb; c += 4) {
                    a0 = vfma(vset1(pg[c]), vload(rows[c], i, 0, D - i), a0);
                    a1 = vfma(vset1(pg[c + 1]), vload(rows[c + 1], i, 0, D - i), a1);
                    a2 = vfma(vset1(pg[c + 2]), vload(rows[c + 2], i, 0, D - i), a2);
                    a3 = vfma(vset1(pg[c + 3]), vload(rows[c + 3], i, 0, D - i), a3);
                }
                for (; c < nb; c++) a0 = vfma(vset1(pg[c]), vload(rows[c], i, 0, D - i), a0);
                vstoref(acc + (long)g * Dp + i, vadd(vadd(a0, a1), vadd(a2, a3)));
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < D; i++) lm_store(out, bf16, orow + g * osh + i, acc[(long)g * Dp + i] * inv[g]);
}

int lm_decode_attention(const void *q, long qsb, long qsh, long qst, const void *k, long ksb, long ksh, long kst,
                        const void *v, long vsb, long vsh, long vst, const uint8_t *mask, long msb, long mst, void *out,
                        long osb, long ost, long osh, int B, int H, int KV, int T, int L, int D, float scale, int bf16,
                        int threads) {
    if (B < 1 || KV < 1 || T < 1 || H % KV != 0 || L < 1 || D < 1 || D > LM_ATTN_MAX_D) return -1;
    const int G = H / KV;
    if (G > LM_ATTN_MAX_G) return -1;
#if !defined(__AVX512F__)
    if (D % VW != 0) return -2;
#endif
    const int Dp = (D + VW - 1) / VW * VW;
    const long per_task = 2L * G * Dp + (long)G * L + (long)KB * Dp;
    const long tasks = (long)B * KV * T;
    if (threads > tasks) threads = (int)tasks;
    if (threads < 1) threads = 1;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)per_task * (size_t)threads);
    int *positions = (int *)malloc(sizeof(int) * (size_t)L * (size_t)threads);
    if (!scratch || !positions) {
        free(scratch);
        free(positions);
        return -3;
    }
#pragma omp parallel num_threads(threads)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        float *buf = scratch + (long)me * per_task;
        int *at = positions + (long)me * L;
#pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < tasks; t++) { /* (row, KV head, query token), the token fastest */
            const int i = (int)(t % T), h = (int)(t / T % KV), b = (int)(t / T / KV);
            attend(q, b * qsb + (long)h * G * qsh + i * qst, qsh, k, b * ksb + h * ksh, kst, v, b * vsb + h * vsh, vst,
                   mask ? mask + b * msb + i * mst : NULL, out, b * osb + i * ost + (long)h * G * osh, osh, G, L, D,
                   scale, bf16, buf, at);
        }
    }
    free(scratch);
    free(positions);
    return 0;
}
