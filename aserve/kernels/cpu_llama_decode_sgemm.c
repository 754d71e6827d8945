/* A decode step of a Llama-family model's decoder layers in one call: the float32
 * variant, for CPUs without AMX (cpu_llama_decode.c has the bf16 one and says why).
 *
 * The linear layers are the layer-by-layer path's own: MKL's sgemm (torch's, passed in
 * as Dims.sgemm, so this library links no BLAS of its own) over the transposed weights
 * ([in, out], row-major) that prepack_linears keeps for small float32 weights. A bias is
 * copied into the output first and the product added to it (beta = 1), as torch.addmm
 * does. The other kernels are the same C kernels with their float32 flag; the cache may
 * be float32 or bf16 (Dims.kv_bf16). So the result is what the layer-by-layer path
 * computes, kernel by kernel (tests/test_llama_decode.py checks the tokens and logits).
 */
#include "cpu_fused_ops.c"
#include "cpu_decode_attention.c"

#define ELEM float
#define IS_BF16 0
#include "cpu_llama_decode_body.h"

/* BLAS's Fortran sgemm (column-major, arguments by address; MKL's LP64 integers), the
 * entry torch.mm calls. Row-major y = x w is column-major y^T = w^T x^T: the same call
 * torch makes for x @ w, so the same arithmetic. */
typedef void (*sgemm_fn)(const char *trans_a, const char *trans_b, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

static int gemm(const Dims *d, const float *x, int64_t ldx, const float *w, float beta, float *y, int64_t ldy,
                int64_t rows, int64_t n, int64_t k) {
    if (!d->sgemm) return -1;
    const int m_ = (int)n, n_ = (int)rows, k_ = (int)k, lda = (int)n, ldb = (int)ldx, ldc = (int)ldy;
    const float one = 1.0f;
    ((sgemm_fn)d->sgemm)("N", "N", &m_, &n_, &k_, &one, w, &lda, x, &ldb, &beta, y, &ldc);
    return 0;
}

/* w: [k, n], the transposed weight. MKL threads as torch set it (torch.set_num_threads
 * sets MKL's count too), so nt is unused here, as in torch.mm. */
static int linear(const Dims *d, const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t rows,
                  int64_t n, int64_t k, int nt) {
    (void)nt;
    return gemm(d, x, ldx, w, 0.0f, y, ldy, rows, n, k);
}

static int linear_bias(const Dims *d, const float *x, int64_t ldx, const float *w, const float *b, int64_t n_bias,
                       float *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int nt) {
    (void)nt;
    if (n_bias != n) return -1; /* unpadded: the bias covers every output */
    for (int64_t r = 0; r < rows; r++) memcpy(y + r * ldy, b, (size_t)n * sizeof(float));
    return gemm(d, x, ldx, w, 1.0f, y, ldy, rows, n, k);
}
