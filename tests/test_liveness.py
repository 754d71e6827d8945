"""Liveness that cannot hide behind a long step (docs/design.md §14): a slow model load
and a long step never look dead, since every engine process ticks its heartbeat from a
thread of its own; a step that makes no progress past ``execute_model_timeout`` fails
the engine even though its workers still tick, and one that keeps finishing layers is
waited for however far past it it runs.

The slowness is injected into the real worker processes with a ``sitecustomize`` module
on their ``PYTHONPATH`` (spawned children inherit the environment): it wraps the
worker's model loading, its first prefill step, or each layer of a prefill step, in a
sleep."""

from __future__ import annotations

import textwrap
import time

import anyio
import pytest

from aserve import SamplingParams
from aserve.errors import EngineDeadError
from aserve.frontend.async_llm import AsyncLLM

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# Half the default (4 s): the slow load and the long step last as many timeouts in half
# the time; the heartbeat thread ticks once a second whatever the steps do, as the 8k
# prefill test (tests/e2e/test_long_prefill.py) relies on at the same timeout.
HEARTBEAT_TIMEOUT = 2.0

SLOW_LOAD = """
import time
import aserve.model.loader as loader
_load = loader.load_model
def load_model(*args, **kwargs):
    time.sleep({seconds})
    return _load(*args, **kwargs)
loader.load_model = load_model
"""

SLOW_STEP = """
import time
import aserve.worker.model_runner as runner
_execute = runner.ModelRunner.execute_model
def execute_model(self, sched):
    if any(n > 1 for n in sched.num_scheduled_tokens.values()):  # a prefill chunk
        time.sleep({seconds})
    return _execute(self, sched)
runner.ModelRunner.execute_model = execute_model
"""

SLOW_LAYERS = """
import time
import aserve.model.models.llama as llama
_forward = llama.LlamaDecoderLayer.forward
def forward(self, rope, x, residual, kv_cache, meta, rows=None):
    if meta.prefills:
        time.sleep({seconds})
    return _forward(self, rope, x, residual, kv_cache, meta, rows)
llama.LlamaDecoderLayer.forward = forward
"""


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def inject(tmp_path, monkeypatch):
    def install(code: str) -> None:
        (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(code))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return install


async def _complete(llm: AsyncLLM, request_id: str) -> list[int]:
    final = None
    async for out in llm.generate("Hello world", GREEDY, request_id=request_id):
        final = out
    return final.outputs[0].token_ids


async def test_a_worker_that_takes_10_s_to_load_is_not_taken_for_dead(llama_dir, inject):
    inject(SLOW_LOAD.format(seconds=10))
    start = time.monotonic()
    async with AsyncLLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22,
                        heartbeat_timeout=HEARTBEAT_TIMEOUT) as llm:
        assert time.monotonic() - start >= 10  # the load really was slow: 5 heartbeat timeouts long
        assert len(await _complete(llm, "r")) == 4
        await llm.check_health()


async def test_a_long_step_is_not_taken_for_dead(llama_dir, inject):
    # 6 s in one step: three heartbeat timeouts, below the step bound's 60 s floor.
    inject(SLOW_STEP.format(seconds=6))
    async with AsyncLLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22,
                        heartbeat_timeout=HEARTBEAT_TIMEOUT) as llm:
        start = time.monotonic()
        assert len(await _complete(llm, "r")) == 4
        assert time.monotonic() - start >= 6
        await llm.check_health()


async def test_a_step_past_execute_model_timeout_fails_the_engine(llama_dir, inject):
    inject(SLOW_STEP.format(seconds=60))
    async with AsyncLLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22,
                        execute_model_timeout=3.0) as llm:
        with anyio.fail_after(30):
            with pytest.raises(EngineDeadError):
                await _complete(llm, "r")
            await llm.dead_event.wait()
        with pytest.raises(EngineDeadError, match="made no progress for 3 s"):
            await llm.check_health()


async def test_a_step_that_keeps_finishing_layers_outlasts_execute_model_timeout(tmp_path, inject):
    # Ten layers of 1 s each: a 10 s prefill step against a 4 s bound. Each layer done
    # moves the workers' progress counters, which the engine core reads once a second,
    # so the bound never runs out (the longest gap it sees is a layer plus a look).
    from aserve.model_builder import llama_config, random_llama_weights, write_model_dir
    from aserve.tiny_tokenizer import build_tokenizer

    cfg = llama_config(hidden_size=64, num_layers=10, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=256)
    model = tmp_path / "llama-10-layers"
    write_model_dir(model, cfg, random_llama_weights(cfg, seed=0))
    inject(SLOW_LAYERS.format(seconds=1.0))
    async with AsyncLLM(str(model), tensor_parallel_size=2, kv_cache_memory=1 << 22,
                        execute_model_timeout=4.0) as llm:
        start = time.monotonic()
        assert len(await _complete(llm, "r")) == 4
        assert time.monotonic() - start >= 10  # the step really outlasted the bound
        await llm.check_health()
