"""Liveness that cannot hide behind a long step (docs/design.md §14): a slow model load
and a long step never look dead, since every engine process ticks its heartbeat from a
thread of its own; a step that makes no progress past ``execute_model_timeout`` fails
the engine even though its workers still tick.

The slowness is injected into the real worker processes with a ``sitecustomize`` module
on their ``PYTHONPATH`` (spawned children inherit the environment): it wraps the
worker's model loading, or its first prefill step, in a sleep."""

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


async def test_a_worker_that_takes_20_s_to_load_is_not_taken_for_dead(llama_dir, inject):
    inject(SLOW_LOAD.format(seconds=20))
    start = time.monotonic()
    async with AsyncLLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22) as llm:
        assert time.monotonic() - start >= 20  # the load really was slow: 5 heartbeat timeouts long
        assert len(await _complete(llm, "r")) == 4
        await llm.check_health()


async def test_a_long_step_is_not_taken_for_dead(llama_dir, inject):
    # 12 s in one step: three default heartbeat timeouts, below the step bound's 60 s floor.
    inject(SLOW_STEP.format(seconds=12))
    async with AsyncLLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22) as llm:
        start = time.monotonic()
        assert len(await _complete(llm, "r")) == 4
        assert time.monotonic() - start >= 12
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
