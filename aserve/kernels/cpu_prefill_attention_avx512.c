/* Causal attention of prefill chunks on CPU with AVX512-BF16 (vdpbf16ps), bf16: the AMX
 * kernel (cpu_prefill_attention.c, which says what is computed) for CPUs without AMX,
 * an AMD EPYC Zen 4 say. The key and value layouts, the task loop and the online
 * softmax's row step (chunk_row) are the AMX kernel's (cpu_prefill_common.h), and so is
 * the row block's walk: 32 query rows, their keys in chunks of 256, per chunk the scores,
 * each row's softmax step, and the weighted values added to the rows' outputs.
 *
 * Why: there torch's CPU flash kernel took 1.1 of a 152M model's 2.6 s prefill of 2,048
 * tokens (~47 GFLOP/s; the linear layers ran at ~430). Both products here are the bf16
 * linear kernel's register block (cpu_bf16_block.h): up to 6 query rows by 4 tiles of
 * 16 outputs, 24 float accumulators; the AMX layouts' 64-byte rows are exactly its
 * vdpbf16ps operands.
 *   S = Q K^T: the outputs are keys (tiles of 16 keys), summed over D;
 *   O = P V:   the outputs are D (tiles of 16 columns), summed over the keys.
 * Why chunks: the form before took 16 rows' scores over every key they see at once
 * (16 x 2,048 floats at 2,048 tokens, out of L1), then read them back for the softmax
 * and as weights (docs/performance.md, the AVX-512 section, for the measurements).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SCORE_BUFFERS 1
#include "cpu_prefill_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PREFILL_AVX512_AVAILABLE 1

/* Rows q0 .. q0 + rows - 1 (rows <= BLOCK_ROWS) of one query head, at positions ctx + q0
 * .. (each sees the keys up to its own), over their keys in chunks of KEY_CHUNK: per
 * chunk, S = Q K^T (pa_product), each row's step of the online softmax (chunk_row), and O
 * += P V (pa_product adding to O), then O divided by each row's sum. */
static void row_block(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride, int64_t q0, int rows,
                      int64_t ctx, int64_t D, float scale, const uint32_t *kt, const uint32_t *vv, void *work,
                      int64_t width) {
    (void)width;
    block_scratch *w = (block_scratch *)work;
    const int64_t DC = D / 32, DT = D / 16;
    const int64_t first = ctx + q0, seen = first + rows; /* the last row sees keys 0 .. seen - 1 */
    const float sc = scale * LOG2E;
    for (int i = 0; i < rows; i++) {
        w->m[i] = -INFINITY;
        _mm512_store_ps(w->sum + 16 * i, _mm512_setzero_ps());
    }
    const uint16_t *qb = q + q0 * q_stride;
    for (int64_t k0 = 0; k0 < seen; k0 += KEY_CHUNK) {
        const int64_t kn = seen - k0 < KEY_CHUNK ? seen - k0 : KEY_CHUNK; /* keys of the chunk the last row sees */
        const int64_t kblocks = (kn + 15) / 16, pblocks = (kn + 31) / 32;
        /* S: tiles of 16 keys (DC * 256 words apart) from the chunk's first, D / 2 pairs. */
        pa_product(qb, q_stride, rows, kt + (k0 / 16) * DC * 256, kblocks, DC * 256, 256, D / 2, w->s[0],
                   SCORE_STRIDE, 1);
        for (int i = 0; i < rows; i++) {
            const int64_t n = first + i + 1 - k0;
            chunk_row(w->s[0] + i * SCORE_STRIDE, w->p + i * WEIGHT_STRIDE, n < kn ? n : kn, 32 * pblocks, sc, &w->m[i],
                      w->sum + 16 * i, w->o + i * D, D);
        }
        /* O (+)= P V: tiles of 16 columns of D (256 words apart), the chunk's 16 pblocks key
           pairs (chunks of 32 keys DT * 256 apart); the first chunk writes O. */
        pa_product(w->p, WEIGHT_STRIDE, rows, vv + (k0 / 32) * DT * 256, DT, 256, DT * 256, 16 * pblocks, w->o, D,
                   k0 == 0);
    }
    finish_rows(w->o, w->sum, rows, D, out, out_stride, q0);
}

static const prefill_form FORM = {row_block, BLOCK_ROWS, work_bytes, NULL};
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
                             int64_t stride_head, int64_t Hq, int64_t Hk, int64_t D, float scale, int num_threads) {
#if PREFILL_AVX512_AVAILABLE
    return prefill_run(&FORM, q, q_stride, k, k_stride, v, v_stride, out, out_stride, starts, lens, ctx,
                       n_prompts, k_cache, v_cache, block_tables, max_blocks, block_size, stride_block, stride_token,
                       stride_head, Hq, Hk, D, scale, num_threads);
#else
    return -1;
#endif
}
