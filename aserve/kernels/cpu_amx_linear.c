/* bf16 linear layers with Intel AMX (aserve/kernels/amx_linear.py), built for
 * decode-sized batches, and within ~20% of oneDNN at prefill sizes (faster on small K).
 *
 * y[M, N] = x[M, K] . W[N, K]^T for K and N multiples of 32, bf16 in and out, float32
 * accumulation (one rounding at the end, as oneDNN and torch do). amx_linear.py pads
 * any other N with zero rows of W before packing.
 *
 * Why: at decode batch sizes a linear layer reads each weight once and does 32 (or
 * fewer) multiply-adds with it, so its time is the time to stream the weights from
 * memory. oneDNN's prepacked GEMM streamed them at ~12-15 GB/s on this machine's cores
 * (which read ~29 GB/s in a plain loop); here each thread reads its own contiguous
 * run of pre-tiled weights (from 2 MiB pages, see amx_linear.py) from start to end,
 * prefetching ahead (see PREFETCH_AHEAD_* and prefetch_block_paced): over the 152M
 * model's 12 layers (309 MB, so partly from the VM's L3), 26 GB/s at 32 rows, 31-33 GB/s
 * at 1-8 (2026-12-04, the AMX machine, which read 30-32 GB/s in a plain loop).
 *
 * Weight layout (aserve_amx_pack): W is cut into blocks of 32 output columns (a
 * "pair" of 16-column tiles) by 32 of K; block (p, kc) is two 1 KiB B tiles, tile j
 * holding W[32p + 16j + c][32kc + 2r + i] at row r, column 2c + i (AMX's pairs of K
 * per 32-bit lane). The blocks are stored p-major, so the blocks of one pair (all of
 * K) are one contiguous run of 2 KiB x K/32.
 *
 * Threads: the work is cut into items (streaming: one pair; prefill: a group of pairs for a
 * panel of rows, see GROUP_BYTES), split in contiguous ranges between `num_threads`
 * OpenMP threads, which take items from each other's ranges once their own are done
 * (work_next in cpu_kernels.h); each loads its own tile configuration (it depends on M)
 * and releases the tiles when done. The process must have asked the kernel for AMX
 * state (aserve_amx_init); torch's oneDNN does the same.
 *
 * Prefill, two threads, against torch.nn.functional.linear (oneDNN) on the same VM: the
 * 7M model's shapes (2,064 rows; K = 256, N = 1,408) 0.58 against 0.75 ms; the 152M
 * model's (4,096 rows; K = 1,024, N = 3,072) 11.6 against 9.9 ms.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_bf16_pack.h"
#include "cpu_fused_ops.c" /* silu_mul_row, for aserve_amx_linear_silu */
#include "cpu_kernels.h"

/* Bytes of weights prefetched ahead of the block being loaded. One row tile (M <= 16):
 * into L1, 4 KiB ahead. Two row tiles: into L2 only, 8 KiB ahead, which leaves L1's
 * fill buffers to the tile loads while the doubled tile arithmetic runs. Measured on 12
 * layers of the 152M model (C harness, two threads, alternated): at M = 32 the L2
 * prefetch took 11.6-12.3 against 12.2-12.7 ms; at M = 12-16 it lost 3-5%, so one row
 * tile keeps the L1 prefetch. */
#define PREFETCH_AHEAD_L1 4096
#define PREFETCH_AHEAD_L2 8192

/* Prefetches the 2 KiB block at p (32 lines) into L2 (l2 = 1) or L1, one line about
 * every four cycles rather than all 32 back to back.
 *
 * Why paced: the same prefetches issued in a burst left the weight stream well below
 * the plain read rate; spread out, it reads about as fast as a plain loop. A C loop of
 * this kernel's shape over 512 MB (two threads, the AMX machine, 2026-12-04): 26-28 GB/s
 * with the prefetches in bursts, 33-36 paced, 32 for a plain read. The kernel on the
 * 152M model's four projections x 12 layers (309 MB, two threads, medians of 15 calls
 * alternated with the burst form): 32 rows 13.8 -> 11.9 ms (the streaming tile loads
 * below included), 24 rows 13.1 -> 11.2, 16 rows 11.9 -> 11.2, 8 rows 10.8 -> 10.0,
 * 1 row 10.5 -> 9.4. Prefetch distances of 4-16 KiB, or L2 for one row tile, measured
 * the same once paced.
 * The pace is a dependency, not filler: each address waits on a multiply by an opaque 1
 * (three cycles), which the compiler cannot fold. Nops between the prefetches gained as
 * much at some code alignments and nothing at others (the same nops, -falign-loops=64
 * or not); the multiply's latency does not depend on where the loop's code falls. */
static inline __attribute__((always_inline)) void prefetch_block_paced(const char *p, const int l2) {
    int64_t one = 1;
    __asm__("" : "+r"(one)); /* opaque to the compiler: the multiply below stays */
    for (int64_t l = 0; l < 2048;) {
        if (l2)
            _mm_prefetch(p + l, _MM_HINT_T2);
        else
            _mm_prefetch(p + l, _MM_HINT_T0);
        l = (l + 64) * one;
    }
}

/* 1 when this process may use AMX tiles (asks the kernel once; idempotent). */
int aserve_amx_init(void) { return amx_request_tiles(); }

/* Pack W [N, K] (rows `w_stride` elements apart) into `out` (N * K elements): the layout
 * above (cpu_bf16_pack.h, shared with the AVX512-BF16 kernel). */
void aserve_amx_pack(const uint16_t *w, int64_t w_stride, uint16_t *out, int64_t N, int64_t K) {
    bf16_tile_pack(w, w_stride, out, N, K);
}

static void configure(int rows0, int rows1) {
    /* Tiles 0-3: accumulators (row tile a, column tile b at 2a + b); 4-5: rows 0-15 and
     * 16-31 of a chunk of x; 6-7: the two weight tiles of a block. */
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)rows0;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(rows1 ? rows1 : rows0);
    cfg.rows[6] = cfg.rows[7] = 16;
    _tile_loadconfig(&cfg);
}

/* One 32-column output block (pair p) for rows [0, rows) of x, rows <= 32, over the
 * weights' K chunks [kc0, kc1) of 32; the tile configuration must match `rows`, and
 * `two` must be rows > 16 (a constant at each call site, so each gets its own loop: a
 * branch in the loop cost more than the better prefetch won). The sums start from zero
 * when kc0 = 0, else from `part` (32 x 32 floats, the earlier chunks' sums); they end in
 * y, rounded to bf16, when kc1 = KC, else in `part`. Either way each output is summed
 * over K in order, so a block split over K gives the bits of one that is not.
 * `stream` (the first 32 rows of stream_pair: the weights come from memory once)
 * prefetches ahead; the later rows of a streamed pair, and prefill blocks, read weights
 * that are already in L2, where the prefetches only took load slots (M = 2064, K = 256,
 * N = 1408, one thread: 1.59 -> 1.40 ms without). */
static inline __attribute__((always_inline)) void pair_block(const uint16_t *x, int64_t x_stride, const char *w,
                                                             uint16_t *y, int64_t y_stride, int rows, int64_t kc0,
                                                             int64_t kc1, int64_t KC, float *part, int64_t p,
                                                             const int two, const int stream) {
    const int64_t xs = x_stride * 2; /* bytes */
    float acc[32 * 32] __attribute__((aligned(64)));
    if (kc0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, part, 128);
        _tile_loadd(1, part + 16, 128);
        if (two) {
            _tile_loadd(2, part + 16 * 32, 128);
            _tile_loadd(3, part + 16 * 32 + 16, 128);
        }
    }
    for (int64_t kc = kc0; kc < kc1; kc++) {
        const char *b = w + kc * 2048;
        if (stream && two)
            prefetch_block_paced(b + PREFETCH_AHEAD_L2, 1);
        else if (stream)
            prefetch_block_paced(b + PREFETCH_AHEAD_L1, 0);
        _tile_loadd(4, x + kc * 32, xs);
        if (stream && two) {
            /* Read once, so loaded with the non-temporal hint (tileloaddt1), which
               leaves L1 to x's tiles, read again for every pair: with the paced
               prefetch, the 12 layers above at 32 rows 12.0 -> 11.7 ms, at 24 rows
               11.6 -> 11.2; no change at 16 rows or fewer. */
            _tile_stream_loadd(6, b, 64);
            _tile_stream_loadd(7, b + 1024, 64);
        } else {
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 1024, 64);
        }
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + 16 * x_stride + kc * 32, xs);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    float *out = kc1 == KC ? acc : part;
    _tile_stored(0, out, 128);
    _tile_stored(1, out + 16, 128);
    if (two) {
        _tile_stored(2, out + 16 * 32, 128);
        _tile_stored(3, out + 16 * 32 + 16, 128);
    }
    if (kc1 < KC) return;
    for (int m = 0; m < rows; m++) {
        const __m512 lo = _mm512_load_ps(acc + m * 32), hi = _mm512_load_ps(acc + m * 32 + 16);
        const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo); /* round to nearest even */
        _mm512_storeu_si512((void *)(y + m * y_stride + 32 * p), (__m512i)v);
    }
}

/* Prefill (M > 32) blocking. Output columns go in groups of pairs whose weights fill
 * about GROUP_BYTES, which stay in L2 while the 32-row chunks of x pass (each chunk, at
 * most 32 x K, from L1 when K is small); rows go in panels of PANEL_CHUNKS chunks. An
 * item of work is one (group, panel); a group of a small weight covers more pairs, so x
 * is read fewer times (M = 2064, K = 256, N = 1408, one thread: 8 pairs a group 1.40 ms,
 * 44 pairs 0.99 ms). Panels exist for the threads: whole groups alone were too few
 * items to share out evenly (3 groups of a [768, 2048] weight on two threads left one
 * thread two groups and the other one). */
#define GROUP_BYTES (1 << 20)
#define MIN_GROUP 8
#define PANEL_CHUNKS 8

/* Streaming (the weights from memory once, pair by pair, every row on each pair while
 * it is in L2) serves every M up to 32, and M up to STREAM_MAX_ROWS on a weight of at
 * least STREAM_MIN_BYTES; the blocked prefill form serves the rest. Why: the prefill
 * form's first pass over a group reads its weights from memory in 16 KiB runs without
 * prefetch, which costs little at thousands of rows and most of the time at tens. The
 * 152M model's four projections x 12 layers (309 MB), two threads, the AMX machine,
 * 2026-12-04, medians of 7 alternated runs (o_proj, 2 MiB, in the blocked form): 64 rows
 * 27.4 -> 17.9 ms, 128 rows 35.3 -> 24.4, 256 rows 52.0 -> 42.3, 384 69.1 -> 59.1. All
 * four streamed: 512 rows 83.0 -> 80.1 ms (o_proj and down_proj even there), 768 115.9
 * -> 119.2, 1,024 146.8 -> 170.8; o_proj alone never gained (32 pairs for two threads).
 * The 7M model's weights (at most 720 KB each, in cache from step to step, one thread)
 * ran 10-20% slower streamed at 64-512 rows, hence the size floor. */
#define STREAM_MAX_ROWS 384
#define STREAM_MIN_BYTES (4 << 20)

/* Pair p for all M rows (streaming): 32 rows at a time, the first 32 reading the pair's
 * weights from memory with prefetch, the others from L2. When M is more than 32 and not
 * a multiple of it, the last block is rows [M - 32, M): it overlaps the one before, whose
 * rows it writes again with the same bits, so the tiles keep one configuration. */
static void stream_pair(const uint16_t *x, int64_t x_stride, const uint16_t *wp, uint16_t *y, int64_t y_stride,
                         int64_t M, int64_t KC, int64_t p, int cfg[2]) {
    const char *w = (const char *)(wp + p * KC * 1024);
    const int rows = M < 32 ? (int)M : 32;
    const int rows0 = rows > 16 ? 16 : rows, rows1 = rows > 16 ? rows - 16 : 0;
    if (rows0 != cfg[0] || rows1 != cfg[1]) configure(cfg[0] = rows0, cfg[1] = rows1);
    if (rows <= 16) {
        pair_block(x, x_stride, w, y, y_stride, rows, 0, KC, KC, NULL, p, 0, 1);
        return;
    }
    pair_block(x, x_stride, w, y, y_stride, rows, 0, KC, KC, NULL, p, 1, 1);
    for (int64_t m0 = 32; m0 < M; m0 += 32) {
        const int64_t m = m0 + 32 <= M ? m0 : M - 32;
        pair_block(x + m * x_stride, x_stride, w, y + m * y_stride, y_stride, 32, 0, KC, KC, NULL, p, 1, 0);
    }
}

/* Pairs [p0, p1) for rows [m0, m1) (m0 a multiple of 32): for each 32-row chunk, every
 * pair in turn, K_BLOCK chunks of K at a time. Why: over all of K a chunk of x (32 rows
 * by K) does not fit L1 once K passes ~700 (32 x 1024 x 2 bytes = 64 KiB against 48), so
 * every pair read x from L2 again, and a step's 2 KiB of x and 2 KiB of weights from L2
 * took about as long as its four products. 32 rows of 256 of K (16 KiB) stay in L1
 * across the group's pairs; each pair's partial sums (4 KiB, in `part`, pairs x 1,024
 * floats) are stored and loaded once a block. The 152M model's four projections at
 * 2,048 rows, two threads, the AMX machine: 19.1-19.7 -> 17.5-17.9 ms (blocks of 4 of K
 * chunks: slower than none; 12: as 8 but for K = 2,816; 16 and 32: K = 2,816 12-15%
 * slower); at 64 and 96 rows unchanged. kblock: K_BLOCK, or KC (all of K, `part`
 * unused). */
#define K_BLOCK 8
static void prefill_pairs(const uint16_t *x, int64_t x_stride, const uint16_t *wp, uint16_t *y, int64_t y_stride,
                          int64_t m0, int64_t m1, int64_t KC, int64_t p0, int64_t p1, float *part, int64_t kblock,
                          int cfg[2]) {
    for (; m0 < m1; m0 += 32) {
        const int rows = (int)(m1 - m0 < 32 ? m1 - m0 : 32);
        const int rows0 = rows > 16 ? 16 : rows, rows1 = rows > 16 ? rows - 16 : 0;
        if (rows0 != cfg[0] || rows1 != cfg[1]) configure(cfg[0] = rows0, cfg[1] = rows1);
        const uint16_t *xm = x + m0 * x_stride;
        uint16_t *ym = y + m0 * y_stride;
        for (int64_t kc0 = 0; kc0 < KC; kc0 += kblock) {
            const int64_t kc1 = kc0 + kblock < KC ? kc0 + kblock : KC;
            if (rows > 16)
                for (int64_t p = p0; p < p1; p++)
                    pair_block(xm, x_stride, (const char *)(wp + p * KC * 1024), ym, y_stride, rows, kc0, kc1, KC,
                               part ? part + (p - p0) * 1024 : NULL, p, 1, 0);
            else
                for (int64_t p = p0; p < p1; p++)
                    pair_block(xm, x_stride, (const char *)(wp + p * KC * 1024), ym, y_stride, rows, kc0, kc1, KC,
                               part ? part + (p - p0) * 1024 : NULL, p, 0, 0);
        }
    }
}

/* y[M, N] (rows `y_stride` apart) = x[M, K] (rows `x_stride` apart) . W^T, W packed by
 * aserve_amx_pack. Returns 0, or -1 when the shape is not supported (M < 1, K or N not
 * a multiple of 32). */
int aserve_amx_linear(const uint16_t *x, int64_t x_stride, const uint16_t *wp, uint16_t *y, int64_t y_stride,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || K % 32 || N % 32) return -1;
    const int64_t pairs = N / 32, KC = K / 32;
    /* Streaming (stream_pair): an item is one pair, each weight read once from memory.
       Blocked (the prefill form, prefill_pairs): an item is a (group, panel),
       group-major, so a thread's consecutive items share weights. */
    const int prefill = M > 32 && (M > STREAM_MAX_ROWS || N * K * 2 < STREAM_MIN_BYTES);
    int64_t group = GROUP_BYTES / ((KC > 0 ? KC : 1) * 2048); /* K = 0: zeros, one item a group */
    if (group < MIN_GROUP) group = MIN_GROUP;
    const int64_t groups = prefill ? (pairs + group - 1) / group : pairs;
    const int64_t chunks = (M + 31) / 32, panels = prefill ? (chunks + PANEL_CHUNKS - 1) / PANEL_CHUNKS : 1;
    const int64_t items = groups * panels;
    if (num_threads > items) num_threads = (int)items;
    if (num_threads < 1) num_threads = 1; /* N = 0 included: no items, one thread */
    work_range ranges[num_threads];
    work_split(ranges, num_threads, items);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        int cfg[2] = {-1, -1};
        /* A group's partial sums when K spans more than one block (prefill_pairs). */
        float *part = prefill && KC > K_BLOCK ? aligned_alloc(64, (size_t)group * 4096) : NULL;
        for (int64_t i; (i = work_next(ranges, t, num_threads)) >= 0;) {
            if (!prefill) {
                stream_pair(x, x_stride, wp, y, y_stride, M, KC, i, cfg);
                continue;
            }
            const int64_t g = i / panels, panel = i % panels;
            const int64_t p0 = g * group, p1 = p0 + group < pairs ? p0 + group : pairs;
            const int64_t m0 = panel * PANEL_CHUNKS * 32, m1 = m0 + PANEL_CHUNKS * 32 < M ? m0 + PANEL_CHUNKS * 32 : M;
            /* Without memory for the partial sums, over all of K at once. */
            prefill_pairs(x, x_stride, wp, y, y_stride, m0, m1, KC, p0, p1, part, part ? K_BLOCK : KC, cfg);
        }
        free(part);
        _tile_release();
    }
    return 0;
}

/* The gated MLP's first half in one pass: y[M, I] (rows `y_stride` apart) =
 * silu(x . W_gate^T) * (x . W_up^T), W = [gate; up] ([2I, K]) packed by aserve_amx_pack,
 * so pairs [0, I/32) are the gate's and [I/32, 2 I/32) the up's, I a multiple of 32.
 *
 * Why: at prefill sizes the two-call form writes the [M, 2I] product to memory and
 * aserve_silu_mul reads it back (the 152M model at 2,048 rows: 23 MB each way a layer,
 * ~4% of a prefill's samples in the activation alone). Here each 32-row chunk's products
 * for a group of gate pairs and the same group of up pairs go to a scratch block (at most
 * 32 rows x 1 KiB, in L1), and the activation runs on it at once. It pays where that
 * product is large and K is not small (AmxLinear.fused_silu_pays says where: it reads x
 * more often than the two-call form, whose groups at small K are larger).
 *
 * The bits are the two calls': each product is summed as aserve_amx_linear sums it and
 * rounded to bf16 the same way (pair_block), and the activation is aserve_silu_mul's own
 * row function. Items are (group, panel) as in the prefill form of aserve_amx_linear,
 * with half the weight bytes a group per side. Returns 0, or -1 for a shape it does not
 * take (M < 1, K or I not a multiple of 32). */
static inline __attribute__((always_inline)) void silu_chunk(const uint16_t *xm, int64_t x_stride,
                                                             const uint16_t *wp, uint16_t *scratch, int64_t sw,
                                                             int rows, int64_t KC, int64_t p0, int64_t p1,
                                                             int64_t half, int64_t group, float *part,
                                                             int64_t kblock, const int two) {
    for (int64_t kc0 = 0; kc0 < KC; kc0 += kblock) {
        const int64_t kc1 = kc0 + kblock < KC ? kc0 + kblock : KC;
        for (int64_t p = p0; p < p1; p++) {
            float *pg = part ? part + (p - p0) * 1024 : NULL, *pu = part ? part + (group + p - p0) * 1024 : NULL;
            pair_block(xm, x_stride, (const char *)(wp + p * KC * 1024), scratch, sw, rows, kc0, kc1, KC, pg, p - p0,
                       two, 0);
            pair_block(xm, x_stride, (const char *)(wp + (p + half) * KC * 1024), scratch + group * 32, sw, rows,
                       kc0, kc1, KC, pu, p - p0, two, 0);
        }
    }
}

int aserve_amx_linear_silu(const uint16_t *x, int64_t x_stride, const uint16_t *wp, uint16_t *y, int64_t y_stride,
                           int64_t M, int64_t I, int64_t K, int num_threads) {
    if (M < 1 || K % 32 || I % 32 || I < 32) return -1;
    const int64_t half = I / 32, KC = K / 32;
    /* Gate pairs an item (as many up pairs with them): half the prefill form's weight
       bytes a group per side, so both sides together stay in L2 as one group does (the
       152M shape at 2,048 rows, two threads, a layer: 11.7 ms; a quarter a side the
       same; a whole GROUP_BYTES a side 15.1 ms; the two calls 12.3-12.9 ms). */
    int64_t group = GROUP_BYTES / 2 / ((KC > 0 ? KC : 1) * 2048);
    if (group < MIN_GROUP / 2) group = MIN_GROUP / 2;
    if (group > 8) group = 8; /* the scratch block: 32 rows x 2 x 8 x 32 bf16 = 32 KiB, in L1 */
    const int64_t groups = (half + group - 1) / group;
    const int64_t chunks = (M + 31) / 32, panels = (chunks + PANEL_CHUNKS - 1) / PANEL_CHUNKS;
    const int64_t items = groups * panels;
    if (num_threads > items) num_threads = (int)items;
    if (num_threads < 1) num_threads = 1;
    work_range ranges[num_threads];
    work_split(ranges, num_threads, items);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        int cfg[2] = {-1, -1};
        const int64_t sw = 2 * group * 32; /* scratch row: the gate group's 32 x group columns, then the up's */
        float *part = KC > K_BLOCK ? aligned_alloc(64, (size_t)group * 2 * 4096) : NULL;
        uint16_t *scratch = aligned_alloc(64, (size_t)32 * sw * 2);
        if (!scratch || (KC > K_BLOCK && !part)) failed = 1;
        for (int64_t i; !failed && (i = work_next(ranges, t, num_threads)) >= 0;) {
            const int64_t g = i / panels, panel = i % panels;
            const int64_t p0 = g * group, p1 = p0 + group < half ? p0 + group : half;
            const int64_t m0 = panel * PANEL_CHUNKS * 32, m1 = m0 + PANEL_CHUNKS * 32 < M ? m0 + PANEL_CHUNKS * 32 : M;
            for (int64_t m = m0; m < m1; m += 32) {
                const int rows = (int)(m1 - m < 32 ? m1 - m : 32);
                const int rows0 = rows > 16 ? 16 : rows, rows1 = rows > 16 ? rows - 16 : 0;
                if (rows0 != cfg[0] || rows1 != cfg[1]) configure(cfg[0] = rows0, cfg[1] = rows1);
                const uint16_t *xm = x + m * x_stride;
                if (rows > 16)
                    silu_chunk(xm, x_stride, wp, scratch, sw, rows, KC, p0, p1, half, group, part,
                               part ? K_BLOCK : KC, 1);
                else
                    silu_chunk(xm, x_stride, wp, scratch, sw, rows, KC, p0, p1, half, group, part,
                               part ? K_BLOCK : KC, 0);
                for (int r = 0; r < rows; r++)
                    silu_mul_row(scratch + r * sw, scratch + r * sw + group * 32, y + (m + r) * y_stride + 32 * p0,
                                 32 * (p1 - p0), 1);
            }
        }
        free(part);
        free(scratch);
        _tile_release();
    }
    return failed ? -1 : 0;
}
