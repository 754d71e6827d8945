/* Causal attention of prefill chunks on CPU with AVX512-BF16 (vdpbf16ps), bf16: the AMX
 * kernel (cpu_prefill_attention.c, which says what is computed) for CPUs without AMX,
 * an AMD EPYC Zen 4 say. The key and value layouts and the task loop are the AMX
 * kernel's (cpu_prefill_common.h); its row blocks are the AMX kernel's earlier form: 16
 * query rows, their scores over every key they see at once, then the softmax
 * (softmax_rows), then the second product. (The AMX kernel now walks 32 rows' keys in
 * chunks of 256 with an online softmax; this form has not been measured that way on a
 * CPU of its kind.)
 *
 * Why: there torch's CPU flash kernel took 1.1 of a 152M model's 2.6 s prefill of 2,048
 * tokens (~47 GFLOP/s; the linear layers ran at ~430). Both products here are the bf16
 * linear kernel's register block (cpu_bf16_block.h): up to 6 query rows by 4 tiles of
 * 16 outputs, 24 float accumulators; the AMX layouts' 64-byte rows are exactly its
 * vdpbf16ps operands.
 *   S = Q K^T: the outputs are keys (tiles of 16 keys), summed over D;
 *   O = P V:   the outputs are D (tiles of 16 columns), summed over the keys.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_prefill_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PREFILL_AVX512_AVAILABLE 1

/* Rows q0 .. q0 + rows - 1 (rows <= 16) of one query head: the scores over every key the
 * rows see, the whole-row softmax (softmax_rows), then the weighted values, on the
 * products above (the AMX kernel's row block before it walked keys in chunks). */
static void row_block(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride, int64_t q0, int rows,
                      int64_t ctx, int64_t D, float scale, const uint32_t *kt, const uint32_t *vv, void *work,
                      int64_t width) {
    float *s = (float *)work;                               /* 16 x width scores */
    uint16_t *p = (uint16_t *)((char *)work + 16 * width * 4); /* 16 x width weights */
    const int64_t DC = D / 32, DT = D / 16;
    const int64_t seen = ctx + q0 + rows; /* keys 0 .. seen - 1 (causal) */
    const int64_t kblocks = (seen + 15) / 16, pblocks = (seen + 31) / 32;
    /* S = Q K^T: tiles of 16 keys (DC * 256 words apart), D / 2 pairs (chunks 256 apart). */
    pa_product(q + q0 * q_stride, q_stride, rows, kt, kblocks, DC * 256, 256, D / 2, s, width);
    float inv_sum[16];
    softmax_rows(s, p, rows, width, ctx, q0, pblocks, scale, inv_sum);
    /* O = P V: tiles of 16 columns of D (256 words apart), 16 pblocks key pairs (chunks
       of 32 keys DT * 256 apart). */
    float o[16 * MAX_D] __attribute__((aligned(64)));
    pa_product(p, width, rows, vv, DT, 256, DT * 256, 16 * pblocks, o, D);
    for (int i = 0; i < rows; i++) {
        const __m512 inv = _mm512_set1_ps(inv_sum[i]);
        for (int64_t t = 0; t < DT; t++)
            _mm256_storeu_si256((__m256i *)(out + (q0 + i) * out_stride + 16 * t),
                                to_bf16x16(_mm512_mul_ps(_mm512_load_ps(o + i * D + 16 * t), inv)));
    }
}

/* A row block's scores (float) and weights (bf16), 16 rows of `width`. */
static size_t work_bytes(int64_t width) { return (size_t)(16 * width * 6); }

static const prefill_form FORM = {row_block, 16, work_bytes, NULL};
#else
#define PREFILL_AVX512_AVAILABLE 0
#endif

int aserve_prefill_attention_available(void) { return PREFILL_AVX512_AVAILABLE; }

/* The AMX kernel's entry point and contract; -1 also where this build lacks AVX512-BF16. */
int aserve_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, uint16_t *out, int64_t out_stride,
                             const int64_t *starts, const int64_t *lens, const int64_t *ctx, int64_t n_prompts,
                             const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *block_tables,
                             int64_t max_blocks, int64_t block_size, int64_t stride_block, int64_t stride_token,
                             int64_t Hq, int64_t Hk, int64_t D, float scale, int num_threads) {
#if PREFILL_AVX512_AVAILABLE
    return prefill_run(&FORM, q, q_stride, k, k_stride, v, v_stride, out, out_stride, starts, lens, ctx,
                       n_prompts, k_cache, v_cache, block_tables, max_blocks, block_size, stride_block, stride_token,
                       Hq, Hk, D, scale, num_threads);
#else
    return -1;
#endif
}
