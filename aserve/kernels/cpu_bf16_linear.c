/* bf16 linear layers on AVX512-BF16 (vdpbf16ps), for CPUs with native bf16 dot products
 * and no AMX (aserve/kernels/bf16_linear.py): y[M, N] = x[M, K] . W[N, K]^T, K and N
 * multiples of 32, bf16 in and out, float32 accumulation and one rounding at the end.
 *
 * Why: on such a CPU (an AMD EPYC Zen 4 here) torch's bf16 linear layers are oneDNN's,
 * and at decode batch sizes oneDNN's prepacked GEMM left a third of the machine's bf16
 * rate unused (docs/performance.md, "AVX-512 with avx512_bf16"). Its weights also live
 * in oneDNN's own layout, which the one-call decode step (cpu_llama_decode_avx512.c)
 * cannot call into.
 *
 * Weight layout: the AMX kernel's (cpu_amx_linear.c says it in full), so the Python side
 * packs, stores and pads weights the same way for both kernels. Blocks of 32 output
 * columns (a "pair" of 16-column tiles) by 32 of K; within a block, tile j's row r is 64
 * bytes: for its 16 columns c, W[32p + 16j + c][32kc + 2r + i], i = 0, 1. That row is
 * exactly one vdpbf16ps operand: 16 lanes, each a pair of consecutive K. A pair's blocks
 * for all of K are one contiguous run.
 *
 * Arithmetic: a block of up to 6 rows of x by 4 tiles (two pairs, 64 columns) keeps 24
 * accumulators in registers; per pair of K it loads 4 weight vectors, broadcasts 6 pairs
 * of x, and issues 24 vdpbf16ps. Each output is one chain over K in order, then rounded
 * to bf16 to nearest even: its value does not depend on the thread count or on the rows
 * around it, so the layer-by-layer path and the one-call decode step agree bit for bit.
 *
 * Threads: an item is a group of two pairs (up to PANEL_ROWS rows, the streaming form:
 * all rows; more: a panel of PANEL_ROWS rows), items group-major, shared out with
 * work_next (cpu_kernels.h), so a thread's consecutive items read the same weights from
 * L2 and, in the streaming form, each thread streams its own contiguous run of weights
 * from memory.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_bf16_pack.h"
#include "cpu_fused_ops.c" /* silu_mul_row, for aserve_bf16_linear_silu */
#include "cpu_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16_LINEAR_AVAILABLE 1
#include "cpu_bf16_block.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#else
#define BF16_LINEAR_AVAILABLE 0
#endif

int aserve_bf16_linear_available(void) { return BF16_LINEAR_AVAILABLE; }

/* Pack W [N, K] (rows `w_stride` elements apart; N, K multiples of 32) into `out` (N * K
 * elements): the AMX kernel's layout (cpu_bf16_pack.h). */
void aserve_bf16_pack(const uint16_t *w, int64_t w_stride, uint16_t *out, int64_t N, int64_t K) {
    bf16_tile_pack(w, w_stride, out, N, K);
}

#if BF16_LINEAR_AVAILABLE
/* Rows of x in a prefill item; 192 rows of a K = 1,024 x are 384 KiB, and the item's
 * weights (two pairs, 128 KiB at K = 1,024) stay in L2 while they pass. Up to this many
 * rows in all, the product takes the streaming form instead (decode_sums): at 33-160
 * rows, where each 6-row block over all of K left memory idle between its first block's
 * waits, that form measured 258 -> 326 GFLOP/s at 33 rows, 294 -> 335 at 48, 307 -> 339
 * at 64, 334 -> 353 at 96, 338 -> 354 at 128, 346 -> 360 at 160 and even from 192 (Zen 4,
 * 2026-12-06, the 152M model's 48 weights, two threads, alternating, medians of six). */
#define PANEL_ROWS 192
/* Rows of float sums (64 apart in acc) -> bf16, rounded to nearest even, into y. */
static void store_rows(const float *acc, int64_t rows, int cols, uint16_t *y, int64_t ldy) {
    for (int64_t r = 0; r < rows; r++)
        for (int c = 0; c < cols; c += 16)
            _mm256_storeu_si256((__m256i *)(y + r * ldy + c), to_bf16x16(_mm512_load_ps(acc + r * 64 + c)));
}

/* K chunks of 32 a decode pass takes before moving to the next rows (4 KiB of weights a
 * chunk for two pairs). Up to 16 rows, 4 chunks: a pass's 16 KiB stay in L1 while every
 * row block reads them, and the next pass's arrive just in time; the weights' stream, not
 * the arithmetic, bounds these sizes. Past 16 rows the arithmetic does, and 32 chunks:
 * a pass's 128 KiB stay in L2, and each row block's 24 sums are stored and reloaded once
 * per 512 pairs of K, not once per 64. On a Zen 4 (2026-12-06, the 152M model's 48
 * weights at 32 rows, two threads, alternating in one process, medians of 16): 348 ->
 * 366 and 347 -> 361 GFLOP/s (24 rows 345 -> 352, 341 -> 366); in the one-call decode
 * step of 32 rows, the two forms taking turns step by step in one process (192 steps
 * each), 38.18 -> 37.33 and 37.03 -> 36.15 ms, 2.3%. 16 rows measured 276
 * against 263, 8 rows 201 against 188, 1 row 31 against 29: the short passes stay there.
 * 24, 48 or 64 chunks measured as 32 or below; all of K (88 chunks for down_proj, 352
 * KiB a pass) lower, 370 against 390 at 32 rows and 281 against 345 at 16. */
static inline int64_t decode_kc(int64_t M) { return M > 16 ? 32 : 4; }

/* The sums of all rows (M <= PANEL_ROWS) against one item's tiles (all four, or with
 * `four` 0 the first two), K-outer, the streaming form: each pass over decode_kc(M)
 * chunks of K runs every 6-row block before the next chunks, carrying the accumulators in
 * acc (rows 64 apart: 8 KiB for 32 rows, in L1; up to 48 KiB, in L2), and prefetches the
 * next pass's weights into L2 while it computes: the next chunks of the item's two pair
 * runs (at tiles[0] and tiles[2]), or after its last pass the first chunks of the runs at
 * next_a and next_b (the item the thread most likely takes next; either may be NULL).
 *
 * Why: with each row block running over all of K (run_item's prefill form), the first
 * block waited on memory and the others computed with memory idle; the hardware
 * prefetchers did not run far enough ahead to overlap the two. The 152M model's 12
 * layers of weights (308 MB, from 2 MiB pages, two Zen 4 threads, 2026-12-02) took 35.9
 * ms at 32 rows that way against oneDNN's 29.7; K-outer with the L2 prefetch, 25.9 against
 * 32.1 (1 row 10.6 against 16.9 ms, 8 rows 10.0 against 17.8; 128 rows even). Prefetching
 * into L1 instead (_MM_HINT_T0) held 1 row at 13.9 ms: the next pass's 16 KiB and this
 * one's together fill a Zen 4 core's 32 KiB L1. */
static void decode_sums(const uint16_t *x, int64_t ldx, const uint16_t *const tiles[4], int four, int64_t M,
                        int64_t KC, const uint16_t *next_a, const uint16_t *next_b, float *acc) {
    const int64_t blocks = (M + 5) / 6;
    /* Blocks of 4 to 6 rows, as even as M allows (32 rows as 6, 6, 5, 5, 5, 5, not five
       of 6 and one of 2; 8 as 4 + 4), where a block of 1-3 rows issues its weight loads
       for fewer products; only 7 rows keep 6 + 1. On a Zen 4 (2026-12-06, 48 weights of
       the 152M model, two threads, medians of six to eight alternating rounds): 32 rows
       25.8 against 27.1 ms, 22 rows 18.7 against 20.6, 10 rows 9.7 against 11.3, 19 rows
       16.1 against 17.6, 8 rows 9.9 against 10.8 (with the 4-row block's registers
       mended, cpu_bf16_block.h). The same bits either way: each output's sum runs over
       K alone. */
    const int balanced = M >= 4 * blocks;
    const int64_t dkc = decode_kc(M);
    for (int64_t kc0 = 0; kc0 < KC; kc0 += dkc) {
        const int64_t nkc = KC - kc0 < dkc ? KC - kc0 : dkc;
        /* The runs to prefetch, `lines` lines each (n chunks of a pair are 32 n lines). */
        const char *ra = NULL, *rb = NULL;
        int64_t lines = 0;
        if (kc0 + dkc < KC) {
            ra = (const char *)(tiles[0] + (kc0 + dkc) * 1024);
            rb = four ? (const char *)(tiles[2] + (kc0 + dkc) * 1024) : NULL;
            lines = 32 * (KC - kc0 - dkc < dkc ? KC - kc0 - dkc : dkc);
        } else if (next_a != NULL) {
            ra = (const char *)next_a;
            rb = (const char *)next_b;
            lines = 32 * (KC < dkc ? KC : dkc);
        }
        const int64_t iters = blocks * nkc * 16, total = (ra ? lines : 0) + (rb ? lines : 0);
        prefetch_run pr = {ra, ra ? ra + 64 * lines : NULL, rb, 64 * lines, (int)((total + iters - 1) / iters)};
        for (int64_t b = 0, r = 0; b < blocks; b++) {
            const int mr = balanced ? (int)((M - r + blocks - b - 1) / (blocks - b)) : (int)(M - r < 6 ? M - r : 6);
            BF16_BLOCK_TABLE[mr - 1][four ? 3 : 1](x + r * ldx, ldx, tiles, 1024, kc0, nkc, acc + r * 64, 64,
                                                   kc0 == 0, &pr);
            r += mr;
        }
    }
}

/* Rows of float sums (64 apart in acc: a gate pair's 32, then the matching up pair's 32)
 * -> silu(gate) * up, 32 bf16 a row into y: each sum rounded to bf16 as store_rows rounds
 * it, then aserve_silu_mul's own row function, so the bits are the two calls'. */
static void store_silu_rows(const float *acc, int64_t rows, uint16_t *y, int64_t ldy) {
    uint16_t gu[64] __attribute__((aligned(64)));
    for (int64_t r = 0; r < rows; r++) {
        for (int c = 0; c < 64; c += 16)
            _mm256_store_si256((__m256i *)(gu + c), to_bf16x16(_mm512_load_ps(acc + r * 64 + c)));
        silu_mul_row(gu, gu + 32, y + r * ldy, 32, 1);
    }
}

/* Rows [m0, m1) of one item: its tiles' sums (all four, or with `four` 0 the first two),
 * stored as they are (store_rows) or, with `silu`, as silu(gate) * up of a gate pair (the
 * first two tiles) and its up pair (store_silu_rows), into y (offset to the item's
 * columns). Up to PANEL_ROWS rows in all, the streaming form (decode_sums, the runs at
 * next_a and next_b prefetched behind it; then m0 = 0, m1 = M); more, the prefill form:
 * each 6-row block over all of K, the item's weights staying in L2 while its panel of
 * rows passes. */
static void run_item(const uint16_t *x, int64_t ldx, const uint16_t *const tiles[4], int four, int64_t M, int64_t m0,
                     int64_t m1, int64_t KC, const uint16_t *next_a, const uint16_t *next_b, int silu, uint16_t *y,
                     int64_t ldy) {
    float acc[PANEL_ROWS * 64] __attribute__((aligned(64)));
    if (M <= PANEL_ROWS) {
        decode_sums(x, ldx, tiles, four, M, KC, next_a, next_b, acc);
        if (silu) store_silu_rows(acc, M, y, ldy);
        else store_rows(acc, M, four ? 64 : 32, y, ldy);
        return;
    }
    prefetch_run none = {NULL, NULL, NULL, 0, 0};
    for (int64_t r = m0; r < m1; r += 6) {
        const int mr = (int)(m1 - r < 6 ? m1 - r : 6);
        BF16_BLOCK_TABLE[mr - 1][four ? 3 : 1](x + r * ldx, ldx, tiles, 1024, 0, KC, acc, 64, 1, &none);
        if (silu) store_silu_rows(acc, mr, y + r * ldy, ldy);
        else store_rows(acc, mr, four ? 64 : 32, y + r * ldy, ldy);
    }
}

/* Two weight runs to prefetch behind an item (either may be NULL). */
typedef struct {
    const uint16_t *a, *b;
} item_runs;

/* The product a caller runs after this one: its packed weights, output width n and summed
 * width k, and whether it is the gated form (n then being I, the gate's width). */
typedef struct {
    const uint16_t *w;
    int64_t n, k;
    int silu;
} bf16_next;

/* The runs of item g of the plain product (pairs 2g and 2g + 1) and of the gated one
 * (gate pair g and up pair g + half): what its first pass reads. */
static item_runs plain_runs(const uint16_t *wp, int64_t g, int64_t pairs, int64_t KC) {
    const item_runs r = {2 * g < pairs ? wp + 2 * g * KC * 1024 : NULL,
                         2 * g + 1 < pairs ? wp + (2 * g + 1) * KC * 1024 : NULL};
    return r;
}

static item_runs silu_runs(const uint16_t *wp, int64_t g, int64_t half, int64_t KC) {
    const item_runs r = {wp + g * KC * 1024, wp + (g + half) * KC * 1024};
    return r;
}

/* Item g of the plain product: the group of pairs p = 2g, 2g + 1 (or p alone, the last of
 * an odd count), the next group's runs prefetched behind it, or where `after` is not
 * NULL (the thread's last item of its own range) those runs. */
static void linear_item(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y, int64_t ldy, int64_t M,
                        int64_t m0, int64_t m1, int64_t g, int64_t pairs, int64_t KC, const item_runs *after) {
    const int64_t p = 2 * g;
    const uint16_t *w = wp + p * KC * 1024;
    const uint16_t *const tiles[4] = {w, w + 512, w + KC * 1024, w + KC * 1024 + 512}; /* the two pairs' tiles */
    const item_runs next = after ? *after : plain_runs(wp, g + 1, pairs, KC);
    run_item(x, ldx, tiles, p + 1 < pairs, M, m0, m1, KC, next.a, next.b, 0, y + 32 * p, ldy);
}

/* Item p of the gated product: gate pair p and up pair p + half (four tiles, as one group
 * of the plain product has), pair p + 1's two runs prefetched behind it (or `after`'s,
 * as above). */
static void silu_item(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y, int64_t ldy, int64_t M,
                      int64_t m0, int64_t m1, int64_t p, int64_t half, int64_t KC, const item_runs *after) {
    const uint16_t *g = wp + p * KC * 1024, *u = wp + (p + half) * KC * 1024;
    const uint16_t *const tiles[4] = {g, g + 512, u, u + 512};
    const item_runs none = {NULL, NULL};
    const item_runs next = after ? *after : p + 1 < half ? silu_runs(wp, p + 1, half, KC) : none;
    run_item(x, ldx, tiles, 1, M, m0, m1, KC, next.a, next.b, 1, y + 32 * p, ldy);
}

typedef void (*item_fn)(const uint16_t *, int64_t, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, const item_runs *);

/* How run_items shares a product of `groups` groups over M rows between up to
 * `num_threads` threads: its thread count, and its items (group-major, `panels` a group). */
static int items_threads(int64_t M, int64_t groups, int num_threads, int64_t *items, int64_t *panels) {
    *panels = (M + PANEL_ROWS - 1) / PANEL_ROWS;
    *items = groups * *panels;
    if (num_threads > *items) num_threads = (int)*items;
    return num_threads < 1 ? 1 : num_threads;
}

/* For each of the `nt` threads of the product now running: the runs its first item of the
 * product `next` (same rows M, up to `num_threads` threads) reads first, or none where
 * that product has fewer threads. Thread t starts on its own range (work_split), so
 * these are the weights it reads first unless another thread has already taken them. */
static void next_first_runs(const bf16_next *next, int64_t M, int num_threads, int nt, item_runs *out) {
    const int64_t KC = next->k / 32, pairs = next->n / 32, groups = next->silu ? pairs : (pairs + 1) / 2;
    int64_t items, panels;
    const int nn = items_threads(M, groups, num_threads, &items, &panels);
    for (int t = 0; t < nt; t++) {
        const item_runs none = {NULL, NULL};
        const int64_t g = items * t / nn / panels; /* work_split's first item of thread t, its group */
        out[t] = t >= nn ? none : next->silu ? silu_runs(next->w, g, pairs, KC) : plain_runs(next->w, g, pairs, KC);
    }
}

/* Runs `fn` on every item (g, panel), g < groups, with M split into panels of PANEL_ROWS
 * (one panel up to PANEL_ROWS rows), items group-major between the threads (work_next);
 * `n` and KC are passed through to fn after g. With `next` (the product the caller runs
 * after this one, or NULL), each thread's last item of its own range prefetches the
 * weights that thread reads first there, where it would read the next thread's first
 * item otherwise: between products of a decode step (cpu_llama_decode_avx512.c), those
 * weights no longer come from memory while the first row block waits on them. */
static void run_items(item_fn fn, const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y, int64_t ldy,
                      int64_t M, int64_t groups, int64_t n, int64_t KC, int num_threads, const bf16_next *next) {
    int64_t items, panels;
    const int nt_asked = num_threads;
    num_threads = items_threads(M, groups, num_threads, &items, &panels);
    work_range ranges[num_threads];
    work_split(ranges, num_threads, items);
    item_runs after[num_threads];
    if (next != NULL) next_first_runs(next, M, nt_asked, num_threads, after);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        const int64_t own_last = items * (t + 1) / num_threads - 1; /* work_split's range end, less one */
        for (int64_t i; (i = work_next(ranges, t, num_threads)) >= 0;) {
            const int64_t g = i / panels, m0 = (i % panels) * PANEL_ROWS;
            fn(x, ldx, wp, y, ldy, M, m0, m0 + PANEL_ROWS < M ? m0 + PANEL_ROWS : M, g, n, KC,
               next != NULL && i == own_last ? &after[t] : NULL);
        }
    }
}

/* aserve_bf16_linear and aserve_bf16_linear_silu (below) with `next`, the product the
 * caller runs after this one (or NULL), as run_items says. */
static int bf16_linear_then(const uint16_t *x, int64_t x_stride, const uint16_t *wp, uint16_t *y, int64_t y_stride,
                            int64_t M, int64_t N, int64_t K, int num_threads, const bf16_next *next) {
    if (M < 1 || K % 32 || N % 32) return -1;
    const int64_t pairs = N / 32;
    run_items(linear_item, x, x_stride, wp, y, y_stride, M, (pairs + 1) / 2, pairs, K / 32, num_threads, next);
    return 0;
}

static int bf16_linear_silu_then(const uint16_t *x, int64_t x_stride, const uint16_t *wp, uint16_t *y,
                                 int64_t y_stride, int64_t M, int64_t I, int64_t K, int num_threads,
                                 const bf16_next *next) {
    if (M < 1 || K % 32 || I % 32 || I < 32) return -1;
    run_items(silu_item, x, x_stride, wp, y, y_stride, M, I / 32, I / 32, K / 32, num_threads, next);
    return 0;
}
#endif

/* y[M, N] (rows `y_stride` apart) = x[M, K] (rows `x_stride` apart) . W^T, W packed by
 * aserve_bf16_pack. Returns 0, or -1 when the shape is not supported (M < 1, K or N not
 * a multiple of 32) or the kernel is not built (no AVX512-BF16). */
int aserve_bf16_linear(const uint16_t *x, int64_t x_stride, const uint16_t *wp, uint16_t *y, int64_t y_stride,
                       int64_t M, int64_t N, int64_t K, int num_threads) {
#if BF16_LINEAR_AVAILABLE
    return bf16_linear_then(x, x_stride, wp, y, y_stride, M, N, K, num_threads, NULL);
#else
    (void)x; (void)x_stride; (void)wp; (void)y; (void)y_stride; (void)M; (void)N; (void)K; (void)num_threads;
    return -1;
#endif
}

/* The gated MLP's first half in one call: y[M, I] (rows `y_stride` apart) =
 * silu(x . W_gate^T) * (x . W_up^T), W = [gate; up] ([2I, K]) packed by aserve_bf16_pack,
 * so pairs [0, I/32) are the gate's and [I/32, 2 I/32) the up's, I a multiple of 32: the
 * bits of aserve_bf16_linear followed by aserve_silu_mul, without the [M, 2I] product
 * written out and read back, and without the activation's own parallel region (in the
 * one-call decode step, one barrier fewer a layer). An item is a gate pair with its up
 * pair (the plain product's group of two pairs, in arithmetic and weight bytes), over all
 * rows up to PANEL_ROWS of them, else a panel of PANEL_ROWS. Returns 0, or -1 for a
 * shape it does not take (M < 1, K or I not a multiple of 32) or without AVX512-BF16. */
int aserve_bf16_linear_silu(const uint16_t *x, int64_t x_stride, const uint16_t *wp, uint16_t *y, int64_t y_stride,
                            int64_t M, int64_t I, int64_t K, int num_threads) {
#if BF16_LINEAR_AVAILABLE
    return bf16_linear_silu_then(x, x_stride, wp, y, y_stride, M, I, K, num_threads, NULL);
#else
    (void)x; (void)x_stride; (void)wp; (void)y; (void)y_stride; (void)M; (void)I; (void)K; (void)num_threads;
    return -1;
#endif
}
