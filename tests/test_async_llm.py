"""AsyncLLM over real processes and wires, under asyncio and Trio."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from aserve import LLM, SamplingParams
from aserve.errors import EngineDeadError, InvalidInputError
from aserve.frontend.async_llm import AsyncLLM
from tests.hf_reference import hf_greedy, load_hf

pytestmark = pytest.mark.anyio

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog", "What is the capital of France?"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def expected(llama_dir):
    hf = load_hf(llama_dir)
    tok = LLM(str(llama_dir), kv_cache_memory=1 << 22).get_tokenizer()
    return [hf_greedy(hf, tok.encode(p), 10) for p in PROMPTS]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def tree(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        out += [child, *tree(child)]
    return out


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def still_running(pid: int) -> str:
    """A process's pid, name and state, for an assertion's message."""
    try:
        return f"{pid}: " + ", ".join(Path(f"/proc/{pid}/status").read_text().split("\n")[:3])
    except FileNotFoundError:
        return f"{pid}: gone"


def leftovers(instance_id: str, instance_dir: str) -> list[str]:
    found = [p.name for p in Path("/dev/shm").glob(f"{instance_id}_*")]
    return found + ([instance_dir] if os.path.exists(instance_dir) else [])


async def collect(llm, prompt, params, request_id=None):
    final = None
    async for out in llm.generate(prompt, params, request_id=request_id):
        final = out
    return final


@pytest.mark.parametrize("tp", [1, 2])
async def test_greedy_matches_transformers(llama_dir, expected, tp):
    async with AsyncLLM(str(llama_dir), tensor_parallel_size=tp, kv_cache_memory=1 << 22) as llm:
        results = [None] * len(PROMPTS)

        async def run(i):
            results[i] = await collect(llm, PROMPTS[i], GREEDY)

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(run, i)
        assert [r.outputs[0].token_ids for r in results] == expected
        assert all(r.finished and r.outputs[0].finish_reason == "length" for r in results)
        instance = (llm.engine_core.instance.id, llm.engine_core.instance.dir)
        pids = [llm.engine_core.engine_process.pid, *tree(llm.engine_core.engine_process.pid)]
        assert len(pids) == 1 + tp  # the engine core and one worker per rank
        titles = sorted(Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode() for p in pids)
        assert titles == ["aserve::engine_core_0", *[f"aserve::worker_tp{r}" for r in range(tp)]]
    assert leftovers(*instance) == []
    assert [still_running(p) for p in pids if alive(p)] == []


async def test_data_parallel_engines_share_the_load_and_match_transformers(llama_dir, expected):
    async with AsyncLLM(str(llama_dir), data_parallel_size=2, kv_cache_memory=1 << 22) as llm:
        instance = (llm.engine_core.instance.id, llm.engine_core.instance.dir)
        engines = [p.pid for p in llm.engine_core.engine_processes]
        # This process's aserve children (other tests may have left a reaped-later helper).
        pids = [p for p in tree(os.getpid())
                if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"aserve::")]
        titles = sorted(Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode() for p in pids)
        assert titles == ["aserve::coordinator", "aserve::engine_core_0", "aserve::engine_core_1",
                          "aserve::worker_tp0", "aserve::worker_tp0"]
        # Pinned to either engine, greedy tokens are transformers'.
        for rank in (0, 1):
            outs = []
            async for out in llm.generate(PROMPTS[0], GREEDY, data_parallel_rank=rank):
                outs.append(out)
            assert outs[-1].outputs[0].token_ids == expected[0]
        with pytest.raises(InvalidInputError, match="data_parallel_rank"):
            async for _ in llm.generate(PROMPTS[0], GREEDY, data_parallel_rank=2):
                pass
        # Unpinned concurrent requests spread over both engines.
        results = [None] * 12

        async def run(i):
            results[i] = await collect(llm, PROMPTS[i % 3], GREEDY)

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(run, i)
        assert [r.outputs[0].token_ids for r in results] == [expected[i % 3] for i in range(12)]
        received = [(await llm.get_stats(rank))["num_requests_received"] for rank in (0, 1)]
        assert sum(received) == 14 and min(received) >= 4, received
        await llm.check_health()
    assert leftovers(*instance) == []
    assert not any(alive(p) for p in [*engines, *pids])


async def test_many_concurrent_streams_and_output_kinds(llama_dir):
    from aserve.sampling_params import RequestOutputKind

    offline = LLM(str(llama_dir), kv_cache_memory=1 << 22)
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(24)]
    want = [o.outputs[0].token_ids for o in offline.generate(prompts, GREEDY)]
    async with AsyncLLM(str(llama_dir), kv_cache_memory=1 << 22) as llm:
        got = [None] * len(prompts)

        async def run(i):
            kind = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY][i % 3]
            params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=kind)
            tokens, count = [], 0
            async for out in llm.generate(prompts[i], params, request_id=f"req-{i}"):
                count += 1
                tokens = tokens + out.outputs[0].token_ids if kind == RequestOutputKind.DELTA else out.outputs[0].token_ids
            if kind == RequestOutputKind.FINAL_ONLY:
                assert count == 1
            got[i] = tokens

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(run, i)
        assert got == want


async def test_a_consumer_that_falls_behind_gets_the_missed_steps_in_one_output(llama_dir):
    from aserve.sampling_params import RequestOutputKind

    # 40 tokens: the engine is still running when the consumer takes its first output.
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(str(llama_dir), kv_cache_memory=1 << 22).generate(PROMPTS[0], greedy)[0].outputs[0]
    async with AsyncLLM(str(llama_dir), kv_cache_memory=1 << 22) as llm:
        for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=kind)
            outputs = []
            async for out in llm.generate(PROMPTS[0], params):
                outputs.append(out)
                if len(outputs) == 1:
                    # Stop consuming until the engine has finished the request (its last
                    # output reaches the front end before the reply to this call).
                    with anyio.fail_after(30):
                        while (await llm.get_stats())["num_running"]:
                            await anyio.sleep(0.01)
            assert len(outputs) == 2 and outputs[1].finished and not outputs[0].finished
            first, rest = outputs[0].outputs[0], outputs[1].outputs[0]
            if kind == RequestOutputKind.DELTA:  # the second delta covers every missed step
                assert first.token_ids + rest.token_ids == want.token_ids and len(rest.token_ids) > 1
                assert first.text + rest.text == want.text
            else:
                assert rest.token_ids == want.token_ids and rest.text == want.text
            assert rest.finish_reason == "length"


async def test_cancelled_consumer_frees_its_blocks(llama_dir):
    async with AsyncLLM(str(llama_dir), kv_cache_memory=1 << 22) as llm:
        seen = 0
        with anyio.CancelScope() as scope:
            async for _ in llm.generate("Hello world", SamplingParams(max_tokens=400, ignore_eos=True)):
                seen += 1
                if seen == 3:
                    stats = await llm.get_stats()
                    assert stats["num_running"] == 1 and stats["kv_cache_usage"] > 0
                    scope.cancel()
        assert scope.cancelled_caught
        # The ABORT went out before this call; the engine handles its input in order.
        stats = await llm.get_stats()
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["kv_cache_usage"] == 0.0


async def test_abort_and_bad_input(llama_dir):
    async with AsyncLLM(str(llama_dir), kv_cache_memory=1 << 22) as llm:
        outputs = []
        async for out in llm.generate("Hello", SamplingParams(max_tokens=400, ignore_eos=True), request_id="x"):
            outputs.append(out)
            if len(outputs) == 2:
                await llm.abort("x")
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(InvalidInputError):
            await collect(llm, "", GREEDY)
        with pytest.raises(InvalidInputError):
            await collect(llm, list(range(10, 600)), GREEDY)
        with pytest.raises(InvalidInputError) as info:  # msgpack carries 64 bits at most
            async for _ in llm.generate("Hello", GREEDY, priority=2**63):
                pass
        assert info.value.param == "priority"
        assert (await collect(llm, "Hello", GREEDY)).finished
        await llm.check_health()
        await llm.reset_prefix_cache()


@pytest.mark.parametrize("victim", ["worker", "engine_core"])
async def test_kill_9_fails_requests_and_leaves_nothing(llama_dir, victim):
    async with AsyncLLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22) as llm:
        engine = llm.engine_core.engine_process.pid
        workers = tree(engine)
        assert len(workers) == 2
        instance = (llm.engine_core.instance.id, llm.engine_core.instance.dir)
        seen = 0
        start = None
        with pytest.raises(EngineDeadError):
            with anyio.fail_after(30):
                async for _ in llm.generate("Hello", SamplingParams(max_tokens=None, ignore_eos=True)):
                    seen += 1
                    if seen == 2:
                        os.kill(workers[1] if victim == "worker" else engine, signal.SIGKILL)
                        start = time.monotonic()
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):
            await collect(llm, "Hello", GREEDY)
        with pytest.raises(EngineDeadError):
            await llm.check_health()
    deadline = time.monotonic() + 15
    while any(alive(p) for p in [engine, *workers]) and time.monotonic() < deadline:
        await anyio.sleep(0.1)
    assert not any(alive(p) for p in [engine, *workers])
    assert leftovers(*instance) == []


async def test_parent_sigkill_leaves_no_process(llama_dir, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import anyio, os, sys
        from aserve.frontend.async_llm import AsyncLLM

        async def main():
            async with AsyncLLM({str(llama_dir)!r}, tensor_parallel_size=2, kv_cache_memory=1 << 22) as llm:
                print(llm.engine_core.instance.id, llm.engine_core.instance.dir, llm.engine_core.engine_process.pid, flush=True)
                await anyio.sleep(3600)

        if __name__ == "__main__":
            anyio.run(main)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        instance_id, instance_dir, engine = proc.stdout.readline().split()
        engine = int(engine)
        workers = tree(engine)
        assert len(workers) == 2
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 20
        while any(alive(p) for p in [engine, *workers]) and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        assert not any(alive(p) for p in [engine, *workers])
        assert leftovers(instance_id, instance_dir) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


async def test_a_stopped_worker_is_dead_after_the_heartbeat_timeout(llama_dir):
    # The default timeout (4 s): healthy workers tick every second from a thread.
    async with AsyncLLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22) as llm:
        engine = llm.engine_core.engine_process.pid
        workers = tree(engine)
        instance = (llm.engine_core.instance.id, llm.engine_core.instance.dir)
        await llm.check_health()
        os.kill(workers[0], signal.SIGSTOP)  # alive, but hung: no exit code to notice
        start = time.monotonic()
        with anyio.fail_after(30):
            await llm.dead_event.wait()
        # Not before the timeout (the others keep ticking), and within about a second after it.
        assert 4.0 <= time.monotonic() - start < 10
        with pytest.raises(EngineDeadError, match="worker tp0 of engine 0 stopped responding"):
            await llm.check_health()
    assert not any(alive(p) for p in [engine, *workers])
    assert leftovers(*instance) == []


async def test_a_request_past_its_max_queue_time_is_aborted_in_the_engine(llama_dir):
    from aserve.errors import RequestTimeoutError

    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    async with AsyncLLM(str(llama_dir), max_num_seqs=1, kv_cache_memory=1 << 22) as llm:
        running = anyio.Event()

        async def hold() -> None:
            async for _ in llm.generate(PROMPTS[0], long):
                running.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await running.wait()  # the one sequence is taken for hundreds of steps: the next request waits
            with pytest.raises(RequestTimeoutError) as exc:
                async for _ in llm.generate(PROMPTS[1], GREEDY, max_queue_time=0.002):
                    pass
            assert exc.value.param == "max_queue_time"
            stats = await llm.get_stats()
            assert (stats["num_waiting"], stats["num_running"]) == (0, 1)  # gone from the queue, not run
            tg.cancel_scope.cancel()
        # A request that is scheduled in time is not affected by its deadline.
        final = None
        async for final in llm.generate(PROMPTS[1], GREEDY, max_queue_time=30):
            pass
        assert final is not None and final.outputs[0].finish_reason == "length"


def test_logit_bias_moves_greedy_choices(llama_dir):
    with LLM(str(llama_dir), kv_cache_memory=1 << 22) as llm:
        plain = llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
        target = next(t for t in range(5, 50) if t not in plain)
        biased = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                           logit_bias={target: 100.0}))[0].outputs[0].token_ids
        banned = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                           logit_bias={plain[0]: -100.0}))[0].outputs[0].token_ids
    assert biased == [target] * 10
    assert banned[0] != plain[0]
