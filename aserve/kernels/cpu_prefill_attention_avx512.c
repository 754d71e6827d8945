/* Causal attention of prefill chunks on CPU with AVX512-BF16 (vdpbf16ps), bf16: the AMX
 * kernel (cpu_prefill_attention.c, which says what is computed) for CPUs without AMX,
 * an AMD EPYC Zen 4 say. The key and value layouts, the softmax and the task loop are
 * the AMX kernel's (cpu_prefill_common.h); only the two products differ.
 *
 * Why: there torch's CPU flash kernel took 1.1 of a 152M model's 2.6 s prefill of 2,048
 * tokens (~47 GFLOP/s; the linear layers ran at ~430). Both products here are the bf16
 * linear kernel's register block (cpu_bf16_linear.c): up to 6 query rows by 4 tiles of
 * 16 outputs, 24 float accumulators, per pair of the summed dimension 4 loads of the
 * layout's 64-byte rows (exactly a vdpbf16ps operand: 16 lanes of a pair each) and 6
 * broadcasts of the rows' pairs.
 *   S = Q K^T: the outputs are keys (tiles of 16 keys), summed over D;
 *   O = P V:   the outputs are D (tiles of 16 columns), summed over the keys.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_prefill_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PREFILL_AVX512_AVAILABLE 1

/* c[i][t] += A row i's pair kp . B tile t's row for kp, for kp < KP: A rows lda bf16
 * apart; tile t's row for pair kp at b + t * tile_stride + (kp / 16) * chunk_stride +
 * (kp % 16) * 16 (32-bit words). Sums into out (float, rows ld apart, tile t at column
 * 16 t), overwriting it. */
#define PA_ROW(R)                                                                                                    \
    if (MR > R) {                                                                                                   \
        uint32_t w_;                                                                                                \
        memcpy(&w_, a + R * lda + 2 * kp, 4);                                                                       \
        const __m512bh x = (__m512bh)_mm512_set1_epi32((int)w_);                                                    \
        c##R##0 = _mm512_dpbf16_ps(c##R##0, x, b0);                                                                 \
        if (NT > 1) c##R##1 = _mm512_dpbf16_ps(c##R##1, x, b1);                                                     \
        if (NT > 2) c##R##2 = _mm512_dpbf16_ps(c##R##2, x, b2);                                                     \
        if (NT > 3) c##R##3 = _mm512_dpbf16_ps(c##R##3, x, b3);                                                     \
    }
#define PA_STORE(R)                                                                                                  \
    if (MR > R) {                                                                                                   \
        _mm512_storeu_ps(out + R * ld, c##R##0);                                                                    \
        if (NT > 1) _mm512_storeu_ps(out + R * ld + 16, c##R##1);                                                   \
        if (NT > 2) _mm512_storeu_ps(out + R * ld + 32, c##R##2);                                                   \
        if (NT > 3) _mm512_storeu_ps(out + R * ld + 48, c##R##3);                                                   \
    }
#define PA_BLOCK(MR_, NT_)                                                                                           \
    static void pa_block_##MR_##_##NT_(const uint16_t *a, int64_t lda, const uint32_t *b, int64_t tile_stride,     \
                                       int64_t chunk_stride, int64_t KP, float *out, int64_t ld) {                  \
        enum { MR = MR_, NT = NT_ };                                                                                \
        const __m512 z = _mm512_setzero_ps();                                                                       \
        __m512 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z, c20 = z, c21 = z, c22 = z,    \
               c23 = z, c30 = z, c31 = z, c32 = z, c33 = z, c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z,   \
               c52 = z, c53 = z;                                                                                    \
        for (int64_t kc = 0; kc * 16 < KP; kc++) {                                                                  \
            const uint32_t *bc = b + kc * chunk_stride;                                                             \
            for (int r = 0; r < 16; r++) {                                                                          \
                const int64_t kp = kc * 16 + r;                                                                     \
                const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bc + r * 16);                                     \
                const __m512bh b1 = NT > 1 ? (__m512bh)_mm512_loadu_si512(bc + tile_stride + r * 16) : b0;         \
                const __m512bh b2 = NT > 2 ? (__m512bh)_mm512_loadu_si512(bc + 2 * tile_stride + r * 16) : b0;     \
                const __m512bh b3 = NT > 3 ? (__m512bh)_mm512_loadu_si512(bc + 3 * tile_stride + r * 16) : b0;     \
                PA_ROW(0) PA_ROW(1) PA_ROW(2) PA_ROW(3) PA_ROW(4) PA_ROW(5)                                         \
            }                                                                                                       \
        }                                                                                                           \
        PA_STORE(0) PA_STORE(1) PA_STORE(2) PA_STORE(3) PA_STORE(4) PA_STORE(5)                                     \
    }
#define PA_BLOCKS(MR) PA_BLOCK(MR, 1) PA_BLOCK(MR, 2) PA_BLOCK(MR, 3) PA_BLOCK(MR, 4)
PA_BLOCKS(1)
PA_BLOCKS(2)
PA_BLOCKS(3)
PA_BLOCKS(4)
PA_BLOCKS(5)
PA_BLOCKS(6)

typedef void (*pa_block_fn)(const uint16_t *, int64_t, const uint32_t *, int64_t, int64_t, int64_t, float *, int64_t);
#define PA_ROW_OF(MR) {pa_block_##MR##_1, pa_block_##MR##_2, pa_block_##MR##_3, pa_block_##MR##_4}
static const pa_block_fn PA_TABLE[6][4] = {PA_ROW_OF(1), PA_ROW_OF(2), PA_ROW_OF(3), PA_ROW_OF(4), PA_ROW_OF(5),
                                           PA_ROW_OF(6)};

/* out[rows, 16 * tiles] = A[rows, 2 KP] . B, in blocks of 6 rows by 4 tiles (see PA_BLOCK). */
static void pa_product(const uint16_t *a, int64_t lda, int rows, const uint32_t *b, int64_t tiles,
                       int64_t tile_stride, int64_t chunk_stride, int64_t KP, float *out, int64_t ld) {
    for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
        const int nt = (int)(tiles - t0 < 4 ? tiles - t0 : 4);
        for (int r0 = 0; r0 < rows; r0 += 6) {
            const int mr = rows - r0 < 6 ? rows - r0 : 6;
            PA_TABLE[mr - 1][nt - 1](a + r0 * lda, lda, b + t0 * tile_stride, tile_stride, chunk_stride, KP,
                                     out + r0 * ld + 16 * t0, ld);
        }
    }
}

/* Rows q0 .. q0 + rows - 1 of one query head: cpu_prefill_attention.c's row_block, with
 * the products above. */
static void row_block(const uint16_t *q, int64_t q_stride, uint16_t *out, int64_t out_stride, int64_t q0, int rows,
                      int64_t ctx, int64_t D, float scale, const uint32_t *kt, const uint32_t *vv, float *s,
                      uint16_t *p, int64_t width) {
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
    return prefill_run(row_block, NULL, q, q_stride, k, k_stride, v, v_stride, out, out_stride, starts, lens, ctx,
                       n_prompts, k_cache, v_cache, block_tables, max_blocks, block_size, stride_block, stride_token,
                       Hq, Hk, D, scale, num_threads);
#else
    return -1;
#endif
}
