"""Admission control, deadlines and request bounds at the HTTP layer, over the fake engine
of ``test_api_fake_engine`` (no process, no model), on asyncio and Trio."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from aserve.api import admission
from aserve.api.admission import Admission, AdmissionCounters, AdmissionLimits
from aserve.api.app import ServerState, build_app
from aserve.api.limits import ServerLimits
from aserve.errors import ConfigError, RequestRefusedError
from aserve.frontend.input_processor import PreparedPrompt
from aserve.outputs import RequestOutput
from tests.test_api_fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


class GatedEngine(FakeEngine):
    """The fake, holding each request before its first token until ``first`` is set and
    before its last until ``rest`` is set; counts renders and requests cancelled early."""

    def __init__(self, model_dir: Any) -> None:
        super().__init__(model_dir)
        self.first, self.rest = anyio.Event(), anyio.Event()
        self.renders = self.cancelled = self.started = 0

    def render_chat(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.renders += 1
        return super().render_chat(*args, **kwargs)

    async def generate(self, prompt: PreparedPrompt, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        self.started += 1
        done = False
        try:
            await self.first.wait()
            outputs = [out async for out in super().generate(prompt, *args, **kwargs)]
            for out in outputs[:-1]:
                yield out
            await self.rest.wait()
            done = True
            yield outputs[-1]
        finally:
            if not done:
                self.cancelled += 1


def client_for(state: ServerState) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://test")


def refused_count(state: ServerState, reason: str) -> float:
    return state.metrics.registry.get_sample_value("aserve:num_requests_refused_total", {"reason": reason}) or 0.0


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "Hi", "n": 129}, "n"),
    ("/v1/completions", {"prompt": ["Hi"] * 257}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "stop": "x" * 257}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}] * 1025}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * (1 << 20)}, {"role": "user", "content": "y"}]},
     "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * ((1 << 20) + 1)}]}]}, "messages"),
])
async def test_a_request_past_a_limit_is_a_400_naming_the_field_and_costs_nothing(llama_dir, route, body, param):
    engine = GatedEngine(llama_dir)
    state = ServerState(engine=engine, served_model_name="fake")
    async with client_for(state) as client:
        r = await client.post(route, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "this server allows at most" in r.json()["error"]["message"]
        assert engine.prepared == [] and engine.renders == 0  # refused before any tokenising or rendering
        engine.first.set(), engine.rest.set()
        ok = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200  # and the server goes on


@pytest.mark.parametrize("body, headers, param", [
    ({"prompt": "Hi", "best_of": 2}, {}, "best_of"),
    ({"prompt": "Hi", "suffix": "!"}, {}, "suffix"),
    ({"prompt": "Hi", "logit_bias": {"not-a-token": 5}}, {}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"1": 101}}, {}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"100000": 1}}, {}, "logit_bias"),
    ({"prompt": "Hi"}, {"x-request-timeout": "soon"}, "request_timeout"),
    ({"prompt": "Hi"}, {"x-max-queue-time": "-1"}, "max_queue_time"),
    ({"prompt": "Hi"}, {"x-request-timeout": "nan"}, "request_timeout"),
])
async def test_what_is_not_implemented_or_malformed_is_refused_by_name(llama_dir, body, headers, param):
    engine = GatedEngine(llama_dir)
    engine.first.set(), engine.rest.set()
    async with client_for(ServerState(engine=engine, served_model_name="fake")) as client:
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_logit_bias_and_best_of_equal_to_n_reach_the_engine(llama_dir):
    engine = GatedEngine(llama_dir)
    engine.first.set(), engine.rest.set()
    async with client_for(ServerState(engine=engine, served_model_name="fake")) as client:
        r = await client.post("/v1/completions", json={"prompt": "Hi", "best_of": 1, "logit_bias": {"5": -100, "7": 2.5}})
        assert r.status_code == 200, r.text
    assert engine.prepared[-1].params.logit_bias == {5: -100.0, 7: 2.5}


async def test_the_request_limit_refuses_with_429_before_rendering_and_frees_on_finish(llama_dir):
    engine = GatedEngine(llama_dir)
    state = ServerState(engine=engine, served_model_name="fake", limits=ServerLimits(max_num_queued_reqs=3))
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    results: list[int] = []
    async with client_for(state) as client, anyio.create_task_group() as tg:
        async def post(path: str, body: dict) -> None:
            results.append((await client.post(path, json=body)).status_code)

        tg.start_soon(post, CHAT, chat)
        tg.start_soon(post, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "n": 2})  # two slots
        with anyio.fail_after(10):
            while engine.started < 2:
                await anyio.sleep(0.01)
        renders = engine.renders
        refused = await client.post(CHAT, json=chat)
        assert refused.status_code == 429
        assert refused.json()["error"]["param"] == "max_num_queued_reqs"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert engine.renders == renders  # refused before its template was rendered
        assert refused_count(state, "max_num_queued_reqs") == 1
        engine.first.set(), engine.rest.set()
    assert results == [200, 200]
    assert state.admission.counters.totals().tolist()[:2] == [0, 0]
    async with client_for(state) as client:
        assert (await client.post(CHAT, json=chat)).status_code == 200


async def test_the_token_limit_counts_prompts_until_their_first_token(llama_dir):
    engine = GatedEngine(llama_dir)
    state = ServerState(engine=engine, served_model_name="fake", limits=ServerLimits(max_num_queued_tokens=12))
    body = {"prompt": [list(range(10, 17))], "max_tokens": 2}  # 7 prompt tokens
    async with client_for(state) as client, anyio.create_task_group() as tg:
        statuses: list[int] = []

        async def post() -> None:
            statuses.append((await client.post("/v1/completions", json=body)).status_code)

        tg.start_soon(post)
        with anyio.fail_after(10):
            while engine.started < 1:
                await anyio.sleep(0.01)
        refused = await client.post("/v1/completions", json=body)  # 7 + 7 > 12
        assert refused.status_code == 429 and refused.json()["error"]["param"] == "max_num_queued_tokens"
        assert refused_count(state, "max_num_queued_tokens") == 1
        engine.first.set()  # the first request's prefill is done: its tokens leave the count
        with anyio.fail_after(10):
            while state.admission.counters.totals()[1] != 0:
                await anyio.sleep(0.01)
        tg.start_soon(post)
        with anyio.fail_after(10):
            while engine.started < 2:
                await anyio.sleep(0.01)
        engine.rest.set()
    assert statuses == [200, 200]
    # One prompt larger than the whole limit is admitted when nothing else waits, not refused for ever.
    big = {"prompt": [list(range(10, 30))], "max_tokens": 1}
    async with client_for(state) as client:
        assert (await client.post("/v1/completions", json=big)).status_code == 200


async def test_request_timeout_aborts_the_engine_request(llama_dir):
    engine = GatedEngine(llama_dir)  # never opens its gate: the request would wait for ever
    state = ServerState(engine=engine, served_model_name="fake", limits=ServerLimits(request_timeout=30))
    async with client_for(state) as client:
        with anyio.fail_after(10):
            r = await client.post("/v1/completions", json={"prompt": "Hi"}, headers={"x-request-timeout": "0.2"})
        assert r.status_code == 408 and r.json()["error"]["param"] == "request_timeout"
        assert r.json()["error"]["type"] == "timeout_error"
        assert engine.cancelled == 1  # the engine request was aborted, not left running
        with anyio.fail_after(10):
            r = await client.post("/v1/completions", json={"prompt": "Hi", "stream": True},
                                  headers={"x-request-timeout": "0.2"})
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        assert '"param":"request_timeout"' in events[-2] and '"code":408' in events[-2]
        assert engine.cancelled == 2
    samples = state.metrics.registry.get_sample_value("aserve:request_timeouts_total", {"deadline": "request_timeout"})
    assert samples == 2
    assert state.admission.counters.totals().tolist()[:2] == [0, 0]


def test_retry_after_follows_the_drain_rate():
    now = [0.0]
    adm = Admission(AdmissionLimits(max_num_queued_reqs=4), AdmissionCounters(), clock=lambda: now[0])
    tickets = [adm.reserve(1) for _ in range(4)]
    with pytest.raises(RequestRefusedError) as exc:
        adm.reserve(1)
    assert exc.value.retry_after == admission.RETRY_UNKNOWN  # nothing has left yet
    now[0] = 2.0
    tickets[0].release()
    tickets[1].release()  # 2 requests left in 2 s: 1 a second
    tickets.append(adm.reserve(2))
    now[0] = 3.0
    with pytest.raises(RequestRefusedError) as exc:
        adm.reserve(3)  # 3 over at 2/3 a second
    assert exc.value.reason == "max_num_queued_reqs" and exc.value.retry_after == 5


def test_api_servers_share_the_counts_through_shared_memory():
    name = f"aserve_test{uuid.uuid4().hex[:8]}_admission"
    admission.create_segment(name, 2)
    try:
        limits = AdmissionLimits(max_num_queued_reqs=3)
        first = Admission(limits, AdmissionCounters(index=0, num_slots=2, name=name))
        second = Admission(limits, AdmissionCounters(index=1, num_slots=2, name=name))
        held = [first.reserve(2), second.reserve(1)]
        with pytest.raises(RequestRefusedError):
            first.reserve(1)
        with pytest.raises(RequestRefusedError):
            second.reserve(1)
        held[0].release()
        held.append(second.reserve(2))
        first.counters.close(), second.counters.close()
    finally:
        os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("field, value", [("max_num_queued_reqs", 0), ("request_timeout", -1.0), ("max_n", 0)])
def test_limits_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(ConfigError) as exc:
        ServerLimits(**{field: value})
    assert exc.value.param == field
