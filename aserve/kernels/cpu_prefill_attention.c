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
 *   - for each query head of the group and each block of up to 32 query rows (two row
 *     tiles), over the keys the block can see in chunks of KEY_CHUNK:
 *       S = Q K^T for the chunk, in float32 (for every chunk after the first, computed
 *           between the rows' softmax steps of the chunk before: see row_block32);
 *       per row, its reference maximum m (the scaled scores'): the first chunk's
 *           maximum; later, raised (the row's output and sum so far scaled by
 *           2^(m_old - m_new)) only when a chunk rises more than HEADROOM above it;
 *       P = 2^(S * scale * log2(e) - m) rounded to bf16 (as torch's flash kernel feeds
 *           its second product), keys past a row's position 0; the unrounded weights
 *           added to the row's sum;
 *       O += P V, O in float32 (loaded into the accumulator tiles and stored back);
 *     then O divided by each row's sum, to bf16.
 * Scratch per task: the two layouts (2 x keys x D bf16, keys = context + chunk rounded
 * up to 32) and one row block's working set (block_scratch, ~90 KB).
 *
 * Why chunks of keys: the form before computed a block of 16 rows' scores over every key
 * it could see, stored them (16 x keys floats: 130 KB at 2,048 keys, out of L1), and
 * read them back twice for the softmax and once more as weights. The 152M model's shape
 * (16 heads of 64, one prompt, two threads, the AMX host, medians of 16 calls): 2,048
 * tokens 9.4-10.0 -> 8.8-9.0 ms, 4,096 36.9 -> 32.4-32.9, 8,192 161-170 -> 120-127
 * (2026-12-04; docs/performance.md). Chunks of 128 and 512 keys were slower than 256
 * at 8,192 tokens (136-139 and 134 ms); four score accumulators (two key blocks at a
 * time) no faster than two.
 * On this host a tile store costs about as much as a tile product (~13 cycles of the
 * 2.6 GHz TSC each, measured alone), so Q K^T at D = 64 (two products a tile of scores,
 * one store) is bound by stores as much as by the products.
 *
 * q, k, v, out: token t's head h at base + t * stride + h * D (D contiguous); chunk i
 * is tokens starts[i] .. starts[i] + lens[i] - 1, at positions ctx[i] .. (ctx NULL: 0).
 * A chunk without context reads its keys and values from k and v; one with context
 * reads all of them (context and its own, which the caller has written) from the paged
 * cache halves k_cache / v_cache ([blocks, block_size, Hk, D], strides in elements)
 * through its row of block_tables ([n, max_blocks]). D a multiple of 32, at most 256.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SCORE_BUFFERS 2 /* a chunk's scores and the next's */
#include "cpu_prefill_common.h"

/* BLOCK_ROWS (two row tiles here), KEY_CHUNK, the strides and the row block's scratch
 * (block_scratch, work_bytes): cpu_prefill_common.h. */

/* 1 when this process may use AMX tiles (asks the kernel once; idempotent). */
int aserve_amx_init(void) { return amx_request_tiles(); }

/* The tiles of a block of rows0 + rows1 query rows (rows1 = 0: one row tile):
 *   Q K^T:  0 and 2, the scores of row tiles 0 and 1; 4 and 5, their Q chunk 0; 1 and 3,
 *           their Q chunk 1 (D = 64, kept for the whole chunk); 6 and 7, K^T blocks.
 *   P V:    0, 1 (row tile 0) and 2, 3 (row tile 1), two column tiles of O; 4 and 5, the
 *           row tiles' weights; 6 and 7, two V tiles. */
static void configure_block(int rows0, int rows1) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* Q's tiles for scores_block: rows 0-15 (and 16-31 when `two`) of the block's queries,
 * D = 64 as two chunks of 32 (4 and 1, 5 and 3); at D > 64 scores_block loads them per
 * key block instead. */
static inline void scores_begin(const uint16_t *q, int64_t q_stride, int two, int64_t DC) {
    if (DC > 2) return;
    const uint16_t *q1 = q + 16 * q_stride;
    _tile_loadd(4, q, q_stride * 2);
    if (two) _tile_loadd(5, q1, q_stride * 2);
    if (DC == 2) {
        _tile_loadd(1, q + 32, q_stride * 2);
        if (two) _tile_loadd(3, q1 + 32, q_stride * 2);
    }
}

/* s (rows SCORE_STRIDE apart, key block j's 16 columns) = Q K^T for key block j (16
 * keys); q: the block's first row, rows q_stride apart; two: a second row tile. Q's
 * tiles as scores_begin left them. */
static inline void scores_block(const uint16_t *q, int64_t q_stride, int two, const uint32_t *kt, int64_t DC,
                                int64_t j, float *s) {
    const int keep = DC <= 2;
    const uint16_t *q1 = q + 16 * q_stride;
    _tile_zero(0);
    if (two) _tile_zero(2);
    for (int64_t c = 0; c < DC; c++) {
        const uint32_t *kb = kt + (j * DC + c) * 256;
        if (!keep) {
            _tile_loadd(4, q + 32 * c, q_stride * 2);
            if (two) _tile_loadd(5, q1 + 32 * c, q_stride * 2);
            _tile_loadd(6, kb, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) _tile_dpbf16ps(2, 5, 6);
        } else if (c == 0) {
            _tile_loadd(6, kb, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) _tile_dpbf16ps(2, 5, 6);
        } else {
            _tile_loadd(7, kb, 64);
            _tile_dpbf16ps(0, 1, 7);
            if (two) _tile_dpbf16ps(2, 3, 7);
        }
    }
    _tile_stored(0, s, SCORE_STRIDE * 4);
    if (two) _tile_stored(2, s + 16 * SCORE_STRIDE, SCORE_STRIDE * 4);
}

/* o (rows D apart, float32) += P V over value blocks b0 .. b0 + pblocks - 1 (32 keys
 * each), p the weights (rows WEIGHT_STRIDE apart). Two column tiles at a time for both
 * row tiles: each V tile serves two products, each weights tile two. */
static inline void block_values(const uint16_t *p, int two, const uint32_t *vv, int64_t DT, int64_t b0,
                                int64_t pblocks, float *o, int64_t D) {
    float *o1 = o + 16 * D;
    for (int64_t t = 0; t < DT; t += 2) {
        _tile_loadd(0, o + 16 * t, D * 4);
        _tile_loadd(1, o + 16 * t + 16, D * 4);
        if (two) {
            _tile_loadd(2, o1 + 16 * t, D * 4);
            _tile_loadd(3, o1 + 16 * t + 16, D * 4);
        }
        for (int64_t b = 0; b < pblocks; b++) {
            _tile_loadd(4, p + 32 * b, WEIGHT_STRIDE * 2);
            _tile_loadd(6, vv + ((b0 + b) * DT + t) * 256, 64);
            _tile_loadd(7, vv + ((b0 + b) * DT + t + 1) * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, p + 16 * WEIGHT_STRIDE + 32 * b, WEIGHT_STRIDE * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, o + 16 * t, D * 4);
        _tile_stored(1, o + 16 * t + 16, D * 4);
        if (two) {
            _tile_stored(2, o1 + 16 * t, D * 4);
            _tile_stored(3, o1 + 16 * t + 16, D * 4);
        }
    }
}

/* Rows q0 .. q0 + rows - 1 (rows <= BLOCK_ROWS) of one query head (q: the chunk's first
 * token, this head), at positions ctx + q0 .. (each sees the keys up to its own). */
static void row_block32(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride, int64_t q0,
                        int rows, int64_t ctx, int64_t D, float scale, const uint32_t *kt, const uint32_t *vv,
                        void *work, int64_t width) {
    (void)width;
    block_scratch *w = (block_scratch *)work;
    const int64_t DC = D / 32, DT = D / 16;
    const int two = rows > 16;
    configure_block(two ? 16 : rows, two ? rows - 16 : 0);
    const int64_t first = ctx + q0, seen = first + rows; /* the last row sees keys 0 .. seen - 1 */
    const float sc = scale * LOG2E;
    for (int i = 0; i < rows; i++) {
        w->m[i] = -INFINITY;
        _mm512_store_ps(w->sum + 16 * i, _mm512_setzero_ps());
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(w->o + i * D + d, _mm512_setzero_ps());
    }
    const uint16_t *qb = q + q0 * q_stride;
    /* The first chunk's scores, then for each chunk: its softmax, row by row, with the
       next chunk's scores (one AMX key block every few rows) in between, and its P V.
       Why between: the products and tile stores then run beside the softmax's vector
       work instead of after it (the 152M shape, 4,096 tokens, six alternated rounds:
       medians 26.2-29.1 against 24.7-26.1 ms a layer; two scores buffers, not one). */
    int cur = 0;
    {
        const int64_t kn = seen < KEY_CHUNK ? seen : KEY_CHUNK;
        scores_begin(qb, q_stride, two, DC);
        for (int64_t j = 0; j < (kn + 15) / 16; j++) scores_block(qb, q_stride, two, kt, DC, j, w->s[cur] + 16 * j);
    }
    for (int64_t k0 = 0; k0 < seen; k0 += KEY_CHUNK) {
        const int64_t kn = seen - k0 < KEY_CHUNK ? seen - k0 : KEY_CHUNK; /* keys of the chunk the last row sees */
        const int64_t pblocks = (kn + 31) / 32;
        const int64_t k1 = k0 + KEY_CHUNK, kn1 = k1 >= seen ? 0 : seen - k1 < KEY_CHUNK ? seen - k1 : KEY_CHUNK;
        const int64_t nb1 = (kn1 + 15) / 16; /* the next chunk's key blocks */
        float *s = w->s[cur], *s1 = w->s[cur ^ 1];
        if (nb1) scores_begin(qb, q_stride, two, DC); /* P V (below) used Q's tiles */
        for (int i = 0, j = 0; i < rows; i++) {
            const int64_t n = first + i + 1 - k0;
            chunk_row(s + i * SCORE_STRIDE, w->p + i * WEIGHT_STRIDE, n < kn ? n : kn, 32 * pblocks, sc, &w->m[i],
                      w->sum + 16 * i, w->o + i * D, D);
            for (const int64_t upto = nb1 * (i + 1) / rows; j < upto; j++)
                scores_block(qb, q_stride, two, kt, DC, k1 / 16 + j, s1 + 16 * j);
        }
        block_values(w->p, two, vv, DT, k0 / 32, pblocks, w->o, D);
        cur ^= 1;
    }
    finish_rows(w->o, w->sum, rows, D, out, out_stride, q0);
}

static void release_tiles(void) { _tile_release(); }

static const prefill_form FORM = {row_block32, BLOCK_ROWS, work_bytes, release_tiles};

/* Returns 0, or -1 for a shape it does not take (D not a multiple of 32 or over MAX_D, Hq
 * not a multiple of Hk) or when scratch memory cannot be had. */
int aserve_prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                             const uint16_t *v, int64_t v_stride, uint16_t *out, int64_t out_stride,
                             const int64_t *starts, const int64_t *lens, const int64_t *ctx, int64_t n_prompts,
                             const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *block_tables,
                             int64_t max_blocks, int64_t block_size, int64_t stride_block, int64_t stride_token,
                             int64_t stride_head, int64_t Hq, int64_t Hk, int64_t D, float scale, int num_threads) {
    return prefill_run(&FORM, q, q_stride, k, k_stride, v, v_stride, out, out_stride, starts, lens, ctx, n_prompts,
                       k_cache, v_cache, block_tables, max_blocks, block_size, stride_block, stride_token, stride_head,
                       Hq, Hk, D, scale, num_threads);
}
