/* Small fused element-wise kernels for CPU: RMSNorm (with the residual add before it)
 * and SiLU(gate) * up.
 *
 * At decode batch sizes each of these is a handful of tiny torch ops whose dispatch
 * costs more than their arithmetic (bf16 RMSNorm: ~8 ops, ~30 us a call on a 7M model's
 * [32, 256] rows); here each is one call. The roundings are Hugging Face's, in the
 * model dtype:
 *   residual = x + residual                              (rounded to the dtype)
 *   out      = weight * dtype(residual * rsqrt(mean(residual^2) + eps))   (mean in float32)
 *   out      = dtype(dtype(silu(gate)) * up),  silu(g) = g / (1 + exp(-g))
 * The sum of squares is accumulated in a different order than torch's, so a float32
 * result may differ from it in the last bit.
 *
 * Built at run time like the decode-attention kernel (aserve/kernels/cbuild.py) and
 * called through ctypes. Rows are split between `num_threads` OpenMP threads (torch's
 * own) when there are enough of them to pay for the fork.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#define PARALLEL_MIN_ELEMENTS (1 << 16)

static inline float load_elt(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_elt(void *p, int64_t i, float v, int is_bf16) {
    if (is_bf16) ((uint16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* Rounds a float to the nearest bfloat16 and back (the value a bf16 tensor would hold). */
static inline float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

static void rms_norm_row(const void *x, const void *res, void *res_out, const void *w, void *out, int64_t h,
                         float eps, int is_bf16, float *tmp) {
    float ss = 0.f;
    for (int64_t i = 0; i < h; i++) {
        float r = load_elt(x, i, is_bf16);
        if (res != NULL) {
            r += load_elt(res, i, is_bf16);
            if (is_bf16) r = round_bf16(r);
        }
        tmp[i] = r;
        ss += r * r;
    }
    if (res != NULL) {
        if (is_bf16) for (int64_t i = 0; i < h; i++) ((uint16_t *)res_out)[i] = float_to_bf16(tmp[i]);
        else memcpy(res_out, tmp, h * sizeof(float));
    }
    const float inv = 1.f / sqrtf(ss / (float)h + eps);
    if (is_bf16) {
        for (int64_t i = 0; i < h; i++)
            ((uint16_t *)out)[i] = float_to_bf16(bf16_to_float(((const uint16_t *)w)[i]) * round_bf16(tmp[i] * inv));
    } else {
        for (int64_t i = 0; i < h; i++) ((float *)out)[i] = ((const float *)w)[i] * (tmp[i] * inv);
    }
}

#define MAX_HIDDEN 65536

/* out[r] = RMSNorm(x[r] (+ residual[r])); with a residual, residual_out[r] = x[r] + residual[r].
 * x and residual rows are `x_stride` / `res_stride` elements apart; out and residual_out are
 * contiguous. Returns -1 when hidden exceeds MAX_HIDDEN. */
int aserve_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t res_stride, void *residual_out,
                    const void *weight, void *out, int64_t rows, int64_t hidden, float eps, int is_bf16,
                    int num_threads) {
    if (hidden > MAX_HIDDEN) return -1;
    const int64_t elt = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && rows > 1 && rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float tmp[MAX_HIDDEN];
        rms_norm_row((const char *)x + r * x_stride * elt, residual ? (const char *)residual + r * res_stride * elt : NULL,
                     residual ? (char *)residual_out + r * hidden * elt : NULL, weight, (char *)out + r * hidden * elt,
                     hidden, eps, is_bf16, tmp);
    }
    return 0;
}

#if defined(__AVX512F__)
static inline __m512 load16(const void *p, int is_bf16) {
    if (is_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* Round to nearest even bf16, as float_to_bf16 does for every value but NaN. */
static inline __m256i to_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

static inline __m512 round_bf16x16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}
#endif

static void silu_mul_row(const void *g, const void *u, void *out, int64_t n, int is_bf16) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const int64_t elt = is_bf16 ? 2 : 4;
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = load16((const char *)g + i * elt, is_bf16), uv = load16((const char *)u + i * elt, is_bf16);
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_clamped(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        if (is_bf16) {
            s = _mm512_mul_ps(round_bf16x16(s), uv);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), to_bf16x16(s));
        } else {
            _mm512_storeu_ps((float *)out + i, _mm512_mul_ps(s, uv));
        }
    }
#endif
    for (; i < n; i++) {
        const float gv = load_elt(g, i, is_bf16);
        float s = gv / (1.0f + exp_clamped(-gv));
        if (is_bf16) s = round_bf16(s);
        store_elt(out, i, s * load_elt(u, i, is_bf16), is_bf16);
    }
}

/* out[r] = silu(gate_up[r][:inter]) * gate_up[r][inter:], rows `in_stride` elements apart;
 * out is contiguous [rows, inter]. */
int aserve_silu_mul(const void *gate_up, int64_t in_stride, void *out, int64_t rows, int64_t inter, int is_bf16,
                    int num_threads) {
    const int64_t elt = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && rows > 1 && rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)gate_up + r * in_stride * elt;
        silu_mul_row(row, row + inter * elt, (char *)out + r * inter * elt, inter, is_bf16);
    }
    return 0;
}
