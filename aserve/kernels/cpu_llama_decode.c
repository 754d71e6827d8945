/* A decode step of a Llama-family model's decoder layers in one call (CPU, bf16, AMX).
 *
 * Why: on a small model a decode step's kernels are short (7M model, 32 rows: ~40
 * kernel calls of 10-60 us each), and calling each from Python (module dispatch, views,
 * output allocation, ctypes argument conversion) cost about a third of the step. Here
 * the whole stack of layers runs from C, calling the same kernels in the same order with
 * the same thread count, so the result is bit-identical to the layer-by-layer path:
 *
 *   per layer:  h, residual = RMSNorm(x + residual)          (first layer: residual = x)
 *               qkv = h . Wqkv^T (+ bias, Qwen2);  RMSNorm of each q and k head (Qwen3);
 *               rotary(q, k)
 *               attn = decode attention over the paged cache (writes k, v into it)
 *               h, residual = RMSNorm(attn . Wo^T + residual)
 *               x = silu(h . Wgate^T) * (h . Wup^T) . Wdown^T
 *
 * and the caller applies the final norm to (x, residual). With tensor parallelism each
 * layer is two calls (aserve_llama_decode_half), the caller all-reducing o_proj's and
 * down_proj's outputs between them. Only for what the layer-by-layer path would run on
 * the same kernels: bf16 weights packed for AMX, no biases but on q/k/v, decode rows
 * only (aserve/kernels/llama_decode.py and LlamaModel.attach_decode_stack check).
 * cpu_llama_decode_avx512.c is the same stack on CPUs with AVX512-BF16 and no AMX.
 *
 * The kernels are compiled into this library from their own files (built by
 * aserve/kernels/cbuild.py, whose cache key covers them).
 */
#include "cpu_amx_linear.c"
#include "cpu_fused_ops.c"
#include "cpu_decode_attention.c"

#define BF16_LINEAR aserve_amx_linear
#include "cpu_llama_decode_bf16.h"
