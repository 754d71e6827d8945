/* The linear layers of the bf16 one-call decode steps: cpu_llama_decode.c (AMX) and
 * cpu_llama_decode_avx512.c (AVX512-BF16). Each includes its linear kernel, defines
 * BF16_LINEAR as that kernel's entry point (both take the same arguments and weights
 * packed in the same layout, with widths that are multiples of 32), optionally
 * BF16_LINEAR_SILU as its gated product in one call (the AVX512-BF16 kernel's; the AMX
 * stack keeps the two calls, its fused form measured only at prefill sizes), optionally
 * BF16_LINEAR_THEN and BF16_LINEAR_SILU_THEN as the same two taking the product that
 * follows (a bf16_next: the AVX512-BF16 kernel's, which prefetches that product's first
 * weights; cpu_bf16_linear.c, run_items), and includes this file, which brings in the
 * shared layer stack (cpu_llama_decode_body.h). */
#define ELEM uint16_t
#define IS_BF16 1
#ifdef BF16_LINEAR_SILU
#define HAS_LINEAR_SILU 1
#endif
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

#if defined(BF16_LINEAR_THEN) || defined(BF16_LINEAR_SILU_THEN)
/* `then` in the kernel's own terms: NULL, or *buf filled from it. */
static const bf16_next *as_next(const NextProduct *then, bf16_next *buf) {
    if (then == NULL) return NULL;
    const bf16_next next = {then->w, then->n, then->k, then->silu};
    *buf = next;
    return buf;
}
#endif

static int linear(const Dims *d, const ELEM *x, int64_t ldx, const ELEM *w, ELEM *y, int64_t ldy, int64_t rows,
                  int64_t n, int64_t k, int nt, const NextProduct *then) {
    (void)d;
#ifdef BF16_LINEAR_THEN
    bf16_next buf;
    return BF16_LINEAR_THEN(x, ldx, w, y, ldy, rows, n, k, nt, as_next(then, &buf));
#else
    (void)then;
    return BF16_LINEAR(x, ldx, w, y, ldy, rows, n, k, nt);
#endif
}

/* As the layer path: the product, then the bias added in a second pass. */
static int linear_bias(const Dims *d, const ELEM *x, int64_t ldx, const ELEM *w, const ELEM *b, int64_t n_bias,
                       ELEM *y, int64_t ldy, int64_t rows, int64_t n, int64_t k, int nt, const NextProduct *then) {
    int rc = linear(d, x, ldx, w, y, ldy, rows, n, k, nt, then);
    if (rc == 0) add_bias_bf16(y, ldy, b, rows, n_bias);
    return rc;
}

#ifdef HAS_LINEAR_SILU
static int linear_silu(const Dims *d, const ELEM *x, int64_t ldx, const ELEM *w, ELEM *act, int64_t rows,
                       int64_t inter, int64_t k, int nt, const NextProduct *then) {
    (void)d;
#ifdef BF16_LINEAR_SILU_THEN
    bf16_next buf;
    return BF16_LINEAR_SILU_THEN(x, ldx, w, act, inter, rows, inter, k, nt, as_next(then, &buf));
#else
    (void)then;
    return BF16_LINEAR_SILU(x, ldx, w, act, inter, rows, inter, k, nt);
#endif
}
#endif
