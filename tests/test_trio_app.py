"""AsyncLLM inside a Trio application, written the way a Trio program is: a nursery of
requests, ``trio.move_on_after`` to give up on one, ``trio.testing`` where it helps.
Trio-only code, so these tests run under pytest-trio (``pytest.mark.trio``); the tests
that must hold on both loops use anyio's plugin with both backends (tests/test_async_llm.py),
never both plugins in one module (PLATFORM-NOTES)."""

from __future__ import annotations

import pytest
import trio

from aserve import SamplingParams
from aserve.frontend.async_llm import AsyncLLM

pytestmark = pytest.mark.trio

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


async def _tokens(engine: AsyncLLM, prompt: str, params: SamplingParams, request_id: str) -> list[int]:
    final = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        final = out
    return final.outputs[0].token_ids


@pytest.fixture
async def engine(llama_dir):
    async with AsyncLLM(str(llama_dir), kv_cache_memory=1 << 22) as llm:
        yield llm


async def test_a_nursery_of_requests_gets_each_its_own_tokens(engine):
    prompts = ["Hello world", "The quick brown fox", "Once upon a time"]
    alone = [await _tokens(engine, p, GREEDY, f"alone-{i}") for i, p in enumerate(prompts)]
    together: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        together[i] = await _tokens(engine, prompts[i], GREEDY, f"together-{i}")

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    assert [together[i] for i in range(len(prompts))] == alone


async def test_a_cancelled_scope_abandons_a_request_and_the_engine_serves_on(engine):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    seen = 0
    # A Trio cancel scope cancelled mid-stream (as trio.move_on_after does at its deadline;
    # cancelled here after three outputs, so no clock decides the test).
    with trio.CancelScope() as scope:
        async for out in engine.generate("Hello", long, request_id="abandoned"):
            seen = len(out.outputs[0].token_ids)
            if seen >= 3:
                scope.cancel()
    assert scope.cancelled_caught and 3 <= seen < 200
    # The abandoned request was aborted, not left running: the next one completes, and
    # the engine's running set empties.
    assert len(await _tokens(engine, "Hello", GREEDY, "after")) == 8
    with trio.fail_after(10):
        while (await engine.get_stats())["num_running"]:
            await trio.sleep(0.01)
