"""``EngineArgs``: one set of engine options, the same for ``LLM``, ``AsyncLLM`` and the CLI."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from aserve import LLM, AsyncLLM, EngineArgs, SamplingParams
from aserve.cli import build_parser
from aserve.engine.args import flag, from_cli, parse_bytes
from aserve.errors import ConfigError, InvalidSamplingParamsError, PromptTooLongError

FIELDS = dataclasses.fields(EngineArgs)
#: A value other than the default for every field, and how the CLI spells it.
OTHER = {
    "model": "/some/model", "dtype": "bfloat16", "max_model_len": 128, "seed": 7, "device": "cpu",
    "kv_cache_memory": 1 << 22, "kv_cache_dtype": "bfloat16", "block_size": 8, "enable_prefix_caching": False,
    "prefix_cache_reserve": 0.5, "max_num_seqs": 8, "max_num_batched_tokens": 64, "enable_chunked_prefill": False,
    "enforce_eager": True, "max_cudagraph_capture_size": 16, "pipeline_parallel_size": 2, "pp_layer_partition": "1,1",
    "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29600,
    "long_prefill_token_threshold": 32, "tensor_parallel_size": 2, "data_parallel_size": 2, "tp_comm": "gloo",
    "worker_threads": 1, "cpu_affinity": False, "heartbeat_timeout": 5.0, "startup_timeout": 60.0,
    "execute_model_timeout": 90.0,
}
ENGINE_COMMANDS = (["run"], ["generate", "hi"], ["bench", "throughput"], ["bench", "latency"])


def cli_words(name: str, value: object, command: list[str]) -> list[str]:
    if name == "model":
        return [str(value)] if command == ["run"] else ["--model", str(value)]
    if isinstance(value, bool):
        return [flag(name) if value else "--no-" + flag(name)[2:]]
    return [flag(name), str(value)]


def test_every_field_has_a_value_to_try():
    assert set(OTHER) == {f.name for f in FIELDS}
    assert all(OTHER[f.name] != f.default for f in FIELDS)


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
def test_cli_defaults_are_the_fields_defaults(command):
    assert from_cli(build_parser().parse_args(command)) == EngineArgs()


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("name", sorted(OTHER))
def test_every_field_is_a_flag(command, name):
    args = build_parser().parse_args([*command, *cli_words(name, OTHER[name], command)])
    assert from_cli(args) == EngineArgs(**{name: OTHER[name]})


def test_short_aliases_and_sizes():
    args = from_cli(build_parser().parse_args(["run", "--tp", "2", "--dp", "2", "--kv-cache-memory", "4GiB"]))
    assert (args.tensor_parallel_size, args.data_parallel_size, args.kv_cache_memory) == (2, 2, 4 << 30)
    assert [parse_bytes(t) for t in ("1048576", "1MiB", "1M", "1MB", "2k")] == [1 << 20, 1 << 20, 1 << 20, 10**6, 2048]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")


def test_llm_and_async_llm_take_exactly_the_fields(llama_dir):
    explicit = {f.name: f.default for f in FIELDS if f.name != "model"}
    explicit["kv_cache_memory"] = 1 << 22  # small, for the test: the rest stay at their defaults
    with LLM(str(llama_dir), **explicit) as llm:
        assert llm.engine_args == EngineArgs(str(llama_dir), kv_cache_memory=1 << 22)
        assert llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
    async_llm = AsyncLLM(str(llama_dir), **explicit)  # nothing starts before ``async with``
    assert async_llm.engine_args == llm.engine_args
    assert async_llm.config.scheduler.max_num_batched_tokens == llm.config.scheduler.max_num_batched_tokens


@pytest.mark.parametrize("owner", [LLM, AsyncLLM])
@pytest.mark.parametrize("typo,closest", [("tensor_parallel", "tensor_parallel_size"),
                                          ("max_seq_len", "max_model_len"), ("kv_cache_mem", "kv_cache_memory")])
def test_an_unknown_keyword_names_the_closest_field(llama_dir, owner, typo, closest):
    with pytest.raises(TypeError, match=f"{owner.__name__}\\(\\) got an unexpected keyword argument '{typo}'; "
                                        f"did you mean '{closest}'"):
        owner(str(llama_dir), **{typo: 1})


@pytest.mark.parametrize("kwargs,param", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),  # not max_num_batched_tokens, which it implies
    ({"max_num_seqs": "8"}, "max_num_seqs"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
    ({"heartbeat_timeout": 0}, "heartbeat_timeout"),
    ({"dtype": "int3"}, "dtype"),
    ({"block_size": 0}, "block_size"),
])
def test_a_bad_value_is_a_config_error_naming_the_field(kwargs, param):
    with pytest.raises(ConfigError) as info:
        EngineArgs(**kwargs)
    assert info.value.param == param


def test_llm_runs_one_engine(llama_dir):
    with pytest.raises(ConfigError) as info:
        LLM(str(llama_dir), data_parallel_size=2)
    assert info.value.param == "data_parallel_size"


# -- max_tokens: one rule on every path -----------------------------------------------------------


@pytest.fixture(scope="module")
def small_llm(llama_dir):
    with LLM(str(llama_dir), kv_cache_memory=1 << 22, max_model_len=32) as llm:
        yield llm


def test_max_tokens_that_cannot_fit_is_refused(small_llm):
    prompt = list(range(10, 30))  # 20 tokens: 12 left
    with pytest.raises(PromptTooLongError) as info:
        small_llm.generate([prompt], SamplingParams(max_tokens=13))
    assert info.value.param == "max_tokens"
    assert "maximum context length is 32 tokens" in str(info.value)
    out = small_llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (12, "length")


def test_max_tokens_none_runs_to_max_model_len(small_llm):
    prompt = list(range(10, 30))
    out = small_llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (12, "length")
    with pytest.raises(InvalidSamplingParamsError) as info:
        small_llm.generate([prompt], SamplingParams(max_tokens=None, min_tokens=13))
    assert info.value.param == "min_tokens"


def test_the_engine_core_refuses_it_too(small_llm):
    from aserve.wire.messages import EngineCoreRequest

    with pytest.raises(PromptTooLongError) as info:
        small_llm.engine.add_request(EngineCoreRequest("r", list(range(10, 30)), SamplingParams(max_tokens=13)))
    assert info.value.param == "max_tokens"
    assert not small_llm.engine.has_unfinished_requests()


def test_one_default():
    from aserve.api.protocol import CompletionRequest
    from aserve.sampling_params import DEFAULT_MAX_TOKENS

    assert SamplingParams().max_tokens == CompletionRequest(prompt="x").max_tokens == DEFAULT_MAX_TOKENS
