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
 * output does not depend on its batch. Both products run as register tiles shared by the group's heads
 * (score_tile, value_tile); on the AVX-512 build a bf16 cache's scores take the BF16 dot product (scores_bh).
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
static LM_ALWAYS_INLINE vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static LM_ALWAYS_INLINE float vhmax(vec a) { return _mm512_reduce_max_ps(a); }
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
static LM_ALWAYS_INLINE vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static LM_ALWAYS_INLINE float vhmax(vec a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
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

/* s[j] = exp(s[j] - mx), lm_exp of common.h; arguments below -87 give exactly 0 (a weight under float32's normal
 * range). */
static LM_ALWAYS_INLINE void exp_block(float *s, int n, float mx) {
    for (int j = 0; j < n; j++) { /* branch-free, so the compiler vectorises it */
        const float x = s[j] - mx;
        const int keep = x > -87.0f;
        const float e = lm_exp(keep ? x : -87.0f);
        s[j] = keep ? e : 0.0f;
    }
}

/* The largest of s[0..n) (exact whatever the order; written out because compilers keep a float max reduction
 * scalar); 0 when n is 0 (nothing attended: no weight is computed). */
static LM_ALWAYS_INLINE float max_of(const float *s, int n) {
    if (n < 1) return 0.0f;
    float mx = s[0];
    int j = 0;
    if (n >= VW) {
        vec m = vloadf(s);
        for (j = VW; j + VW <= n; j += VW) m = vmax(m, vloadf(s + j));
        mx = vhmax(m);
    }
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}

/* The sum of s[0..n): VW partial sums over the full chunks, then their lanes, then the tail, in that fixed order. */
static LM_ALWAYS_INLINE float sum_of(const float *s, int n) {
    vec a = vzero();
    int j = 0;
    for (; j + VW <= n; j += VW) a = vadd(a, vloadf(s + j));
    float total = vsum(a);
    for (; j < n; j++) total += s[j];
    return total;
}

/* Keys (or values) per block: a bf16 block is widened to float32 once, then read by every query head. */
#define KB 32

/* Rows ahead of the one being read that are prefetched: far enough to cover the memory's latency at the rate
 * the tiles consume rows (a long cache outgrows the caches: each step reads it from memory once). */
#define PD 24

/* Asks for the bytes bytes of a row at p. */
static LM_ALWAYS_INLINE void prefetch_row(const char *p, long bytes) {
    for (long b = 0; b < bytes; b += 64) lm_prefetch(p + b);
}

/* Rows at[t0 .. t0+nb) of a [L, D] matrix (row stride st elements) as float32 row pointers: bf16 rows widened
 * into wide (nb rows of Dp floats), float32 rows read where they lie. Each row's read prefetches the row PD
 * attended rows further on (below n). */
static LM_ALWAYS_INLINE void block_rows(const void *base, long row0, long st, const int *at, int t0, int nb, int n,
                                        int D, int Dp, int bf16, float *wide, const float **rows) {
    const long es = bf16 ? 2 : 4;
    for (int c = 0; c < nb; c++) {
        if (t0 + c + PD < n) prefetch_row((const char *)base + (row0 + (long)at[t0 + c + PD] * st) * es, D * es);
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

/* Register tiles: HT query heads share each load of a key or value chunk, CT chunks of a value row share each
 * broadcast weight. The sizes keep the accumulators and operands in registers (32 on AVX-512, 16 on AVX2); the
 * kernel is bound by loads without them (one chunk load per multiply-add). */
#if defined(__AVX512F__)
#define HT 4
#else
#define HT 2
#endif
#define CT 4

/* F(nh, ...) with nh = min(left, HT) as a constant, so each instance keeps its tile in registers; a group size
 * that is not a multiple of HT (3 query heads per KV head) still shares each load among all of its heads. */
#if HT == 4
#define HEAD_TILE(left, F, ...)                                                                                        \
    switch ((left) < HT ? (left) : HT) {                                                                               \
    case 4: F(4, __VA_ARGS__); break;                                                                                  \
    case 3: F(3, __VA_ARGS__); break;                                                                                  \
    case 2: F(2, __VA_ARGS__); break;                                                                                  \
    default: F(1, __VA_ARGS__);                                                                                        \
    }
#else
#define HEAD_TILE(left, F, ...)                                                                                        \
    switch ((left) < HT ? (left) : HT) {                                                                               \
    case 2: F(2, __VA_ARGS__); break;                                                                                  \
    default: F(1, __VA_ARGS__);                                                                                        \
    }
#endif

/* s[0..4) = the lane sums of a[0..4) (lm_reduce4's fixed order) times scale: one head's scores of four keys. */
static LM_ALWAYS_INLINE void store_scores(const vec *a, float *s, float scale) {
    float t[4];
    _mm_storeu_ps(t, lm_reduce4(a[0], a[1], a[2], a[3]));
    for (int e = 0; e < 4; e++) s[e] = t[e] * scale;
}

/* Scores of four keys (rows r[0..3]) for nh query heads (queries qh, Dp floats apart): s[h*L + e] = (q_h . k_e) *
 * scale. Each key's products are summed over the head-size chunks in order, then by lm_reduce4: the same sums in the
 * same order whichever heads share the tile. */
static LM_ALWAYS_INLINE void score_tile(const int nh, const float *qh, int Dp, int D, const float *const *r, float *s,
                                        long L, float scale) {
    vec a[HT][4];
    for (int h = 0; h < nh; h++)
        for (int e = 0; e < 4; e++) a[h][e] = vzero();
    for (int i = 0; i < Dp; i += VW) {
        const vec k0 = vload(r[0], i, 0, D - i), k1 = vload(r[1], i, 0, D - i);
        const vec k2 = vload(r[2], i, 0, D - i), k3 = vload(r[3], i, 0, D - i);
        for (int h = 0; h < nh; h++) {
            const vec x = vloadf(qh + (long)h * Dp + i);
            a[h][0] = vfma(x, k0, a[h][0]);
            a[h][1] = vfma(x, k1, a[h][1]);
            a[h][2] = vfma(x, k2, a[h][2]);
            a[h][3] = vfma(x, k3, a[h][3]);
        }
    }
    for (int h = 0; h < nh; h++) store_scores(a[h], s + (long)h * L, scale);
}

#if defined(__AVX512BF16__)
/* As score_tile for a bf16 cache, on the keys' and queries' bf16 values as they lie: the BF16 dot product sums
 * pairs of exact products into float32 lanes, so the keys are never widened and each chunk of 32 elements is one
 * instruction per (head, key). Rows r[0..3] and the nh queries (qsh elements apart) are bf16. */
static LM_ALWAYS_INLINE void score_tile_bh(const int nh, const uint16_t *q, long qsh, int D, const uint16_t *const *r,
                                           float *s, long L, float scale) {
    vec a[HT][4]; /* __m512: the BF16 instruction is on the AVX-512 build only */
    for (int h = 0; h < nh; h++)
        for (int e = 0; e < 4; e++) a[h][e] = vzero();
    for (int i = 0; i < D; i += 32) {
        const __mmask32 m = D - i >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (D - i)) - 1u);
        const __m512bh k0 = lm_load_bh_tail(r[0] + i, m), k1 = lm_load_bh_tail(r[1] + i, m);
        const __m512bh k2 = lm_load_bh_tail(r[2] + i, m), k3 = lm_load_bh_tail(r[3] + i, m);
        for (int h = 0; h < nh; h++) {
            const __m512bh x = lm_load_bh_tail(q + (long)h * qsh + i, m);
            a[h][0] = _mm512_dpbf16_ps(a[h][0], x, k0);
            a[h][1] = _mm512_dpbf16_ps(a[h][1], x, k1);
            a[h][2] = _mm512_dpbf16_ps(a[h][2], x, k2);
            a[h][3] = _mm512_dpbf16_ps(a[h][3], x, k3);
        }
    }
    for (int h = 0; h < nh; h++) store_scores(a[h], s + (long)h * L, scale);
}

/* The scores of a bf16 task's attended keys: four keys (score_tile_bh) at a time, then the rest one by one; each
 * key row is asked for PD rows ahead. */
static void scores_bh(const uint16_t *q, long qsh, const uint16_t *k, long krow, long kst, const int *at, int n, int G,
                      int D, long L, float scale, float *s) {
    const uint16_t *r[4];
    int c = 0;
    for (; c < n; c += 4) {
        const int nr = n - c < 4 ? n - c : 4;
        for (int e = 0; e < nr; e++) {
            if (c + e + PD < n) prefetch_row((const char *)(k + krow + (long)at[c + e + PD] * kst), 2L * D);
            r[e] = k + krow + (long)at[c + e] * kst;
        }
        if (nr < 4) break;
        for (int g = 0; g < G; g += HT)
            HEAD_TILE(G - g, score_tile_bh, q + (long)g * qsh, qsh, D, r, s + (long)g * L + c, L, scale)
    }
    for (; c < n; c++) /* the last n % 4 keys */
        for (int g = 0; g < G; g++) {
            const uint16_t *qg = q + (long)g * qsh, *kr = k + krow + (long)at[c] * kst;
            __m512 a = _mm512_setzero_ps();
            for (int i = 0; i < D; i += 32) {
                const __mmask32 m = D - i >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (D - i)) - 1u);
                a = _mm512_dpbf16_ps(a, lm_load_bh_tail(qg + i, m), lm_load_bh_tail(kr + i, m));
            }
            s[(long)g * L + c] = _mm512_reduce_add_ps(a) * scale;
        }
}
#endif

/* acc[h][chunk] += sum_j p[h*L + j] * v_j[chunk] for nh heads, nc chunks starting at element i0 (rest = D - i0
 * elements left in the row), over the block's nb value rows, one partial sum per (head, chunk) added key by key in
 * order. */
static LM_ALWAYS_INLINE void value_tile(const int nh, const int nc, const float *p, long L, const float *const *rows,
                                        int nb, float *acc, int Dp, int rest, int i0) {
    vec a[HT][CT];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < nc; c++) a[h][c] = vloadf(acc + (long)h * Dp + c * VW);
    for (int j = 0; j < nb; j++) {
        vec x[CT];
        for (int c = 0; c < nc; c++) x[c] = vload(rows[j], i0 + c * VW, 0, rest - c * VW);
        for (int h = 0; h < nh; h++) {
            const vec w = vset1(p[(long)h * L + j]);
            for (int c = 0; c < nc; c++) a[h][c] = vfma(w, x[c], a[h][c]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < nc; c++) vstoref(acc + (long)h * Dp + c * VW, a[h][c]);
}

/* The scores of a task's attended keys on float32 values (bf16 keys widened a block at a time by block_rows, the
 * queries into qf): four keys and HT query heads at a time (score_tile), then the block's rest one by one. */
static void scores_f(const void *q, long qrow, long qsh, const void *k, long krow, long kst, const int *at, int n,
                     int G, int D, long L, float scale, int bf16, float *qf, float *wide, float *s) {
    const int Dp = (D + VW - 1) / VW * VW;
    const float *rows[KB];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < Dp; i += VW) vstoref(qf + (long)g * Dp + i, vload(q, qrow + g * qsh + i, bf16, D - i));
    for (int t0 = 0; t0 < n; t0 += KB) {
        const int nb = n - t0 < KB ? n - t0 : KB;
        block_rows(k, krow, kst, at, t0, nb, n, D, Dp, bf16, wide, rows);
        int c = 0;
        for (; c + 4 <= nb; c += 4) {
            for (int g = 0; g < G; g += HT)
                HEAD_TILE(G - g, score_tile, qf + (long)g * Dp, Dp, D, rows + c, s + (long)g * L + t0 + c, L, scale)
        }
        for (; c < nb; c++)
            for (int g = 0; g < G; g++) {
                const float *qg = qf + (long)g * Dp;
                vec a = vzero();
                for (int i = 0; i < Dp; i += VW) a = vfma(vloadf(qg + i), vload(rows[c], i, 0, D - i), a);
                s[(long)g * L + t0 + c] = vsum(a) * scale;
            }
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
    /* scores s[g][t] of the t-th attended key */
#if defined(__AVX512BF16__)
    if (bf16) /* bf16 keys and queries as they lie */
        scores_bh((const uint16_t *)q + qrow, qsh, (const uint16_t *)k, krow, kst, at, n, G, D, L, scale, s);
    else
#endif
        scores_f(q, qrow, qsh, k, krow, kst, at, n, G, D, L, scale, bf16, qf, wide, s);

    /* softmax per query head, unnormalised: p = exp(s - max), divided by their sum at the end */
    float inv[LM_ATTN_MAX_G];
    for (int g = 0; g < G; g++) {
        float *sg = s + (long)g * L;
        exp_block(sg, n, max_of(sg, n));
        const float total = sum_of(sg, n);
        inv[g] = total > 0.0f ? 1.0f / total : 0.0f; /* nothing attended: the output is zero */
    }

    /* the weighted sum of the values, block by block: tiles of HT query heads by CT head-size chunks (value_tile) */
    for (long i = 0; i < (long)G * Dp; i += VW) vstoref(acc + i, vzero());
    for (int t0 = 0; t0 < n; t0 += KB) {
        const int nb = n - t0 < KB ? n - t0 : KB;
        block_rows(v, vrow, vst, at, t0, nb, n, D, Dp, bf16, wide, rows);
        for (int g = 0; g < G; g += HT)
            for (int i = 0; i < Dp;) {
                const float *pg = s + (long)g * L + t0;
                float *ag = acc + (long)g * Dp + i;
                if ((Dp - i) / VW >= CT) {
                    HEAD_TILE(G - g, value_tile, CT, pg, L, rows, nb, ag, Dp, D - i, i)
                    i += CT * VW;
                } else {
                    HEAD_TILE(G - g, value_tile, 1, pg, L, rows, nb, ag, Dp, D - i, i)
                    i += VW;
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
