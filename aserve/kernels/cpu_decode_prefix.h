/* Decode attention's shared prefix as matrix products ("cascade attention"), for
 * cpu_decode_attention.c on CPUs with AMX, or with AVX512-BF16 and no AMX.
 *
 * Why: when every decode row of a step shares its first blocks (the prefix cache handed
 * the same system prompt or few-shot preamble to each request), each row still attends
 * over those tokens one query at a time, in vector FMAs: 32 rows of the 152M model over
 * 1,024 shared tokens spend about half of a 60 ms step there, bound by the arithmetic,
 * not by memory (docs/performance.md, "Decode rows that share a prefix"). Stacked, the
 * rows' queries for one KV head form a matrix, and the prefix's part of their attention
 * becomes two matrix products over keys and values read once, which AMX tiles compute
 * at more than ten times the vector rate (where there are no tiles, AVX512-BF16's
 * vdpbf16ps: bf16 pairs, each key and value loaded once for six query rows).
 *
 * For each KV head (one task each, split between OpenMP threads):
 *   - the prefix's keys laid out as K^T in AMX's B layout, its values as pairs of keys
 *     (cpu_prefill_common.h's layouts), read from the paged cache;
 *   - for each block of up to 16 query rows (row r = sequence r / G, query head
 *     hk * G + r % G, with G query heads per KV head):
 *       S = Q K^T over the T prefix tokens, in float32;
 *       m = max(S) * scale, P = exp(S * scale - m) (cpu_prefill_common.h's softmax_row),
 *           l = the sum of P, P rounded to bf16 for the second product, as the prefill
 *           kernel rounds it;
 *       acc = P V, in float32, not divided by l.
 * The row's (m, l, acc) is where the decode task for that row then starts its online
 * softmax, over the tokens after the prefix only: the result is the whole context's
 * attention, with the prefix's weights rounded to bf16 (relative error about 2^-9 each)
 * where the vector path keeps them in float32.
 *
 * The products are cpu_prefill_common.h's: amx_scores / amx_values, or pa_product.
 * Needs: q and the cache in bf16, D a multiple of 32 and at most MAX_D, every row's
 * context longer than the prefix (the caller's check).
 */
#ifndef ASERVE_CPU_DECODE_PREFIX_H
#define ASERVE_CPU_DECODE_PREFIX_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_prefill_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define PREFIX_TILES 1 /* else AVX512-BF16 (cpu_decode_attention.c includes this file only then) */
#endif

/* The shape a prefix phase pays for: its K and V layouts cost about what three rows'
 * vector attention over the prefix costs (152M heads, 1,024 tokens, AMX: ~0.2 ms a layer
 * against ~0.07 a row), so with few rows or few tokens the vector path alone is as fast;
 * at 8 rows the phase already halves the layer (docs/performance.md). */
#define PREFIX_MIN_ROWS 8    /* query rows per KV head: sequences x query heads per KV head */
#define PREFIX_MIN_TOKENS 64

/* K^T blocks as layout_keys (cpu_prefill_common.h) lays them out, by gathers: with
 * block_size a multiple of 16, the 16 keys of a block of K^T lie in one cache block,
 * kv_stride_token apart, so row r of a tile (dimension pair 32c + 2r of 16 keys) is one
 * 16-lane gather. T is a multiple of 16 here. */
static void prefix_layout_keys(const KeyRows *k, int64_t T, int64_t D, uint32_t *kt) {
    const int64_t DC = D / 32;
    const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32((int)(k->stride_token * 2)));
    for (int64_t j = 0; j < T / 16; j++) {
        const char *first = (const char *)key_row(k, 16 * j);
        for (int64_t c = 0; c < DC; c++)
            for (int r = 0; r < 16; r++)
                _mm512_storeu_si512((void *)(kt + (j * DC + c) * 256 + r * 16),
                                    _mm512_i32gather_epi32(lanes, first + 64 * c + 4 * r, 1));
    }
}

/* Bytes of one KV head's K and V layouts of a T-token prefix (head hk's at hk times
 * this in Args.prefix_layout): width x D bf16 each, width = T rounded up to 32. */
static inline int64_t prefix_layout_bytes(int64_t T, int64_t D) { return (T + 31) / 32 * 32 * D * 4; }

/* One task: KV head hk, all R = B * G query rows; pm, pl, pacc as prefix_phase says;
 * `laid_out`: a->prefix_layout already holds this prefix's layouts. Returns 0, or -1
 * when scratch memory cannot be had. */
static int prefix_head(const Args *a, int64_t hk, int64_t T, float *pm, float *pl, float *pacc, int laid_out) {
    const int64_t D = a->D, G = a->Hq / a->Hk, R = a->B * G, DT = D / 16;
    const int64_t width = (T + 31) / 32 * 32, kblocks = T / 16, pblocks = width / 32;
    const int64_t layout = a->prefix_layout != NULL ? 0 : prefix_layout_bytes(T, D);
    /* kt, vv (unless kept in a->prefix_layout): width x D bf16 each; s: 16 x width
       floats; p: 16 x width bf16; qb: 16 x D bf16. */
    char *scratch = aligned_alloc(64, (size_t)(layout + 16 * width * 6 + 16 * D * 2));
    if (!scratch) return -1;
    uint32_t *kt = a->prefix_layout != NULL ? (uint32_t *)((char *)a->prefix_layout + hk * prefix_layout_bytes(T, D))
                                            : (uint32_t *)scratch;
    uint32_t *vv = (uint32_t *)((char *)kt + width * D * 2);
    float *s = (float *)(scratch + layout);
    uint16_t *p = (uint16_t *)(scratch + layout + 16 * width * 4);
    uint16_t *qb = (uint16_t *)(scratch + layout + 16 * width * 6);
    const KeyRows ks = {(const uint16_t *)a->k + hk * a->kv_stride_head, 2, 0, a->block_table, a->block_size,
                        a->kv_stride_block, a->kv_stride_token};
    const KeyRows vs = {(const uint16_t *)a->v + hk * a->kv_stride_head, 2, 0, a->block_table, a->block_size,
                        a->kv_stride_block, a->kv_stride_token};
    if (!laid_out) {
        if (a->block_size % 16 == 0) prefix_layout_keys(&ks, T, D, kt);
        else layout_keys(&ks, T, D, kt);
        layout_values(&vs, T, D, vv);
    }
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
        const int rows = (int)(R - r0 < 16 ? R - r0 : 16);
        for (int i = 0; i < rows; i++) {
            const int64_t b = (r0 + i) / G, hq = hk * G + (r0 + i) % G;
            memcpy(qb + i * D, (const uint16_t *)a->q + b * a->q_stride_b + hq * a->q_stride_h, (size_t)D * 2);
        }
#ifdef PREFIX_TILES
        amx_configure_rows(rows);
        amx_scores(qb, D, kt, D, kblocks, s, width); /* S = Q K^T */
#else
        pa_product(qb, D, rows, kt, kblocks, D / 32 * 256, 256, D / 2, s, width, 1);
#endif
        for (int i = 0; i < rows; i++) { /* softmax numerators, the max and the sum kept */
            const int64_t at = (r0 + i) / G * a->Hq + hk * G + (r0 + i) % G;
            pl[at] = softmax_row(s + i * width, p + i * width, T, 32 * pblocks, a->scale, &pm[at]);
        }
        float o[16 * MAX_D] __attribute__((aligned(64))); /* acc = P V, rows D apart */
#ifdef PREFIX_TILES
        amx_values(p, width, vv, D, pblocks, o, D);
#else
        pa_product(p, width, rows, vv, DT, 256, DT * 256, 16 * pblocks, o, D, 1);
#endif
        for (int i = 0; i < rows; i++) {
            const int64_t at = (r0 + i) / G * a->Hq + hk * G + (r0 + i) % G;
            memcpy(pacc + at * D, o + i * D, (size_t)D * 4);
        }
    }
#ifdef PREFIX_TILES
    _tile_release();
#endif
    free(scratch);
    return 0;
}

/* Runs the prefix phase when it applies, over the first prefix_blocks blocks of the
 * block table (the same for every row): fills pm, pl ([B * Hq]) and pacc ([B * Hq, D],
 * element order) for row b, query head h at b * Hq + h, and returns the tokens it
 * covered (T), or 0 when it does not apply: no AMX permission, a dtype or shape it does
 * not take, a prefix or a batch too small to pay for it, or no memory. */
static int64_t prefix_phase(const Args *a, float *pm, float *pl, float *pacc) {
    static int tiles = -1; /* the process's AMX permission, asked once (idempotent anyway) */
    const int64_t T = a->prefix_blocks * a->block_size, G = a->Hq / a->Hk;
    if (T < PREFIX_MIN_TOKENS || T % 16 || a->B * G < PREFIX_MIN_ROWS || !a->q_bf16 || !a->kv_bf16 || a->D % 32
        || a->D > MAX_D)
        return 0;
    for (int64_t b = 0; b < a->B; b++)
        if (a->seq_lens[b] <= T) return 0; /* the caller's promise, checked: a row's own token lies past T */
#ifdef PREFIX_TILES
    if (tiles < 0) tiles = amx_request_tiles();
    if (!tiles) return 0;
#else
    (void)tiles;
#endif
    int failed = 0;
    const int nt = a->num_threads > a->Hk ? (int)a->Hk : a->num_threads;
    /* Layouts kept from an earlier call (the caller's state says they are still these
       blocks'): reading them back costs a third of laying them out again (152M heads,
       1,024 tokens, 32 rows: 1.25 -> 0.81 ms a layer). */
    const int laid_out = a->prefix_layout != NULL && a->prefix_state != NULL && *a->prefix_state == 1;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1) reduction(| : failed)
    for (int64_t hk = 0; hk < a->Hk; hk++) failed |= prefix_head(a, hk, T, pm, pl, pacc, laid_out) != 0;
    if (a->prefix_layout != NULL && a->prefix_state != NULL) *a->prefix_state = failed ? 0 : 1;
    return failed ? 0 : T;
}

#endif
