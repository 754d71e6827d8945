/* A float vector for the CPU a kernel is built for, and the operations the decode
 * attention needs from it, so one kernel body serves both instruction sets aserve meets:
 *   AVX-512F     VL = 16 lanes, 32 registers (Intel Xeons, AVX-512 AMD EPYCs);
 *   AVX2 + FMA   VL = 8 lanes, 16 registers (AMD EPYC Zen 3).
 * ASERVE_SIMD is defined when one of them is available; without it the kernels keep
 * their portable loops. Every function is a thin inline wrapper over one or a few
 * intrinsics; the AVX-512 ones are those the kernels called directly before this layer.
 *
 * bfloat16 rows are widened without shuffles: a 32-bit lane holding elements (2i, 2i+1)
 * gives element 2i by a left shift and element 2i+1 by a mask. So vf_load_bf16 turns
 * 2 * VL elements into two vectors, the even ones and the odd ones; see
 * vf_slot_element for where each element lands. */
#ifndef ASERVE_CPU_SIMD_H
#define ASERVE_CPU_SIMD_H

#include <stdint.h>

#include "cpu_kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ASERVE_SIMD 1
#include <immintrin.h>
#endif

#if defined(__AVX512F__)

#define VL 16    /* float lanes */
#define VREGS 32 /* vector registers */
typedef __m512 vf;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_load(const float *p) { return _mm512_load_ps(p); } /* p aligned to 64 */
static inline void vf_store(float *p, vf v) { _mm512_store_ps(p, v); }
static inline void vf_storeu(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vf_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p * 2^n, n integral */

/* Lanes [0, cnt) of x, the others `fill` (0 < cnt <= VL). */
static inline vf vf_first(vf x, int64_t cnt, float fill) {
    return _mm512_mask_blend_ps((__mmask16)((1u << cnt) - 1u), _mm512_set1_ps(fill), x);
}

static inline void vf_load_bf16(const void *p, vf *even, vf *odd) {
    const __m512i u = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The sums of the lanes of VL vectors v[0 .. VL), lane t of the result the sum of
 * v[t]'s: a transpose-and-add tree, 15 shuffles and adds for all 16 sums instead of 16
 * horizontal sums, in three steps, so a caller that makes the vectors a few at a time
 * folds each four in as they come instead of holding all VL (cpu_decode_attention.c):
 *   vf_sum_pair(v[2i], v[2i+1]): per 128-bit chunk, pairs of lanes of the two;
 *   vf_sum_quad(pair 2i, pair 2i+1): per 128-bit chunk c, the chunk's sum of v[4i .. 4i+3];
 *   vf_sum_finish(quads[VL / 4]): chunk c of the result, quad c summed over its chunks;
 * that is, vf_sum_finish of quads i = vf_sum_quad(vf_sum_pair(v[4i], v[4i+1]),
 * vf_sum_pair(v[4i+2], v[4i+3])). */
static inline vf vf_sum_pair(vf x, vf y) { return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y)); }

static inline vf vf_sum_quad(vf a0, vf a1) {
    const __m512d x = _mm512_castps_pd(a0), y = _mm512_castps_pd(a1);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

static inline vf vf_sum_finish(const vf b[VL / 4]) {
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

#elif defined(ASERVE_SIMD)

#define VL 8
#define VREGS 16
typedef __m256 vf;

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_load(const float *p) { return _mm256_load_ps(p); } /* p aligned to 32 */
static inline void vf_store(float *p, vf v) { _mm256_store_ps(p, v); }
static inline void vf_storeu(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }

static inline float vf_reduce_add(vf v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

static inline float vf_reduce_max(vf v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vf_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* p * 2^n, n integral in [-126, 127] (as vf_exp_clamped's clamp keeps it): AVX2 has no
 * scalef, so 2^n is built in the exponent field. */
static inline vf vf_scale2(vf p, vf n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline vf vf_first(vf x, int64_t cnt, float fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt), lane));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, keep);
}

static inline void vf_load_bf16(const void *p, vf *even, vf *odd) {
    const __m256i u = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}

/* The lane sums' steps with vectors of 8 (see the AVX-512 form): hadd of pairs, twice: per
 * 128-bit half, lane i of quad 0 holds v[i]'s sum over that half (i < 4), and quad 1 the
 * same for v[4 + i]; vf_sum_finish adds the halves. */
static inline vf vf_sum_pair(vf x, vf y) { return _mm256_hadd_ps(x, y); }

static inline vf vf_sum_quad(vf a0, vf a1) { return _mm256_hadd_ps(a0, a1); }

static inline vf vf_sum_finish(const vf b[VL / 4]) {
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

#endif

#if defined(ASERVE_SIMD)
/* exp_clamped (cpu_kernels.h) lane by lane: the same clamp, reduction and polynomial. */
static inline vf vf_exp_clamped(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.0f)), vf_set1(88.0f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693145751953125f), x);
    r = vf_fnmadd(n, vf_set1(1.428606765330187e-06f), r);
    vf p = vf_set1(1.0f / 5040.0f);
    p = vf_fmadd(p, r, vf_set1(1.0f / 720.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 120.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 24.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 6.0f));
    p = vf_fmadd(p, r, vf_set1(0.5f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    return vf_scale2(p, n);
}

/* Where element e of a row lies once loaded: as `slot * VL + lane` of the row's vectors.
 * float32 rows keep their order; bf16 rows (vf_load_bf16) put elements 2VLc + 2l in
 * slot 2c and 2VLc + 2l + 1 in slot 2c + 1. */
static inline int64_t vf_slot_element(int64_t slot, int64_t lane, int is_bf16) {
    return is_bf16 ? 2 * VL * (slot / 2) + 2 * lane + (slot % 2) : VL * slot + lane;
}
#endif

#endif
