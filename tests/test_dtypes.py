"""``dtype="auto"``: the checkpoint's dtype, except a half dtype the CPU cannot multiply
natively, which computes in float32."""

from __future__ import annotations

import logging


from aserve import LLM, SamplingParams
from aserve.engine import fit as engine_fit
from aserve.engine.fit import fit_config
from aserve.engine.args import EngineArgs
from aserve.model.dtypes import cpu_half_dtypes, resolve_dtype_name
from aserve.model.hf_config import load_arch_config

SPR_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 avx512_fp16 amx_fp16\n"
ZEN3_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"


def test_cpu_half_dtypes_from_flags():
    assert cpu_half_dtypes(SPR_FLAGS) == {"bfloat16", "float16"}
    assert cpu_half_dtypes(ZEN3_FLAGS) == frozenset()
    assert cpu_half_dtypes("processor\t: 0\nflags\t\t: avx512f avx512_bf16\n") == {"bfloat16"}
    assert cpu_half_dtypes("processor\t: 0\nFeatures\t: fp asimd bf16\n") is None  # not x86: unknown


def test_auto_resolves_by_what_the_cpu_multiplies_natively(bf16_llama_dir):
    arch = load_arch_config(bf16_llama_dir)
    assert resolve_dtype_name("auto", arch, frozenset({"bfloat16"})) == "bfloat16"
    assert resolve_dtype_name("auto", arch, frozenset()) == "float32"
    assert resolve_dtype_name("auto", arch, None) == "bfloat16"  # unknown CPU: the checkpoint's
    assert resolve_dtype_name("bfloat16", arch, frozenset()) == "bfloat16"  # explicit wins


def test_auto_on_a_cpu_without_native_bf16_serves_in_float32(bf16_llama_dir, llama_dir, monkeypatch, caplog):
    monkeypatch.setattr(engine_fit, "cpu_half_dtypes", lambda: frozenset())
    with caplog.at_level(logging.WARNING, logger="aserve.engine"):
        fitted = fit_config(EngineArgs(str(bf16_llama_dir), kv_cache_memory=1 << 22).create_engine_config())
    assert fitted.config.model.dtype == "float32"
    assert "no native bfloat16 matrix products: computing in float32" in caplog.text
    assert fit_config(EngineArgs(str(bf16_llama_dir), dtype="bfloat16",
                                         kv_cache_memory=1 << 22).create_engine_config()).config.model.dtype == "bfloat16"
    # Served: the same greedy tokens as the float32 checkpoint (the weights are float32).
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = LLM(str(bf16_llama_dir), kv_cache_memory=1 << 22).generate(["Hello world"], greedy)
    want = LLM(str(llama_dir), kv_cache_memory=1 << 22).generate(["Hello world"], greedy)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    monkeypatch.setattr(engine_fit, "cpu_half_dtypes", lambda: frozenset({"bfloat16"}))
    assert fit_config(EngineArgs(str(bf16_llama_dir), kv_cache_memory=1 << 22).create_engine_config()).config.model.dtype == "bfloat16"
