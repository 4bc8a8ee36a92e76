/*
 * Shared by every kernel source: bf16 <-> f32 conversion, the fixed-order sum of four vectors' lanes (linear_bf16.c,
 * attention_decode.c), and the int8 quantization of activation rows that the quantized kernels (linear_q8.c,
 * linear_q4.c) multiply against their weights.
 *
 * Each source is compiled once per instruction set (see loaders/native/kernel_build.py): with -mavx512... flags the
 * __AVX512F__ branch is taken, with -mavx2 -mfma -mf16c the AVX2 branch; both export the same symbols, so
 * Python binds one library per instruction set and the rest of the code never knows which it got.
 */
#ifndef LM_COMMON_H
#define LM_COMMON_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Quantized kernels work on groups of this many inputs: one activation scale per group of each row, and, for
 * 4-bit weights, one weight scale per group of each output channel. 64 int8 values fill one zmm register. */
#define LM_GROUP 64

/* The most products one *_multi call takes (a layer's q, k, v; its gate and up). */
#define LM_MULTI_MAX 8

/* For a kernel's inner block, instantiated once per constant row count so its accumulators stay in registers. */
#define LM_ALWAYS_INLINE inline __attribute__((always_inline))

/* How far ahead of its read position a kernel that streams weights front to back asks for them. The hardware
 * prefetcher alone left the weight stream 20-40% under its rate on a Sapphire Rapids-class Xeon (bench.kernels);
 * asking for each cache line this far ahead keeps enough misses in flight. Harmless where the prefetcher keeps up. */
#define LM_PREFETCH_AHEAD 4096
static LM_ALWAYS_INLINE void lm_prefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }

#if defined(__AVX512BF16__)
/* 32 bf16 values as one operand of the BF16 dot product (linear_bf16.c, attention_decode.c); lm_load_bh_tail
 * reads only the lanes of m (zeros elsewhere), for a row's last partial chunk. */
static LM_ALWAYS_INLINE __m512bh lm_load_bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static LM_ALWAYS_INLINE __m512bh lm_load_bh_tail(const uint16_t *p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, (const void *)p);
}
#endif

static inline float lm_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* f rounded to bfloat16 as torch stores a float32 (nearest even; a NaN stays a quiet NaN), kept as a float whose
 * low 16 bits are zero. Branch-free, so loops over it vectorise. */
static LM_ALWAYS_INLINE float lm_round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const uint32_t quiet = (u | 0x00400000u) & 0xffff0000u;
    const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
    float o;
    memcpy(&o, &r, sizeof o);
    return o;
}

/* Round to nearest even, as torch does when it stores a float32 result as bfloat16. */
static LM_ALWAYS_INLINE uint16_t lm_f32_to_bf16(float f) {
    const float r = lm_round_bf16(f);
    uint32_t u;
    memcpy(&u, &r, sizeof u);
    return (uint16_t)(u >> 16);
}

/* Sum of the 8 floats of an AVX register (the AVX2 paths' final reduction of each accumulator). */
static inline float lm_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
/* The sums of the 16 lanes of each of a, b, c and d, as 4 floats. The lanes are combined in one fixed order (pairs
 * two apart, then one apart, then the four 128-bit quarters) whatever else the block holds, so a row's result never
 * depends on its batch-mates; and 4 sums cost a dozen instructions instead of a dozen each. */
static LM_ALWAYS_INLINE __m128 lm_reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* a0 b0 a1 b1 per quarter */
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd))); /* a b c d per quarter */
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#else
/* As the AVX-512 lm_reduce4: the 8 lanes of each of a, b, c, d summed in one fixed order, as 4 floats. */
static LM_ALWAYS_INLINE __m128 lm_reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    const __m256d abd = _mm256_castps_pd(ab), cdd = _mm256_castps_pd(cd);
    const __m256 s = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(abd, cdd)),
                                   _mm256_castpd_ps(_mm256_unpackhi_pd(abd, cdd)));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

/* exp(x) for x in [-87, 88] (callers clamp; attention_decode.c's softmax, decoder_ops.c's SiLU): 2^k * p(r), r = x - k ln2 in [-ln2/2, ln2/2], a degree-6 polynomial
 * (relative error ~2 ulp). Branch-free, so the loops calling it vectorise. */
static LM_ALWAYS_INLINE float lm_exp(float x) {
    const float k = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return p * two_k;
}

/* Element i of a float32 or bfloat16 array as a float, and a float stored into one (rounded for bf16). Inlined, so
 * a loop that passes a constant bf16 compiles without the branch. */
static LM_ALWAYS_INLINE float lm_act(const void *x, int bf16, long i) {
    return bf16 ? lm_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static LM_ALWAYS_INLINE void lm_store(void *y, int bf16, long i, float v) {
    if (bf16)
        ((uint16_t *)y)[i] = lm_f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* Round 64 floats to int8 with one symmetric scale: q = round(v / d), d = max|v| / 127 (round to nearest even,
 * the CPU's default mode). Returns d; *sum gets the sum of the int8 values. Vectorised: it runs for every group of
 * every activation row at every call, single-threaded before the parallel part. */
static inline float lm_quantize_group(const float *v, int8_t *q, int32_t *sum) {
#if defined(__AVX512F__)
    __m512 a[4], amax = _mm512_setzero_ps();
    for (int i = 0; i < 4; i++) {
        a[i] = _mm512_loadu_ps(v + 16 * i);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(a[i]));
    }
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m512i s = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) {
        __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(a[i], inv));
        r = _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        s = _mm512_add_epi32(s, r);
        _mm_storeu_si128((__m128i *)(q + 16 * i), _mm512_cvtepi32_epi8(r));
    }
    *sum = _mm512_reduce_add_epi32(s);
    return d;
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a[8], amax = _mm256_setzero_ps();
    for (int i = 0; i < 8; i++) {
        a[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, a[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.0f;
    const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < 8; i += 2) {
        __m256i r0 = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], inv));
        __m256i r1 = _mm256_cvtps_epi32(_mm256_mul_ps(a[i + 1], inv));
        r0 = _mm256_max_epi32(_mm256_min_epi32(r0, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        r1 = _mm256_max_epi32(_mm256_min_epi32(r1, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        s = _mm256_add_epi32(s, _mm256_add_epi32(r0, r1));
        /* packs works within 128-bit lanes: reorder so the 16 values come out in order */
        __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(r0, r1), 0xD8);
        __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
        _mm_storeu_si128((__m128i *)(q + 8 * i), p8);
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    *sum = _mm_cvtsi128_si32(t);
    return d;
#endif
}

/*
 * Quantize M rows of x ([M, K], row stride ldx, float32 or bfloat16) to int8, symmetric, one scale per group of
 * LM_GROUP: xq [M, G*LM_GROUP] (zero-padded past K), dx [M, G] the scales, xsum [M, G] the sum of each group's
 * int8 values (the 4-bit kernel's zero-point correction needs it). Values lie in [-127, 127], never -128, so the
 * AVX2 sign trick (|x| times sign-adjusted w) cannot overflow its 16-bit pair sums.
 */
static inline void lm_quantize_rows(const void *x, long ldx, int bf16, int M, int K, int G, int8_t *xq, float *dx,
                                    int32_t *xsum) {
    float v[LM_GROUP];
    for (int m = 0; m < M; m++) {
        for (int g = 0; g < G; g++) {
            const int k0 = g * LM_GROUP;
            const int n = K - k0 < LM_GROUP ? K - k0 : LM_GROUP;
            const long base = (long)m * ldx + k0;
            if (bf16) {
                const uint16_t *h = (const uint16_t *)x + base;
                for (int i = 0; i < n; i++) v[i] = lm_bf16_to_f32(h[i]);
            } else {
                memcpy(v, (const float *)x + base, sizeof(float) * (size_t)n);
            }
            for (int i = n; i < LM_GROUP; i++) v[i] = 0.0f;
            const long mg = (long)m * G + g;
            dx[mg] = lm_quantize_group(v, xq + mg * LM_GROUP, &xsum[mg]);
        }
    }
}

#if defined(__AMX_BF16__)
#define LM_ISA "amx"
#elif defined(__AVX512F__)
#define LM_ISA "avx512"
#else
#define LM_ISA "avx2"
#endif

#endif
