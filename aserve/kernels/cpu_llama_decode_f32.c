/* A decode step of a Llama-family model's decoder layers in one call: the float32
 * variant, for CPUs without AMX (cpu_llama_decode.c has the bf16 one and says why).
 *
 * The linear layers are the layer-by-layer path's own kernel, cpu_f32_linear.c, over
 * the packed weights prepack_linears made; a bias is added as that kernel adds it. The
 * other kernels are the same C kernels with their float32 flag, and the cache may be
 * float32 or bf16 (Dims.kv_bf16). So the result is what the layer-by-layer path
 * computes, kernel by kernel (tests/test_llama_decode.py checks tokens and logprobs).
 */
#include "cpu_f32_linear.c"
#include "cpu_fused_ops.c"
#include "cpu_decode_attention.c"

#define ELEM float
#define IS_BF16 0
#include "cpu_llama_decode_body.h"

/* w: the packed weight (aserve_f32_pack). `then` is not used: this kernel takes no hint
 * of the product after it. */
static int linear(const Dims *d, const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t rows,
                  int64_t n, int64_t k, int nt, const NextProduct *then) {
    (void)d;
    (void)then;
    return aserve_f32_linear(x, ldx, w, NULL, y, ldy, rows, n, k, nt);
}

static int linear_bias(const Dims *d, const float *x, int64_t ldx, const float *w, const float *b, int64_t n_bias,
                       float *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int nt, const NextProduct *then) {
    (void)d;
    (void)then;
    if (n_bias != n) return -1; /* unpadded: the bias covers every output */
    return aserve_f32_linear(x, ldx, w, b, y, ldy, rows, n, k, nt);
}
