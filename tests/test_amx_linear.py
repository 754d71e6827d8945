"""The bf16 linear kernels against float32 matmuls, and their place in the model: AMX
(``cpu_amx_linear.c``) and AVX512-BF16 (``cpu_bf16_linear.c``), which share the packed
layout and the Python class. Each runs where the CPU can execute it; on an AMX CPU both
do."""

from __future__ import annotations

import pytest
import torch

from aserve.kernels import amx_linear, bf16_linear, cpu_fused_ops
from aserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aserve.model.layers.linear import ColumnParallelLinear, prepack_linears
from aserve.distributed.tp_group import TPGroup
from tests.cpu_marks import needs_amx, needs_avx512_bf16



@pytest.fixture(scope="module", params=[pytest.param("amx", marks=needs_amx),
                                        pytest.param("avx512_bf16", marks=needs_avx512_bf16)])
def amx(request):
    loaded = amx_linear.load() if request.param == "amx" else bf16_linear.load()
    assert loaded is not None, f"the {request.param} kernel must build (and get the tile state) where the CPU has it"
    assert loaded.kind == request.param
    return loaded


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # Float32 products and sums, rounded to bf16 once: what oneDNN computes too.
    y = x.float() @ w.float().T
    return (y if bias is None else y.bfloat16().float() + bias.float()).bfloat16()


# Decode sizes (one row-tile or two, partial tiles), and prefill sizes that take
# several 32-row chunks with a partial last one.
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 100])
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (96, 160), (256, 64), (427, 64), (5, 32)])
def test_matches_float32_matmul_to_one_bf16_rounding(amx, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = (torch.randn(out_features, in_features, generator=g) * 0.1).bfloat16()
    got = amx.linear(x, amx.pack(w), out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    # The sums run in another order than the reference's: at most one bf16 rounding apart.
    torch.testing.assert_close(got.float(), reference(x, w).float(), rtol=2**-7, atol=1e-3)


def test_strided_rows_bias_and_threads_agree(amx, set_threads):
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(40, 256, generator=g).bfloat16()
    x = wide[:, 64:192]  # rows 256 elements apart
    w = (torch.randn(128, 128, generator=g) * 0.1).bfloat16()
    bias = torch.randn(128, generator=g).bfloat16()
    packed = amx.pack(w)
    set_threads(1)
    one = amx.linear(x, packed, 128, bias)
    set_threads(2)
    two = amx.linear(x, packed, 128, bias)
    # Each output block is summed by one thread in the same order, whatever the count.
    assert torch.equal(one, two)
    torch.testing.assert_close(one.float(), reference(x, w, bias).float(), rtol=2**-7, atol=1e-2)


def test_prefill_groups_and_row_panels_cover_every_output_once(amx, set_threads):
    # K = 2048: groups of 8 pairs (1 MiB of weights), so 17 pairs are 3 groups, the last
    # of one pair; 300 rows are two panels of 8 and 2 chunks, the last chunk 12 rows.
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, 2048, generator=g).bfloat16()
    w = (torch.randn(17 * 32, 2048, generator=g) * 0.05).bfloat16()
    packed = amx.pack(w)
    outs = []
    for threads in (1, 2, 3):
        set_threads(threads)
        outs.append(amx.linear(x, packed, w.shape[0]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0].float(), reference(x, w).float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("in_features", [544, 1056, 2816])  # 17, 33 and 88 chunks of 32: blocks of 16 and a rest
def test_prefill_split_over_k_gives_the_bits_of_one_pass(amx, in_features):
    """Prefill rows (more than 32) are summed over K a block at a time, their partial sums
    stored and loaded between blocks; each output keeps its order of sums, so the first
    32 rows of a prefill equal those rows as a decode call (one pass over all of K)."""
    g = torch.Generator().manual_seed(in_features)
    x = torch.randn(77, in_features, generator=g).bfloat16()
    w = (torch.randn(96, in_features, generator=g) * 0.05).bfloat16()
    packed = amx.pack(w)
    prefill = amx.linear(x, packed, 96)
    assert torch.equal(prefill[:32], amx.linear(x[:32], packed, 96))
    assert torch.equal(prefill[64:], amx.linear(x[64:], packed, 96))  # a last chunk of 13 rows
    torch.testing.assert_close(prefill.float(), reference(x, w).float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("rows", [33, 47, 100, 384])
def test_a_large_weight_streamed_at_tens_of_rows_gives_the_bits_of_the_blocked_form(amx, rows, set_threads):
    """On AMX, a weight of 4 MiB or more streams pair by pair at up to 384 rows (every
    32-row block on a pair while it is in L2, the last block overlapping the one before
    when the rows are not a multiple of 32); 385 rows and more take the blocked prefill
    form. Each output keeps its order of sums either way, so the rows agree bit for bit,
    whatever the thread count."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(400, 1024, generator=g).bfloat16()
    w = (torch.randn(2048, 1024, generator=g) * 0.05).bfloat16()  # 4 MiB of bf16
    packed = amx.pack(w)
    blocked = amx.linear(x, packed, 2048)
    outs = []
    for threads in (1, 2, 3):
        set_threads(threads)
        outs.append(amx.linear(x[:rows], packed, 2048))
    assert all(torch.equal(out, blocked[:rows]) for out in outs)
    torch.testing.assert_close(blocked.float(), reference(x, w).float(), rtol=2**-7, atol=1e-2)


# Prefill panels with a partial last one (AMX: K in blocks and not, a group of gate pairs
# and a rest); the AVX512-BF16 kernel's streaming form up to 192 rows (1, 5, 32, 33, 77,
# 130) and its panels past them (300).
@pytest.mark.parametrize("rows, inter, in_features", [(77, 96, 544), (33, 64, 2816), (300, 704, 256), (5, 32, 64),
                                                     (130, 2816, 1024), (1, 64, 2336), (32, 96, 1024)])
def test_the_fused_gated_product_has_the_bits_of_the_two_calls(amx, rows, inter, in_features, set_threads):
    """``linear_silu``: silu(x W_gate^T) * (x W_up^T) in one pass gives exactly
    ``linear`` followed by the C ``silu_mul``, on one thread and on two."""
    fused = cpu_fused_ops.load()
    assert fused is not None
    assert amx.fuses_silu(2 * inter) and not amx.fuses_silu(2 * inter + 32)
    g = torch.Generator().manual_seed(rows + inter)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = (torch.randn(2 * inter, in_features, generator=g) * 0.05).bfloat16()
    packed = amx.pack(w)
    for threads in (1, 2):
        set_threads(threads)
        want = fused.silu_mul(amx.linear(x, packed, 2 * inter))
        assert torch.equal(amx.linear_silu(x, packed, inter), want), threads
    gate, up = reference(x, w).float().chunk(2, dim=-1)
    torch.testing.assert_close(want.float(), torch.nn.functional.silu(gate) * up, rtol=2**-6, atol=2e-2)


def test_supports_bf16_weights_whose_input_side_is_a_multiple_of_32(amx):
    assert amx.supports(torch.zeros(64, 32, dtype=torch.bfloat16))
    assert amx.supports(torch.zeros(48, 32, dtype=torch.bfloat16))  # outputs padded to 64
    assert amx.packed_numel(torch.zeros(48, 32, dtype=torch.bfloat16)) == 64 * 32
    assert not amx.supports(torch.zeros(64, 32, dtype=torch.float32))
    assert not amx.supports(torch.zeros(64, 40, dtype=torch.bfloat16))


def test_prepack_gives_eligible_layers_amx_and_keeps_one_weight_copy(amx):
    tp = TPGroup.single()
    model = torch.nn.ModuleList([
        ColumnParallelLinear(64, [96], bias=True, tp=tp, dtype=torch.bfloat16),
        ColumnParallelLinear(40, [64], bias=False, tp=tp, dtype=torch.bfloat16),  # 40 inputs: not tileable
        ColumnParallelLinear(64, [40], bias=True, tp=tp, dtype=torch.bfloat16),  # 40 outputs: padded to 64
    ])
    g = torch.Generator().manual_seed(3)
    for layer in model:
        layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g) * 0.1)
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=g))
    weights = [layer.weight.data.clone() for layer in model]
    x = torch.randn(3, 64, generator=g).bfloat16()
    assert prepack_linears(model, amx) == 3
    tiled, other, padded = model
    assert tiled.amx_weight is not None and tiled.packed_weight is None and tiled.weight.numel() == 0
    assert other.amx_weight is None
    assert padded.amx_weight is not None and padded.amx_weight.numel() == 64 * 64
    torch.testing.assert_close(tiled(x).float(), reference(x, weights[0], tiled.bias).float(), rtol=2**-7, atol=1e-2)
    x40 = torch.randn(3, 40, generator=g).bfloat16()
    torch.testing.assert_close(other(x40).float(), reference(x40, weights[1]).float(), rtol=2**-7, atol=1e-2)
    out = padded(x)
    assert out.shape == (3, 40)
    torch.testing.assert_close(out.float(), reference(x, weights[2], padded.bias).float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_takes_the_kernel_and_a_tied_one_keeps_the_embeddings_weight(amx, tied):
    tp = TPGroup.single()
    model = torch.nn.Module()
    model.embed = VocabParallelEmbedding(427, 64, tp=tp, dtype=torch.bfloat16)
    model.head = ParallelLMHead(427, 64, tp=tp, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    model.embed.weight.data.copy_(torch.randn(427, 64, generator=g) * 0.1)
    if tied:
        model.head.weight = model.embed.weight
    else:
        model.head.weight.data.copy_(torch.randn(427, 64, generator=g) * 0.1)
    weight = model.head.weight.data.clone()
    prepack_linears(model, amx)
    assert model.head.amx_weight is not None
    # A tied head keeps the plain weight the embedding reads; an untied one drops its own.
    assert model.embed.weight.numel() == 427 * 64
    assert model.head.weight.numel() == (427 * 64 if tied else 0)
    x = torch.randn(4, 64, generator=g).bfloat16()
    logits = model.head(x)
    assert logits.shape == (4, 427)
    torch.testing.assert_close(logits.float(), reference(x, weight).float(), rtol=2**-7, atol=1e-2)
    ids = torch.tensor([0, 5, 426])
    assert torch.equal(model.embed(ids), model.embed.weight[ids])


@needs_amx
def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("ASERVE_CPU_AMX", "0")
    assert amx_linear.load() is None
    # bf16 layers then take the AVX512-BF16 kernel (every AMX CPU has avx512_bf16).
    best = bf16_linear.load_best()
    assert best is not None and best.kind == "avx512_bf16"


@needs_avx512_bf16
def test_avx512_bf16_kernel_switched_off_by_the_environment(monkeypatch):
    assert bf16_linear.load_best() is not None
    monkeypatch.setenv("ASERVE_CPU_BF16_LINEAR", "0")
    assert bf16_linear.load() is None
    monkeypatch.setenv("ASERVE_CPU_AMX", "0")
    assert bf16_linear.load_best() is None  # both off: oneDNN


@needs_avx512_bf16
# One block (1, 4, 6), 6 + 1 (7), or even blocks of 4 to 6 rows (8, 10, 12, 13, 14, 16,
# 19, 22, 25, 31, 32).
@pytest.mark.parametrize("rows", [1, 4, 6, 7, 8, 10, 12, 13, 14, 16, 17, 19, 22, 25, 31, 32])
@pytest.mark.parametrize("in_features", [320, 2336])
def test_avx512_bf16_decode_passes_cover_every_row_and_column_once(rows, in_features, set_threads):
    """The decode form (rows <= 32) runs K in passes over blocks of up to 6 rows,
    carrying the sums between passes (4 chunks of 32 up to 16 rows, 32 chunks past 16),
    and an odd count of 32-column pairs leaves a last group of one pair: K = 320 (2.5
    short passes, one long one) and K = 2,336 (18.25 short passes, 2.28 long ones) with
    5 pairs cover each edge. One and two threads give the same bits, and rows of a batch
    do not change each other's values, whatever block a row falls in or however long
    the batch's passes are (each row alone takes the short ones)."""
    kernel = bf16_linear.load()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    w = (torch.randn(160, in_features, generator=g) * 0.1).bfloat16()
    packed = kernel.pack(w)
    set_threads(1)
    one = kernel.linear(x, packed, 160)
    set_threads(2)
    two = kernel.linear(x, packed, 160)
    assert torch.equal(one, two)
    for r in range(rows):
        assert torch.equal(kernel.linear(x[r : r + 1], packed, 160), one[r : r + 1])
    torch.testing.assert_close(one.float(), reference(x, w).float(), rtol=2**-7, atol=1e-3)


def _count_fused_rows(monkeypatch) -> list[int]:
    """The rows of every ``linear_silu`` call from here on (the call itself unchanged)."""
    rows: list[int] = []
    fused = amx_linear.AmxLinear.linear_silu
    monkeypatch.setattr(amx_linear.AmxLinear, "linear_silu",
                        lambda self, x, *rest: rows.append(x.shape[0]) or fused(self, x, *rest))
    return rows


def _gated_run(model_dir, kind: str) -> tuple[list, bool]:
    """Greedy tokens and top-2 logprobs of three prompts (40, 90 and 20 tokens, 8 out) on
    a bf16 LLM whose MLPs take the ``kind`` kernel, and whether its one-call decode step
    attached."""
    from aserve import LLM, SamplingParams

    prompts = [[(3 * i + 5 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((40, 90, 20))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    with LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=1 << 22) as llm:
        model = llm.engine.executor.worker.runner.model.model
        assert model.layers[0].mlp.gate_up_proj.amx.kind == kind
        return ([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                 for o in llm.generate(prompts, params)], model.decode_stack is not None)


@needs_amx
def test_a_bf16_prefill_takes_the_fused_gated_product_and_keeps_its_tokens(llama_dir, monkeypatch):
    """Where ``fused_silu_pays`` (long prefills of wide models; here told so for every
    step of more than 32 rows, the tiny model being narrow), a bf16 Llama on AMX runs its
    MLP's first half as ``linear_silu``, and decode steps as the two calls; the tokens and
    logprobs are those of the two calls everywhere."""
    # As measured (AmxLinear.amx_fused_silu_pays): the 152M model's long prefills, not the 7M's.
    pays = amx_linear.AmxLinear.amx_fused_silu_pays
    assert pays(2048, 1024) and not pays(2048, 256) and not pays(128, 1024)
    rows = _count_fused_rows(monkeypatch)

    def run(pays) -> list:
        monkeypatch.setattr(amx_linear.AmxLinear, "fused_silu_pays", staticmethod(pays))
        return _gated_run(llama_dir, "amx")[0]

    with_fused = run(lambda n, k: n > 32)
    assert rows and min(rows) > 32  # the prefill steps only
    rows.clear()
    assert run(lambda n, k: False) == with_fused and not rows


@needs_avx512_bf16
def test_the_avx512_bf16_kernel_takes_the_fused_gated_product_in_every_step(llama_dir, monkeypatch):
    """On the AVX512-BF16 kernel the gated product is one call at every size (measured
    faster everywhere: ``fused_silu_pays``): prefill steps take ``linear_silu`` from the
    layer path and decode steps inside the one-call decode step. The tokens and logprobs
    are those of the two calls, with the fused form and the one-call step switched off."""
    monkeypatch.setenv("ASERVE_CPU_AMX", "0")  # on an AMX CPU, the AVX512-BF16 kernel all the same
    kernel = bf16_linear.load()
    assert kernel.fused_silu_pays(1, 32) and kernel.fused_silu_pays(4096, 256)
    rows = _count_fused_rows(monkeypatch)
    with_fused, stacked = _gated_run(llama_dir, "avx512_bf16")
    assert stacked and rows and max(rows) == 150  # the prefill step (its 150 prompt tokens) among them
    rows.clear()
    monkeypatch.setattr(amx_linear.AmxLinear, "fused_silu_pays", lambda self, n, k: False)
    monkeypatch.setenv("ASERVE_CPU_FUSED_DECODE", "0")
    assert _gated_run(llama_dir, "avx512_bf16") == (with_fused, False) and not rows
