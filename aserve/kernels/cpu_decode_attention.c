/* Decode attention over the paged KV cache, for CPU: one query token per sequence.
 *
 * Writes each sequence's new key and value into its slot of the paged cache, then reads
 * its keys and values where they lie (no gather, no dense copy), one block at a time,
 * with an online softmax in float32: per block, the scores of its tokens, then one
 * rescale of the running sums. The query heads that
 * share a KV head (grouped-query attention) are handled together, and a token's keys
 * (values) of all heads are read as one row, in memory order, so each block streams.
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

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40); /* NaN */
    x.u += 0x7fffu + ((x.u >> 16) & 1u);
    return (uint16_t)(x.u >> 16);
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
                                                             const int64_t D, const int is_bf16) {
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
            const float corr = expf(m[j] - mx); /* 0 on the first block: m is -FLT_MAX */
            float sum = l[j] * corr;
            if (corr != 1.f)
                for (int64_t i = 0; i < D; i++) acc[j][i] *= corr;
            for (int64_t t = 0; t < n; t++) {
                s[j][t] = expf(s[j][t] - mx);
                sum += s[j][t];
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

/* One copy of the task per common head size and dtype, so gcc unrolls the loops over
 * the head dimension and drops the dtype branch from them. */
static void dispatch_task(const Args *a, int64_t b, int64_t hk0, int64_t hk1) {
    if (a->D == 64) {
        if (a->is_bf16) one_task(a, b, hk0, hk1, 64, 1); else one_task(a, b, hk0, hk1, 64, 0);
    } else if (a->D == 128) {
        if (a->is_bf16) one_task(a, b, hk0, hk1, 128, 1); else one_task(a, b, hk0, hk1, 128, 0);
    } else {
        if (a->is_bf16) one_task(a, b, hk0, hk1, a->D, 1); else one_task(a, b, hk0, hk1, a->D, 0);
    }
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
#pragma omp parallel for num_threads(a->num_threads) schedule(static) if (a->num_threads > 1 && tasks > 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / chunks, c = task % chunks;
        const int64_t hk0 = a->Hk * c / chunks, hk1 = a->Hk * (c + 1) / chunks;
        dispatch_task(a, b, hk0, hk1);
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
