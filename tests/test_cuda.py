"""The CUDA path: the model, its KV pool and its TP collectives on GPUs.

Every test here needs a GPU and is skipped, with that reason, on a machine without one
(CI's). ``scripts/cuda_check.sh`` runs them on a lent GPU machine. Correctness is
transformers in float32 on the CPU, as everywhere else in the suite.
"""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.errors import EngineDeadError
from aserve.frontend.async_llm import AsyncLLM
from tests.hf_reference import GREEDY, PROMPTS, hf_greedy, hf_logprobs, load_hf
from tests.test_async_llm import alive, collect, leftovers, tree

GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU (none visible)")

KV = 1 << 24


def _generate(model_dir, **kwargs):
    # A small step budget: the longer prompts prefill in several chunks, the later ones
    # over cached context (the gathered-block path).
    llm = LLM(str(model_dir), device="cuda", kv_cache_memory=KV, max_num_batched_tokens=32, **kwargs)
    return llm, llm.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3"])
def test_float32_on_cuda_gives_transformers_greedy_tokens(model_dirs, variant):
    model_dir = model_dirs[variant]
    hf = load_hf(model_dir)
    llm, outs = _generate(model_dir, dtype="float32")
    worker = llm.engine.executor.worker
    assert worker.device.type == "cuda"
    assert worker.runner.kv_caches[0].paged.device.type == "cuda"
    assert next(worker.runner.model.parameters()).device.type == "cuda"
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        got = out.outputs[0].token_ids
        assert got == hf_greedy(hf, ids, 16), prompt
        reference = hf_logprobs(hf, ids + got)
        for i, (token, lp) in enumerate(zip(got, out.outputs[0].logprobs)):
            assert lp[token].logprob == pytest.approx(float(reference[len(ids) + i - 1, token]), abs=1e-3)


@pytest.mark.parametrize("variant", ["llama", "qwen3", "gemma2"])
def test_bfloat16_on_cuda_stays_close_to_transformers(model_dirs, variant):
    """bf16 weights and activations: each chosen token is within 0.1 of the float32
    reference's best logprob at its position (greedy paths may part where two tokens
    are that close)."""
    llama_dir = model_dirs[variant]
    hf = load_hf(llama_dir)
    llm, outs = _generate(llama_dir, dtype="bfloat16")
    assert llm.engine.executor.worker.runner.kv_caches[0].paged.dtype == torch.bfloat16
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        got = out.outputs[0].token_ids
        reference = hf_logprobs(hf, ids + got)
        for i, token in enumerate(got):
            row = reference[len(ids) + i - 1]
            assert float(row.max() - row[token]) < 0.1, (prompt, i)


@pytest.mark.parametrize("variant", ["llama", "gemma2"])
def test_cuda_graphs_give_the_eager_tokens(model_dirs, variant):
    """Decode steps replayed from CUDA graphs (buckets 1, 2, 4, 8 here, padded rows
    included) give the tokens of the same engine with ``enforce_eager``: greedy and
    seeded rows, requests finishing at different lengths so the batch shrinks."""
    prompts = [[(3 * i + 5 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((9, 21, 5, 17, 12, 30))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 5, 8, 12, 16, 16)]
    params[4] = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", kv_cache_memory=KV, max_num_seqs=8, max_model_len=256)
    with LLM(str(model_dirs[variant]), enforce_eager=True, **kwargs) as eager:
        assert eager.engine.executor.worker.runner.graphs is None
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    with LLM(str(model_dirs[variant]), **kwargs) as llm:
        graphs = llm.engine.executor.worker.runner.graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert graphs.replayed > 0
    assert got == want


def test_sampling_on_the_gpu_is_seeded_and_reports_logprobs(llama_dir):
    """The sampler runs on the GPU: a seeded request gives the same tokens on two
    engines, with other requests beside it or not, and its logprobs are the float32
    log-softmax of the logits (each chosen token's logprob at most 0)."""
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=12, ignore_eos=True,
                            logprobs=3)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    with LLM(str(llama_dir), device="cuda", dtype="float32", kv_cache_memory=KV) as llm:
        alone = llm.generate(["The sky is"], seeded)[0].outputs[0]
        beside = llm.generate(["The sky is", "Once upon"], [seeded, other])[0].outputs[0]
    with LLM(str(llama_dir), device="cuda", dtype="float32", kv_cache_memory=KV) as again:
        fresh = again.generate(["The sky is"], seeded)[0].outputs[0]
    assert alone.token_ids == beside.token_ids == fresh.token_ids
    for token, lp in zip(alone.token_ids, alone.logprobs):
        assert token in lp and lp[token].logprob <= 0 and len(lp) >= 3


def test_tp2_over_gloo_on_cuda_gives_tp1_results(llama_dir):
    """Two worker processes, their shards and KV pools on the GPU, collectives through
    gloo (which takes CUDA tensors; NCCL refuses two ranks on one GPU)."""
    _, single = _generate(llama_dir, dtype="float32")
    llm, sharded = _generate(llama_dir, dtype="float32", tensor_parallel_size=2, tp_comm="gloo")
    with llm:
        assert llm.engine.config.model.device == "cuda" and llm.engine.config.parallel.tp_comm == "gloo"
    for a, b in zip(single, sharded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)


@pytest.mark.skipif(GPUS < 2, reason=f"NCCL needs a GPU per rank; {GPUS} visible")
def test_tp2_over_nccl_gives_tp1_results(llama_dir):
    _, single = _generate(llama_dir, dtype="float32")
    llm, sharded = _generate(llama_dir, dtype="float32", tensor_parallel_size=2)
    with llm:
        assert llm.engine.config.parallel.tp_comm == "nccl"
    for a, b in zip(single, sharded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_async_llm_serves_from_a_cuda_worker_process_and_dies_as_one_unit(llama_dir):
    """The engine core's worker process on the GPU: transformers' tokens for concurrent
    streams, then kill -9 of that worker fails the stream and leaves nothing behind."""
    hf = load_hf(llama_dir)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    async with AsyncLLM(str(llama_dir), device="cuda", dtype="float32", kv_cache_memory=KV) as llm:
        tok = llm.tokenizer
        expected = [hf_greedy(hf, tok.encode(p), 10) for p in PROMPTS]
        results = [None] * 9

        async def run(i):
            results[i] = await collect(llm, PROMPTS[i % 3], params)

        async with anyio.create_task_group() as tg:
            for i in range(9):
                tg.start_soon(run, i)
        assert [r.outputs[0].token_ids for r in results] == [expected[i % 3] for i in range(9)]
        engine = llm.engine_core.engine_process.pid
        workers = tree(engine)
        assert len(workers) == 1
        instance = (llm.engine_core.instance.id, llm.engine_core.instance.dir)
        seen = 0
        with pytest.raises(EngineDeadError):
            with anyio.fail_after(30):
                async for _ in llm.generate("Hello", SamplingParams(max_tokens=None, ignore_eos=True)):
                    seen += 1
                    if seen == 2:
                        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await llm.check_health()
    deadline = time.monotonic() + 15
    while any(alive(p) for p in [engine, *workers]) and time.monotonic() < deadline:
        await anyio.sleep(0.1)
    assert not any(alive(p) for p in [engine, *workers])
    assert leftovers(*instance) == []


@pytest.mark.anyio
async def test_data_parallel_engines_share_one_gpu(llama_dir):
    """Two engines, each with its worker process on GPU 0 (workers beyond the GPUs wrap
    round: each engine is its own process group, so NCCL's one-rank-a-GPU rule does not
    apply between them)."""
    hf = load_hf(llama_dir)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    async with AsyncLLM(str(llama_dir), device="cuda", dtype="float32", data_parallel_size=2,
                        kv_cache_memory=KV) as llm:
        expected = hf_greedy(hf, llm.tokenizer.encode(PROMPTS[1]), 10)
        for rank in (0, 1):
            final = None
            async for out in llm.generate(PROMPTS[1], params, data_parallel_rank=rank):
                final = out
            assert final.outputs[0].token_ids == expected


def test_aserve_run_on_cuda_serves_over_http_and_drains(llama_dir):
    """``aserve run --device cuda --dp 2``: both engines' workers on the GPU, plain and
    streamed completions give the offline greedy text, and SIGTERM exits 0 leaving no
    process and no shared memory."""
    import json

    import httpx

    from tests.e2e.server import Server, aserve_shm
    from tests.e2e.server import alive as pid_alive

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = LLM(str(llama_dir), device="cuda", dtype="float32", kv_cache_memory=KV).generate(
        ["Hello world"], params)[0].outputs[0].text
    before = aserve_shm()
    server = Server(llama_dir, "--device", "cuda", "--dtype", "float32", "--dp", "2")
    pids = server.pids()
    try:
        # Each engine is its own TP group of one: both workers are titled worker_tp0.
        assert sorted(t for _, t in server.title_list() if "worker" in t) == ["aserve::worker_tp0"] * 2
        body = {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        for _ in range(4):  # over both engines
            r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        text = ""
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == expected
        assert httpx.get(server.base_url + "/health").status_code == 200
        assert "aserve:num_requests_running" in httpx.get(server.base_url + "/metrics").text
        assert server.stop() == 0
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)
    assert [p for p in pids if pid_alive(p)] == []
    assert aserve_shm() <= before
