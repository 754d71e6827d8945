"""Pipeline parallelism (``--pp``): the layers split over stages, each stage's workers
holding only theirs, hidden states passed on over ``torch.distributed``, the last stage
sampling. Greedy tokens match transformers at PP 2 and PP 2 x TP 2, with chunked prefill
and preemption; the stages' tensors and the KV pool are the stage's own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.distributed.tp_group import TPGroup
from aserve.errors import ConfigError
from aserve.model.hf_config import load_arch_config
from aserve.model.kv_spec import bytes_per_block
from aserve.model.loader import load_model
from aserve.model.pipeline import Stage, parse_partition, stage_layers
from tests.hf_reference import hf_greedy, load_hf
from tests.models import EAGER

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. A language model reads a sequence",
    "Once upon a time there was a small town by the sea. The people of the town were fishers and bakers",
]
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _expected(model_dir: Path, name: str) -> tuple[list[list[int]], list[list[int]]]:
    hf = load_hf(model_dir, eager=name in EAGER)
    tok = LLM(str(model_dir), kv_cache_memory=1 << 22).get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    return prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("layers, pp, partition, bounds", [
    (12, 2, None, [(0, 6), (6, 12)]),
    (5, 2, None, [(0, 3), (3, 5)]),  # the extra layer before the last stage (it has the head)
    (7, 4, None, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    (3, 3, None, [(0, 1), (1, 2), (2, 3)]),
    (12, 1, None, [(0, 12)]),
    (5, 2, (1, 4), [(0, 1), (1, 5)]),
])
def test_stage_layers_split_as_vllm_does(layers, pp, partition, bounds):
    assert stage_layers(layers, pp, partition) == bounds


@pytest.mark.parametrize("layers, pp, partition, param", [
    (2, 3, None, "pipeline_parallel_size"),
    (5, 2, (2, 2), "pp_layer_partition"),
    (5, 2, (1, 1, 3), "pp_layer_partition"),
])
def test_impossible_splits_name_their_parameter(layers, pp, partition, param):
    with pytest.raises(ConfigError) as err:
        stage_layers(layers, pp, partition)
    assert err.value.param == param


def test_the_partition_flag_is_comma_separated_counts():
    assert parse_partition("5,7") == (5, 7) and parse_partition(None) is None and parse_partition("") is None
    for bad in ("5;7", "0,3", "a"):
        with pytest.raises(ConfigError) as err:
            parse_partition(bad)
        assert err.value.param == "pp_layer_partition"


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_each_stage_loads_only_its_layers(arch, model_dirs):
    """Stage 0: the embedding and layer 0; stage 1: layer 1, the final norm and the head
    (tied to an embedding of its own where the checkpoint ties them: mistral)."""
    cfg = load_arch_config(model_dirs[arch])
    held = []
    for rank in range(2):
        model = load_model(model_dirs[arch], cfg, dtype=torch.float32, max_positions=64, tp=TPGroup.single(),
                           stage=Stage(rank, 2, rank, rank + 1))
        # Where each parameter lives: a layer's number, or the module's name.
        held.append({name.split(".")[2] if ".layers." in name else name.rsplit(".", 1)[0]
                     for name, _ in model.named_parameters()})
    assert held[0] == {"model.embed_tokens", "0"}
    # A tied head is the embedding's weight (named once, as the embedding).
    assert held[1] == {"1", "model.norm", "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"}


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "qwen3_moe"])
def test_pipeline_2_matches_transformers(arch, model_dirs):
    """Chunked prefill (a 7-token budget: chunks and decodes share steps) through two
    stages: tied heads (mistral, gemma2), sliding windows and soft-caps (gemma2, three
    layers: an uneven split), experts (qwen3_moe)."""
    prompts, expected = _expected(model_dirs[arch], arch)
    with LLM(str(model_dirs[arch]), kv_cache_memory=1 << 22, pipeline_parallel_size=2,
             max_num_batched_tokens=7) as llm:
        assert len(llm.engine.executor.workers) == 2
        outputs = llm.generate(prompts, GREEDY)
        instance_id, instance_dir = llm._instance.id, llm._instance.dir
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert not list(Path("/dev/shm").glob(f"{instance_id}_*"))
    assert not os.path.exists(instance_dir)


def test_pipeline_2_by_tensor_parallel_2_matches_transformers(model_dirs):
    """Four workers: two stages of two TP ranks (the shared-memory collectives inside each
    stage, gloo between them)."""
    prompts, expected = _expected(model_dirs["llama"], "llama")
    with LLM(str(model_dirs["llama"]), kv_cache_memory=1 << 22, pipeline_parallel_size=2,
             tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert len(llm.engine.executor.workers) == 4
        outputs = llm.generate(prompts, GREEDY)
        instance_id = llm._instance.id
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert not list(Path("/dev/shm").glob(f"{instance_id}_*"))


def test_an_uneven_partition_and_preemption_give_the_same_tokens(model_dirs):
    """Gemma 2's three layers as 1 + 2 (``--pp-layer-partition 1,2``), in a KV pool too
    small for every request at once: some are preempted and recomputed through both
    stages."""
    arch = "gemma2"
    prompts, expected = _expected(model_dirs[arch], arch)
    cfg = load_arch_config(model_dirs[arch])
    per_block = bytes_per_block(cfg, tp_size=1, dtype="float32", block_size=4, num_layers=2)
    needs = [-(-(len(p) + MAX_NEW) // 4) for p in prompts]  # blocks each request holds at its end
    blocks = max(needs) + 2  # block 0 is reserved: room for the longest and one more block
    assert sum(needs) > blocks - 1
    with LLM(str(model_dirs[arch]), kv_cache_memory=blocks * per_block, block_size=4, max_model_len=4 * (blocks - 1),
             pipeline_parallel_size=2, pp_layer_partition="1,2") as llm:
        # The pool is sized by the stage with the most layers (2 of 3).
        assert llm.engine.config.cache.num_blocks == blocks
        outputs = llm.generate(prompts, GREEDY)
        assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_sampled_and_seeded_requests_agree_with_one_stage(model_dirs):
    """The last stage samples and hands the tokens back: a seeded request gives the
    tokens it gives without pipeline stages, and so do top-k/top-p rows beside it."""
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True)
              for s in (1, 2, 3)]
    with LLM(str(model_dirs["llama"]), kv_cache_memory=1 << 22) as one:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
    with LLM(str(model_dirs["llama"]), kv_cache_memory=1 << 22, pipeline_parallel_size=2) as two:
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)]
    assert got == want


def test_more_stages_than_layers_is_refused(model_dirs):
    with pytest.raises(ConfigError) as err:
        LLM(str(model_dirs["llama"]), kv_cache_memory=1 << 22, pipeline_parallel_size=3)
    assert err.value.param == "pipeline_parallel_size"
