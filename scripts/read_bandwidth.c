/* The read rate the decode-step floor is stated against (scripts/decode_roofline.py):
 * `threads` OpenMP threads each sum their half of a `bytes` buffer with AVX-512 loads,
 * on 2 MiB pages when `huge` (as aserve's packed weights are) or 4 KiB pages (as the KV
 * pool is). Returns the best of `reps` passes in GB/s. Built by aserve's kernel builder
 * (aserve/kernels/cbuild.py). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

double read_gbps(int64_t bytes, int threads, int huge, int reps) {
    char *p = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return -1.0;
    madvise(p, (size_t)bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    memset(p, 1, (size_t)bytes);
    double best = 0.0;
    volatile int64_t sink = 0;
    for (int rep = 0; rep < reps; rep++) {
        const double t0 = now();
        int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t lo = bytes / 256 * t / nt * 256, hi = bytes / 256 * (t + 1) / nt * 256;
#if defined(__AVX512F__)
            __m512i acc = _mm512_setzero_si512();
            for (int64_t i = lo; i < hi; i += 256) {
                acc = _mm512_add_epi32(acc, _mm512_load_si512(p + i));
                acc = _mm512_add_epi32(acc, _mm512_load_si512(p + i + 64));
                acc = _mm512_add_epi32(acc, _mm512_load_si512(p + i + 128));
                acc = _mm512_add_epi32(acc, _mm512_load_si512(p + i + 192));
            }
            total += _mm512_reduce_add_epi32(acc);
#else
            int64_t acc = 0;
            for (int64_t i = lo; i < hi; i += 8) acc += *(const int64_t *)(p + i);
            total += acc;
#endif
        }
        const double dt = now() - t0;
        sink += total;
        if (bytes / dt / 1e9 > best) best = bytes / dt / 1e9;
    }
    munmap(p, (size_t)bytes);
    return best;
}
