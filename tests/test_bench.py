"""The benchmark tools: arrivals, datasets and the summary by hand-worked cases;
``aserve bench serve`` against a real server over HTTP/1.1 and HTTP/2; the offline
``throughput`` and ``latency`` commands."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from aserve.bench.datasets import random_requests, sharegpt_requests
from aserve.bench.serve import LoadConfig, RequestResult, arrival_delays, parse_goodput, summarize
from aserve.errors import ConfigError
from aserve.frontend.tokenizer import Tokenizer
from tests.e2e.server import Server


def test_arrivals():
    assert arrival_delays(5, math.inf, 1.0, 0) == [0.0] * 5
    poisson = np.asarray(arrival_delays(20000, 4.0, 1.0, 0))
    assert abs(poisson.mean() - 0.25) < 0.01 and abs(poisson.std() - 0.25) < 0.01  # exponential: std == mean
    bursty = np.asarray(arrival_delays(20000, 4.0, 0.25, 0))
    assert abs(bursty.mean() - 0.25) < 0.02 and bursty.std() > 2 * poisson.std()  # same rate, burstier
    assert arrival_delays(10, 2.0, 1.0, 7) == arrival_delays(10, 2.0, 1.0, 7)


def test_goodput_and_summary():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        parse_goodput(["speed:1"])
    cfg = LoadConfig("http://x", "/v1/completions", "m", max_concurrency=2, goodput={"ttft": 150.0})
    results = [
        RequestResult(10, True, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4, text="abcde"),  # tpot 100 ms, good
        RequestResult(20, True, 3, ttft=0.2, latency=0.4, itl=[0.1, 0.1], text="abc"),  # tpot 100 ms, ttft too slow
        RequestResult(30, False, error="HTTP 500"),
    ]
    out = summarize(cfg, results, duration=2.0)
    assert (out["completed"], out["failed"]) == (2, 1)
    assert (out["total_input_tokens"], out["total_output_tokens"]) == (30, 8)
    assert out["request_throughput"] == 1.0 and out["output_throughput"] == 4.0
    assert out["total_token_throughput"] == 19.0 and out["request_goodput"] == 0.5
    assert out["mean_ttft_ms"] == pytest.approx(150.0) and out["median_tpot_ms"] == pytest.approx(100.0)
    assert out["mean_itl_ms"] == pytest.approx(100.0) and out["p99_e2el_ms"] == pytest.approx(499.0)
    assert out["errors"] == ["", "", "HTTP 500"] and out["request_rate"] == "inf"


def test_datasets(llama_dir, tmp_path):
    tok = Tokenizer(llama_dir)
    samples = random_requests(tok, 20, 32, 8, 0.25, seed=3)
    assert samples == random_requests(tok, 20, 32, 8, 0.25, seed=3)  # reproducible
    assert all(6 <= s.expected_output_len <= 10 and s.prompt_len <= 40 for s in samples)
    assert all(s.prompt_len == len(tok.encode(s.prompt, add_special_tokens=False)) for s in samples)
    prefixed = random_requests(tok, 4, 8, 4, 0.0, seed=1, prefix_len=32)
    shared = os.path.commonprefix([s.prompt for s in prefixed])
    assert len(tok.encode(shared, add_special_tokens=False)) >= 30 and all(s.prompt_len > 32 for s in prefixed)
    with pytest.raises(ConfigError):
        random_requests(tok, 1, 8, 8, 1.5, seed=0)

    conversations = [{"conversations": [{"from": "human", "value": f"Tell me about topic number {i} please"},
                                        {"from": "gpt", "value": "Here is a long enough answer " * (i + 1)}]}
                     for i in range(5)]
    conversations.append({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    picked = sharegpt_requests(tok, str(path), 5, seed=0)
    assert sorted(s.prompt for s in picked) == sorted(c["conversations"][0]["value"] for c in conversations[:5])
    assert sharegpt_requests(tok, str(path), 2, seed=0, output_len=7)[0].expected_output_len == 7
    with pytest.raises(ConfigError, match="only 5 usable"):
        sharegpt_requests(tok, str(path), 6, seed=0)  # "Hi" is too short to count


def test_bench_serve_against_a_real_server_over_http1_and_http2(llama_dir, tmp_path):
    server = Server(llama_dir, "--served-model-name", str(llama_dir))
    try:
        # HTTP/1.1 on the default loop (uvloop where installed) and on plain asyncio.
        for flags in ([], ["--loop", "asyncio"], ["--http2"]):
            out = tmp_path / f"result{'-'.join(flags)}.json"
            cmd = [sys.executable, "-m", "aserve", "bench", "serve", "--base-url", server.base_url,
                   "--model", str(llama_dir), "--random-input-len", "16", "--random-output-len", "6",
                   "--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos", "--goodput", "e2el:60000",
                   "--result-filename", str(out), *flags]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            result = json.loads(out.read_text())
            assert (result["completed"], result["failed"], result["total_output_tokens"]) == (8, 0, 48)
            assert result["request_goodput"] == pytest.approx(result["request_throughput"])
            assert result["median_ttft_ms"] > 0 and result["median_itl_ms"] > 0 and len(result["itls"]) == 8
            assert result["client_cpu_s"] > 0 and result["client_cpu_us_per_event"] > 0
            assert "Output token throughput" in r.stdout
        chat = subprocess.run(
            [sys.executable, "-m", "aserve", "bench", "serve", "--base-url", server.base_url, "--model", str(llama_dir),
             "--endpoint", "/v1/chat/completions", "--random-input-len", "8", "--random-output-len", "4",
             "--num-prompts", "2", "--no-progress", "--ignore-eos"], capture_output=True, text=True, timeout=120)
        assert chat.returncode == 0 and "Successful requests:" in chat.stdout and " 2\n" in chat.stdout
        wrong = subprocess.run(
            [sys.executable, "-m", "aserve", "bench", "serve", "--base-url", server.base_url, "--model", "nope",
             "--tokenizer", str(llama_dir), "--random-input-len", "8", "--num-prompts", "2", "--no-progress"],
            capture_output=True, text=True, timeout=120)
        assert wrong.returncode == 1 and "HTTP 404" in wrong.stderr  # every request failed, and why
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("kind, extra, keys", [
    ("throughput", ["--num-prompts", "4"], {"elapsed_time", "requests_per_second", "tokens_per_second"}),
    # 40 prompt tokens: two full KV blocks, which a second run would find cached.
    ("latency", ["--batch-size", "2", "--num-iters", "2", "--input-len", "40"],
     {"avg_latency", "latencies", "percentiles", "avg_step_ms", "cached_prompt_tokens"}),
])
def test_offline_benchmarks(llama_dir, tmp_path, kind, extra, keys):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "aserve", "bench", kind, "--model", str(llama_dir), "--input-len", "8",
                        "--output-len", "4", "--kv-cache-memory", str(1 << 22), "--output-json", str(out), *extra],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert keys <= set(result)
    if kind == "throughput":
        assert result["num_requests"] == 4 and result["total_num_tokens"] == 4 * (8 + 4)
    else:
        assert len(result["latencies"]) == 2 and all(x > 0 for x in result["latencies"])
        # Every run pays for its prefill: the same prompts, but the prefix cache emptied.
        assert result["cached_prompt_tokens"] == 0


def test_structured_load_constrains_its_share():
    from aserve.bench.datasets import SampleRequest
    from aserve.bench.serve import BENCH_SCHEMA, _body

    half = LoadConfig("http://x", "/v1/completions", "m", structured="json_schema", structured_fraction=0.5)
    assert [half.is_constrained(i) for i in range(6)] == [False, True] * 3
    every = LoadConfig("http://x", "/v1/chat/completions", "m", structured="json_schema")
    assert all(every.is_constrained(i) for i in range(5))
    assert not any(LoadConfig("http://x", "/v1/completions", "m").is_constrained(i) for i in range(5))
    sample = SampleRequest("hi", 1, 8)
    assert _body(every, sample, True)["response_format"]["json_schema"]["schema"] == BENCH_SCHEMA
    assert _body(half, sample, True)["structured_outputs"] == {"json": BENCH_SCHEMA}
    assert "structured_outputs" not in _body(half, sample, False)
    results = [RequestResult(4, True, 3, ttft=0.1, latency=0.3, itl=[0.1, 0.1], text='[{"id":1', constrained=True),
               RequestResult(4, True, 3, ttft=0.2, latency=0.6, itl=[0.2, 0.2], text="free text")]
    by_kind = summarize(half, results, duration=1.0)["by_kind"]
    assert by_kind["constrained"]["schema_shaped"] == 1 and by_kind["unconstrained"]["schema_shaped"] == 0
    assert by_kind["constrained"]["median_itl_ms"] == pytest.approx(100.0)
    assert by_kind["unconstrained"]["median_itl_ms"] == pytest.approx(200.0)
