/* Where key (or value) j of a prefill chunk lies, for the prefill-attention kernels
 * (cpu_prefill_common.h's bf16 ones, cpu_prefill_attention_f32.c): rows `stride`
 * elements apart from `base`, or, with a block table, in the paged cache (strides in
 * elements). One struct for both element types, so the bf16 and float32 kernels read the
 * cache by the same rule. */
#ifndef ASERVE_CPU_KEY_ROWS_H
#define ASERVE_CPU_KEY_ROWS_H

#include <stdint.h>

typedef struct {
    const void *base;
    int64_t elem; /* bytes an element */
    int64_t stride;
    const int64_t *table; /* NULL: rows of base */
    int64_t block_size, stride_block, stride_token;
} KeyRows;

static inline const void *key_row(const KeyRows *src, int64_t j) {
    const int64_t at = !src->table ? j * src->stride
                                   : src->table[j / src->block_size] * src->stride_block
                                         + (j % src->block_size) * src->stride_token;
    return (const char *)src->base + at * src->elem;
}

#endif
