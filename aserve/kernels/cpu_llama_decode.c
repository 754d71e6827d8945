/* A decode step of a Llama-family model's decoder layers in one call (CPU, bf16, AMX).
 *
 * Why: on a small model a decode step's kernels are short (7M model, 32 rows: ~40
 * kernel calls of 10-60 us each), and calling each from Python (module dispatch, views,
 * output allocation, ctypes argument conversion) cost about a third of the step. Here
 * the whole stack of layers runs from C, calling the same kernels in the same order with
 * the same thread count, so the result is bit-identical to the layer-by-layer path:
 *
 *   per layer:  h, residual = RMSNorm(x + residual)          (first layer: residual = x)
 *               qkv = h . Wqkv^T (+ bias, Qwen2);  RMSNorm of each q and k head (Qwen3);
 *               rotary(q, k)
 *               attn = decode attention over the paged cache (writes k, v into it)
 *               h, residual = RMSNorm(attn . Wo^T + residual)
 *               x = silu(h . Wgate^T) * (h . Wup^T) . Wdown^T
 *
 * and the caller applies the final norm to (x, residual). With tensor parallelism each
 * layer is two calls (aserve_llama_decode_half), the caller all-reducing o_proj's and
 * down_proj's outputs between them. Only for what the layer-by-layer path would run on
 * the same kernels: bf16 weights packed for AMX, no biases but on q/k/v, decode rows
 * only (aserve/kernels/llama_decode.py and LlamaModel.attach_decode_stack check).
 *
 * The kernels are compiled into this library from their own files (built by
 * aserve/kernels/cbuild.py, whose cache key covers them).
 */
#include "cpu_amx_linear.c"
#include "cpu_fused_ops.c"
#include "cpu_decode_attention.c"

#define ELEM uint16_t
#define IS_BF16 1
#include "cpu_llama_decode_body.h"

/* y[r][i] += b[i] for r < rows, i < n, rounded to bf16 as torch's bf16 add_ is (in float,
 * to nearest even). */
static void add_bias_bf16(uint16_t *y, int64_t y_stride, const uint16_t *b, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *row = y + r * y_stride;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(row + i),
                                to_bf16x16(_mm512_add_ps(load16(row + i, 1), load16(b + i, 1))));
#endif
        for (; i < n; i++) row[i] = float_to_bf16(bf16_to_float(row[i]) + bf16_to_float(b[i]));
    }
}

/* Weights packed by AmxLinear.pack; widths are multiples of 32. */
static int linear(const Dims *d, const ELEM *x, int64_t ldx, const ELEM *w, ELEM *y, int64_t ldy, int64_t rows,
                  int64_t n, int64_t k, int nt) {
    (void)d;
    return aserve_amx_linear(x, ldx, w, y, ldy, rows, n, k, nt);
}

/* As the layer path: the AMX product, then the bias added in a second pass. */
static int linear_bias(const Dims *d, const ELEM *x, int64_t ldx, const ELEM *w, const ELEM *b, int64_t n_bias,
                       ELEM *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int nt) {
    int rc = linear(d, x, ldx, w, y, ldy, rows, n, k, nt);
    if (rc == 0) add_bias_bf16(y, ldy, b, rows, n_bias);
    return rc;
}

