/*
 * The element-wise steps of a Llama-family decoder layer at a decode step, around the linear and attention kernels:
 * residual add + RMSNorm, rotary embedding + the KV cache write, and SiLU(gate) * up.
 *
 * Why native: at a decode step these steps touch a few thousand numbers per row, yet run as a dozen torch operators
 * per layer (norms, rotate_half's slices and cat, the cache's index_put, the MLP's activation and product), each
 * paying torch's dispatch; on a 22-layer 1B Llama that was ~9 ms of a 40 ms int8 step. Here each is one call.
 *
 * Each step rounds as transformers' modules do in torch, so a bfloat16 result equals theirs up to the order of
 * one sum (RMSNorm's mean of squares) and the last bits of exp (SiLU): every product and sum that torch stores as
 * bfloat16 is rounded to bfloat16 here at the same point. A row's result depends on that row alone.
 *
 * Element types: float32 (bf16 = 0) or bfloat16 (bf16 = 1) throughout one call. Strides in elements.
 * Compiled once per instruction set like every kernel here; the loops are written so that -O3 vectorises them
 * for the path's width (no intrinsics needed: the work is small next to the weight reads around it).
 */
#include "common.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* x as torch holds it after storing into the dtype: bf16-rounded, or as is. */
static LM_ALWAYS_INLINE float lm_round(float x, int bf16) { return bf16 ? lm_round_bf16(x) : x; }

/* One row of lm_add_rms_norm. Two passes over h and no buffer: the first adds delta (storing the rounded sum back
 * into h) and sums the squares in 16 lanes; the second reads h again. */
static LM_ALWAYS_INLINE void norm_row(void *h, const void *delta, const void *weight, void *out, int n, float eps,
                                      const int bf16) {
    float part[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) {
            float x = lm_act(h, bf16, i + j);
            if (delta) {
                x = lm_round(x + lm_act(delta, bf16, i + j), bf16);
                lm_store(h, bf16, i + j, x);
            }
            part[j] += x * x;
        }
    float ss = 0.0f;
    for (int j = 0; j < 16; j++) ss += part[j];
    for (; i < n; i++) {
        float x = lm_act(h, bf16, i);
        if (delta) {
            x = lm_round(x + lm_act(delta, bf16, i), bf16);
            lm_store(h, bf16, i, x);
        }
        ss += x * x;
    }
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int k = 0; k < n; k++)
        lm_store(out, bf16, k, lm_act(weight, bf16, k) * lm_round(lm_act(h, bf16, k) * r, bf16));
}

/*
 * For each of `rows` rows: if delta is given, h += delta (stored in h, rounded to the dtype: the residual add);
 * then out = weight * (h * rsqrt(mean(h^2) + eps)), the product inside rounded to the dtype before the weight
 * multiplies it (transformers' LlamaRMSNorm: float32 inside, cast back, then the weight). Rows are shared among
 * threads when there are several.
 */
int lm_add_rms_norm(void *h, long ldh, const void *delta, long ldd, const void *weight, void *out, long ldo, int rows,
                    int n, float eps, int bf16, int threads) {
    if (rows < 1 || n < 1) return -1;
    if (threads < 1 || rows < 4) threads = 1;
    const size_t es = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < rows; b++) {
        void *hb = (char *)h + (size_t)b * (size_t)ldh * es;
        const void *db = delta ? (const char *)delta + (size_t)b * (size_t)ldd * es : NULL;
        void *ob = (char *)out + (size_t)b * (size_t)ldo * es;
        if (bf16)
            norm_row(hb, db, weight, ob, n, eps, 1);
        else
            norm_row(hb, db, weight, ob, n, eps, 0);
    }
    return 0;
}

/* One head of D values at x (rotated in place when dst is x): transformers' apply_rotary_pos_emb,
 * x * cos + rotate_half(x) * sin, with each product and the sum rounded to the dtype as torch stores them. */
static LM_ALWAYS_INLINE void rotate(const void *x, long xi, void *dst, long di, const void *cs, const void *sn,
                                    long ci, int D, int bf16, float *tmp) {
    const int half = D / 2;
    for (int i = 0; i < D; i++) tmp[i] = lm_act(x, bf16, xi + i);
    for (int i = 0; i < D; i++) {
        const float other = i < half ? -tmp[i + half] : tmp[i - half];
        const float a = lm_round(tmp[i] * lm_act(cs, bf16, ci + i), bf16);
        const float s = lm_round(other * lm_act(sn, bf16, ci + i), bf16);
        lm_store(dst, bf16, di + i, a + s);
    }
}

/*
 * Rotary embedding and the cache write of one decode token per row. Row b is at position pos[b] of cache slot
 * slot[b]: its H query heads (q, row stride ldq, heads D apart) are rotated in place; its KV key heads (k) are
 * rotated into kcache[slot][head][pos] and its value heads (v) copied into vcache[slot][head][pos] (cache strides
 * cs0, cs1, cs2 for slot, head, position; both caches laid out alike). cos and sin hold one row of D values per
 * position (row stride ldc), in the dtype, as the model's rotary module makes them.
 */
int lm_rope_store(void *q, long ldq, const void *k, long ldk, const void *v, long ldv, const void *cos_t,
                  const void *sin_t, long ldc, const int64_t *pos, const int64_t *slot, void *kcache, void *vcache,
                  long cs0, long cs1, long cs2, int rows, int H, int KV, int D, int bf16) {
    if (rows < 1 || H < 1 || KV < 1 || D < 2 || D % 2 || D > 1024) return -1;
    float tmp[1024];
    const size_t es = bf16 ? 2 : 4;
    for (int b = 0; b < rows; b++) {
        const long ci = pos[b] * ldc;
        for (int hd = 0; hd < H; hd++) {
            const long qi = (long)b * ldq + (long)hd * D;
            rotate(q, qi, q, qi, cos_t, sin_t, ci, D, bf16, tmp);
        }
        for (int hd = 0; hd < KV; hd++) {
            const long at = slot[b] * cs0 + (long)hd * cs1 + pos[b] * cs2;
            rotate(k, (long)b * ldk + (long)hd * D, kcache, at, cos_t, sin_t, ci, D, bf16, tmp);
            memcpy((char *)vcache + (size_t)at * es, (const char *)v + (size_t)((long)b * ldv + (long)hd * D) * es,
                   (size_t)D * es);
        }
    }
    return 0;
}

/* Elements per chunk of the SiLU product; chunks are shared among threads. */
#define LM_ACT_CHUNK 1024

/*
 * out = silu(gate) * up for rows x n values (row strides ldg, ldu, ldo): transformers' LlamaMLP between its
 * projections, SiLU rounded to the dtype before the product, as torch stores it.
 */
/* One chunk of lm_silu_mul (bf16 constant per call site, see ld). */
static LM_ALWAYS_INLINE void silu_chunk(const void *gate, const void *up, void *out, int n, const int bf16) {
    for (int i = 0; i < n; i++) {
        const float g = lm_act(gate, bf16, i);
        /* exp(-g) past float32's range is infinite, as in torch (silu of a large negative g is -0) */
        const float x = g < -88.0f ? 88.0f : (g > 87.0f ? -87.0f : -g);
        const float e = g < -88.0f ? INFINITY : lm_exp(x);
        const float s = lm_round(g / (1.0f + e), bf16);
        lm_store(out, bf16, i, s * lm_act(up, bf16, i));
    }
}

int lm_silu_mul(const void *gate, long ldg, const void *up, long ldu, void *out, long ldo, int rows, int n, int bf16,
                int threads) {
    if (rows < 1 || n < 1) return -1;
    const int per_row = (n + LM_ACT_CHUNK - 1) / LM_ACT_CHUNK;
    const long chunks = (long)rows * per_row;
    const size_t es = bf16 ? 2 : 4;
    if (threads < 1) threads = 1;
    if (chunks < 4 * threads) threads = 1; /* a single decode row's worth: forking costs more than it saves */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < chunks; c++) {
        const long b = c / per_row, i0 = (c % per_row) * LM_ACT_CHUNK;
        const int len = (int)(i0 + LM_ACT_CHUNK < n ? LM_ACT_CHUNK : n - i0);
        const void *g = (const char *)gate + (size_t)(b * ldg + i0) * es;
        const void *u = (const char *)up + (size_t)(b * ldu + i0) * es;
        void *o = (char *)out + (size_t)(b * ldo + i0) * es;
        if (bf16)
            silu_chunk(g, u, o, len, 1);
        else
            silu_chunk(g, u, o, len, 0);
    }
    return 0;
}
