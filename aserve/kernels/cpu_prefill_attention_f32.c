/* Causal attention of prefill chunks on CPU in float32, AVX-512F or AVX2 + FMA
 * (aserve/kernels/cpu_prefill_attention.py): the float32 twin of the bf16 kernels
 * (cpu_prefill_attention.c says what is computed), with the same arguments but float
 * pointers.
 *
 * Why: a float32 model's prefill attention went through torch's CPU flash kernel one
 * prompt at a time, at ~61 GFLOP/s on one Zen 4 core (a 7M model's 2,048-token prompt:
 * 4 x 35.5 ms of attention in a 215-223 ms prefill). Here both products are one
 * register block of MR query rows by NT vectors of VL outputs (cpu_simd.h's vector:
 * 6 x 4 of 16 lanes on AVX-512, 6 x 2 of 8 on AVX2), every score and weight float32.
 *
 * Two phases, each split between OpenMP threads:
 *   1. per chunk and KV head: its keys (cached context, then its own) laid out as K^T in
 *      blocks of VL keys (kt[(j * D + d) * VL + n] = dimension d of key VL j + n, zeros
 *      past the end), its values copied to rows of D (vv[key * D + d]);
 *   2. per chunk, group of up to HG query heads of one KV head (stacked: one pass over
 *      the keys serves them all) and block of up to RB query rows, the last blocks (the
 *      longest) first:
 *        S = Q K^T over the keys the rows can see (causal);
 *        P = exp(S * scale - the row's max), keys past a row's position 0;
 *        O = P V in chunks of KC keys (a chunk of V stays in L1 over the rows),
 *            divided by the row's sum of P.
 * Scratch: the layouts (2 x chunks x Hk x keys x D floats) and, per thread, one block's
 * stacked query rows, scores and outputs (HG x RB rows of D, keys and D floats). The
 * sums run in a fixed order, so the result does not
 * depend on the thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_key_rows.h"
#include "cpu_simd.h"

#ifdef ASERVE_SIMD
#define PF_AVAILABLE 1
#define MR 6 /* query rows of the register block */
#if VL == 16
#define NT 4 /* vectors of outputs: MR x NT accumulators, NT loads, one broadcast (29 of 32) */
#else
#define NT 2 /* 12 accumulators, 2 loads, one broadcast (15 of 16); 6 x 2 ran 5% faster than 4 x 3 */
#endif
#define RB 16 /* query rows of a block, per head */
#define HG 4  /* query heads of one KV head a block takes at most (they share its keys) */

/* c[i][VL t + n] (+)= sum over k < K of a[i * lda + k] * b[k * b_step + t * b_tile + n],
 * for i < M, t < N; accumulate: add to what c holds. Always inlined with constant M and
 * N, so the accumulators are registers. */
static inline __attribute__((always_inline)) void block_body(const int M, const int N, const float *a, int64_t lda,
                                                             const float *b, int64_t b_step, int64_t b_tile,
                                                             int64_t K, float *c, int64_t ldc, int accumulate) {
    vf acc[MR][NT];
    for (int i = 0; i < M; i++)
        for (int t = 0; t < N; t++) acc[i][t] = accumulate ? vf_loadu(c + i * ldc + t * VL) : vf_zero();
    for (int64_t k = 0; k < K; k++) {
        vf bv[NT];
        for (int t = 0; t < N; t++) {
            bv[t] = vf_loadu(b + k * b_step + t * b_tile);
#if VL == 8
            /* Keeps the row in a register: otherwise gcc folds it into each row's FMA as a
               memory operand, and the loads (4 a row instead of 1) ran the AVX2 form at
               ~60% of this speed. */
            __asm__("" : "+x"(bv[t]));
#endif
        }
        for (int i = 0; i < M; i++) {
            const vf av = vf_set1(a[i * lda + k]);
            for (int t = 0; t < N; t++) acc[i][t] = vf_fmadd(av, bv[t], acc[i][t]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int t = 0; t < N; t++) vf_storeu(c + i * ldc + t * VL, acc[i][t]);
}

typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, int64_t, int64_t, float *, int64_t, int);
#define DEFINE_BLOCK(M, N)                                                                                            \
    static void block_##M##_##N(const float *a, int64_t lda, const float *b, int64_t b_step, int64_t b_tile,       \
                                int64_t K, float *c, int64_t ldc, int accumulate) {                                   \
        block_body(M, N, a, lda, b, b_step, b_tile, K, c, ldc, accumulate);                                           \
    }
#if VL == 16
#define DEFINE_ROW(M) DEFINE_BLOCK(M, 1) DEFINE_BLOCK(M, 2) DEFINE_BLOCK(M, 3) DEFINE_BLOCK(M, 4)
#define ROW(M) {block_##M##_1, block_##M##_2, block_##M##_3, block_##M##_4}
DEFINE_ROW(1) DEFINE_ROW(2) DEFINE_ROW(3) DEFINE_ROW(4) DEFINE_ROW(5) DEFINE_ROW(6)
static const block_fn BLOCKS[MR][NT] = {ROW(1), ROW(2), ROW(3), ROW(4), ROW(5), ROW(6)};
#else
#define DEFINE_ROW(M) DEFINE_BLOCK(M, 1) DEFINE_BLOCK(M, 2)
#define ROW(M) {block_##M##_1, block_##M##_2}
DEFINE_ROW(1) DEFINE_ROW(2) DEFINE_ROW(3) DEFINE_ROW(4) DEFINE_ROW(5) DEFINE_ROW(6)
static const block_fn BLOCKS[MR][NT] = {ROW(1), ROW(2), ROW(3), ROW(4), ROW(5), ROW(6)};
#endif

/* c[rows, VL * tiles] (+)= a[rows, K] . b, tiles outer (a group of NT tiles' b stays in
 * cache over the rows), MR rows at a time. */
static void product(const float *a, int64_t lda, int rows, const float *b, int64_t b_step, int64_t b_tile,
                    int64_t tiles, int64_t K, float *c, int64_t ldc, int accumulate) {
    for (int64_t t0 = 0; t0 < tiles; t0 += NT) {
        const int nt = (int)(tiles - t0 < NT ? tiles - t0 : NT);
        for (int r0 = 0; r0 < rows; r0 += MR) {
            const int mr = rows - r0 < MR ? rows - r0 : MR;
            BLOCKS[mr - 1][nt - 1](a + r0 * lda, lda, b + t0 * b_tile, b_step, b_tile, K, c + r0 * ldc + VL * t0, ldc,
                                   accumulate);
        }
    }
}

/* Phase 1 for one chunk and KV head: kt (padded x D, K^T in blocks of VL keys) and vv
 * (padded x D, value rows), zeros past len. */
static void layout(const KeyRows *k, const KeyRows *v, int64_t len, int64_t padded, int64_t D, float *kt, float *vv) {
    for (int64_t j = 0; j < padded; j += VL)
        for (int64_t n = 0; n < VL; n++) {
            float *dst = kt + j * D + n;
            if (j + n < len) {
                const float *src = key_row(k, j + n);
                for (int64_t d = 0; d < D; d++) dst[d * VL] = src[d];
            } else {
                for (int64_t d = 0; d < D; d++) dst[d * VL] = 0.0f;
            }
        }
    for (int64_t j = 0; j < padded; j++) {
        if (j < len)
            memcpy(vv + j * D, key_row(v, j), (size_t)D * sizeof(float));
        else
            memset(vv + j * D, 0, (size_t)D * sizeof(float));
    }
}

/* Rows q0 .. q0 + rows - 1 of `heads` query heads of one KV head (q, out: the chunk's
 * first token, the first of these heads), at positions ctx + q0 ..: each sees the keys up
 * to its own position. The heads' rows are stacked (qb: heads x rows rows of D), so one
 * pass over the keys and values serves all of them. s: heads x rows rows of width floats
 * (width >= the keys rounded up to VL); o: heads x rows rows of D floats. */
static void row_block(const float *q, int64_t q_stride, float *out, int64_t out_stride, int heads, int64_t q0,
                      int rows, int64_t ctx, int64_t D, float scale, const float *kt, const float *vv, float *qb,
                      float *s, float *o, int64_t width) {
    const int64_t seen = ctx + q0 + rows; /* keys 0 .. seen - 1 */
    const int64_t ktiles = (seen + VL - 1) / VL, dtiles = D / VL;
    const int all = heads * rows;
    for (int g = 0; g < heads; g++)
        for (int i = 0; i < rows; i++) memcpy(qb + (g * rows + i) * D, q + (q0 + i) * q_stride + g * D, (size_t)D * 4);
    /* S = Q K^T: tiles of VL keys (D * VL floats apart), K = D. */
    product(qb, D, all, kt, VL, D * VL, ktiles, D, s, width, 0);
    float inv_sum[HG * RB];
    const vf sc = vf_set1(scale);
    for (int r = 0; r < all; r++) {
        float *row = s + r * width;
        const int64_t n = ctx + q0 + r % rows + 1;
        vf mx = vf_set1(-3.0e38f);
        int64_t t = 0;
        for (; t + VL <= n; t += VL) mx = vf_max(mx, vf_loadu(row + t));
        float m = vf_reduce_max(mx);
        for (; t < n; t++) m = row[t] > m ? row[t] : m;
        const vf ms = vf_set1(m * scale);
        vf acc = vf_zero();
        for (t = 0; t + VL <= n; t += VL) {
            const vf e = vf_exp_clamped(vf_sub(vf_mul(vf_loadu(row + t), sc), ms));
            acc = vf_add(acc, e);
            vf_storeu(row + t, e);
        }
        if (t < n) {
            const vf e = vf_first(vf_exp_clamped(vf_sub(vf_mul(vf_loadu(row + t), sc), ms)), n - t, 0.0f);
            acc = vf_add(acc, e);
            vf_storeu(row + t, e);
            t += VL;
        }
        for (; t < seen; t += VL) vf_storeu(row + t, vf_zero()); /* the later rows' keys */
        inv_sum[r] = 1.0f / vf_reduce_add(acc);
    }
    /* O = P V in chunks of keys (a chunk of V stays in L1 over the rows): tiles of VL
       columns of D (VL floats apart), rows of V D floats apart. */
    const int64_t kc = D <= 64 ? 64 : 4096 / D;
    for (int64_t k0 = 0; k0 < seen; k0 += kc)
        product(s + k0, width, all, vv + k0 * D, D, VL, dtiles, seen - k0 < kc ? seen - k0 : kc, o, D, k0 > 0);
    for (int r = 0; r < all; r++) {
        const vf inv = vf_set1(inv_sum[r]);
        float *dst = out + (q0 + r % rows) * out_stride + (r / rows) * D;
        for (int64_t t = 0; t < dtiles; t++) vf_storeu(dst + VL * t, vf_mul(vf_load(o + r * D + VL * t), inv));
    }
}
#else
#define PF_AVAILABLE 0
#endif

/* The vector width of this build's products: 16 (AVX-512F) or 8 (AVX2 + FMA); 0 where it
 * lacks them (the kernel is then unavailable). */
int aserve_prefill_attention_f32_available(void) {
#if PF_AVAILABLE
    return VL;
#else
    return 0;
#endif
}

/* cpu_prefill_attention.c's entry point, in float32: D a multiple of 16, at most 256.
 * Returns 0, or -1 for a shape it does not take, where the build lacks AVX2 + FMA, or
 * when scratch memory cannot be had. */
int aserve_prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                                 int64_t v_stride, float *out, int64_t out_stride, const int64_t *starts,
                                 const int64_t *lens, const int64_t *ctx, int64_t n_prompts, const float *k_cache,
                                 const float *v_cache, const int64_t *block_tables, int64_t max_blocks,
                                 int64_t block_size, int64_t stride_block, int64_t stride_token, int64_t stride_head,
                                 int64_t Hq, int64_t Hk, int64_t D, float scale, int num_threads) {
#if PF_AVAILABLE
    if (D % 16 || D > 256 || Hk < 1 || Hq % Hk || n_prompts < 0) return -1;
    if (n_prompts == 0) return 0;
    const int64_t group = Hq / Hk;
    /* A block takes hg query heads of a KV head: the largest divisor of the group up to HG. */
    int hg = (int)(group < HG ? group : HG);
    while (group % hg) hg--;
    const int64_t head_blocks = Hk * (group / hg);
    /* Where each chunk's layouts start (floats), and its row blocks (work items). */
    int64_t *offset = malloc((size_t)(n_prompts + 1) * sizeof(int64_t) * 2);
    if (!offset) return -1;
    int64_t *first_item = offset + n_prompts + 1, max_padded = VL;
    offset[0] = first_item[0] = 0;
    for (int64_t i = 0; i < n_prompts; i++) {
        const int64_t len = lens[i] > 0 ? lens[i] : 0, padded = ((ctx ? ctx[i] : 0) + len + VL - 1) / VL * VL;
        offset[i + 1] = offset[i] + 2 * Hk * padded * D;
        first_item[i + 1] = first_item[i] + head_blocks * ((len + RB - 1) / RB);
        max_padded = padded > max_padded ? padded : max_padded;
    }
    float *layouts = aligned_alloc(64, (size_t)(offset[n_prompts] > 0 ? offset[n_prompts] : 16) * sizeof(float));
    if (!layouts) {
        free(offset);
        return -1;
    }
    const int64_t tasks = n_prompts * Hk, items = first_item[n_prompts];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t i = task / Hk, h = task % Hk, len = lens[i];
            if (len <= 0) continue;
            const int64_t c0 = ctx ? ctx[i] : 0, total = c0 + len, padded = (total + VL - 1) / VL * VL;
            float *kt = layouts + offset[i] + 2 * h * padded * D, *vv = kt + padded * D;
            KeyRows ks = {k + starts[i] * k_stride + h * D, 4, k_stride, NULL, 0, 0, 0};
            KeyRows vs = {v + starts[i] * v_stride + h * D, 4, v_stride, NULL, 0, 0, 0};
            if (c0 > 0) {
                const int64_t *table = block_tables + i * max_blocks;
                ks = (KeyRows){k_cache + h * stride_head, 4, 0, table, block_size, stride_block, stride_token};
                vs = (KeyRows){v_cache + h * stride_head, 4, 0, table, block_size, stride_block, stride_token};
            }
            layout(&ks, &vs, total, padded, D, kt, vv);
        }
        /* Per thread: the stacked query rows, the scores and the output rows of a block. */
        const int64_t rows_max = (int64_t)hg * RB;
        float *qb = aligned_alloc(64, (size_t)(rows_max * (2 * D + max_padded)) * sizeof(float));
        if (!qb) failed |= 1;
        float *o = qb + rows_max * D, *s = o + rows_max * D;
        /* The items from the last (each chunk's last row blocks, the longest) to the first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = items - 1; item >= 0; item--) {
            if (!qb) continue;
            int64_t i = 0;
            while (first_item[i + 1] <= item) i++;
            const int64_t local = item - first_item[i], blocks = (lens[i] + RB - 1) / RB, len = lens[i];
            const int64_t hb = local / blocks, q0 = (local % blocks) * RB, hq = hb * hg, h = hq / group;
            const int64_t c0 = ctx ? ctx[i] : 0, padded = (c0 + len + VL - 1) / VL * VL;
            const float *kt = layouts + offset[i] + 2 * h * padded * D, *vv = kt + padded * D;
            row_block(q + starts[i] * q_stride + hq * D, q_stride, out + starts[i] * out_stride + hq * D, out_stride,
                      hg, q0, (int)(len - q0 < RB ? len - q0 : RB), c0, D, scale, kt, vv, qb, s, o, padded);
        }
        free(qb);
    }
    free(layouts);
    free(offset);
    return failed ? -1 : 0;
#else
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out, (void)out_stride;
    (void)starts, (void)lens, (void)ctx, (void)n_prompts, (void)k_cache, (void)v_cache, (void)block_tables;
    (void)max_blocks, (void)block_size, (void)stride_block, (void)stride_token, (void)stride_head, (void)Hq, (void)Hk;
    (void)D;
    (void)scale, (void)num_threads;
    return -1;
#endif
}
