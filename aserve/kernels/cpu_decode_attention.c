/* Decode attention over the paged KV cache, for CPU: one query token per sequence.
 *
 * Writes each sequence's new key and value into its slot of the paged cache, then reads
 * its keys and values where they lie (no gather, no dense copy), one block at a time,
 * with an online softmax in float32: per block, the scores of its tokens, then one
 * rescale of the running sums. The query heads that
 * share a KV head (grouped-query attention) are handled together, and a token's keys
 * (values) of all heads are read as one row, in memory order, so each block streams.
 *
 * The cache may hold a different dtype from the query's (a bf16 cache under a float32
 * model halves the bytes each step reads): q, the new keys and values, and the output
 * are in one dtype (q_bf16), the cache in another (kv_bf16); new keys and values are
 * rounded to the cache's dtype as they are written.
 *
 * With AVX-512 or AVX2 (cpu_simd.h) and a head_dim that fills whole vectors, a
 * vectorised form of the same task runs instead; see one_task_simd.
 *
 * Built at run time by aserve/kernels/cpu_decode_attention.py (gcc -O3 -march=native)
 * and called through ctypes with raw pointers: no Python or torch headers, so the build
 * takes about a second. Work is split over sequences (and over KV heads when there are
 * fewer sequences than threads) between `num_threads` OpenMP threads.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_kernels.h"
#include "cpu_simd.h"

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
    int q_bf16;  /* q, k_new, v_new and out are bf16 (else float32) */
    int kv_bf16; /* the cache is bf16 (else float32) */
    int num_threads;
    /* The first prefix_blocks blocks of the block table are the same for every row (a
       shared prefix). Where the prefix phase (cpu_decode_prefix.h) has covered their
       `prefix` tokens, pm, pl and pacc hold each (row, query head)'s softmax state over
       them, at b * Hq + h, and the tasks start from it at token `prefix`; else prefix
       is 0. */
    int64_t prefix_blocks, prefix;
    const float *pm, *pl, *pacc;
    /* Where the prefix phase keeps its K and V layouts from one call to the next (or
       NULL: it lays them out in scratch each call), and their state: *prefix_state is 1
       when prefix_layout holds the layouts of these prefix blocks (the phase then skips
       laying them out), 0 when not (it lays them out there and sets it). The caller
       zeroes it when the blocks change or are written (cpu_decode_prefix.h). */
    void *prefix_layout;
    int32_t *prefix_state;
} Args;

/* AVX-512 with AMX or AVX512-BF16 (AMX's macros alone are not enough: a build with
   -mno-avx512f, the AVX2 form tests make on an AVX-512 CPU, keeps them). */
#if defined(__AVX512F__) && ((defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(__AVX512BF16__))
#define ASERVE_DECODE_PREFIX 1
#include "cpu_decode_prefix.h"
#endif

/* A task: sequence b, KV heads [hk0, hk1). */
typedef struct {
    int64_t b, hk0, hk1;
} Task;

/* This step's keys and values of sequence b, KV heads [hk0, hk1), into the slot of
 * position L - 1: by the thread that reads that block next, so the write and the read
 * share the cache lines. Rounded to the cache's dtype where it differs. */
static inline void write_new_kv(const Args *a, int64_t b, int64_t hk0, int64_t hk1, int64_t L, int64_t D) {
    const int64_t bs = a->block_size;
    const int64_t slot = a->block_table[b * a->max_blocks + (L - 1) / bs] * a->kv_stride_block
                         + ((L - 1) % bs) * a->kv_stride_token;
    const size_t in_elt = a->q_bf16 ? 2 : 4, elt = a->kv_bf16 ? 2 : 4;
    for (int64_t hk = hk0; hk < hk1; hk++) {
        const int64_t dst = slot + hk * a->kv_stride_head;
        const char *src[2] = {(const char *)a->k_new + (b * a->k_new_stride_b + hk * a->k_new_stride_h) * in_elt,
                              (const char *)a->v_new + (b * a->v_new_stride_b + hk * a->v_new_stride_h) * in_elt};
        char *dst_p[2] = {(char *)a->k + dst * elt, (char *)a->v + dst * elt};
        for (int h = 0; h < 2; h++) {
            if (a->q_bf16 == a->kv_bf16) memcpy(dst_p[h], src[h], D * elt);
            else if (a->kv_bf16)
                for (int64_t i = 0; i < D; i++) ((uint16_t *)dst_p[h])[i] = float_to_bf16(((const float *)src[h])[i]);
            else
                for (int64_t i = 0; i < D; i++) ((float *)dst_p[h])[i] = bf16_to_float(((const uint16_t *)src[h])[i]);
        }
    }
}

static inline float load_q(const Args *a, int64_t b, int64_t h, int64_t i) {
    const int64_t at = b * a->q_stride_b + h * a->q_stride_h + i;
    return a->q_bf16 ? bf16_to_float(((const uint16_t *)a->q)[at]) : ((const float *)a->q)[at];
}

static inline void store_out(const Args *a, int64_t b, int64_t h, int64_t i, float val) {
    const int64_t at = b * a->out_stride_b + h * a->out_stride_h + i;
    if (a->q_bf16) ((uint16_t *)a->out)[at] = float_to_bf16(val);
    else ((float *)a->out)[at] = val;
}

/* A task's softmax state for row b, query head h: after the prefix phase its result (acc
 * put in slot order: vf_slot_element, or element order for the portable task, slotted
 * = 0), else empty. */
static inline void start_state(const Args *a, int64_t b, int64_t h, float *acc, float *m, float *l, int64_t D,
                               int slotted) {
    if (a->prefix == 0) {
        memset(acc, 0, sizeof(float) * D);
        *m = -FLT_MAX;
        *l = 0.f;
        return;
    }
    const int64_t at = b * a->Hq + h;
    const float *src = a->pacc + at * D;
#if defined(ASERVE_SIMD)
    if (slotted) {
        for (int64_t sl = 0; sl < D / VL; sl++)
            for (int64_t lane = 0; lane < VL; lane++) acc[VL * sl + lane] = src[vf_slot_element(sl, lane, a->kv_bf16)];
    } else
#endif
        memcpy(acc, src, sizeof(float) * D);
    (void)slotted;
    *m = a->pm[at];
    *l = a->pl[at];
}

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
                                                             const Task *next, const int64_t D, const int kv_bf16) {
    (void)next; /* no software prefetch here */
    const int64_t G = a->Hq / a->Hk, bs = a->block_size;
    const int64_t NH = (hk1 - hk0) * G; /* query heads of this task */
    const int64_t L = a->seq_lens[b];
    float q[MAX_HEADS][MAX_DIM], acc[MAX_HEADS][MAX_DIM], s[MAX_HEADS][MAX_BLOCK];
    float m[MAX_HEADS], l[MAX_HEADS];
    if (a->k_new != NULL && L > 0) write_new_kv(a, b, hk0, hk1, L, D);
    for (int64_t j = 0; j < NH; j++) {
        for (int64_t i = 0; i < D; i++) q[j][i] = load_q(a, b, hk0 * G + j, i) * a->scale;
        start_state(a, b, hk0 * G + j, acc[j], &m[j], &l[j], D, 0);
    }
    for (int64_t start = a->prefix, blk = a->prefix / bs; start < L; start += bs, blk++) {
        const int64_t n = L - start < bs ? L - start : bs;
        const int64_t base = a->block_table[b * a->max_blocks + blk] * a->kv_stride_block;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t hk = hk0; hk < hk1; hk++) {
                const int64_t off = base + t * a->kv_stride_token + hk * a->kv_stride_head;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t j = (hk - hk0) * G + g;
                    s[j][t] = kv_bf16 ? dot_bf16(q[j], (const uint16_t *)a->k + off, D)
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
                    if (kv_bf16) axpy_bf16(acc[j], s[j][t], (const uint16_t *)a->v + off, D);
                    else axpy_f32(acc[j], s[j][t], (const float *)a->v + off, D);
                }
            }
        }
    }
    for (int64_t j = 0; j < NH; j++) {
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        for (int64_t i = 0; i < D; i++) store_out(a, b, hk0 * G + j, i, acc[j][i] * inv);
    }
}

#if defined(ASERVE_SIMD)

/* The same task with vectors of VL floats (cpu_simd.h), a sequence CHUNK tokens at a
 * time, in three passes:
 *   1. the scores of every head of the task, VL tokens at a time: VL independent dot
 *      products per head, reduced together by a transpose-and-add tree (vf_sum_pair,
 *      vf_sum_quad, vf_sum_finish) instead of VL horizontal sums;
 *   2. per head, the chunk's maximum, the exponentials (a vector exp) and their sum, and
 *      the running sums rescaled to the new maximum;
 *   3. the weighted values, VL tokens at a time (a lone head with two accumulators).
 * Passes 1 and 3 read the chunk's rows in memory order and prefetch AHEAD tokens ahead,
 * spread over the heads (the next block is usually on another page, where the hardware
 * prefetcher stops). Near a pass's end the lookahead runs on into the rows read next:
 * the chunk's values, then the next chunk's keys or the first keys of the thread's next
 * task, so no pass starts cold (152M shape, two threads: 2-3% a layer). Both take the
 * query heads that share a KV head (grouped-query attention) in groups of GB, a power of
 * two whose rows fit half the registers: each key or value row is loaded and widened
 * once per group, not once per query head (AVX-512, one thread, 32 rows of 192 tokens:
 * 4 query heads on 2 KV heads 194-220 -> 167-190 us a layer, 16 on 2 491-534 -> 377-408
 * us; 32 on 8 at 512 tokens 1.43-1.49 -> 1.16 ms).
 * The portable loop above softmaxes block by block in one chain of dependent
 * reductions, and has no software prefetch; this one gives the core independent work
 * to overlap. With AVX-512 it reads the cache at about 24 GB/s on two cores of the
 * Intel machine (29 GB/s is a plain read loop's) against 12 (152M model: 2.2 -> 1.06
 * ms a layer); with AVX2 on the AMD machine, see docs/performance.md. On token-major
 * blocks one head's rows lie 2 KiB apart (that shape), and those reads ran below the
 * plain read's rate even without arithmetic; on the CPU pool's head-major blocks
 * (aserve.kernels.attention.head_major) they are one run a block, read at the plain
 * read's rate (Zen 4: 1,167 -> 877 us a layer; docs/performance.md, "The KV cache head
 * by head").
 *
 * The query rows are put in the cache rows' slot order (vf_slot_element) once per
 * task, and the output back in element order at its end. */

#define CHUNK 256
#define AHEAD 32 /* tokens: how far ahead passes 1 and 3 prefetch */
/* Where those prefetches bring the rows: into L2. On an AMD EPYC Zen 4 (152M shape, 32
 * rows of 192 tokens, bf16 cache, two threads, 12 layers cycled, 2026-12-02) L1 held the
 * kernel at 1.9-2.0 ms a layer (13 GB/s), L2 ran it at 1.1-1.3 ms (19-23 GB/s; 64 or 128
 * tokens ahead measured the same as 32). On the AMX Intel machine (2026-12-05) L2 ran it
 * at 951-1,029 us a layer against 1,088-1,094 with L1, the 7M shape the same either way,
 * and the 152M decode step 3% faster (docs/performance.md). */
#define KV_PREFETCH _MM_HINT_T1
/* Tokens of one KV head that passes 1 and 3 take before the next head: a 16-token
 * block's rows of that head, one 2 KiB run in the CPU pool's head-major blocks (152M
 * shape, bf16), where AVX2's vectors of 8 would otherwise read half a run a head. */
#define SPAN (VL < 16 ? 16 : VL)
#define MAX_VEC (MAX_DIM / VL)
#define MAX_GB 8 /* query heads per pass over a KV head's rows (see one_task_simd) */

/* Row of D elements -> nv = D / VL vectors, in slot order. */
static inline __attribute__((always_inline)) void load_row(const char *p, vf *v, const int64_t nv, const int is_bf16) {
    if (is_bf16) {
        for (int64_t c = 0; c < nv / 2; c++) vf_load_bf16(p + c * 4 * VL, &v[2 * c], &v[2 * c + 1]);
    } else {
        for (int64_t i = 0; i < nv; i++) v[i] = vf_loadu((const float *)p + VL * i);
    }
}

/* One pass of the scores over VL (cnt valid) tokens for GB query heads of one KV
 * head: each key row is loaded and widened once and multiplied by every query row. */
typedef struct {
    const Args *a;
    const float (*q)[MAX_DIM];    /* the task's query rows, in slot order */
    const char *kbase;            /* key cache half, offset to this KV head */
    const int64_t *row;           /* byte offset of each of the VL tokens' rows */
    int64_t cnt;
    float (*s)[CHUNK];            /* scores of the task's heads */
    float *mx;                    /* running maximum of each of the task's heads */
    int64_t j0, t0;               /* first head of the group within the task; first token */
} ScoreArgs;

static inline __attribute__((always_inline)) void score_group(const ScoreArgs *sa, const int64_t D, const int kv_bf16,
                                                                const int64_t GB) {
    const int64_t nv = D / VL, cnt = sa->cnt;
    vf qv[MAX_VEC], kv[MAX_VEC], quads[MAX_GB][VL / 4];
    for (int64_t g = 0; g < GB; g++)
        for (int64_t i = 0; i < nv; i++) qv[g * nv + i] = vf_load(sa->q[sa->j0 + g] + VL * i);
    /* Four tokens at a time, each head's four products folded into their quad of the
       lane sums' tree at once (cpu_simd.h: the same adds in the same order as summing all
       VL products at the end, so the same bits), so a group holds GB * VL / 4 quads
       and GB * 4 products instead of GB * VL products: with two query heads a KV head
       (the 7M shape, D = 64, AVX-512) 16 registers of sums instead of 32, which with the
       query and key rows asked for more than the 32 there are (the kernel alone, the 7M
       shape: 3-5% faster where its instructions bound it; docs/performance.md). */
    for (int64_t t4 = 0; t4 < VL; t4 += 4) {
        vf dots[MAX_GB][4];
        for (int64_t u = 0; u < 4; u++) {
            const int64_t t = t4 + u;
            if (t < cnt) {
                load_row(sa->kbase + sa->row[t], kv, nv, kv_bf16);
                for (int64_t g = 0; g < GB; g++) {
                    vf d = vf_zero();
                    for (int64_t i = 0; i < nv; i++) d = vf_fmadd(qv[g * nv + i], kv[i], d);
                    dots[g][u] = d;
                }
            } else {
                for (int64_t g = 0; g < GB; g++) dots[g][u] = vf_zero();
            }
        }
        for (int64_t g = 0; g < GB; g++)
            quads[g][t4 / 4] = vf_sum_quad(vf_sum_pair(dots[g][0], dots[g][1]), vf_sum_pair(dots[g][2], dots[g][3]));
    }
    for (int64_t g = 0; g < GB; g++) {
        const int64_t j = sa->j0 + g;
        const vf sc = vf_first(vf_mul(vf_sum_finish(quads[g]), vf_set1(sa->a->scale)), cnt, -FLT_MAX);
        vf_store(sa->s[j] + sa->t0, sc);
        const float gm = vf_reduce_max(sc);
        sa->mx[j] = gm > sa->mx[j] ? gm : sa->mx[j];
    }
}

/* The weighted values of VL (cnt valid) tokens for GB query heads of one KV head:
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

static inline __attribute__((always_inline)) void value_group(const ValueArgs *va, const int64_t D, const int kv_bf16,
                                                                const int64_t GB) {
    const int64_t nv = D / VL, cnt = va->cnt, j0 = va->j0, t0 = va->t0;
    vf kv[MAX_VEC], av[MAX_VEC], bv[MAX_VEC];
    if (GB == 1) {
        for (int64_t i = 0; i < nv; i++) {
            av[i] = vf_load(va->acc[j0] + VL * i);
            bv[i] = vf_zero();
        }
        int64_t t = 0;
        for (; t + 1 < cnt; t += 2) {
            const vf p0 = vf_set1(va->s[j0][t0 + t]), p1 = vf_set1(va->s[j0][t0 + t + 1]);
            load_row(va->vbase + va->row[t], kv, nv, kv_bf16);
            for (int64_t i = 0; i < nv; i++) av[i] = vf_fmadd(p0, kv[i], av[i]);
            load_row(va->vbase + va->row[t + 1], kv, nv, kv_bf16);
            for (int64_t i = 0; i < nv; i++) bv[i] = vf_fmadd(p1, kv[i], bv[i]);
        }
        if (t < cnt) {
            const vf p0 = vf_set1(va->s[j0][t0 + t]);
            load_row(va->vbase + va->row[t], kv, nv, kv_bf16);
            for (int64_t i = 0; i < nv; i++) av[i] = vf_fmadd(p0, kv[i], av[i]);
        }
        for (int64_t i = 0; i < nv; i++) vf_store(va->acc[j0] + VL * i, vf_add(av[i], bv[i]));
        return;
    }
    for (int64_t g = 0; g < GB; g++)
        for (int64_t i = 0; i < nv; i++) av[g * nv + i] = vf_load(va->acc[j0 + g] + VL * i);
    for (int64_t t = 0; t < cnt; t++) {
        load_row(va->vbase + va->row[t], kv, nv, kv_bf16);
        for (int64_t g = 0; g < GB; g++) {
            const vf p = vf_set1(va->s[j0 + g][t0 + t]);
            for (int64_t i = 0; i < nv; i++) av[g * nv + i] = vf_fmadd(p, kv[i], av[g * nv + i]);
        }
    }
    for (int64_t g = 0; g < GB; g++)
        for (int64_t i = 0; i < nv; i++) vf_store(va->acc[j0 + g] + VL * i, av[g * nv + i]);
}

static inline __attribute__((always_inline)) void one_task_simd(const Args *a, int64_t b, int64_t hk0, int64_t hk1,
                                                                  const Task *next, const int64_t D, const int kv_bf16) {
    const int64_t G = a->Hq / a->Hk, bs = a->block_size, nv = D / VL, elt = kv_bf16 ? 2 : 4;
    const int64_t NH = (hk1 - hk0) * G;
    /* Query heads of one KV head taken together: their rows (or accumulators) in at most
       half the registers. */
    int64_t GB = MAX_GB; /* a power of two that divides G, with GB * nv <= VREGS / 2 */
    while (GB > 1 && (G % GB || GB * nv > VREGS / 2)) GB /= 2;
    const int64_t L = a->seq_lens[b];
    const int64_t *table = a->block_table + b * a->max_blocks;
    const int64_t *next_table = next != NULL ? a->block_table + next->b * a->max_blocks : NULL;
    const int64_t next_L = next != NULL ? a->seq_lens[next->b] : 0;
    float q[MAX_HEADS][MAX_DIM] __attribute__((aligned(64)));
    float acc[MAX_HEADS][MAX_DIM] __attribute__((aligned(64)));
    float s[MAX_HEADS][CHUNK] __attribute__((aligned(64)));
    float m[MAX_HEADS], l[MAX_HEADS], mx[MAX_HEADS];
    int64_t row[CHUNK + AHEAD]; /* byte offset of each token's row (first head of the task) in the cache halves */
    if (a->k_new != NULL && L > 0) write_new_kv(a, b, hk0, hk1, L, D);
    for (int64_t j = 0; j < NH; j++) {
        for (int64_t sl = 0; sl < nv; sl++)
            for (int64_t lane = 0; lane < VL; lane++)
                q[j][VL * sl + lane] = load_q(a, b, hk0 * G + j, vf_slot_element(sl, lane, kv_bf16));
        start_state(a, b, hk0 * G + j, acc[j], &m[j], &l[j], D, 1);
    }
    const char *kbase = (const char *)a->k, *vbase = (const char *)a->v;
    for (int64_t c0 = a->prefix; c0 < L; c0 += CHUNK) {
        /* n rounded up to whole vectors: where the lookahead past the chunk's keys
           reaches its values (and past its values the next keys). */
        const int64_t n = L - c0 < CHUNK ? L - c0 : CHUNK, n_up = (n + VL - 1) & ~(int64_t)(VL - 1);
        const int last_chunk = c0 + CHUNK >= L;
        /* AHEAD tokens past the chunk too, for prefetching (clamped to the sequence). */
        const int64_t n_ahead = L - c0 < CHUNK + AHEAD ? L - c0 : CHUNK + AHEAD;
        /* One division per block, not per token (bs is not a compile-time constant:
           7M model, 32 rows: 250 -> 212 us a layer). */
        for (int64_t t = 0, pos = c0; t < n_ahead;) {
            const int64_t first = pos % bs;
            const int64_t base = table[pos / bs] * a->kv_stride_block + hk0 * a->kv_stride_head;
            for (int64_t o = first; o < bs && t < n_ahead; o++, t++, pos++)
                row[t] = (base + o * a->kv_stride_token) * elt;
        }
        /* Scores, VL tokens at a time, every head of the task: each group's rows are read
           in memory order, and the rows AHEAD tokens on are prefetched (a new block is
           usually on another page, where the hardware prefetcher stops), a KV head's
           lines as that head is processed: a whole block's prefetches at once fill the
           core's miss queues and stall the arithmetic (152M layer: 1.32 -> 1.06 ms).
           The query heads that share a KV head (up to GB at a time, their query rows
           held in registers) take each key row as it is loaded and widened: with
           grouped-query attention the widening is done once, not once per query head. */
        for (int64_t j = 0; j < NH; j++) mx[j] = -FLT_MAX;
        for (int64_t s0 = 0; s0 < n; s0 += SPAN)
            for (int64_t hk = 0; hk < hk1 - hk0; hk++)
            for (int64_t t0 = s0; t0 < n && t0 < s0 + SPAN; t0 += VL) {
                const int64_t cnt = n - t0 < VL ? n - t0 : VL;
                const int64_t head_off = hk * a->kv_stride_head * elt;
                for (int64_t t = t0 + AHEAD; t < t0 + AHEAD + VL; t++) {
                    /* Past the chunk's keys, its first values (the value pass comes next). */
                    const char *p = t < n ? kbase + row[t] : t - n_up >= 0 && t - n_up < n ? vbase + row[t - n_up] : NULL;
                    if (p != NULL)
                        for (int64_t off = 0; off < D * elt; off += 64) _mm_prefetch(p + head_off + off, KV_PREFETCH);
                }
                for (int64_t g0 = 0; g0 < G; g0 += GB) {
                    const ScoreArgs sa = {a, (const float (*)[MAX_DIM])q, kbase + head_off, row + t0, cnt, s, mx,
                                          hk * G + g0, t0};
                    switch (GB) { /* a constant group size keeps the query rows in registers */
                    case 8: score_group(&sa, D, kv_bf16, 8); break;
                    case 4: score_group(&sa, D, kv_bf16, 4); break;
                    case 2: score_group(&sa, D, kv_bf16, 2); break;
                    default: score_group(&sa, D, kv_bf16, 1); break;
                    }
                }
            }
        /* Softmax weights of the chunk, and the running sums rescaled to its maximum. */
        for (int64_t j = 0; j < NH; j++) {
            const float new_m = mx[j] > m[j] ? mx[j] : m[j];
            const float corr = exp_clamped(m[j] - new_m); /* ~0 on the first chunk: m is -FLT_MAX */
            const vf mb = vf_set1(new_m);
            vf sumv = vf_zero();
            for (int64_t t0 = 0; t0 < n; t0 += VL) {
                const int64_t cnt = n - t0 < VL ? n - t0 : VL;
                const vf p = vf_first(vf_exp_clamped(vf_sub(vf_load(s[j] + t0), mb)), cnt, 0.f);
                sumv = vf_add(sumv, p);
                vf_store(s[j] + t0, p);
            }
            l[j] = l[j] * corr + vf_reduce_add(sumv);
            m[j] = new_m;
            for (int64_t i = 0; i < D; i++) acc[j][i] *= corr;
        }
        /* Weighted values, in the same order as the keys; the query heads of a KV head
           share each widened value row, as above. */
        for (int64_t s0 = 0; s0 < n; s0 += SPAN)
            for (int64_t hk = 0; hk < hk1 - hk0; hk++)
            for (int64_t t0 = s0; t0 < n && t0 < s0 + SPAN; t0 += VL) {
                const int64_t cnt = n - t0 < VL ? n - t0 : VL;
                const int64_t head_off = hk * a->kv_stride_head * elt;
                for (int64_t t = t0 + AHEAD; t < t0 + AHEAD + VL; t++) {
                    /* Past the chunk's values, the keys read next: the next chunk's, or
                       after the last chunk the first keys of this thread's next task. */
                    const char *p = NULL;
                    if (t < n) p = vbase + row[t] + head_off;
                    else if (t - n_up >= 0 && n + t - n_up < n_ahead) p = kbase + row[n + t - n_up] + head_off;
                    else if (next != NULL && last_chunk && t - n_up >= 0 && a->prefix + t - n_up < next_L
                             && next->hk0 + hk < next->hk1) {
                        const int64_t u = a->prefix + t - n_up;
                        p = kbase + (next_table[u / bs] * a->kv_stride_block + (u % bs) * a->kv_stride_token
                                     + (next->hk0 + hk) * a->kv_stride_head) * elt;
                    }
                    if (p != NULL)
                        for (int64_t off = 0; off < D * elt; off += 64) _mm_prefetch(p + off, KV_PREFETCH);
                }
                for (int64_t g0 = 0; g0 < G; g0 += GB) {
                    const ValueArgs va = {vbase + head_off, row + t0, cnt, s, acc, hk * G + g0, t0};
                    switch (GB) {
                    case 8: value_group(&va, D, kv_bf16, 8); break;
                    case 4: value_group(&va, D, kv_bf16, 4); break;
                    case 2: value_group(&va, D, kv_bf16, 2); break;
                    default: value_group(&va, D, kv_bf16, 1); break;
                    }
                }
            }
    }
    for (int64_t j = 0; j < NH; j++) {
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        for (int64_t sl = 0; sl < nv; sl++)
            for (int64_t lane = 0; lane < VL; lane++)
                store_out(a, b, hk0 * G + j, vf_slot_element(sl, lane, kv_bf16), acc[j][VL * sl + lane] * inv);
    }
}
#endif

/* One copy of the task per common head size and cache dtype, so gcc unrolls the loops
 * over the head dimension and drops the dtype branch from them. */
#define CALL_BY_SIZE(task)                                                                         \
    do {                                                                                           \
        if (a->D == 64) {                                                                          \
            if (a->kv_bf16) task(a, b, hk0, hk1, next, 64, 1); else task(a, b, hk0, hk1, next, 64, 0); \
        } else if (a->D == 128) {                                                                  \
            if (a->kv_bf16) task(a, b, hk0, hk1, next, 128, 1);                                   \
            else task(a, b, hk0, hk1, next, 128, 0);                                               \
        } else {                                                                                   \
            if (a->kv_bf16) task(a, b, hk0, hk1, next, a->D, 1);                                  \
            else task(a, b, hk0, hk1, next, a->D, 0);                                              \
        }                                                                                          \
    } while (0)

/* next: the task this thread runs after this one (NULL if none), for prefetching. */
static void dispatch_task(const Args *a, int64_t b, int64_t hk0, int64_t hk1, const Task *next) {
#if defined(ASERVE_SIMD)
    if (a->D % (a->kv_bf16 ? 2 * VL : VL) == 0) { /* whole vectors (bf16 rows: pairs of them) */
        CALL_BY_SIZE(one_task_simd);
        return;
    }
    /* Only a head size of no whole vectors comes here (64 and 128 always fill them), so
       the portable task has no copies by size: they cost a quarter of the library's build
       (Zen 1: 10.1 -> 7.8 s) and would never run. */
    if (a->kv_bf16) one_task(a, b, hk0, hk1, next, a->D, 1);
    else one_task(a, b, hk0, hk1, next, a->D, 0);
#else
    CALL_BY_SIZE(one_task);
#endif
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
                            int64_t prefix_blocks, void *prefix_layout, int32_t *prefix_state,
                            int64_t q_stride_b, int64_t q_stride_h, int64_t out_stride_b, int64_t out_stride_h,
                            int64_t kv_stride_block, int64_t kv_stride_token, int64_t kv_stride_head,
                            float scale, int q_bf16, int kv_bf16, int num_threads) {
    if (Hq / Hk > MAX_HEADS || D > MAX_DIM || block_size > MAX_BLOCK || Hq % Hk) return -1;
    if (num_threads > B * Hk) num_threads = (int)(B * Hk);
    if (num_threads < 1) num_threads = 1;
    Args args = {q, k, v, k_new, v_new, k_new_stride_b, k_new_stride_h, v_new_stride_b, v_new_stride_h,
                 out, block_table, seq_lens, B, Hq, Hk, D, block_size, max_blocks,
                 q_stride_b, q_stride_h, out_stride_b, out_stride_h,
                 kv_stride_block, kv_stride_token, kv_stride_head, scale, q_bf16, kv_bf16, num_threads,
                 prefix_blocks, 0, NULL, NULL, NULL, prefix_layout, prefix_state};
    float *state = NULL; /* the prefix phase's pm, pl and pacc */
#ifdef ASERVE_DECODE_PREFIX
    if (prefix_blocks > 0 && (state = malloc(sizeof(float) * (size_t)(B * Hq * (D + 2)))) != NULL) {
        args.prefix = prefix_phase(&args, state, state + B * Hq, state + 2 * B * Hq);
        args.pm = state;
        args.pl = state + B * Hq;
        args.pacc = state + 2 * B * Hq;
    }
#endif
    run_tasks(&args);
    free(state);
    return 0;
}
