/* float32 linear layers on AVX2 + FMA: y = x W^T (+ bias), for the float32 weights that
 * CPUs without native bf16 products compute in (aserve/kernels/f32_linear.py).
 *
 * Why: at decode batch sizes (a few to 32 rows) MKL's sgemm reached about half of this
 * machine's float32 peak on the 7M model's weights (54-56 GFLOP/s on one Zen 3 core),
 * repacking the weight on every call. Here the weight is packed once, in panels of 16
 * output columns: panel p holds, for every k, the 16 weights W[16p .. 16p + 15][k]
 * contiguously (zeros past the last column), so a pass over one panel streams it in
 * order. Six rows of x share each panel load: per k, two vector loads of the panel and
 * six broadcasts of x feed twelve FMAs into twelve accumulators, all in registers.
 * Measured on one core (4 layers of the 7M shapes, weights cycled): 32 rows 66-73
 * against MKL's 54-56 GFLOP/s, 8 rows 44 against 27, 512 rows 85 against 78, 2,048
 * rows even (83-84). The 152M model's weights (3 layers cycled, two cores) against
 * oneDNN on its prepacked copy: 32 rows 122 against 99, 8 rows 70 against 55, 2,048
 * rows 158 against 132 GFLOP/s.
 *
 * Each output is one FMA chain over k in order, then + bias (one rounding): the result
 * does not depend on the thread count (threads split the panels) or on the rows around
 * it. Built with -march=native (aserve/kernels/cbuild.py); without AVX2 and FMA the
 * functions report that they are unavailable and Python keeps MKL.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define F32_LINEAR_AVAILABLE 1
#else
#define F32_LINEAR_AVAILABLE 0
#endif

#define F32_PANEL 16 /* output columns a panel holds */

int aserve_f32_linear_available(void) { return F32_LINEAR_AVAILABLE; }

/* Elements of the packed copy of an [n, k] weight. */
int64_t aserve_f32_packed_numel(int64_t n, int64_t k) { return (n + F32_PANEL - 1) / F32_PANEL * F32_PANEL * k; }

/* w: [n, k] row-major (an nn.Linear weight) -> out: aserve_f32_packed_numel(n, k)
 * elements, 32-byte aligned. */
void aserve_f32_pack(const float *w, int64_t n, int64_t k, float *out) {
    const int64_t panels = (n + F32_PANEL - 1) / F32_PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < F32_PANEL; j++) {
                const int64_t col = p * F32_PANEL + j;
                out[(p * k + kk) * F32_PANEL + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

#if F32_LINEAR_AVAILABLE
/* Stores one row's 16 accumulators (ncols of them: the last panel may be narrower),
 * each plus its bias when there is one. */
static inline void f32_store_row(float *y, __m256 a0, __m256 a1, int ncols, const float *bias) {
    if (ncols == F32_PANEL) {
        if (bias) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
        }
        _mm256_storeu_ps(y, a0);
        _mm256_storeu_ps(y + 8, a1);
        return;
    }
    float tmp[F32_PANEL];
    _mm256_storeu_ps(tmp, a0);
    _mm256_storeu_ps(tmp + 8, a1);
    for (int j = 0; j < ncols; j++) y[j] = bias ? tmp[j] + bias[j] : tmp[j];
}

/* MRV (1-6) rows of x against one panel; `next` (or NULL): a panel to prefetch, a line
 * (one k-step of it) per k-step. Written out with named accumulators rather than an
 * array: with an array indexed in the store loop, GCC kept the accumulators on the stack
 * and stored them on every k (30 GFLOP/s instead of 70). */
#define F32_BLOCK(MRV)                                                                                                \
    static void f32_block##MRV(const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy, int64_t k,       \
                               int ncols, const float *bias, const float *next) {                                    \
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,          \
               c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                                                \
        const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx,               \
                    *x5 = x + 5 * ldx;                                                                               \
        for (int64_t kk = 0; kk < k; kk++) {                                                                         \
            if (next != NULL) _mm_prefetch((const char *)(next + kk * F32_PANEL), _MM_HINT_T1);                     \
            const __m256 b0 = _mm256_load_ps(wp + kk * F32_PANEL), b1 = _mm256_load_ps(wp + kk * F32_PANEL + 8);    \
            __m256 a = _mm256_broadcast_ss(x0 + kk);                                                                 \
            c00 = _mm256_fmadd_ps(a, b0, c00);                                                                       \
            c01 = _mm256_fmadd_ps(a, b1, c01);                                                                       \
            if (MRV > 1) { a = _mm256_broadcast_ss(x1 + kk); c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11); } \
            if (MRV > 2) { a = _mm256_broadcast_ss(x2 + kk); c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21); } \
            if (MRV > 3) { a = _mm256_broadcast_ss(x3 + kk); c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31); } \
            if (MRV > 4) { a = _mm256_broadcast_ss(x4 + kk); c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41); } \
            if (MRV > 5) { a = _mm256_broadcast_ss(x5 + kk); c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51); } \
        }                                                                                                            \
        f32_store_row(y, c00, c01, ncols, bias);                                                                     \
        if (MRV > 1) f32_store_row(y + ldy, c10, c11, ncols, bias);                                                  \
        if (MRV > 2) f32_store_row(y + 2 * ldy, c20, c21, ncols, bias);                                              \
        if (MRV > 3) f32_store_row(y + 3 * ldy, c30, c31, ncols, bias);                                              \
        if (MRV > 4) f32_store_row(y + 4 * ldy, c40, c41, ncols, bias);                                              \
        if (MRV > 5) f32_store_row(y + 5 * ldy, c50, c51, ncols, bias);                                              \
    }
F32_BLOCK(1)
F32_BLOCK(2)
F32_BLOCK(3)
F32_BLOCK(4)
F32_BLOCK(5)
F32_BLOCK(6)
#endif

#if F32_LINEAR_AVAILABLE && defined(__AVX512F__)
#define F32_AVX512 1
/* The AVX-512 form: a panel's 16 columns are one register, and a block is up to 6 rows
 * against up to 4 panels (24 accumulators; per k, 4 loads and 6 broadcasts feed 24
 * FMAs of 16 lanes). Each output is the same FMA chain over k in the same order as the
 * AVX2 form's, so the two give the same bits. */
static inline void f32_store_row512(float *y, __m512 a, int ncols, const float *bias) {
    const __mmask16 m = ncols >= F32_PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1u);
    if (bias) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(m, bias));
    _mm512_mask_storeu_ps(y, m, a);
}

#define F32_ROW512(R)                                                                                                 \
    if (mrv > R) {                                                                                                   \
        const __m512 a = _mm512_set1_ps(x[R * ldx + kk]);                                                            \
        c##R##0 = _mm512_fmadd_ps(a, b0, c##R##0);                                                                   \
        if (np_ > 1) c##R##1 = _mm512_fmadd_ps(a, b1, c##R##1);                                                       \
        if (np_ > 2) c##R##2 = _mm512_fmadd_ps(a, b2, c##R##2);                                                       \
        if (np_ > 3) c##R##3 = _mm512_fmadd_ps(a, b3, c##R##3);                                                       \
    }
#define F32_STORE512(R)                                                                                               \
    if (mrv > R) {                                                                                                   \
        float *yr = y + R * ldy;                                                                                     \
        f32_store_row512(yr, c##R##0, ncols[0], bias);                                                               \
        if (np_ > 1) f32_store_row512(yr + F32_PANEL, c##R##1, ncols[1], bias ? bias + F32_PANEL : NULL);            \
        if (np_ > 2) f32_store_row512(yr + 2 * F32_PANEL, c##R##2, ncols[2], bias ? bias + 2 * F32_PANEL : NULL);    \
        if (np_ > 3) f32_store_row512(yr + 3 * F32_PANEL, c##R##3, ncols[3], bias ? bias + 3 * F32_PANEL : NULL);    \
    }
#define F32_BLOCK512(MRV, NP)                                                                                         \
    static void f32_block512_##MRV##_##NP(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy,        \
                                          int64_t k, const int *ncols, const float *bias) {                          \
        enum { mrv = MRV, np_ = NP }; /* for the row macros */                                                       \
        const __m512 z = _mm512_setzero_ps();                                                                        \
        __m512 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z, c20 = z, c21 = z, c22 = z,     \
               c23 = z, c30 = z, c31 = z, c32 = z, c33 = z, c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z,    \
               c52 = z, c53 = z;                                                                                     \
        const int64_t ps = k * F32_PANEL; /* floats between two panels */                                           \
        for (int64_t kk = 0; kk < k; kk++) {                                                                         \
            const float *wk = w + kk * F32_PANEL;                                                                    \
            const __m512 b0 = _mm512_loadu_ps(wk);                                                                   \
            const __m512 b1 = NP > 1 ? _mm512_loadu_ps(wk + ps) : b0;                                                \
            const __m512 b2 = NP > 2 ? _mm512_loadu_ps(wk + 2 * ps) : b0;                                            \
            const __m512 b3 = NP > 3 ? _mm512_loadu_ps(wk + 3 * ps) : b0;                                            \
            F32_ROW512(0) F32_ROW512(1) F32_ROW512(2) F32_ROW512(3) F32_ROW512(4) F32_ROW512(5)                      \
        }                                                                                                            \
        F32_STORE512(0) F32_STORE512(1) F32_STORE512(2) F32_STORE512(3) F32_STORE512(4) F32_STORE512(5)             \
    }
#define F32_BLOCKS512(NP) F32_BLOCK512(1, NP) F32_BLOCK512(2, NP) F32_BLOCK512(3, NP) F32_BLOCK512(4, NP) \
    F32_BLOCK512(5, NP) F32_BLOCK512(6, NP)
F32_BLOCKS512(1)
F32_BLOCKS512(2)
F32_BLOCKS512(3)
F32_BLOCKS512(4)

typedef void (*f32_block512_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t, const int *,
                                const float *);
#define F32_ROW_OF_BLOCKS(NP) {NULL, f32_block512_1_##NP, f32_block512_2_##NP, f32_block512_3_##NP, \
    f32_block512_4_##NP, f32_block512_5_##NP, f32_block512_6_##NP}
static const f32_block512_fn F32_BLOCKS512_TABLE[4][7] = {F32_ROW_OF_BLOCKS(1), F32_ROW_OF_BLOCKS(2),
                                                          F32_ROW_OF_BLOCKS(3), F32_ROW_OF_BLOCKS(4)};
#else
#define F32_AVX512 0
#endif

/* Which form this build runs: 512 (AVX-512F), 256 (AVX2 + FMA), or 0 (none). */
int aserve_f32_linear_form(void) { return F32_AVX512 ? 512 : F32_LINEAR_AVAILABLE ? 256 : 0; }

/* y[r][j] = sum_k x[r][k] W[j][k] (+ bias[j]) for r < rows, j < n; x rows ldx apart, y
 * rows ldy apart, wp the packed weight. Returns 0, or -1 where the kernel is not built
 * (no AVX2 and FMA). */
int aserve_f32_linear(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy,
                      int64_t rows, int64_t n, int64_t k, int num_threads) {
#if F32_AVX512
    const int64_t panels = (n + F32_PANEL - 1) / F32_PANEL, groups = (panels + 3) / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && groups > 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t p = 4 * g;
        const int np = (int)(panels - p < 4 ? panels - p : 4);
        int ncols[4];
        for (int j = 0; j < 4; j++) {
            const int64_t left = n - (p + j) * F32_PANEL;
            ncols[j] = (int)(left < F32_PANEL ? left : F32_PANEL);
        }
        const float *w = wp + p * k * F32_PANEL;
        const float *b = bias ? bias + p * F32_PANEL : NULL;
        float *yp = y + p * F32_PANEL;
        for (int64_t r = 0; r < rows; r += 6) {
            const int mr = (int)(rows - r < 6 ? rows - r : 6);
            F32_BLOCKS512_TABLE[np - 1][mr](x + r * ldx, ldx, w, yp + r * ldy, ldy, k, ncols, b);
        }
    }
    return 0;
#elif F32_LINEAR_AVAILABLE
    const int64_t panels = (n + F32_PANEL - 1) / F32_PANEL;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && panels > 1)
    for (int64_t p = 0; p < panels; p++) {
        const float *w = wp + p * k * F32_PANEL;
        const int ncols = (int)(n - p * F32_PANEL < F32_PANEL ? n - p * F32_PANEL : F32_PANEL);
        const float *b = bias ? bias + p * F32_PANEL : NULL;
        float *yp = y + p * F32_PANEL;
        /* The first row block of this panel brings the next panel (this thread's next
           under the static schedule) into L2, so the next panel's first block does not
           wait on memory for each line: at decode sizes a panel is read from memory once
           and then from L2 by each later block, and the hardware prefetcher alone left
           that first pass short of the FMA rate (Zen 1, 152M shapes, two threads: 4-16
           rows 8-35% faster, 32 rows 4-10%, 2,048 rows even; docs/performance.md). Not
           for one row, where the kernel only streams weights and a second stream was
           5-7% slower. */
        const float *next = p + 1 < panels && rows > 1 ? w + k * F32_PANEL : NULL;
        int64_t r = 0;
        for (; r + 6 <= rows; r += 6)
            f32_block6(x + r * ldx, ldx, w, yp + r * ldy, ldy, k, ncols, b, r == 0 ? next : NULL);
        const float *pf = r == 0 ? next : NULL;
        switch (rows - r) {
            case 5: f32_block5(x + r * ldx, ldx, w, yp + r * ldy, ldy, k, ncols, b, pf); break;
            case 4: f32_block4(x + r * ldx, ldx, w, yp + r * ldy, ldy, k, ncols, b, pf); break;
            case 3: f32_block3(x + r * ldx, ldx, w, yp + r * ldy, ldy, k, ncols, b, pf); break;
            case 2: f32_block2(x + r * ldx, ldx, w, yp + r * ldy, ldy, k, ncols, b, pf); break;
            case 1: f32_block1(x + r * ldx, ldx, w, yp + r * ldy, ldy, k, ncols, b, pf); break;
        }
    }
    return 0;
#else
    (void)x; (void)ldx; (void)wp; (void)bias; (void)y; (void)ldy; (void)rows; (void)n; (void)k; (void)num_threads;
    return -1;
#endif
}
