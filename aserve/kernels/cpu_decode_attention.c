/* Decode attention over the paged KV cache, for CPU: one query token per sequence.
 *
 * Writes each sequence's new key and value into its slot of the paged cache, then reads
 * its keys and values where they lie (no gather, no dense copy), one block at a time,
 * with an online softmax in float32: per block, the scores of its tokens, then one
 * rescale of the running sums. The query heads that
 * share a KV head (grouped-query attention) are handled together, and a token's keys
 * (values) of all heads are read as one row, in memory order, so each block streams.
 *
 * With AVX-512 (and a head_dim that is a multiple of 32) a vectorised form of the same
 * task runs instead; see one_task_avx512.
 *
 * Built at run time by aserve/kernels/cpu_decode_attention.py (gcc -O3 -march=native)
 * and called through ctypes with raw pointers: no Python or torch headers, so the build
 * takes about a second. Work is split over sequences (and over KV heads when there are
 * fewer sequences than threads) between `num_threads` OpenMP threads.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_kernels.h"

#define MAX_HEADS 64    /* query heads in one task (and per KV head) */
#define MAX_DIM 512     /* head_dim */
#define MAX_BLOCK 128   /* tokens per block */

typedef struct {
    const void *q;
    void *k, *v; /* the layer's paged cache halves: this step's keys and values are written here */
    const void *k_new, *v_new; /* [B, Hk, D] this step's keys and values (may be NULL: already written) */
    int64_t k_new_stride_b, k_new_stride_h, v_new_stride_b, v_new_stride_h;
    void *out;
    const int64_t *block_table; /* [B, max_blocks] */
    const int64_t *seq_lens;    /* [B] */
    int64_t B, Hq, Hk, D, block_size, max_blocks;
    int64_t q_stride_b, q_stride_h;     /* elements */
    int64_t out_stride_b, out_stride_h; /* elements */
    int64_t kv_stride_block, kv_stride_token, kv_stride_head; /* elements, same for K and V */
    float scale;
    int is_bf16;
    int num_threads;
} Args;

/* A task: sequence b, KV heads [hk0, hk1). */
typedef struct {
    int64_t b, hk0, hk1;
} Task;

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float dot_bf16(const float *a, const uint16_t *b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * bf16_to_float(b[i]);
    return s;
}

static inline void axpy_f32(float *acc, float p, const float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += p * v[i];
}

static inline void axpy_bf16(float *acc, float p, const uint16_t *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += p * bf16_to_float(v[i]);
}

/* Sequence b, KV heads [hk0, hk1): reads each token's row of those heads in one pass,
 * in memory order, so the hardware prefetcher streams the blocks. */
static inline __attribute__((always_inline)) void one_task(const Args *a, int64_t b, int64_t hk0, int64_t hk1,
                                                             const Task *next, const int64_t D, const int is_bf16) {
    (void)next; /* no software prefetch here */
    const int64_t G = a->Hq / a->Hk, bs = a->block_size;
    const int64_t NH = (hk1 - hk0) * G; /* query heads of this task */
    const int64_t L = a->seq_lens[b];
    float q[MAX_HEADS][MAX_DIM], acc[MAX_HEADS][MAX_DIM], s[MAX_HEADS][MAX_BLOCK];
    float m[MAX_HEADS], l[MAX_HEADS];
    if (a->k_new != NULL && L > 0) {
        /* This token's keys and values, into the slot of position L - 1: by the thread
           that reads that block next, so the write and the read share the cache lines. */
        const int64_t slot = a->block_table[b * a->max_blocks + (L - 1) / bs] * a->kv_stride_block
                             + ((L - 1) % bs) * a->kv_stride_token;
        const size_t elt = is_bf16 ? 2 : 4;
        for (int64_t hk = hk0; hk < hk1; hk++) {
            const int64_t dst = slot + hk * a->kv_stride_head;
            const int64_t k_src = b * a->k_new_stride_b + hk * a->k_new_stride_h;
            const int64_t v_src = b * a->v_new_stride_b + hk * a->v_new_stride_h;
            memcpy((char *)a->k + dst * elt, (const char *)a->k_new + k_src * elt, D * elt);
            memcpy((char *)a->v + dst * elt, (const char *)a->v_new + v_src * elt, D * elt);
        }
    }
    for (int64_t j = 0; j < NH; j++) {
        const int64_t h = hk0 * G + j;
        if (is_bf16) {
            const uint16_t *src = (const uint16_t *)a->q + b * a->q_stride_b + h * a->q_stride_h;
            for (int64_t i = 0; i < D; i++) q[j][i] = bf16_to_float(src[i]) * a->scale;
        } else {
            const float *src = (const float *)a->q + b * a->q_stride_b + h * a->q_stride_h;
            for (int64_t i = 0; i < D; i++) q[j][i] = src[i] * a->scale;
        }
        memset(acc[j], 0, sizeof(float) * D);
        m[j] = -FLT_MAX;
        l[j] = 0.f;
    }
    for (int64_t start = 0, blk = 0; start < L; start += bs, blk++) {
        const int64_t n = L - start < bs ? L - start : bs;
        const int64_t base = a->block_table[b * a->max_blocks + blk] * a->kv_stride_block;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t hk = hk0; hk < hk1; hk++) {
                const int64_t off = base + t * a->kv_stride_token + hk * a->kv_stride_head;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t j = (hk - hk0) * G + g;
                    s[j][t] = is_bf16 ? dot_bf16(q[j], (const uint16_t *)a->k + off, D)
                                         : dot_f32(q[j], (const float *)a->k + off, D);
                }
            }
        }
        for (int64_t j = 0; j < NH; j++) {
            float mx = m[j];
            for (int64_t t = 0; t < n; t++) mx = s[j][t] > mx ? s[j][t] : mx;
            const float corr = exp_clamped(m[j] - mx); /* ~0 on the first block: m is -FLT_MAX */
            float sum = l[j] * corr;
            if (corr != 1.f)
                for (int64_t i = 0; i < D; i++) acc[j][i] *= corr;
            float *sj = s[j];
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                sj[t] = exp_clamped(sj[t] - mx);
                sum += sj[t];
            }
            m[j] = mx;
            l[j] = sum;
        }
        for (int64_t t = 0; t < n; t++) {
            for (int64_t hk = hk0; hk < hk1; hk++) {
                const int64_t off = base + t * a->kv_stride_token + hk * a->kv_stride_head;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t j = (hk - hk0) * G + g;
                    if (is_bf16) axpy_bf16(acc[j], s[j][t], (const uint16_t *)a->v + off, D);
                    else axpy_f32(acc[j], s[j][t], (const float *)a->v + off, D);
                }
            }
        }
    }
    for (int64_t j = 0; j < NH; j++) {
        const int64_t h = hk0 * G + j;
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        if (is_bf16) {
            uint16_t *dst = (uint16_t *)a->out + b * a->out_stride_b + h * a->out_stride_h;
            for (int64_t i = 0; i < D; i++) dst[i] = float_to_bf16(acc[j][i] * inv);
        } else {
            float *dst = (float *)a->out + b * a->out_stride_b + h * a->out_stride_h;
            for (int64_t i = 0; i < D; i++) dst[i] = acc[j][i] * inv;
        }
    }
}

#if defined(__AVX512F__)

/* The same task with AVX-512, a sequence CHUNK tokens at a time, in three passes:
 *   1. the scores of every head of the task, 16 tokens at a time: 16 independent dot
 *      products per head, reduced together by a transpose-and-add tree (15 shuffles and
 *      adds for all 16 instead of 16 horizontal sums);
 *   2. per head, the chunk's maximum, the exponentials (a vector exp) and their sum, and
 *      the running sums rescaled to the new maximum;
 *   3. the weighted values, 16 tokens at a time (a lone head with two accumulators).
 * Passes 1 and 3 read the chunk's rows in memory order and prefetch two groups ahead,
 * spread over the heads (the next block is usually on another page, where the hardware
 * prefetcher stops). Near a pass's end the lookahead runs on into the rows read next:
 * the chunk's values, then the next chunk's keys or the first keys of the thread's next
 * task, so no pass starts cold (152M shape, two threads: 2-3% a layer). Both take the
 * query heads that share a KV head (grouped-query attention) in groups of GB, a power of
 * two whose rows fit 16 registers: each key or value row is loaded and widened once per
 * group, not once per query head (one thread, 32 rows of 192 tokens: 4 query heads on
 * 2 KV heads 194-220 -> 167-190 us a layer, 16 on 2 491-534 -> 377-408 us; 32 on 8 at
 * 512 tokens 1.43-1.49 -> 1.16 ms).
 * The portable loop above softmaxes block by block in one chain of dependent
 * reductions; this one gives the core independent work to overlap, and reads the cache
 * at about 24 GB/s on two cores of this machine (29 GB/s is a plain read loop's) against
 * 12 (152M model: 2.2 -> 1.06 ms a layer).
 *
 * bfloat16 rows are widened without shuffles: a 32-bit lane holding elements (2i, 2i+1)
 * gives element 2i by a left shift and element 2i+1 by a mask, so a row of D elements is
 * held as D/16 vectors in an even/odd order ("slots"), the same for the query, the keys,
 * the values and the accumulator, and put back in order only for the output. */

#define CHUNK 256
#define MAX_VEC (MAX_DIM / 16)
#define MAX_GB 8 /* query heads per pass over a KV head's rows (see one_task_avx512) */

/* Row of D elements -> nv = D / 16 float vectors (bf16: slot 2c holds elements 32c + 2l,
 * slot 2c + 1 elements 32c + 2l + 1; float32: slot s holds elements 16s + l). */
static inline __attribute__((always_inline)) void load_row(const char *p, __m512 *v, const int64_t nv, const int is_bf16) {
    if (is_bf16) {
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
        for (int64_t c = 0; c < nv / 2; c++) {
            const __m512i u = _mm512_loadu_si512((const void *)(p + c * 64));
            v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
            v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(u, hi));
        }
    } else {
        for (int64_t i = 0; i < nv; i++) v[i] = _mm512_loadu_ps((const float *)p + 16 * i);
    }
}

static inline int64_t slot_element(int64_t slot, int64_t lane, const int is_bf16) {
    return is_bf16 ? 32 * (slot / 2) + 2 * lane + (slot % 2) : 16 * slot + lane;
}

/* Lane t of the result is the sum of the 16 lanes of v[t]. */
static inline __m512 sum16x16(const __m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++) /* per 128-bit chunk: pairs of lanes of v[2i] and v[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit chunk c: the chunk's sum of v[4i .. 4i+3] */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* Chunk c of the result: b[c] summed over its four chunks. */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

/* One pass of the scores over 16 (cnt valid) tokens for GB query heads of one KV
 * head: each key row is loaded and widened once and multiplied by every query row. */
typedef struct {
    const Args *a;
    int64_t b, h0;                /* sequence; first query head (absolute) of the group */
    const char *kbase;            /* key cache half, offset to this KV head */
    const int64_t *row;           /* byte offset of each of the 16 tokens' rows */
    int64_t cnt;
    float (*s)[CHUNK];            /* scores of the task's heads */
    float *mx;                    /* running maximum of each of the task's heads */
    int64_t j0, t0;               /* first head of the group within the task; first token */
} ScoreArgs;

static inline __attribute__((always_inline)) void score_group(const ScoreArgs *sa, const int64_t D, const int is_bf16,
                                                                const int64_t GB) {
    const Args *a = sa->a;
    const int64_t nv = D / 16, elt = is_bf16 ? 2 : 4, cnt = sa->cnt;
    __m512 qv[MAX_VEC], kv[MAX_VEC], dots[MAX_GB][16];
    for (int64_t g = 0; g < GB; g++)
        load_row((const char *)a->q + (sa->b * a->q_stride_b + (sa->h0 + g) * a->q_stride_h) * elt, qv + g * nv, nv, is_bf16);
    for (int64_t t = 0; t < 16; t++) {
        if (t < cnt) {
            load_row(sa->kbase + sa->row[t], kv, nv, is_bf16);
            for (int64_t g = 0; g < GB; g++) {
                __m512 d = _mm512_setzero_ps();
                for (int64_t i = 0; i < nv; i++) d = _mm512_fmadd_ps(qv[g * nv + i], kv[i], d);
                dots[g][t] = d;
            }
        } else {
            for (int64_t g = 0; g < GB; g++) dots[g][t] = _mm512_setzero_ps();
        }
    }
    for (int64_t g = 0; g < GB; g++) {
        const int64_t j = sa->j0 + g;
        const __m512 sc = _mm512_mask_blend_ps((__mmask16)((1u << cnt) - 1u), _mm512_set1_ps(-FLT_MAX),
                                               _mm512_mul_ps(sum16x16(dots[g]), _mm512_set1_ps(a->scale)));
        _mm512_store_ps(sa->s[j] + sa->t0, sc);
        const float gm = _mm512_reduce_max_ps(sc);
        sa->mx[j] = gm > sa->mx[j] ? gm : sa->mx[j];
    }
}

/* The weighted values of 16 (cnt valid) tokens for GB query heads of one KV head:
 * each value row is loaded and widened once. One head keeps two accumulators (twice
 * the FMAs in flight); GB heads have GB * nv independent ones already. */
typedef struct {
    const char *vbase;            /* value cache half, offset to this KV head */
    const int64_t *row;
    int64_t cnt;
    float (*s)[CHUNK];            /* softmax weights of the task's heads */
    float (*acc)[MAX_DIM];        /* running weighted sums of the task's heads */
    int64_t j0, t0;
} ValueArgs;

static inline __attribute__((always_inline)) void value_group(const ValueArgs *va, const int64_t D, const int is_bf16,
                                                                const int64_t GB) {
    const int64_t nv = D / 16, cnt = va->cnt, j0 = va->j0, t0 = va->t0;
    __m512 kv[MAX_VEC], av[MAX_VEC], bv[MAX_VEC];
    if (GB == 1) {
        for (int64_t i = 0; i < nv; i++) {
            av[i] = _mm512_load_ps(va->acc[j0] + 16 * i);
            bv[i] = _mm512_setzero_ps();
        }
        int64_t t = 0;
        for (; t + 1 < cnt; t += 2) {
            const __m512 p0 = _mm512_set1_ps(va->s[j0][t0 + t]), p1 = _mm512_set1_ps(va->s[j0][t0 + t + 1]);
            load_row(va->vbase + va->row[t], kv, nv, is_bf16);
            for (int64_t i = 0; i < nv; i++) av[i] = _mm512_fmadd_ps(p0, kv[i], av[i]);
            load_row(va->vbase + va->row[t + 1], kv, nv, is_bf16);
            for (int64_t i = 0; i < nv; i++) bv[i] = _mm512_fmadd_ps(p1, kv[i], bv[i]);
        }
        if (t < cnt) {
            const __m512 p0 = _mm512_set1_ps(va->s[j0][t0 + t]);
            load_row(va->vbase + va->row[t], kv, nv, is_bf16);
            for (int64_t i = 0; i < nv; i++) av[i] = _mm512_fmadd_ps(p0, kv[i], av[i]);
        }
        for (int64_t i = 0; i < nv; i++) _mm512_store_ps(va->acc[j0] + 16 * i, _mm512_add_ps(av[i], bv[i]));
        return;
    }
    for (int64_t g = 0; g < GB; g++)
        for (int64_t i = 0; i < nv; i++) av[g * nv + i] = _mm512_load_ps(va->acc[j0 + g] + 16 * i);
    for (int64_t t = 0; t < cnt; t++) {
        load_row(va->vbase + va->row[t], kv, nv, is_bf16);
        for (int64_t g = 0; g < GB; g++) {
            const __m512 p = _mm512_set1_ps(va->s[j0 + g][t0 + t]);
            for (int64_t i = 0; i < nv; i++) av[g * nv + i] = _mm512_fmadd_ps(p, kv[i], av[g * nv + i]);
        }
    }
    for (int64_t g = 0; g < GB; g++)
        for (int64_t i = 0; i < nv; i++) _mm512_store_ps(va->acc[j0 + g] + 16 * i, av[g * nv + i]);
}

static inline __attribute__((always_inline)) void one_task_avx512(const Args *a, int64_t b, int64_t hk0, int64_t hk1,
                                                                    const Task *next, const int64_t D, const int is_bf16) {
    const int64_t G = a->Hq / a->Hk, bs = a->block_size, nv = D / 16, elt = is_bf16 ? 2 : 4;
    const int64_t NH = (hk1 - hk0) * G;
    /* Query heads of one KV head taken together: their rows (or accumulators) in at most
       16 registers. */
    int64_t GB = MAX_GB; /* a power of two that divides G, with GB * nv <= 16 */
    while (GB > 1 && (G % GB || GB * nv > 16)) GB /= 2;
    const int64_t L = a->seq_lens[b];
    const int64_t *table = a->block_table + b * a->max_blocks;
    const int64_t *next_table = next != NULL ? a->block_table + next->b * a->max_blocks : NULL;
    const int64_t next_L = next != NULL ? a->seq_lens[next->b] : 0;
    float acc[MAX_HEADS][MAX_DIM] __attribute__((aligned(64)));
    float s[MAX_HEADS][CHUNK] __attribute__((aligned(64)));
    float m[MAX_HEADS], l[MAX_HEADS], mx[MAX_HEADS];
    int64_t row[CHUNK + 32]; /* byte offset of each token's row (first head of the task) in the cache halves */
    if (a->k_new != NULL && L > 0) {
        const int64_t slot = table[(L - 1) / bs] * a->kv_stride_block + ((L - 1) % bs) * a->kv_stride_token;
        for (int64_t hk = hk0; hk < hk1; hk++) {
            const int64_t dst = slot + hk * a->kv_stride_head;
            memcpy((char *)a->k + dst * elt, (const char *)a->k_new + (b * a->k_new_stride_b + hk * a->k_new_stride_h) * elt, D * elt);
            memcpy((char *)a->v + dst * elt, (const char *)a->v_new + (b * a->v_new_stride_b + hk * a->v_new_stride_h) * elt, D * elt);
        }
    }
    for (int64_t j = 0; j < NH; j++) {
        memset(acc[j], 0, sizeof(float) * D);
        m[j] = -FLT_MAX;
        l[j] = 0.f;
    }
    const char *kbase = (const char *)a->k, *vbase = (const char *)a->v;
    for (int64_t c0 = 0; c0 < L; c0 += CHUNK) {
        const int64_t n = L - c0 < CHUNK ? L - c0 : CHUNK, n16 = (n + 15) & ~(int64_t)15;
        const int last_chunk = c0 + CHUNK >= L;
        /* Two groups past the chunk too, for prefetching (clamped to the sequence). */
        const int64_t n_ahead = L - c0 < CHUNK + 32 ? L - c0 : CHUNK + 32;
        /* One division per block, not per token (bs is not a compile-time constant:
           7M model, 32 rows: 250 -> 212 us a layer). */
        for (int64_t t = 0, pos = c0; t < n_ahead;) {
            const int64_t first = pos % bs;
            const int64_t base = table[pos / bs] * a->kv_stride_block + hk0 * a->kv_stride_head;
            for (int64_t o = first; o < bs && t < n_ahead; o++, t++, pos++)
                row[t] = (base + o * a->kv_stride_token) * elt;
        }
        /* Scores, 16 tokens at a time, every head of the task: each group's rows are read
           in memory order, and the group after next is prefetched (a new block is
           usually on another page, where the hardware prefetcher stops), a KV head's
           lines as that head is processed: a whole block's prefetches at once fill the
           core's miss queues and stall the arithmetic (152M layer: 1.32 -> 1.06 ms).
           The query heads that share a KV head (up to GB at a time, their query rows
           held in registers) take each key row as it is loaded and widened: with
           grouped-query attention the widening is done once, not once per query head. */
        for (int64_t j = 0; j < NH; j++) mx[j] = -FLT_MAX;
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
            const int64_t cnt = n - t0 < 16 ? n - t0 : 16;
            for (int64_t hk = 0; hk < hk1 - hk0; hk++) {
                const int64_t head_off = hk * a->kv_stride_head * elt;
                for (int64_t t = t0 + 32; t < t0 + 48; t++) {
                    /* Past the chunk's keys, its first values (the value pass comes next). */
                    const char *p = t < n ? kbase + row[t] : t - n16 >= 0 && t - n16 < n ? vbase + row[t - n16] : NULL;
                    if (p != NULL)
                        for (int64_t off = 0; off < D * elt; off += 64) _mm_prefetch(p + head_off + off, _MM_HINT_T0);
                }
                for (int64_t g0 = 0; g0 < G; g0 += GB) {
                    const ScoreArgs sa = {a, b, (hk0 + hk) * G + g0, kbase + head_off, row + t0, cnt, s, mx, hk * G + g0, t0};
                    switch (GB) { /* a constant group size keeps the query rows in registers */
                    case 8: score_group(&sa, D, is_bf16, 8); break;
                    case 4: score_group(&sa, D, is_bf16, 4); break;
                    case 2: score_group(&sa, D, is_bf16, 2); break;
                    default: score_group(&sa, D, is_bf16, 1); break;
                    }
                }
            }
        }
        /* Softmax weights of the chunk, and the running sums rescaled to its maximum. */
        for (int64_t j = 0; j < NH; j++) {
            const float new_m = mx[j] > m[j] ? mx[j] : m[j];
            const float corr = exp_clamped(m[j] - new_m); /* ~0 on the first chunk: m is -FLT_MAX */
            const __m512 mb = _mm512_set1_ps(new_m);
            __m512 sumv = _mm512_setzero_ps();
            for (int64_t t0 = 0; t0 < n; t0 += 16) {
                const int64_t cnt = n - t0 < 16 ? n - t0 : 16;
                const __m512 p = _mm512_maskz_mov_ps((__mmask16)((1u << cnt) - 1u),
                                                     exp16_clamped(_mm512_sub_ps(_mm512_load_ps(s[j] + t0), mb)));
                sumv = _mm512_add_ps(sumv, p);
                _mm512_store_ps(s[j] + t0, p);
            }
            l[j] = l[j] * corr + _mm512_reduce_add_ps(sumv);
            m[j] = new_m;
            for (int64_t i = 0; i < D; i++) acc[j][i] *= corr;
        }
        /* Weighted values, in the same order as the keys; the query heads of a KV head
           share each widened value row, as above. */
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
            const int64_t cnt = n - t0 < 16 ? n - t0 : 16;
            for (int64_t hk = 0; hk < hk1 - hk0; hk++) {
                const int64_t head_off = hk * a->kv_stride_head * elt;
                for (int64_t t = t0 + 32; t < t0 + 48; t++) {
                    /* Past the chunk's values, the keys read next: the next chunk's, or
                       after the last chunk the first keys of this thread's next task. */
                    const char *p = NULL;
                    if (t < n) p = vbase + row[t] + head_off;
                    else if (t - n16 >= 0 && n + t - n16 < n_ahead) p = kbase + row[n + t - n16] + head_off;
                    else if (next != NULL && last_chunk && t - n16 >= 0 && t - n16 < next_L && next->hk0 + hk < next->hk1) {
                        const int64_t u = t - n16;
                        p = kbase + (next_table[u / bs] * a->kv_stride_block + (u % bs) * a->kv_stride_token
                                     + (next->hk0 + hk) * a->kv_stride_head) * elt;
                    }
                    if (p != NULL)
                        for (int64_t off = 0; off < D * elt; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
                }
                for (int64_t g0 = 0; g0 < G; g0 += GB) {
                    const ValueArgs va = {vbase + head_off, row + t0, cnt, s, acc, hk * G + g0, t0};
                    switch (GB) {
                    case 8: value_group(&va, D, is_bf16, 8); break;
                    case 4: value_group(&va, D, is_bf16, 4); break;
                    case 2: value_group(&va, D, is_bf16, 2); break;
                    default: value_group(&va, D, is_bf16, 1); break;
                    }
                }
            }
        }
    }
    for (int64_t j = 0; j < NH; j++) {
        const int64_t h = hk0 * G + j;
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        for (int64_t sl = 0; sl < nv; sl++) {
            for (int64_t lane = 0; lane < 16; lane++) {
                const int64_t e = slot_element(sl, lane, is_bf16);
                const float val = acc[j][16 * sl + lane] * inv;
                if (is_bf16) ((uint16_t *)a->out)[b * a->out_stride_b + h * a->out_stride_h + e] = float_to_bf16(val);
                else ((float *)a->out)[b * a->out_stride_b + h * a->out_stride_h + e] = val;
            }
        }
    }
}
#endif

/* One copy of the task per common head size and dtype, so gcc unrolls the loops over
 * the head dimension and drops the dtype branch from them. */
#define CALL_BY_SIZE(task)                                                                         \
    do {                                                                                           \
        if (a->D == 64) {                                                                          \
            if (a->is_bf16) task(a, b, hk0, hk1, next, 64, 1); else task(a, b, hk0, hk1, next, 64, 0); \
        } else if (a->D == 128) {                                                                  \
            if (a->is_bf16) task(a, b, hk0, hk1, next, 128, 1);                                   \
            else task(a, b, hk0, hk1, next, 128, 0);                                               \
        } else {                                                                                   \
            if (a->is_bf16) task(a, b, hk0, hk1, next, a->D, 1);                                  \
            else task(a, b, hk0, hk1, next, a->D, 0);                                              \
        }                                                                                          \
    } while (0)

/* next: the task this thread runs after this one (NULL if none), for prefetching. */
static void dispatch_task(const Args *a, int64_t b, int64_t hk0, int64_t hk1, const Task *next) {
#if defined(__AVX512F__)
    if (a->D % 32 == 0) { /* bf16 rows are read 32 elements at a time */
        CALL_BY_SIZE(one_task_avx512);
        return;
    }
#endif
    CALL_BY_SIZE(one_task);
}

/* Tasks: (sequence, chunk of KV heads). A chunk holds every KV head unless there are
 * fewer sequences than threads, or more query heads than one task holds (MAX_HEADS):
 * with at least ceil(Hk / (MAX_HEADS / G)) chunks, none exceeds MAX_HEADS query heads
 * (G <= MAX_HEADS is checked by the caller). */
static void run_tasks(const Args *a) {
    const int64_t G = a->Hq / a->Hk, per_task = MAX_HEADS / G;
    int64_t chunks = a->B >= a->num_threads ? 1 : (a->num_threads + a->B - 1) / a->B;
    if (chunks < (a->Hk + per_task - 1) / per_task) chunks = (a->Hk + per_task - 1) / per_task;
    if (chunks > a->Hk) chunks = a->Hk;
    const int64_t tasks = a->B * chunks;
    /* OpenMP from the libgomp torch already loaded (same soname), so these are torch's
       own intra-op threads, not a second pool competing with them for the cores. */
    /* Each thread starts on a contiguous range of tasks and takes from the others' once
       it is done (work_next in cpu_kernels.h). While on its own range it knows the next
       task it will probably run, and prefetches that task's first keys as it finishes
       the current one (a hint only: another thread may take that task). */
    int nt_req = a->num_threads > tasks ? (int)tasks : a->num_threads;
    if (nt_req < 1) nt_req = 1;
    work_range ranges[nt_req];
    work_split(ranges, nt_req, tasks);
#pragma omp parallel num_threads(nt_req) if (nt_req > 1)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        const int64_t own_end = tasks * (t + 1) / nt_req;
        for (int64_t task; (task = work_next(ranges, t, nt_req)) >= 0;) {
            const int64_t b = task / chunks, c = task % chunks;
            const Task next = {(task + 1) / chunks, a->Hk * ((task + 1) % chunks) / chunks,
                               a->Hk * ((task + 1) % chunks + 1) / chunks};
            dispatch_task(a, b, a->Hk * c / chunks, a->Hk * (c + 1) / chunks, task + 1 < own_end ? &next : NULL);
        }
    }
}

/* Returns 0, or -1 when a size exceeds the fixed limits above (the caller checks). */
int aserve_decode_attention(const void *q, void *k, void *v, const void *k_new, const void *v_new,
                            int64_t k_new_stride_b, int64_t k_new_stride_h,
                            int64_t v_new_stride_b, int64_t v_new_stride_h, void *out,
                            const int64_t *block_table, const int64_t *seq_lens,
                            int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t block_size, int64_t max_blocks,
                            int64_t q_stride_b, int64_t q_stride_h, int64_t out_stride_b, int64_t out_stride_h,
                            int64_t kv_stride_block, int64_t kv_stride_token, int64_t kv_stride_head,
                            float scale, int is_bf16, int num_threads) {
    if (Hq / Hk > MAX_HEADS || D > MAX_DIM || block_size > MAX_BLOCK || Hq % Hk) return -1;
    if (num_threads > B * Hk) num_threads = (int)(B * Hk);
    if (num_threads < 1) num_threads = 1;
    const Args args = {q, k, v, k_new, v_new, k_new_stride_b, k_new_stride_h, v_new_stride_b, v_new_stride_h,
                       out, block_table, seq_lens, B, Hq, Hk, D, block_size, max_blocks,
                       q_stride_b, q_stride_h, out_stride_b, out_stride_h,
                       kv_stride_block, kv_stride_token, kv_stride_head, scale, is_bf16, num_threads};
    run_tasks(&args);
    return 0;
}
