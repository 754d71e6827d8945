"""``aserve run`` driven by the official openai client and by raw HTTP."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest

from aserve import LLM, SamplingParams
from tests.e2e.server import Server

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = Server(llama_dir, "--api-key", KEY, "--served-model-name", "tiny")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(str(llama_dir), kv_cache_memory=1 << 24, max_model_len=256)


def test_completion_matches_offline_greedy(client, offline):
    out = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    want = offline.generate("Hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.choices[0].text == want.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(want.prompt_token_ids) and out.usage.completion_tokens == 8


def test_streaming_completion_concatenates_to_the_same_text(client):
    full = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_several_prompts_and_n(client):
    out = client.completions.create(model="tiny", prompt=["Hello", "The quick brown fox"], n=2, max_tokens=4,
                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16


def test_seed_reproducible(client):
    def run():
        return client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=1.0, seed=42,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert run() == run()


def test_logprobs_and_echo(client):
    out = client.completions.create(model="tiny", prompt="Hello world", max_tokens=3, temperature=0, logprobs=2,
                                    echo=True, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text.startswith("Hello world")
    assert len(choice.logprobs.token_logprobs) == 3
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_stop_string(client):
    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[4:7]
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"


def test_chat_completion_and_stream(client):
    messages = [{"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    message = out.choices[0].message
    assert message.role == "assistant" and out.usage.completion_tokens == 6
    assert len(out.choices[0].logprobs.content) == 6
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_startup_log_and_metrics(client, server):
    log = server.output()
    assert "aserve::supervisor -> [aserve::api_server_0, aserve::engine_core_0 -> [aserve::worker_tp0]]" in log
    assert "loading weights [" in log and "100%" in log
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("aserve:num_requests_running{", "aserve:num_requests_waiting{", "aserve:prompt_tokens_total{",
                 "aserve:generation_tokens_total{", 'aserve:request_success_total{engine="0",finished_reason="length"}',
                 "aserve:time_to_first_token_seconds_bucket{", "aserve:inter_token_latency_seconds_bucket{",
                 "aserve:e2e_request_latency_seconds_count{", "aserve:request_queue_time_seconds_count{",
                 'aserve:engine_requests_received_total{engine="0"}', 'aserve:engine_requests_finished_total{engine="0"}',
                 'aserve:engine_generation_tokens_total{engine="0"}'):
        assert name in text, name
    queued = [line for line in text.splitlines() if line.startswith("aserve:request_queue_time_seconds_count")]
    assert float(queued[0].split()[-1]) >= 1


def test_models_and_small_routes(client, server):
    assert [m.id for m in client.models.list()] == ["tiny"]
    base = server.base_url
    auth = {"authorization": f"Bearer {KEY}"}
    tokens = httpx.post(base + "/tokenize", json={"prompt": "Hello world"}, headers=auth).json()
    assert tokens["count"] == len(tokens["tokens"])
    assert httpx.post(base + "/detokenize", json={"tokens": tokens["tokens"][1:]}, headers=auth).json()["prompt"] == "Hello world"
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=auth).json()
    assert chat["count"] == len(chat["tokens"]) > 2
    # Malformed bodies are 400s naming the field, never a 500 (the fuzzer's one finding).
    for bad, param in (({"messages": True}, "messages"), ({"messages": [{"content": 1}]}, "messages"),
                       ({"prompt": 5}, "prompt"), ({"prompt": "x", "nonsense": 1}, "nonsense")):
        r = httpx.post(base + "/tokenize", json=bad, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    assert httpx.get(base + "/version", headers=auth).json()["version"]
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/ready").status_code == 200


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": "many"}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 5000}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": [' + b"5," * 300 + b'5]}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": ""}', 400, "prompt"),
    (b'{"model": "nope", "prompt": "hi"}', 404, None),
    # Integers past 64 bits cannot cross to the engine: refused by name, where they were
    # accepted and then failed to encode (a 500, or a stream cut after its first chunk).
    (b'{"model": "tiny", "prompt": "hi", "priority": 278492291076909072384}', 400, "priority"),
    (b'{"model": "tiny", "prompt": "hi", "priority": -278492291076909072384, "stream": true}', 400, "priority"),
    (b'{"model": "tiny", "prompt": "hi", "seed": 18446744073709551616}', 400, "seed"),
    (b'{"model": "tiny", "prompt": "hi", "top_k": 9223372036854775808}', 400, "top_k"),
    (b'{"model": "tiny", "prompt": "hi", "stop_token_ids": [3, 278492291076909072384]}', 400, "stop_token_ids"),
])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, client, body, status, param):
    r = httpx.post(server.base_url + "/v1/completions", content=body,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None


def test_unknown_route_and_auth(server):
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.get(server.base_url + "/nowhere", headers=auth).status_code == 404
    assert httpx.get(server.base_url + "/nowhere", headers=auth).json()["error"]["code"] == 404
    assert httpx.get(server.base_url + "/nowhere").status_code == 401
    r = httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(server.base_url + "/v1/models", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401
    # Every route but the probes needs the key (the probes are what orchestrators poll).
    for path in ("/tokenize", "/detokenize"):
        r = httpx.post(server.base_url + path, json={"prompt": "hi"})
        assert r.status_code == 401, path
    assert httpx.get(server.base_url + "/version").status_code == 401
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.base_url + probe).status_code == 200, probe
    # CORS is off unless --allowed-origins: no Access-Control header, even to a preflight.
    r = httpx.options(server.base_url + "/v1/models", headers={"origin": "https://evil.example",
                                                               "access-control-request-method": "GET"})
    assert not any(h.lower().startswith("access-control-") for h in r.headers)


def test_body_size_limit(server):
    r = httpx.post(server.base_url + "/v1/completions", content=b"x" * (17 << 20),
                   headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 413


def kv_usage(server) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith("aserve:kv_cache_usage_perc{"):
            return float(line.split()[-1])
    raise AssertionError("no aserve:kv_cache_usage_perc")


def metric_total(server, name: str) -> float:
    """The sum of a metric's samples (over its labels)."""
    return sum(float(line.split()[-1]) for line in httpx.get(server.base_url + "/metrics").text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_every_engine_request(server, stream):
    tokens_before = metric_total(server, "aserve:generation_tokens_total")
    disconnects_before = metric_total(server, "aserve:http_requests_client_disconnected_total")
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    body = (b'{"model": "tiny", "prompt": ["Hello", "World"], "n": 2, "max_tokens": 200, "ignore_eos": true, '
            b'"stream": ' + (b"true" if stream else b"false") + b"}")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        if stream:
            received = b""
            while b"data:" not in received:
                chunk = sock.recv(4096)
                assert chunk, "the server closed the stream"
                received += chunk
        deadline = time.monotonic() + 30
        while kv_usage(server) == 0.0 and time.monotonic() < deadline:
            pass  # until the four requests hold blocks
        assert kv_usage(server) > 0.0
    deadline = time.monotonic() + 10
    while kv_usage(server) > 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_usage(server) == 0.0
    assert metric_total(server, "aserve:http_requests_client_disconnected_total") == disconnects_before + 1
    # Cut short, not finished: the four requests would have produced 4 x 200 tokens.
    assert metric_total(server, "aserve:generation_tokens_total") - tokens_before < 4 * 200


def test_openai_stream_closed_early_aborts(server, client):
    stream = client.completions.create(model="tiny", prompt=["Hello", "World"], n=2, max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    assert kv_usage(server) > 0.0
    stream.close()
    deadline = time.monotonic() + 10
    while kv_usage(server) > 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_usage(server) == 0.0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
# Under Trio the openai client leaves its inner SSE byte iterator to the garbage
# collector once it has seen [DONE]; that is the client's, not the server's, doing.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_async_openai_client_streams(server, anyio_backend):
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0) as aclient:
        stream = await aclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=5, temperature=0, stream=True,
                                                       extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        await stream.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_only_the_worker_loads_torch(server, client):
    """The supervisor, the API server and the engine core run without torch (~140 MiB of
    resident memory each); the worker maps it."""
    client.completions.create(model="tiny", prompt="Hello", max_tokens=2)  # every code path of a request taken

    def maps_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch_cpu" in f.read()

    titles = server.titles()
    assert {title: maps_torch(pid) for title, pid in titles.items()} == {
        "aserve::supervisor": False, "aserve::api_server_0": False, "aserve::engine_core_0": False,
        "aserve::worker_tp0": True,
    }
