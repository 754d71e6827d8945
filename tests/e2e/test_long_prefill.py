"""No false alarm on a long step: an 8k-token prefill of the 152M benchmark model, in one
step, outlasts the time a stopped heartbeat takes to be seen and is served, with ``/health``
200 throughout (the heartbeat ticks from its own thread). On a slow CPU (an AVX2-only
Zen 1 computes it in float32 in over 60 s) it also outlasts the step bound's 60 s floor,
and is served since every layer it finishes counts as progress."""

from __future__ import annotations

import threading
import time

import httpx

from aserve.kernels.amx_linear import cpu_has_amx
from aserve.model_builder import llama_config, random_llama_weights, write_model_dir
from aserve.process.heartbeat import INTERVAL
from aserve.tiny_tokenizer import build_tokenizer
from tests.e2e.server import Server

PROMPT = 8192
HEARTBEAT_TIMEOUT = 2.0  # the default is 4 s; shorter makes the test's point sharper


def test_an_8k_prefill_of_the_152m_model_is_not_taken_for_a_hang(tmp_path):
    # The benchmark's 152M Llama (scripts/make_bench_model.py), with room for 8k positions.
    cfg = llama_config(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=16, intermediate_size=2816,
                       vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=PROMPT + 256,
                       dtype="bfloat16")
    model = tmp_path / "llama-152m"
    write_model_dir(model, cfg, random_llama_weights(cfg, seed=0))
    # On two AMX cores the prefill takes ~4 s, close to the bound below: one worker thread
    # there keeps it well past it (elsewhere the step is longer anyway).
    threads = ["--worker-threads", "1"] if cpu_has_amx() else []
    server = Server(model, "--max-model-len", str(PROMPT + 256), "--max-num-batched-tokens", str(PROMPT + 256),
                    "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--kv-cache-memory", str(1 << 30), *threads)
    health: list[int] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            health.append(httpx.get(server.base_url + "/health", timeout=10).status_code)
            done.wait(0.5)  # a liveness probe's period, shortened

    prober = threading.Thread(target=probe)
    try:
        prober.start()
        start = time.monotonic()
        r = httpx.post(server.base_url + "/v1/completions", timeout=600,
                       json={"prompt": [(7 * i) % 300 + 3 for i in range(PROMPT)], "max_tokens": 2, "ignore_eos": True})
        took = time.monotonic() - start
        done.set()
        prober.join()
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == PROMPT and r.json()["choices"][0]["finish_reason"] == "length"
        # The point of the test: one step longer than a stopped heartbeat takes to be seen
        # (the timeout, plus a tick's period).
        assert took > HEARTBEAT_TIMEOUT + INTERVAL, f"the prefill took {took:.1f} s: too short to show anything"
        assert health and set(health) == {200}
        assert httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                          timeout=60).status_code == 200
    finally:
        done.set()
        server.stop()
