/* Causal attention of prefill chunks on CPU with AMX tiles, bf16
 * (aserve/kernels/cpu_prefill_attention.py).
 *
 * Why: a prefill's attention went through torch's CPU flash kernel one prompt at a time,
 * at ~110 GFLOP/s (a 7M model's 16 x 128-token prefill: ~5.5 of ~30 ms). Here the two
 * products run on AMX tiles and only the softmax on AVX-512.
 *
 * For each chunk and KV head (one task each, split between OpenMP threads):
 *   - its keys (the request's cached context, then the chunk's own) are laid out once as
 *     K^T in AMX's B layout (per block of 16 keys and 32 of D: 16 rows of dimension
 *     pairs by 16 keys), its values as B tiles of 32 keys (16 rows of key pairs) by 16
 *     of D; keys past the end are zeros;
 *   - for each query head of the group and each block of up to 16 query rows:
 *       S = Q K^T over the keys the rows can see (causal), in float32;
 *       P = softmax(S * scale) per row, in float32, rounded to bf16 (as torch's flash
 *           kernel feeds its second product), keys past a row's position 0;
 *       O = P V, in float32, divided by the row's sum (of the unrounded weights), bf16.
 * Scratch per task: the two layouts (2 x keys x D bf16, keys = context + chunk rounded
 * up to 32) and one row block's scores and weights.
 *
 * q, k, v, out: token t's head h at base + t * stride + h * D (D contiguous); chunk i
 * is tokens starts[i] .. starts[i] + lens[i] - 1, at positions ctx[i] .. (ctx NULL: 0).
 * A chunk without context reads its keys and values from k and v; one with context
 * reads all of them (context and its own, which the caller has written) from the paged
 * cache halves k_cache / v_cache ([blocks, block_size, Hk, D], strides in elements)
 * through its row of block_tables ([n, max_blocks]). D a multiple of 32, at most 256.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_prefill_common.h"

/* 1 when this process may use AMX tiles (asks the kernel once; idempotent). */
int aserve_amx_init(void) { return amx_request_tiles(); }

/* Rows q0 .. q0 + rows - 1 of one query head (q: the chunk's first token, this head),
 * at positions ctx + q0 .. (each sees the keys up to its own position). */
static void row_block(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride, int64_t q0, int rows,
                      int64_t ctx, int64_t D, float scale, const uint32_t *kt, const uint32_t *vv, float *s,
                      uint16_t *p, int64_t width) {
    const int64_t DT = D / 16;
    const int64_t seen = ctx + q0 + rows;           /* keys 0 .. seen - 1 (causal) */
    const int64_t kblocks = (seen + 15) / 16, pblocks = (seen + 31) / 32;
    amx_configure_rows(rows);
    amx_scores(q + q0 * q_stride, q_stride, kt, D, kblocks, s, width); /* S = Q K^T; s is rows x width floats */
    float inv_sum[16];
    softmax_rows(s, p, rows, width, ctx, q0, pblocks, scale, inv_sum);
    /* O = P V, then scaled and rounded into out. */
    float o[16 * MAX_D] __attribute__((aligned(64)));
    amx_values(p, width, vv, D, pblocks, o, D);
    for (int i = 0; i < rows; i++)
        for (int64_t t = 0; t < DT; t++) {
            const __m512 r = _mm512_mul_ps(_mm512_load_ps(o + i * D + 16 * t), _mm512_set1_ps(inv_sum[i]));
            _mm256_storeu_si256((__m256i *)(out + (q0 + i) * out_stride + 16 * t), to_bf16x16(r));
        }
}

static void release_tiles(void) { _tile_release(); }

/* Returns 0, or -1 for a shape it does not take (D not a multiple of 32 or over MAX_D, Hq
 * not a multiple of Hk) or when scratch memory cannot be had. */
int aserve_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, uint16_t *out, int64_t out_stride,
                             const int64_t *starts, const int64_t *lens, const int64_t *ctx, int64_t n_prompts,
                             const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *block_tables,
                             int64_t max_blocks, int64_t block_size, int64_t stride_block, int64_t stride_token,
                             int64_t Hq, int64_t Hk, int64_t D, float scale, int num_threads) {
    return prefill_run(row_block, release_tiles, q, q_stride, k, k_stride, v, v_stride, out, out_stride, starts, lens,
                       ctx, n_prompts, k_cache, v_cache, block_tables, max_blocks, block_size, stride_block,
                       stride_token, Hq, Hk, D, scale, num_threads);
}
