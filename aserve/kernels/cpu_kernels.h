/* Helpers shared by aserve's CPU kernels (included by each .c file; the build's cache key
 * covers this header too, see aserve/kernels/cbuild.py). */
#ifndef ASERVE_CPU_KERNELS_H
#define ASERVE_CPU_KERNELS_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* AMX: a tile configuration (palette 1), and the request for the tile state that Linux
 * wants from a process before its first tile instruction (idempotent; 1 when granted).
 * Each AMX library exports it as aserve_amx_init. */
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_tile_config;

static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

#if defined(__AMX_TILE__) && defined(__AVX512F__) /* a build with -mno-avx512f keeps AMX's macro */
/* The decode-prefix attention's tiles (cpu_decode_prefix.h, cpu_prefill_common.h): 0, 3, 4
 * and 5, float32 accumulators of `rows` x 16; 1, an A operand of `rows` x 32 bf16; 2, 6
 * and 7, B operands of 16 rows of bf16 pairs. For the calling thread (the state is per
 * thread). */
static inline void amx_configure_rows(int rows) {
    amx_tile_config cfg;
    __builtin_memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(t == 2 || t >= 6 ? 16 : rows);
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif

/* Items [0, n) of a kernel shared out between the threads of a parallel region so that
 * no thread waits at the region's end while another still has a long list.
 *
 * Why: under a static split by count, the decode attention's thread with the longer
 * sequences set the kernel's time (16 sequences of 320 tokens and 16 of 64, two
 * threads: 1.9 ms a layer against 1.2 ms shared out; docs/performance.md). It also
 * helps, less, when the OS runs another process (the API server, the engine core) on
 * one worker thread's core: the other thread goes on with the remaining items, though
 * not with the one the preempted thread holds. Each thread starts with the contiguous
 * range a static split would give it (so in the common case it streams its weights or
 * keys exactly as before) and takes items from its front; a thread that runs out
 * takes items, one at a time, from the back of the others' ranges. Every item is taken
 * exactly once (a compare-and-swap on the range's packed ends), so the outputs do not
 * depend on which thread computed them.
 *
 * The caller fills `r[0..nt)` with work_split before the region (the region's start
 * orders those stores before the threads' loads); inside, thread t calls work_next
 * until it returns -1. If OpenMP gives the region fewer threads than nt, the ranges of
 * the missing ones are taken by the others. */
typedef struct {
    int64_t ends; /* lo | hi << 32: the items [lo, hi) not yet taken */
    char pad[56]; /* one cache line per range: only a thief writes to another's line */
} __attribute__((aligned(64))) work_range;

static inline void work_split(work_range *r, int nt, int64_t n) {
    for (int t = 0; t < nt; t++) r[t].ends = (n * t / nt) | ((n * (t + 1) / nt) << 32);
}

/* Takes one item from the front (front = 1) or the back of one range; -1 if it is empty. */
static inline int64_t work_take(work_range *r, int front) {
    int64_t old = __atomic_load_n(&r->ends, __ATOMIC_RELAXED);
    for (;;) {
        const int64_t lo = old & 0xffffffff, hi = old >> 32;
        if (lo >= hi) return -1;
        const int64_t next = front ? (lo + 1) | (hi << 32) : lo | ((hi - 1) << 32);
        if (__atomic_compare_exchange_n(&r->ends, &old, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return front ? lo : hi - 1;
    }
}

/* Thread t's next item: its own range's front, else another range's back; -1 when all
 * are taken. */
static inline int64_t work_next(work_range *r, int t, int nt) {
    int64_t i = t < nt ? work_take(&r[t], 1) : -1;
    for (int k = 1; i < 0 && k <= nt; k++) i = work_take(&r[(t + k) % nt], 0);
    return i;
}

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

/* exp(x) for x clamped to [-87, 88]: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p of
 * degree 7 (relative error about one float rounding). Below -87 it gives 2^-126, not 0
 * (softmax weights that small, and silu's exp(-g) beyond the range, change nothing). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_roundevenf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

#if defined(__AVX512F__)
/* Round to nearest even bf16, as float_to_bf16 does for every value but NaN. Where the CPU
 * has AVX512-BF16 that is one instruction (vcvtneps2bf16) instead of five. */
static inline __m256i to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
}
#endif

#endif
