"""Sleep, wake up and profile: the KV pool's pages go back to the OS (the worker's RSS
drops), requests meanwhile are refused by name, and waking serves the same tokens; level 2
reloads the weights; a profile writes one trace per worker."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from aserve import LLM, SamplingParams
from aserve.default_model import default_model_dir
from aserve.errors import EngineSleepingError
from aserve.frontend.async_llm import AsyncLLM
from tests.e2e.server import process_tree

pytestmark = pytest.mark.anyio
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def rss_mib(pid: int) -> float:
    line = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.parametrize("level", [1, 2])
def test_offline_sleep_and_wake_give_the_same_tokens(llama_dir, level):
    with LLM(str(llama_dir), kv_cache_memory=1 << 22) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(["Hello", "The quick brown fox"], GREEDY)]
        llm.sleep(level)
        assert llm.is_sleeping()
        with pytest.raises(EngineSleepingError):
            llm.generate(["Hello"], GREEDY)
        llm.wake_up()
        assert not llm.is_sleeping()
        after = [o.outputs[0].token_ids for o in llm.generate(["Hello", "The quick brown fox"], GREEDY)]
    assert after == before


async def test_a_sleeping_worker_gives_its_kv_pages_back(tmp_path):
    model = default_model_dir()  # 8 KiB of float32 KV a token: enough to see in the RSS
    prompts = [[(7 * i + 13 * j) % 4000 + 3 for j in range(900)] for i in range(16)]
    async with AsyncLLM(str(model), kv_cache_memory=256 << 20, enable_prefix_caching=False) as llm:
        worker = next(p for p in process_tree(llm.engine_core.engine_process.pid)
                      if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"aserve::worker"))

        async def run(prompt) -> list[int]:
            final = None
            async for final in llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)):
                pass
            return final.outputs[0].token_ids

        results: list = [None] * len(prompts)

        async def one(i: int) -> None:
            results[i] = await run(prompts[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        awake = rss_mib(worker)
        # 16 x 904 tokens x 8 KiB = 113 MiB of the pool written; the sleep gives it back.
        await llm.sleep(1)
        assert await llm.is_sleeping()
        asleep = rss_mib(worker)
        assert awake - asleep > 80, (awake, asleep)
        with pytest.raises(EngineSleepingError, match="asleep"):
            await run(prompts[0])
        await llm.wake_up()
        assert not await llm.is_sleeping()
        assert await run(prompts[3]) == results[3]

        # A sleep with a request in flight is refused, and the request goes on.
        started = anyio.Event()
        tokens: list[int] = []

        async def long() -> None:
            async for out in llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)):
                started.set()
                tokens[:] = out.outputs[0].token_ids

        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            await started.wait()
            with pytest.raises(RuntimeError, match="requests in flight"):
                await llm.sleep(1)
        assert len(tokens) == 100

        await llm.sleep(2)  # the weights too: reloaded on waking
        await llm.wake_up()
        assert await run(prompts[3]) == results[3]


async def test_a_profile_writes_one_trace_per_worker(llama_dir, tmp_path):
    async with AsyncLLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22) as llm:
        await llm.start_profile(str(tmp_path))
        async for _ in llm.generate("Hello", GREEDY):
            pass
        await llm.stop_profile()
        with pytest.raises(RuntimeError, match="no profile"):
            await llm.stop_profile()
    traces = sorted(tmp_path.glob("worker_dp0_tp*.json"))
    assert [t.name.split("_")[2] for t in traces] == ["tp0", "tp1"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]
        assert any("aten::" in str(e.get("name", "")) for e in events)
