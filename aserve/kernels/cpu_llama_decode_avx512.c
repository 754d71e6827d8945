/* A decode step of a Llama-family model's decoder layers in one call: the bf16 variant
 * for CPUs with AVX512-BF16 and no AMX (an AMD EPYC Zen 4, say). cpu_llama_decode.c is
 * the AMX one and says why and what; this one is the same stack over the AVX512-BF16
 * linear kernel (cpu_bf16_linear.c), whose packed weights have the AMX kernel's layout.
 * The layer-by-layer path calls the same kernels, so the two agree bit for bit. */
#include "cpu_bf16_linear.c"
#include "cpu_fused_ops.c"
#include "cpu_decode_attention.c"

#define BF16_LINEAR aserve_bf16_linear
#define BF16_LINEAR_SILU aserve_bf16_linear_silu /* the MLP's first half: one call, one barrier fewer */
#if BF16_LINEAR_AVAILABLE /* the kernel is built: prefetch each product's first weights during the one before */
#define BF16_LINEAR_THEN bf16_linear_then
#define BF16_LINEAR_SILU_THEN bf16_linear_silu_then
#endif
#include "cpu_llama_decode_bf16.h"
