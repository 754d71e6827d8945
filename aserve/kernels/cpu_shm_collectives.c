// Collectives between the tensor-parallel ranks of one node, through one shared-memory
// segment (the Python side, aserve/distributed/shm_comm.py, creates and maps it).
//
// Layout, every part 64-byte aligned (offsets computed by the caller and passed in):
//
//     [ line 0 | line 1 | ... | line N-1 ][ slot 0.0 | slot 0.1 | slot 1.0 | ... ]
//
//     line r  = { seq: u32, waiters: u32, ... }, one cache line per rank
//     slot r.b = rank r's buffer for generations of parity b (slot_bytes each)
//
// A collective is one or more generations. In generation g rank r copies its part into
// slot r.(g & 1) and stores seq = g (release); then it waits until every rank's seq has
// reached g, and reads every rank's slot of parity g & 1. Two slots a rank make this
// safe without a second barrier: rank r writes slot r.(g & 1) again only in generation
// g + 2, after it saw every rank reach g + 1, and a rank reaches g + 1 only after it
// finished reading generation g.
//
// Waiting spins with sched_yield for spin_us (the ranks of one step arrive microseconds
// apart), then sleeps on a futex on the peer's seq word for at most block_us and returns
// to the caller, which looks for signals and dead peers and calls again. A publisher
// wakes the futex only when its waiters count is non-zero. The count and seq form a
// Dekker pair: the waiter increments waiters then reads seq, the publisher stores seq
// then reads waiters, both sequentially consistent, so one of them sees the other; and
// FUTEX_WAIT itself re-checks the word, so no wake-up is lost. Nothing waits outside a
// collective: an idle server has no thread here.
//
// Sums are taken in rank order, in float32, and rounded once to the element type, so
// every rank gets bit-identical results (the ranks must sample identical tokens).

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define LINE 64
#define SUM_BLOCK 1024

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

typedef struct {
    uint32_t seq;
    uint32_t waiters;
} line_t;

static inline line_t *line_of(uint8_t *base, int rank) { return (line_t *)(base + (int64_t)rank * LINE); }

static inline uint8_t *slot_of(uint8_t *base, int64_t data_offset, int64_t slot_bytes, int rank, uint32_t gen) {
    return base + data_offset + ((int64_t)rank * 2 + (gen & 1)) * slot_bytes;
}

static inline int reached(uint32_t seq, uint32_t gen) { return (int32_t)(seq - gen) >= 0; }

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

// Copies nbytes from src into this rank's slot of the next generation, publishes it and
// returns the generation. nbytes must be at most slot_bytes.
uint32_t shm_publish(uint8_t *base, int64_t data_offset, int64_t slot_bytes, int rank, const void *src,
                     int64_t nbytes) {
    line_t *me = line_of(base, rank);
    uint32_t gen = __atomic_load_n(&me->seq, __ATOMIC_RELAXED) + 1;
    memcpy(slot_of(base, data_offset, slot_bytes, rank, gen), src, (size_t)nbytes);
    __atomic_store_n(&me->seq, gen, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&me->waiters, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &me->seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    return gen;
}

// 0 once every rank has published generation gen; 1 when it has waited block_us in the
// futex without that (or a signal woke it): the caller checks its peers and calls again.
int shm_wait(uint8_t *base, int rank, int size, uint32_t gen, int spin_us, int block_us) {
    double start = now_us();
    for (int p = 0; p < size; p++) {
        if (p == rank)
            continue;
        line_t *peer = line_of(base, p);
        while (!reached(__atomic_load_n(&peer->seq, __ATOMIC_ACQUIRE), gen)) {
            if (now_us() - start < spin_us) {
                sched_yield();
                continue;
            }
            __atomic_add_fetch(&peer->waiters, 1, __ATOMIC_SEQ_CST);
            uint32_t seen = __atomic_load_n(&peer->seq, __ATOMIC_SEQ_CST);
            long rc = 0;
            if (!reached(seen, gen)) {
                struct timespec timeout = {block_us / 1000000, (long)(block_us % 1000000) * 1000};
                rc = syscall(SYS_futex, &peer->seq, FUTEX_WAIT, seen, &timeout, NULL, 0);
            }
            __atomic_sub_fetch(&peer->waiters, 1, __ATOMIC_SEQ_CST);
            if (rc == -1 && (errno == ETIMEDOUT || errno == EINTR) &&
                !reached(__atomic_load_n(&peer->seq, __ATOMIC_ACQUIRE), gen))
                return 1;
        }
    }
    return 0;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// dst[0:n] = the sum over ranks 0..size-1 (in that order) of their slots of generation
// gen, as n elements of dtype. dst may be the caller's own source buffer.
void shm_sum(uint8_t *base, int64_t data_offset, int64_t slot_bytes, int size, uint32_t gen, void *dst, int64_t n,
             int dtype) {
    float acc[SUM_BLOCK];
    for (int64_t start = 0; start < n; start += SUM_BLOCK) {
        int64_t len = n - start < SUM_BLOCK ? n - start : SUM_BLOCK;
        for (int p = 0; p < size; p++) {
            const uint8_t *slot = slot_of(base, data_offset, slot_bytes, p, gen);
            if (dtype == DT_F32) {
                const float *src = (const float *)slot + start;
                if (p == 0)
                    for (int64_t i = 0; i < len; i++) acc[i] = src[i];
                else
                    for (int64_t i = 0; i < len; i++) acc[i] += src[i];
            } else if (dtype == DT_BF16) {
                const uint16_t *src = (const uint16_t *)slot + start;
                if (p == 0)
                    for (int64_t i = 0; i < len; i++) acc[i] = bf16_to_f32(src[i]);
                else
                    for (int64_t i = 0; i < len; i++) acc[i] += bf16_to_f32(src[i]);
            } else {
                const _Float16 *src = (const _Float16 *)slot + start;
                if (p == 0)
                    for (int64_t i = 0; i < len; i++) acc[i] = (float)src[i];
                else
                    for (int64_t i = 0; i < len; i++) acc[i] += (float)src[i];
            }
        }
        if (dtype == DT_F32) {
            memcpy((float *)dst + start, acc, (size_t)len * 4);
        } else if (dtype == DT_BF16) {
            uint16_t *out = (uint16_t *)dst + start;
            for (int64_t i = 0; i < len; i++) out[i] = f32_to_bf16(acc[i]);
        } else {
            _Float16 *out = (_Float16 *)dst + start;
            for (int64_t i = 0; i < len; i++) out[i] = (_Float16)acc[i];
        }
    }
}
