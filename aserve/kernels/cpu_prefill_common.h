/* What the two prefill-attention kernels share: cpu_prefill_attention.c (AMX tiles) and
 * cpu_prefill_attention_avx512.c (AVX512-BF16). The first says what the kernel computes
 * and why; this file holds the key and value layouts, the weights' exponential, the
 * online softmax's row step over a chunk of keys (chunk_row: both forms' row blocks walk
 * 32 rows' keys in chunks), the whole-row softmax of cpu_decode_prefix.h, and the entry
 * point's task loop, which calls the including form's row block. */
#ifndef ASERVE_CPU_PREFILL_COMMON_H
#define ASERVE_CPU_PREFILL_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_key_rows.h"

#define MAX_D 256

/* A 16 x 16 transpose of 32-bit words in registers: row n of the result is column n of
 * `r` (r[i] word j -> r[j] word i). 64 shuffles: pairs of rows interleaved by words, then
 * by word pairs (each 128-bit lane then holds one column's four words of four rows),
 * then the lanes moved into place in two rounds. */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + m]: in lane L, column 4L + m of rows 4g .. 4g + 3 */
    __m512i u[16];
    for (int g = 0; g < 4; g++) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    /* Column 4L + m is lane L of u[m], u[4 + m], u[8 + m], u[12 + m]: a 4 x 4 transpose
       of 128-bit lanes for each m. */
    for (int m = 0; m < 4; m++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* K^T blocks: kt[(j * DC + c) * 256 + r * 16 + n] (32-bit words) = the pair of dimensions
 * 32c + 2r, 32c + 2r + 1 of key 16j + n (zeros past len). Each 16 keys x 32 dimensions
 * is one 16 x 16 transpose of words in registers (transpose16_epi32): word by word, with
 * a store 64 bytes from the last, this layout took about a quarter of a 2,048-token
 * prefill's attention. */
static void layout_keys(const KeyRows *k, int64_t len, int64_t D, uint32_t *kt) {
    const int64_t DC = D / 32, blocks = (len + 15) / 16;
    for (int64_t j = 0; j < blocks; j++) {
        const uint16_t *rows[16];
        for (int n = 0; n < 16; n++) rows[n] = 16 * j + n < len ? (const uint16_t *)key_row(k, 16 * j + n) : NULL;
        for (int64_t c = 0; c < DC; c++) {
            __m512i r[16];
            for (int n = 0; n < 16; n++)
                r[n] = rows[n] ? _mm512_loadu_si512((const void *)(rows[n] + 32 * c)) : _mm512_setzero_si512();
            transpose16_epi32(r);
            uint32_t *dst = kt + (j * DC + c) * 256;
            for (int w = 0; w < 16; w++) _mm512_storeu_si512((void *)(dst + w * 16), r[w]);
        }
    }
}

/* V blocks: vv[(b * DT + t) * 256 + r * 16 + n] (32-bit words) = (v[32b + 2r][16t + n],
 * v[32b + 2r + 1][16t + n]) as a bf16 pair, low half first (zeros past len). */
static void layout_values(const KeyRows *v, int64_t len, int64_t D, uint32_t *vv) {
    const int64_t DT = D / 16, blocks = (len + 31) / 32;
    for (int64_t b = 0; b < blocks; b++)
        for (int r = 0; r < 16; r++) {
            const int64_t k0 = 32 * b + 2 * r, k1 = k0 + 1;
            const uint16_t *row0 = k0 < len ? key_row(v, k0) : NULL, *row1 = k1 < len ? key_row(v, k1) : NULL;
            for (int64_t t = 0; t < DT; t++) {
                const __m512i lo = row0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row0 + 16 * t)))
                                        : _mm512_setzero_si512();
                const __m512i hi = row1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row1 + 16 * t)))
                                        : _mm512_setzero_si512();
                _mm512_storeu_si512((void *)(vv + (b * DT + t) * 256 + r * 16), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "cpu_bf16_block.h"

/* Either product of a block of query rows with AVX512-BF16 (cpu_prefill_attention_avx512.c,
 * and cpu_decode_prefix.h on CPUs without AMX): out[rows, 16 * tiles] = A[rows, 2 KP] . B,
 * in blocks of 6 rows by 4 tiles (cpu_bf16_block.h): tile t's chunk 0 at
 * b + t * tile_stride, chunks chunk_stride apart (32-bit words, as the layouts count
 * them); KP a multiple of 16. `first`: 1 to write out, 0 to add to it. */
static void pa_product(const uint16_t *a, int64_t lda, int rows, const uint32_t *b, int64_t tiles,
                       int64_t tile_stride, int64_t chunk_stride, int64_t KP, float *out, int64_t ld, int first) {
    prefetch_run none = {NULL, NULL, NULL, 0, 0};
    for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
        const int nt = (int)(tiles - t0 < 4 ? tiles - t0 : 4);
        const uint16_t *tile[4];
        for (int t = 0; t < 4; t++) tile[t] = (const uint16_t *)(b + (t0 + (t < nt ? t : 0)) * tile_stride);
        for (int r0 = 0; r0 < rows; r0 += 6) {
            const int mr = rows - r0 < 6 ? rows - r0 : 6;
            BF16_BLOCK_TABLE[mr - 1][nt - 1](a + r0 * lda, lda, tile, 2 * chunk_stride, 0, KP / 16,
                                             out + r0 * ld + 16 * t0, ld, first, &none);
        }
    }
}

#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
/* The two products of a block of `rows` query rows on AMX tiles (amx_configure_rows(rows)
 * first), over whole rows of scores, for cpu_decode_prefix.h (the prefill kernel's
 * earlier row blocks; cpu_prefill_attention.c now has its own, over chunks of keys):
 *   amx_scores:  s[rows x 16 kblocks] (rows `width` floats apart) = Q K^T over the first
 *                16 * kblocks keys of kt (layout_keys), q's rows `q_stride` elements apart;
 *   amx_values:  o[rows x D] (float32, rows `ld` apart) = P V over the first 32 * pblocks
 *                weights of each row of p (bf16, `width` apart) and vv (layout_values).
 * D a multiple of 32. */
static inline void amx_scores(const uint16_t *q, int64_t q_stride, const uint32_t *kt, int64_t D, int64_t kblocks,
                              float *s, int64_t width) {
    /* Two key blocks at a time, each into its own accumulator (0 and 3), so one's
       products do not wait on the other's; with D <= 64 the query's one or two tiles
       stay loaded (1 and 4) for the whole row. */
    const int64_t DC = D / 32;
    const int keep = DC <= 2;
    if (keep) {
        _tile_loadd(1, q, q_stride * 2);
        if (DC == 2) _tile_loadd(4, q + 32, q_stride * 2);
    }
    for (int64_t j = 0; j < kblocks; j += 2) {
        const int two = j + 1 < kblocks;
        _tile_zero(0);
        if (two) _tile_zero(3);
        for (int64_t c = 0; c < DC; c++) {
            if (!keep) _tile_loadd(1, q + 32 * c, q_stride * 2);
            _tile_loadd(2, kt + (j * DC + c) * 256, 64);
            if (two) _tile_loadd(6, kt + ((j + 1) * DC + c) * 256, 64);
            if (keep && c == 1) {
                _tile_dpbf16ps(0, 4, 2);
                if (two) _tile_dpbf16ps(3, 4, 6);
            } else {
                _tile_dpbf16ps(0, 1, 2);
                if (two) _tile_dpbf16ps(3, 1, 6);
            }
        }
        _tile_stored(0, s + 16 * j, width * 4);
        if (two) _tile_stored(3, s + 16 * (j + 1), width * 4);
    }
}

/* Four column tiles t0 .. t0 + 3 (or two: n = 2) of P V, the weights' tile loaded once
 * for them all and each product into its own accumulator: one accumulator took every
 * product of a column tile in a chain, each waiting on the one before. */
#define AMX_PV_STEP(acc, btile, t)                                 \
    _tile_loadd(btile, vv + (b * DT + (t)) * 256, 64);             \
    _tile_dpbf16ps(acc, 1, btile)

static inline void amx_values(const uint16_t *p, int64_t width, const uint32_t *vv, int64_t D, int64_t pblocks,
                              float *o, int64_t ld) {
    const int64_t DT = D / 16;
    for (int64_t t0 = 0; t0 < DT; t0 += 4) {
        const int four = DT - t0 >= 4;
        _tile_zero(0);
        _tile_zero(3);
        if (four) {
            _tile_zero(4);
            _tile_zero(5);
        }
        for (int64_t b = 0; b < pblocks; b++) {
            _tile_loadd(1, p + 32 * b, width * 2);
            AMX_PV_STEP(0, 2, t0);
            AMX_PV_STEP(3, 6, t0 + 1);
            if (four) {
                AMX_PV_STEP(4, 7, t0 + 2);
                AMX_PV_STEP(5, 2, t0 + 3);
            }
        }
        _tile_stored(0, o + 16 * t0, ld * 4);
        _tile_stored(3, o + 16 * (t0 + 1), ld * 4);
        if (four) {
            _tile_stored(4, o + 16 * (t0 + 2), ld * 4);
            _tile_stored(5, o + 16 * (t0 + 3), ld * 4);
        }
    }
}
#undef AMX_PV_STEP
#endif

/* The row stride, in elements, of a row block's scores (float) and weights (bf16) for
 * `padded` keys: 32 more, so that the 16 rows of a tile stored to or loaded from them
 * fall in different L1 sets. At a power-of-two width they are a multiple of 4 KiB apart
 * and all land in one set of 12 ways, and each tile access evicts its own lines. */
static inline int64_t row_width(int64_t padded) { return padded + 32; }

/* 2^y for the softmax weights, which are rounded to bf16 (8 bits of mantissa) before the
 * second product and summed in float32; the caller folds log2(e) into its scale, so the
 * scores become y in one fmsub. With AVX512DQ (every AVX-512 CPU these kernels serve):
 * f = y - floor(y) in [0, 1) by vreduceps, 2^f by a cubic fitted there for the least
 * relative error (7.5e-5 at most; the bf16 rounding that follows is 2e-3), and vscalefps
 * multiplies by 2^floor(y) itself; -inf gives f = 0 and 2^-inf = 0. Without it: n =
 * round(y), r = y - n (|r| <= 1/2), the same cubic's fit on that interval, y clamped at
 * -150 first so that -inf gives 0, not NaN. The DQ form is two instructions fewer a
 * vector (the 152M shape's prefill-attention layer at 2,048 tokens, alternated:
 * 8.5-8.9 -> 7.9-8.4 ms, 2026-12-05). */
#define LOG2E 1.44269504088896341f
/* c3 x^3 + c2 x^2 + c1 x + c0, by Horner's rule (three FMAs). */
static inline __m512 cubic(__m512 x, float c3, float c2, float c1, float c0) {
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(c3), x, _mm512_set1_ps(c2));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(c1));
    return _mm512_fmadd_ps(p, x, _mm512_set1_ps(c0));
}

static inline __m512 exp2_weights(__m512 y) {
#if defined(__AVX512DQ__)
    const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(cubic(f, 0.07802451f, 0.22606725f, 0.69583344f, 0.99992526f), y);
#else
    y = _mm512_max_ps(y, _mm512_set1_ps(-150.0f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(cubic(_mm512_sub_ps(y, n), 0.05517167f, 0.24261115f, 0.69326097f, 0.99992806f), n);
#endif
}

/* The maximum of row[0 .. n) (-3e38 when n = 0): four independent chains of vmaxps,
 * where one waited on each maximum before the next (the pass took a tenth of the
 * prefill attention's samples). */
static inline float row_max(const float *row, int64_t n) {
    __m512 m0 = _mm512_set1_ps(-3.0e38f), m1 = m0, m2 = m0, m3 = m0;
    int64_t t = 0;
    for (; t + 64 <= n; t += 64) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(row + t));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(row + t + 16));
        m2 = _mm512_max_ps(m2, _mm512_loadu_ps(row + t + 32));
        m3 = _mm512_max_ps(m3, _mm512_loadu_ps(row + t + 48));
    }
    for (; t + 16 <= n; t += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(row + t));
    float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
    for (; t < n; t++) m = row[t] > m ? row[t] : m;
    return m;
}

/* A row's weights: prow[0 .. n) = 2^(row * sc - ms) rounded to bf16 (n > 0), then zeros up
 * to `padded` (a multiple of 16); returns *acc plus the unrounded weights, by lanes.
 * ymax (NULL: not wanted) gets the largest exponent row * sc - ms, by lanes. */
static inline __m512 weights_row(const float *row, uint16_t *prow, int64_t n, int64_t padded, __m512 sc, __m512 ms,
                                 __m512 acc, __m512 *ymax) {
    __m512 mx0 = _mm512_set1_ps(-INFINITY), mx1 = mx0;
    int64_t t = 0;
    __m512 acc1 = _mm512_setzero_ps(); /* a second chain of sums: an add waits ~4 cycles on the last */
    for (; t + 32 <= n; t += 32) {
        const __m512 y0 = _mm512_fmsub_ps(_mm512_loadu_ps(row + t), sc, ms);
        const __m512 y1 = _mm512_fmsub_ps(_mm512_loadu_ps(row + t + 16), sc, ms);
        if (ymax) {
            mx0 = _mm512_max_ps(mx0, y0);
            mx1 = _mm512_max_ps(mx1, y1);
        }
        const __m512 e0 = exp2_weights(y0), e1 = exp2_weights(y1);
        acc = _mm512_add_ps(acc, e0);
        acc1 = _mm512_add_ps(acc1, e1);
#if defined(__AVX512BF16__)
        _mm512_storeu_si512((void *)(prow + t), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
#else
        _mm256_storeu_si256((__m256i *)(prow + t), to_bf16x16(e0));
        _mm256_storeu_si256((__m256i *)(prow + t + 16), to_bf16x16(e1));
#endif
    }
    acc = _mm512_add_ps(acc, acc1);
    for (; t + 16 <= n; t += 16) {
        const __m512 y = _mm512_fmsub_ps(_mm512_loadu_ps(row + t), sc, ms);
        if (ymax) mx0 = _mm512_max_ps(mx0, y);
        const __m512 e = exp2_weights(y);
        acc = _mm512_add_ps(acc, e);
        _mm256_storeu_si256((__m256i *)(prow + t), to_bf16x16(e));
    }
    if (t < n) { /* the last keys, fewer than 16 */
        const __mmask16 live = (__mmask16)((1u << (n - t)) - 1);
        const __m512 y = _mm512_fmsub_ps(_mm512_loadu_ps(row + t), sc, ms);
        if (ymax) mx0 = _mm512_mask_max_ps(mx0, live, mx0, y);
        const __m512 e = _mm512_maskz_mov_ps(live, exp2_weights(y));
        acc = _mm512_add_ps(acc, e);
        _mm256_storeu_si256((__m256i *)(prow + t), to_bf16x16(e));
        t += 16;
    }
    for (; t < padded; t += 16) _mm256_storeu_si256((__m256i *)(prow + t), _mm256_setzero_si256());
    if (ymax) *ymax = _mm512_max_ps(mx0, mx1);
    return acc;
}

/* One row of softmax numerators: row[0 .. n) (float scores) -> prow (bf16 weights
 * e^((s - max) * scale), rounded; zeros after them up to `padded`, a multiple of 16).
 * Returns the sum of the unrounded weights; *m_scaled gets max * scale. */
static inline float softmax_row(const float *row, uint16_t *prow, int64_t n, int64_t padded, float scale,
                                float *m_scaled) {
    const float m = row_max(row, n);
    *m_scaled = m * scale;
    /* e^((s - m) * scale) = 2^(s * c - m * c), c = scale * log2(e) */
    const __m512 ms = _mm512_set1_ps(m * scale * LOG2E), sc = _mm512_set1_ps(scale * LOG2E);
    return _mm512_reduce_add_ps(weights_row(row, prow, n, padded, sc, ms, _mm512_setzero_ps(), NULL));
}

/* The softmax of a block of query rows between the two products: s (rows x width
 * floats, the scores of keys 0 .. ctx + q0 + i for row i) -> p (rows x width bf16, the
 * weights rounded, zeros past each row's last key up to 32 * pblocks), and inv_sum (1 / the
 * sum of each row's unrounded weights). */
static inline void softmax_rows(const float *s, uint16_t *p, int rows, int64_t width, int64_t ctx, int64_t q0,
                                int64_t pblocks, float scale, float *inv_sum) {
    for (int i = 0; i < rows; i++) {
        float m;
        inv_sum[i] = 1.0f / softmax_row(s + i * width, p + i * width, ctx + q0 + i + 1, 32 * pblocks, scale, &m);
    }
}

/* How far (in powers of two) a chunk's scores may rise above a row's running maximum
 * and still be weighted against it: weights up to 2^16, which bf16 and the float32 sums
 * hold without loss. */
#define HEADROOM 16.0f

/* One row's step of the online softmax over a chunk of keys (both forms' row blocks):
 * its n visible scores (n <= 0: it sees none of the chunk) -> its weights, zeros after
 * them up to `padded` (a multiple of 32); its running maximum *m (scaled by sc = scale *
 * log2(e)), its 16-lane sum and its output orow (D floats), rescaled when *m moves. On a
 * row's first chunk (*m = -inf, its sum zero) orow is not read: the AVX512-BF16 form's
 * first P V writes it rather than adding to it.
 *
 * After a row's first chunk the weights are taken against the maximum so far, in one
 * pass over the scores; only when some score rises more than HEADROOM above it is the
 * chunk's maximum found and the row rescaled, and its weights taken again. A weight's
 * rounding to bf16 is relative, so a reference below the true maximum loses nothing.
 * Why: finding every chunk's maximum first (a pass over its scores, a reduction across
 * lanes, a scalar exp2 whenever it rose) was an eighth of the kernel. */
static inline void chunk_row(const float *srow, uint16_t *prow, int64_t n, int64_t padded, float sc, float *m,
                             float *sum, float *orow, int64_t D) {
    if (n <= 0) {
        for (int64_t t = 0; t < padded; t += 16) _mm256_storeu_si256((__m256i *)(prow + t), _mm256_setzero_si256());
        return;
    }
    __m512 acc = _mm512_load_ps(sum);
    const __m512 scv = _mm512_set1_ps(sc);
    if (*m != -INFINITY) {
        __m512 ymax;
        const __m512 lazy = weights_row(srow, prow, n, padded, scv, _mm512_set1_ps(*m), acc, &ymax);
        if (!_mm512_cmp_ps_mask(ymax, _mm512_set1_ps(HEADROOM), _CMP_GT_OQ)) {
            _mm512_store_ps(sum, lazy);
            return;
        }
    }
    const float mx = row_max(srow, n) * sc;
    if (mx > *m) {
        const __m512 a = _mm512_set1_ps(exp2f(*m - mx)); /* 0 on the first chunk: m = -inf */
        acc = _mm512_mul_ps(acc, a);
        if (*m != -INFINITY)
            for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(orow + d, _mm512_mul_ps(_mm512_load_ps(orow + d), a));
        *m = mx;
    }
    _mm512_store_ps(sum, weights_row(srow, prow, n, padded, scv, _mm512_set1_ps(*m), acc, NULL));
}

/* The chunked row blocks' shape, shared by both forms: query rows a block, keys a step
 * of the online softmax, and the row strides of a chunk's scores (floats) and weights
 * (bf16), off a power of two as row_width says. */
#define BLOCK_ROWS 32
#define KEY_CHUNK 256
#define SCORE_STRIDE (KEY_CHUNK + 16)
#define WEIGHT_STRIDE (KEY_CHUNK + 32)

#ifdef SCORE_BUFFERS
/* One chunked row block's working set, reused by every block of a task. SCORE_BUFFERS,
 * set by the including form before this header: the chunks' scores it holds at once (the
 * AMX form computes the next chunk's while it weighs this one's: 2). */
typedef struct {
    float s[SCORE_BUFFERS][BLOCK_ROWS * SCORE_STRIDE] __attribute__((aligned(64))); /* chunks' scores */
    uint16_t p[BLOCK_ROWS * WEIGHT_STRIDE] __attribute__((aligned(64)));             /* a chunk's weights */
    float o[BLOCK_ROWS * MAX_D] __attribute__((aligned(64)));    /* the rows' outputs, rows D apart */
    float sum[BLOCK_ROWS * 16] __attribute__((aligned(64)));     /* per row, 16 lanes of its sum */
    float m[BLOCK_ROWS];                                         /* per row, its scaled maximum */
} block_scratch;

/* A task's scratch for its row blocks, whatever the width. */
static size_t work_bytes(int64_t width) {
    (void)width;
    return sizeof(block_scratch);
}
#endif

/* The end of a chunked row block: each of its rows' outputs (o, rows D apart) divided by
 * the sum of its weights (16 lanes a row in sum), to bf16, into rows q0 .. q0 + rows - 1
 * of out. */
static inline void finish_rows(const float *o, const float *sum, int rows, int64_t D, uint16_t *out,
                               int64_t out_stride, int64_t q0) {
    for (int i = 0; i < rows; i++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(sum + 16 * i)));
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(out + (q0 + i) * out_stride + d),
                                to_bf16x16(_mm512_mul_ps(_mm512_load_ps(o + i * D + d), inv)));
    }
}

/* The including file's product of rows q0 .. q0 + rows - 1 (rows <= its block_rows) of one
 * query head: see row_block in cpu_prefill_attention_avx512.c and row_block32 in
 * cpu_prefill_attention.c. `work`: the task's scratch for it (work_bytes(width) bytes,
 * 64-byte aligned), `width` the row stride for keys padded to 32 (row_width). */
typedef void (*row_block_fn)(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride, int64_t q0,
                             int rows, int64_t ctx, int64_t D, float scale, const uint32_t *kt, const uint32_t *vv,
                             void *work, int64_t width);

/* One form of the kernel for prefill_run: its row block, how many query rows it takes
 * at a time, its scratch, and what each task's thread runs at the task's end (or NULL). */
typedef struct {
    row_block_fn row_block;
    int block_rows;
    size_t (*work_bytes)(int64_t width);
    void (*task_done)(void);
} prefill_form;

/* The entry point's body (the kernels' aserve_prefill_attention, cpu_prefill_attention.c
 * says its arguments) over the including file's form. Returns 0, or -1 for a shape it
 * does not take (D not a multiple of 32 or over MAX_D, Hq not a multiple of Hk) or when
 * scratch memory cannot be had. */
static int prefill_run(const prefill_form *form, const uint16_t *q, int64_t q_stride, const uint16_t *k,
                       int64_t k_stride, const uint16_t *v, int64_t v_stride, uint16_t *out, int64_t out_stride,
                       const int64_t *starts, const int64_t *lens, const int64_t *ctx, int64_t n_prompts,
                       const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *block_tables,
                       int64_t max_blocks, int64_t block_size, int64_t stride_block, int64_t stride_token,
                       int64_t stride_head, int64_t Hq, int64_t Hk, int64_t D, float scale, int num_threads) {
    if (D % 32 || D > MAX_D || Hk < 1 || Hq % Hk) return -1;
    const int64_t group = Hq / Hk, tasks = n_prompts * Hk;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1 && tasks > 1) reduction(| : failed)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t i = task / Hk, h = task % Hk, start = starts[i], len = lens[i];
        const int64_t c0 = ctx ? ctx[i] : 0, total = c0 + len;
        if (len <= 0) continue;
        const int64_t padded = (total + 31) / 32 * 32, width = row_width(padded);
        /* kt, vv: padded x D bf16 each; then the row block's own scratch. */
        char *scratch = aligned_alloc(64, (size_t)(padded * D * 4) + form->work_bytes(width));
        if (!scratch) {
            failed |= 1;
            continue;
        }
        uint32_t *kt = (uint32_t *)scratch, *vv = (uint32_t *)(scratch + padded * D * 2);
        void *work = scratch + padded * D * 4;
        KeyRows ks = {k + start * k_stride + h * D, 2, k_stride, NULL, 0, 0, 0};
        KeyRows vs = {v + start * v_stride + h * D, 2, v_stride, NULL, 0, 0, 0};
        if (c0 > 0) {
            const int64_t *table = block_tables + i * max_blocks;
            ks = (KeyRows){k_cache + h * stride_head, 2, 0, table, block_size, stride_block, stride_token};
            vs = (KeyRows){v_cache + h * stride_head, 2, 0, table, block_size, stride_block, stride_token};
        }
        layout_keys(&ks, total, D, kt);
        layout_values(&vs, total, D, vv);
        for (int64_t g = 0; g < group; g++) {
            const int64_t hq = h * group + g;
            for (int64_t q0 = 0; q0 < len; q0 += form->block_rows)
                form->row_block(q + start * q_stride + hq * D, q_stride, out + start * out_stride + hq * D,
                                out_stride, q0, (int)(len - q0 < form->block_rows ? len - q0 : form->block_rows), c0,
                                D, scale, kt, vv, work, width);
        }
        if (form->task_done) form->task_done();
        free(scratch);
    }
    return failed ? -1 : 0;
}

#endif
