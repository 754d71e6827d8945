/* The AVX512-BF16 register block shared by the bf16 linear kernel (cpu_bf16_linear.c) and
 * the prefill attention's products (cpu_prefill_attention_avx512.c): up to 6 rows of A by
 * up to 4 tiles of 16 outputs, 24 float accumulators in registers.
 *
 * B is in AMX's tiled form (cpu_bf16_pack.h): a tile's 64-byte row r of chunk kc holds, for
 * each of its 16 outputs, the pair of summed-dimension elements 32 kc + 2r, 32 kc + 2r + 1,
 * exactly one vdpbf16ps operand. Per pair the block loads one row of each tile and
 * broadcasts each A row's pair, then issues MR x NT vdpbf16ps. Each output is one chain
 * over the summed dimension in order, so its value does not depend on the rows or tiles
 * around it. Built only where __AVX512BF16__ is defined. */
#ifndef ASERVE_CPU_BF16_BLOCK_H
#define ASERVE_CPU_BF16_BLOCK_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Software prefetch spread over a block's iterations: the lines of [cur, stop), then those
 * of [then, then + then_bytes) (`then` may be NULL), per_iter lines a pair of K (0: none).
 * A cursor and its end, not a line count over two bases: the block keeps these five in
 * registers through its loop (see BF16_BLOCK). */
typedef struct {
    const char *cur, *stop, *then;
    int64_t then_bytes;
    int per_iter;
} prefetch_run;

static inline void prefetch_some(prefetch_run *pr) {
    for (int i = 0; i < pr->per_iter; i++) {
        if (pr->cur == pr->stop) {
            if (pr->then == NULL) break;
            pr->cur = pr->then;
            pr->stop = pr->then + pr->then_bytes;
            pr->then = NULL;
        }
        _mm_prefetch(pr->cur, _MM_HINT_T1); /* L2: see cpu_bf16_linear.c, decode_sums */
        pr->cur += 64;
    }
}

static inline __m512bh pair_of_x(const uint16_t *x) { /* x[0], x[1] in every 32-bit lane */
    int32_t v;
    memcpy(&v, x, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}

#define BF16_ROW(R)                                                                                                  \
    if (MR > R) {                                                                                                   \
        const __m512bh x = pair_of_x(a + R * lda + k2);                                                             \
        c##R##0 = _mm512_dpbf16_ps(c##R##0, x, b0);                                                                 \
        if (NT > 1) c##R##1 = _mm512_dpbf16_ps(c##R##1, x, b1);                                                     \
        if (NT > 2) c##R##2 = _mm512_dpbf16_ps(c##R##2, x, b2);                                                     \
        if (NT > 3) c##R##3 = _mm512_dpbf16_ps(c##R##3, x, b3);                                                     \
    }
#define BF16_LOAD_ACC(R)                                                                                             \
    if (MR > R && !first) {                                                                                         \
        c##R##0 = _mm512_loadu_ps(acc + R * ld);                                                                    \
        if (NT > 1) c##R##1 = _mm512_loadu_ps(acc + R * ld + 16);                                                   \
        if (NT > 2) c##R##2 = _mm512_loadu_ps(acc + R * ld + 32);                                                   \
        if (NT > 3) c##R##3 = _mm512_loadu_ps(acc + R * ld + 48);                                                   \
    }
#define BF16_SAVE_ACC(R)                                                                                             \
    if (MR > R) {                                                                                                   \
        _mm512_storeu_ps(acc + R * ld, c##R##0);                                                                    \
        if (NT > 1) _mm512_storeu_ps(acc + R * ld + 16, c##R##1);                                                   \
        if (NT > 2) _mm512_storeu_ps(acc + R * ld + 32, c##R##2);                                                   \
        if (NT > 3) _mm512_storeu_ps(acc + R * ld + 48, c##R##3);                                                   \
    }
/* GCC 12 at -O3 keeps one of the 4-row, 4-tile block's accumulators (and a weight
 * vector) on the stack through its loop, so that sum waits on a store and a load every
 * pair of K; IRA's single-region allocation keeps all 16 in registers (the other shapes
 * spill nothing either way, and the 5- and 6-row ones measured slower under it). */
#if defined(__GNUC__) && !defined(__clang__)
#define BF16_BLOCK_ATTR_4 __attribute__((optimize("ira-region=one")))
#else
#define BF16_BLOCK_ATTR_4
#endif
#define BF16_BLOCK_ATTR_1
#define BF16_BLOCK_ATTR_2
#define BF16_BLOCK_ATTR_3
#define BF16_BLOCK_ATTR_5
#define BF16_BLOCK_ATTR_6
/* MR rows of a (bf16, rows lda apart) against NT tiles (tile[t]: its chunk 0; chunks
 * `chunk` elements apart), over chunks [kc0, kc0 + nkc) (32 of the summed dimension
 * each). The sums start from acc (float, rows ld apart, tile t at column 16 t), or from
 * zero when `first`, and are stored back there; each pair also issues its share of the
 * run *pr_out's prefetches, from a local copy written back at the end. Why the copy: the
 * vector loads may alias anything (their type is may_alias), so with the run behind a
 * pointer GCC stored the cursor and reloaded the run's fields every pair of K; the
 * decode form (cpu_bf16_linear.c, decode_sums) measured 368-372 -> 406-407 GFLOP/s at 32
 * rows, 364 -> 401 at 24, 393 -> 424 at 64 (Zen 4, 2026-12-07, the 152M model's 48
 * weights cycled, two threads, medians of eight alternating rounds), 2,048 rows even. */
#define BF16_BLOCK(MR_, NT_)                                                                                         \
    static BF16_BLOCK_ATTR_##MR_ void bf16_block_##MR_##_##NT_(const uint16_t *a, int64_t lda,                    \
                                                               const uint16_t *const *tile, int64_t chunk,         \
                                                               int64_t kc0, int64_t nkc, float *acc, int64_t ld,   \
                                                               int first, prefetch_run *pr_out) {                  \
        enum { MR = MR_, NT = NT_ };                                                                                \
        prefetch_run pf = *pr_out, *pr = &pf;                                                                       \
        const __m512 z = _mm512_setzero_ps();                                                                       \
        __m512 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z, c20 = z, c21 = z, c22 = z,    \
               c23 = z, c30 = z, c31 = z, c32 = z, c33 = z, c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z,   \
               c52 = z, c53 = z;                                                                                    \
        BF16_LOAD_ACC(0) BF16_LOAD_ACC(1) BF16_LOAD_ACC(2) BF16_LOAD_ACC(3) BF16_LOAD_ACC(4) BF16_LOAD_ACC(5)        \
        const uint16_t *t0 = tile[0], *t1 = NT > 1 ? tile[1] : t0, *t2 = NT > 2 ? tile[2] : t0,                     \
                       *t3 = NT > 3 ? tile[3] : t0;                                                                 \
        for (int64_t kc = kc0; kc < kc0 + nkc; kc++) {                                                              \
            const int64_t off = kc * chunk;                                                                         \
            for (int r = 0; r < 16; r++) {                                                                          \
                const int64_t k2 = kc * 32 + 2 * r;                                                                 \
                const __m512bh b0 = (__m512bh)_mm512_loadu_si512(t0 + off + r * 32);                               \
                const __m512bh b1 = NT > 1 ? (__m512bh)_mm512_loadu_si512(t1 + off + r * 32) : b0;                 \
                const __m512bh b2 = NT > 2 ? (__m512bh)_mm512_loadu_si512(t2 + off + r * 32) : b0;                 \
                const __m512bh b3 = NT > 3 ? (__m512bh)_mm512_loadu_si512(t3 + off + r * 32) : b0;                 \
                BF16_ROW(0) BF16_ROW(1) BF16_ROW(2) BF16_ROW(3) BF16_ROW(4) BF16_ROW(5)                             \
                prefetch_some(pr);                                                                                  \
            }                                                                                                       \
        }                                                                                                           \
        BF16_SAVE_ACC(0) BF16_SAVE_ACC(1) BF16_SAVE_ACC(2) BF16_SAVE_ACC(3) BF16_SAVE_ACC(4) BF16_SAVE_ACC(5)        \
        *pr_out = pf;                                                                                               \
    }
#define BF16_BLOCKS(MR) BF16_BLOCK(MR, 1) BF16_BLOCK(MR, 2) BF16_BLOCK(MR, 3) BF16_BLOCK(MR, 4)
BF16_BLOCKS(1)
BF16_BLOCKS(2)
BF16_BLOCKS(3)
BF16_BLOCKS(4)
BF16_BLOCKS(5)
BF16_BLOCKS(6)

typedef void (*bf16_block_fn)(const uint16_t *, int64_t, const uint16_t *const *, int64_t, int64_t, int64_t, float *,
                              int64_t, int, prefetch_run *);
#define BF16_ROW_OF(MR) {bf16_block_##MR##_1, bf16_block_##MR##_2, bf16_block_##MR##_3, bf16_block_##MR##_4}
/* BF16_BLOCK_TABLE[MR - 1][NT - 1]. */
static const bf16_block_fn BF16_BLOCK_TABLE[6][4] = {BF16_ROW_OF(1), BF16_ROW_OF(2), BF16_ROW_OF(3),
                                                     BF16_ROW_OF(4), BF16_ROW_OF(5), BF16_ROW_OF(6)};

#endif
