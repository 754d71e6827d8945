/* Small fused element-wise kernels for CPU: RMSNorm (with the residual add before it),
 * SiLU(gate) * up, rotary, and the KV pool's writes.
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
/* Included once per library: cpu_amx_linear.c includes it for its fused MLP entry, and
 * the one-call decode steps include both. */
#ifndef ASERVE_CPU_FUSED_OPS_C
#define ASERVE_CPU_FUSED_OPS_C
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_simd.h"

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

#if defined(__AVX512F__)
static inline __m512 load16(const void *p, int is_bf16) {
    if (is_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* 1 / x to within about a float rounding: the 14-bit estimate and one Newton step. A
 * 512-bit division issues once every ~16 cycles; this is three instructions that pipeline. */
static inline __m512 recip16(__m512 x) {
    const __m512 r = _mm512_rcp14_ps(x);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.0f)));
}

static inline __m512 round_bf16x16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}
#endif

static void rms_norm_row(const void *x, const void *res, void *res_out, const void *w, void *out, int64_t h,
                         float eps, int is_bf16, float *tmp) {
#if defined(__AVX512F__)
    if (h % 16 == 0) {
        const int64_t elt = is_bf16 ? 2 : 4;
        __m512 ssv = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 16) {
            __m512 r = load16((const char *)x + i * elt, is_bf16);
            if (res != NULL) {
                r = _mm512_add_ps(r, load16((const char *)res + i * elt, is_bf16));
                if (is_bf16) {
                    const __m256i rb = to_bf16x16(r);
                    _mm256_storeu_si256((__m256i *)((uint16_t *)res_out + i), rb);
                    r = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rb), 16));
                } else {
                    _mm512_storeu_ps((float *)res_out + i, r);
                }
            }
            _mm512_storeu_ps(tmp + i, r);
            ssv = _mm512_fmadd_ps(r, r, ssv);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ssv) / (float)h + eps));
        for (int64_t i = 0; i < h; i += 16) {
            __m512 v = _mm512_mul_ps(_mm512_loadu_ps(tmp + i), inv);
            if (is_bf16) {
                v = _mm512_mul_ps(load16((const uint16_t *)w + i, 1), round_bf16x16(v));
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), to_bf16x16(v));
            } else {
                _mm512_storeu_ps((float *)out + i, _mm512_mul_ps(_mm512_loadu_ps((const float *)w + i), v));
            }
        }
        return;
    }
#endif
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


/* Never inlined, cloned or specialised (noipa): aserve_amx_linear_silu (cpu_amx_linear.c)
 * calls it too, and promises aserve_silu_mul's bits. Inlined, or cloned with is_bf16
 * fixed, each copy may have its products and sums fused differently (GCC contracts the
 * intrinsics' arithmetic too): with noinline alone a few outputs of the 152M shape came
 * out a bf16 step apart. */
__attribute__((noipa)) static void silu_mul_row(const void *g, const void *u, void *out, int64_t n, int is_bf16) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const int64_t elt = is_bf16 ? 2 : 4;
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = load16((const char *)g + i * elt, is_bf16), uv = load16((const char *)u + i * elt, is_bf16);
        __m512 s = _mm512_mul_ps(gv, recip16(_mm512_add_ps(_mm512_set1_ps(1.0f), vf_exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
        if (is_bf16) {
            s = _mm512_mul_ps(round_bf16x16(s), uv);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), to_bf16x16(s));
        } else {
            _mm512_storeu_ps((float *)out + i, _mm512_mul_ps(s, uv));
        }
    }
#elif defined(ASERVE_SIMD)
    /* AVX2, float32 rows (bf16 ones take the loop below): the loop's arithmetic, VL
       lanes at a time, with an exact division; within two ulps of the loop, whose exp
       may round its steps differently (7M model served on the AVX2 machine: the scalar
       loop was 4.7% of the worker's samples). */
    if (!is_bf16)
        for (; i + VL <= n; i += VL) {
            const vf gv = vf_loadu((const float *)g + i), uv = vf_loadu((const float *)u + i);
            const vf s = vf_div(gv, vf_add(vf_set1(1.0f), vf_exp_clamped(vf_sub(vf_zero(), gv))));
            vf_storeu((float *)out + i, vf_mul(s, uv));
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

/* Rotary embedding ("rotate half" layout), in place: each row of x ([T, H, D], rows
 * `t_stride` and heads `h_stride` elements apart, D contiguous) becomes
 *   (x1 cos - x2 sin, x2 cos + x1 sin)    with x = (x1, x2), cos/sin [T, D/2] in x's dtype,
 * rounded as Hugging Face's x * cos + rotate_half(x) * sin is in bfloat16: each product
 * rounded, then their sum (in float32 the compiler may fuse a product into the sum, one
 * rounding fewer). */
int aserve_rotary(void *x, int64_t t_stride, int64_t h_stride, int64_t T, int64_t H, int64_t D, const void *cos,
                  const void *sin, int is_bf16, int num_threads) {
    const int64_t half = D / 2, elt = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && T > 1 && T * H * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++) {
            char *row = (char *)x + (t * t_stride + h * h_stride) * elt;
            int64_t i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= half; i += 16) {
                const __m512 c = load16((const char *)cos + (t * half + i) * elt, is_bf16);
                const __m512 s = load16((const char *)sin + (t * half + i) * elt, is_bf16);
                const __m512 x1 = load16(row + i * elt, is_bf16), x2 = load16(row + (i + half) * elt, is_bf16);
                __m512 a = _mm512_mul_ps(x1, c), b = _mm512_mul_ps(x2, s);
                __m512 e = _mm512_mul_ps(x2, c), f = _mm512_mul_ps(x1, s);
                if (is_bf16) {
                    a = round_bf16x16(a); b = round_bf16x16(b); e = round_bf16x16(e); f = round_bf16x16(f);
                    _mm256_storeu_si256((__m256i *)(row + i * elt), to_bf16x16(_mm512_sub_ps(a, b)));
                    _mm256_storeu_si256((__m256i *)(row + (i + half) * elt), to_bf16x16(_mm512_add_ps(e, f)));
                } else {
                    _mm512_storeu_ps((float *)row + i, _mm512_sub_ps(a, b));
                    _mm512_storeu_ps((float *)row + i + half, _mm512_add_ps(e, f));
                }
            }
#endif
            for (; i < half; i++) {
                const float c = load_elt(cos, t * half + i, is_bf16), s = load_elt(sin, t * half + i, is_bf16);
                const float x1 = load_elt(row, i, is_bf16), x2 = load_elt(row, i + half, is_bf16);
                float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
                if (is_bf16) {
                    a = round_bf16(a); b = round_bf16(b); e = round_bf16(e); f = round_bf16(f);
                }
                store_elt(row, i, a - b, is_bf16);
                store_elt(row, i + half, e + f, is_bf16);
            }
        }
    }
    return 0;
}

/* This step's keys and values of T tokens into the paged KV pool: row (t, h) of k and v
 * ([T, H, D], t_stride / h_stride elements apart, the cache's dtype, elt bytes an
 * element) into slot slots[t] (block slots[t] / block_size, offset slots[t] % block_size),
 * which lies at block * s_block + offset * s_token + h * s_head elements in k_cache and
 * v_cache (same strides). Any layout of the pool's blocks: token by token, or head by head
 * (ModelRunner's CPU pool), where a token's heads are rows of D apart by a block's width
 * and torch's index_put_ took 4x as long (4,096 tokens, 152M shape). Returns 0, or -1
 * (nothing written) when a slot lies outside [0, num_slots). */
int aserve_write_kv(void *k_cache, void *v_cache, const void *k, const void *v, int64_t k_t_stride, int64_t k_h_stride,
                    int64_t v_t_stride, int64_t v_h_stride, const int64_t *slots, int64_t num_slots, int64_t T,
                    int64_t H, int64_t D, int64_t elt, int64_t block_size, int64_t s_block, int64_t s_token,
                    int64_t s_head, int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_threads > 1 && T * H * D >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const int64_t at = slots[t] / block_size * s_block + slots[t] % block_size * s_token;
        for (int64_t h = 0; h < H; h++) {
            memcpy((char *)k_cache + (at + h * s_head) * elt, (const char *)k + (t * k_t_stride + h * k_h_stride) * elt,
                   (size_t)(D * elt));
            memcpy((char *)v_cache + (at + h * s_head) * elt, (const char *)v + (t * v_t_stride + h * v_h_stride) * elt,
                   (size_t)(D * elt));
        }
    }
    return 0;
}

#endif /* ASERVE_CPU_FUSED_OPS_C */
