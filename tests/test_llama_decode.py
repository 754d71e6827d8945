"""The fused decode step (aserve/kernels/llama_decode.py): every layer of a decode step in
one C call must give exactly what the layer-by-layer path gives, and apply only where
it computes the model's layers. bf16 (AMX, and AVX512-BF16) and float32 (AVX2 or AVX-512)
forms; each is skipped, with its reason, on a CPU that cannot run it.
``bfloat16`` is the bf16 form this CPU picks (AMX where it has it); ``bfloat16-avx512``
forces the AVX512-BF16 one (``ASERVE_CPU_AMX=0``), so an AMX CPU tests both."""

from __future__ import annotations

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.kernels import f32_linear, llama_decode
from tests.cpu_marks import needs_amx, needs_avx512_bf16, needs_bf16_kernel

needs_f32 = pytest.mark.skipif(not f32_linear.cpu_supported(),
                               reason="needs AVX2 and FMA (this CPU lacks them)")
DTYPES = [pytest.param("bfloat16", marks=needs_bf16_kernel), pytest.param("bfloat16-avx512", marks=needs_avx512_bf16),
          pytest.param("float32", marks=needs_f32)]


def _dtype(dtype: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The model dtype of a DTYPES entry, with the environment it names set."""
    if dtype == "bfloat16-avx512":
        monkeypatch.setenv("ASERVE_CPU_AMX", "0")
        return "bfloat16"
    return dtype


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.executor.worker.runner.model


def _random_qkv_biases(llm: LLM) -> None:
    """Nonzero q/k/v biases and q/k norm weights other than one, the same for every LLM
    (transformers initialises them to zeros and ones, which would not show a bias left
    out or the q and k norms swapped)."""
    g = torch.Generator().manual_seed(7)
    for layer in _model(llm).model.layers:
        attn = layer.self_attn
        bias = attn.qkv_proj.bias
        if bias is not None:
            bias.data.copy_(torch.randn(bias.shape, generator=g) * 0.5)
        if attn.use_qk_norm:
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight.data.copy_(1 + torch.randn(norm.weight.shape, generator=g) * 0.5)


def _generate(llm: LLM) -> list[tuple[list[int], list]]:
    """Greedy completions with their top-3 logprobs, of prompts of different lengths that
    finish at different steps (so decode-only steps and mixed ones both occur)."""
    prompts = [[5, 9, 14, 3], list(range(10, 50)), [7] * 19, list(range(60, 64))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (30, 9, 21, 17)]
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])  # qwen2: q/k/v bias; qwen3: q/k norms
@pytest.mark.parametrize("threads", [1, 2])
def test_same_tokens_and_logprobs_as_the_layer_by_layer_path(dtype, arch, threads, model_dirs, monkeypatch,
                                                             set_threads):
    set_threads(threads)
    dtype = _dtype(dtype, monkeypatch)
    fused_llm = LLM(str(model_dirs[arch]), dtype=dtype, kv_cache_memory=1 << 24)
    stack = _model(fused_llm).model.decode_stack
    assert stack is not None
    calls = []
    run = stack.run
    monkeypatch.setattr(stack, "run", lambda *a: calls.append(a[0].shape[0]) or run(*a))
    _random_qkv_biases(fused_llm)
    fused = _generate(fused_llm)
    # Decode-only steps went through it (4 rows, then fewer as requests finish).
    assert calls and max(calls) == 4 and min(calls) < 4

    monkeypatch.setenv("ASERVE_CPU_FUSED_DECODE", "0")
    llm = LLM(str(model_dirs[arch]), dtype=dtype, kv_cache_memory=1 << 24)
    assert _model(llm).model.decode_stack is None
    _random_qkv_biases(llm)
    assert _generate(llm) == fused  # bit-identical: the same kernels in the same order


@needs_f32
def test_float32_model_over_a_bf16_cache(llama_dir, monkeypatch):
    """The float32 stack reads and writes a bf16 KV cache as the layer path does."""
    fused_llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=1 << 24)
    assert _model(fused_llm).model.decode_stack is not None
    fused = _generate(fused_llm)
    monkeypatch.setenv("ASERVE_CPU_FUSED_DECODE", "0")
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory=1 << 24)
    assert _model(llm).model.decode_stack is None
    assert _generate(llm) == fused


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_step_gives_the_layers_hidden_states_and_kv_cache(dtype, llama_dir, monkeypatch):
    """A decode step of 3 rows at different lengths, straight through the model: the
    hidden states and every layer's written cache slots equal the layer loop's."""
    dtype = _dtype(dtype, monkeypatch)
    llm = LLM(str(llama_dir), dtype=dtype, kv_cache_memory=1 << 24)
    runner = llm.engine.executor.worker.runner
    model = runner.model
    llm.generate([[5, 9, 14, 3], list(range(10, 50)), [7] * 19], SamplingParams(temperature=0, max_tokens=1))
    from aserve.kernels.attention import AttentionMetadata

    block_size = runner.block_size
    lens = torch.tensor([5, 41, 20])
    table = torch.tensor([[1, 0, 0], [2, 3, 4], [5, 6, 0]])
    slots = torch.stack([table[i, (n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(lens)])
    meta = AttentionMetadata(slots, 3, table, None, (), decode_kernel=runner.decode_kernel, decode_seq_lens=lens)
    ids, pos = torch.tensor([11, 12, 13]), lens - 1
    before = [kv.paged.clone() for kv in runner.kv_caches]
    with torch.inference_mode():
        fused = model(ids, pos, runner.kv_caches, meta).clone()
        fused_kv = [kv.paged.clone() for kv in runner.kv_caches]
        for kv, saved in zip(runner.kv_caches, before):
            kv.paged.copy_(saved)
        stack, model.model.decode_stack = model.model.decode_stack, None
        try:
            plain = model(ids, pos, runner.kv_caches, meta)
        finally:
            model.model.decode_stack = stack
    assert torch.equal(fused, plain)
    for got, want, old in zip(fused_kv, runner.kv_caches, before):
        assert torch.equal(got, want.paged)
        assert not torch.equal(got, old)  # the step wrote its keys and values


@needs_f32
def test_not_attached_where_a_linear_is_not_in_the_kernels_form(llama_dir):
    """A float32 weight in another form (oneDNN's, as large ones are; MKL's, where the
    AVX2 kernel is switched off) is not the float32 stack's; nor are bf16 weights."""
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=1 << 24)
    model = _model(llm).model
    assert model.decode_stack is not None
    kernel = llama_decode.load_float32()
    model.decode_stack = None
    o_proj = model.layers[1].self_attn.o_proj
    o_proj.f32, o_proj.transposed_weight = None, torch.zeros(o_proj.f32_weight.shape[0] // 64, 64)
    assert not model.attach_decode_stack(kernel)
    norm = model.layers[0].input_layernorm.weight.data
    with pytest.raises(ValueError, match="takes contiguous torch.float32 weights"):
        kernel.stack([llama_decode.LayerTensors(norm.bfloat16(), *[norm] * 5)],
                     llama_decode.StackDims(64, 4, 2, 32, 128, 256, 64, 256, 64, 1e-6, 0.1))


@needs_amx
@pytest.mark.parametrize("var", ["ASERVE_CPU_FUSED_DECODE", "ASERVE_CPU_AMX", "ASERVE_CPU_FUSED_OPS"])
def test_switched_off_by_the_environment(var, monkeypatch):
    assert llama_decode.load("amx") is not None
    monkeypatch.setenv(var, "0")
    assert llama_decode.load("amx") is None


@needs_avx512_bf16
@pytest.mark.parametrize("var", ["ASERVE_CPU_FUSED_DECODE", "ASERVE_CPU_BF16_LINEAR", "ASERVE_CPU_FUSED_OPS"])
def test_avx512_bf16_form_switched_off_by_the_environment(var, monkeypatch):
    monkeypatch.setenv("ASERVE_CPU_AMX", "0")  # so that the default is this form on an AMX CPU too
    assert llama_decode.load("avx512_bf16") is not None and llama_decode.load() is not None
    monkeypatch.setenv(var, "0")
    assert llama_decode.load("avx512_bf16") is None and llama_decode.load() is None


@needs_avx512_bf16
def test_bf16_model_on_the_avx512_kernel_takes_the_one_call_step(llama_dir, monkeypatch):
    """Without AMX (or with it off), a bf16 model's linear layers are the AVX512-BF16
    kernel's, and its decode steps the one-call stack over the same packed weights."""
    monkeypatch.setenv("ASERVE_CPU_AMX", "0")
    model = _model(LLM(str(llama_dir), dtype="bfloat16", kv_cache_memory=1 << 24)).model
    assert model.layers[0].mlp.down_proj.amx.kind == "avx512_bf16"
    assert model.decode_stack is not None
    monkeypatch.setenv("ASERVE_CPU_BF16_LINEAR", "0")
    model = _model(LLM(str(llama_dir), dtype="bfloat16", kv_cache_memory=1 << 24)).model
    assert model.layers[0].mlp.down_proj.amx is None and model.decode_stack is None  # oneDNN, layer by layer


@needs_f32
def test_float32_form_needs_no_amx_and_is_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("ASERVE_CPU_AMX", "0")
    assert llama_decode.load_float32() is not None
    for var in ("ASERVE_CPU_FUSED_DECODE", "ASERVE_CPU_FUSED_OPS", "ASERVE_CPU_F32_LINEAR"):
        monkeypatch.setenv(var, "0")
        assert llama_decode.load_float32() is None
        monkeypatch.delenv(var)
    monkeypatch.setenv("ASERVE_CPU_ATTENTION", "sdpa")  # the stack calls the C attention kernel
    assert llama_decode.load_float32() is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tensor_parallel_2_same_tokens_and_logprobs(dtype, arch, model_dirs, monkeypatch, capfd):
    """With two ranks each layer is two C calls with the all-reduces between them, where
    the layer-by-layer path has them: the results stay bit-identical."""
    dtype = _dtype(dtype, monkeypatch)
    with LLM(str(model_dirs[arch]), dtype=dtype, kv_cache_memory=1 << 24, tensor_parallel_size=2) as llm:
        fused = _generate(llm)
    logged = capfd.readouterr().err
    assert logged.count("decode steps run the decoder layers from C (two calls a layer") == 2  # both ranks
    monkeypatch.setenv("ASERVE_CPU_FUSED_DECODE", "0")
    with LLM(str(model_dirs[arch]), dtype=dtype, kv_cache_memory=1 << 24, tensor_parallel_size=2) as llm:
        plain = _generate(llm)
    assert "decode steps run the decoder layers from C" not in capfd.readouterr().err
    assert plain == fused


@needs_bf16_kernel
def test_rows_sharing_a_prefix_attend_over_it_together(llama_dir, monkeypatch):
    """Ten requests that open with the same 96 tokens, after one that put them in the
    prefix cache: their decode steps hand the shared blocks to the attention kernel
    (which, with AMX or AVX512-BF16, attends over them for all rows at once, keeping its
    layouts of them from step to step), the one-call step and the layer-by-layer path
    agree bit for bit, with the layouts kept or laid out afresh each step, and the tokens
    are the row-by-row attention's (``ASERVE_CPU_DECODE_PREFIX=0``)."""
    prefix = list(range(3, 99))
    prompts = [prefix + [100 + i, 7 * i % 50 + 1] for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run(env: dict[str, str], keep_layouts: bool = True) -> tuple[list, list[int], list[bool], bool]:
        """(outputs, each step's prefix blocks, whether each step found its layouts kept,
        whether this CPU runs the prefix phase)."""
        for var in ("ASERVE_CPU_FUSED_DECODE", "ASERVE_CPU_DECODE_PREFIX"):
            monkeypatch.setenv(var, env.get(var, "1"))
        llm = LLM(str(llama_dir), dtype="bfloat16", kv_cache_memory=1 << 24)
        runner = llm.engine.executor.worker.runner
        if runner.prefix_layouts is not None and not keep_layouts:
            runner.prefix_layouts.max_bytes = 0
        seen: list[int] = []
        kept: list[bool] = []

        def note(blocks: int, slot) -> None:
            seen.append(blocks)
            kept.append(slot is not None and int(slot[1]) == 1)

        stack = runner.model.model.decode_stack
        if stack is not None:
            run_stack = stack.run
            monkeypatch.setattr(stack, "run", lambda *a: note(a[6], a[7][0] if a[7] else None) or run_stack(*a))
        else:
            kernel = runner.decode_kernel
            runner.decode_kernel = lambda *a, prefix_blocks=0, prefix_slot=None: note(prefix_blocks, prefix_slot) or kernel(
                *a, prefix_blocks=prefix_blocks, prefix_slot=prefix_slot)
        llm.generate([prefix + [1]], SamplingParams(temperature=0, max_tokens=1))
        outs = llm.generate(prompts, params)
        return ([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                 for o in outs], seen, kept, runner.decode_prefix)

    fused, seen, kept, prefix_phase = run({})
    assert max(seen) == 96 // 16  # the cached prefix's six blocks, every row's
    assert any(kept) == prefix_phase  # later steps read the layouts an earlier one made
    layers, seen, kept, _ = run({"ASERVE_CPU_FUSED_DECODE": "0"})
    assert layers == fused and max(seen) == 6 and any(kept) == prefix_phase
    afresh, seen, kept, _ = run({}, keep_layouts=False)
    assert afresh == fused and max(seen) == 6 and not any(kept)
    by_rows, seen, _, _ = run({"ASERVE_CPU_DECODE_PREFIX": "0"})
    assert set(seen) == {0}
    for (tokens, got), (want_tokens, want) in zip(fused, by_rows):
        same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
        for i in range(min(same + 1, len(tokens))):  # up to the first token that differs, that one included
            common = got[i].keys() & want[i].keys()
            assert len(common) >= 2
            assert {t: got[i][t] for t in common} == pytest.approx({t: want[i][t] for t in common}, abs=0.05)
        if same < len(tokens):  # a near tie: each run's choice is among the other's top three, within 0.05
            assert want_tokens[same] in got[same] and got[same][want_tokens[same]] > got[same][tokens[same]] - 0.05
