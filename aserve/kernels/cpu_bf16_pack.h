/* The packed layout of a bf16 weight shared by the AMX kernel (cpu_amx_linear.c, which
 * describes it) and the AVX512-BF16 one (cpu_bf16_linear.c): blocks of 32 output columns
 * by 32 of K, two 1 KiB tiles each, tile j's row r holding W[32p + 16j + c][32kc + 2r + i]
 * at column 2c + i; a pair's blocks for all of K contiguous. */
#ifndef ASERVE_CPU_BF16_PACK_H
#define ASERVE_CPU_BF16_PACK_H

#include <stdint.h>

/* W [N, K] (rows `w_stride` elements apart; N and K multiples of 32) -> out (N * K). */
static void bf16_tile_pack(const uint16_t *w, int64_t w_stride, uint16_t *out, int64_t N, int64_t K) {
    const int64_t KC = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / 32; p++) {
        for (int64_t kc = 0; kc < KC; kc++) {
            uint16_t *block = out + (p * KC + kc) * 1024;
            for (int j = 0; j < 2; j++)
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++)
                        for (int i = 0; i < 2; i++)
                            block[j * 512 + r * 32 + 2 * c + i] = w[(32 * p + 16 * j + c) * w_stride + 32 * kc + 2 * r + i];
        }
    }
}

#endif
