"""The HTTP layer over a fake ``EngineClient``: the routes need nothing else of the engine.

No process and no model: the fake prepares prompts with the real ``InputProcessor``
(the tiny tokenizer) and "generates" each prompt's own token ids back, one per delta.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from aserve.api.app import ServerState, build_app
from aserve.frontend.engine_client import EngineClient
from aserve.frontend.input_processor import InputProcessor, PreparedPrompt
from aserve.frontend.tokenizer import Tokenizer
from aserve.outputs import CompletionOutput, RequestOutput
from aserve.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


class FakeEngine:
    """Echoes each prompt's tokens as its completion (at most ``max_tokens`` of them)."""

    num_engines = 1

    def __init__(self, model_dir: Any) -> None:
        self.tokenizer = Tokenizer(model_dir)
        self.inputs = InputProcessor(self.tokenizer, max_model_len=64, vocab_size=self.tokenizer.vocab_size,
                                     eos_token_ids=())
        self.prepared: list[PreparedPrompt] = []
        self.is_dead, self.ready, self.failure = False, object(), None
        self.dead_event = anyio.Event()

    max_model_len = property(lambda self: self.inputs.max_model_len)
    vocab_size = property(lambda self: self.inputs.vocab_size)

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.inputs.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                       template_kwargs=template_kwargs)

    def prepare(self, prompt: Any, sampling_params: SamplingParams | None = None, *,
                grammar_after: tuple[int, ...] = (), constraint_param: str = "structured_outputs") -> PreparedPrompt:
        prepared = self.inputs.prepare(prompt, sampling_params or SamplingParams(), grammar_after=grammar_after,
                                       constraint_param=constraint_param)
        self.prepared.append(prepared)
        return prepared

    async def generate(self, prompt: PreparedPrompt, sampling_params: None = None, request_id: str | None = None, *,
                       priority: int = 0, data_parallel_rank: int | None = None,
                       max_queue_time: float | None = None) -> AsyncIterator[RequestOutput]:
        ids = prompt.token_ids[: prompt.params.max_tokens]
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            yield RequestOutput(request_id or "r", prompt.text, prompt.token_ids, [CompletionOutput(
                0, self.tokenizer.decode([token]), [token], finish_reason="length" if last else None)], last)

    def engine_for(self, request_id: str) -> int | None:
        return 0

    async def get_stats(self, engine: int = 0) -> dict[str, float]:
        return {}

    async def sleep(self, level: int = 1) -> None:
        self.asleep = level

    async def wake_up(self) -> None:
        self.asleep = 0

    async def is_sleeping(self) -> bool:
        return bool(getattr(self, "asleep", 0))

    async def start_profile(self, directory: str) -> None:
        pass

    async def stop_profile(self) -> None:
        pass


def test_the_fake_is_an_engine_client(llama_dir):
    engine: EngineClient = FakeEngine(llama_dir)  # a type checker holds it to the protocol
    assert {name for name in dir(EngineClient) if not name.startswith("_")} <= set(dir(engine))


async def test_completions_through_the_interface(llama_dir):
    engine = FakeEngine(llama_dir)
    app = build_app(ServerState(engine=engine, served_model_name="fake"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/completions", json={"model": "fake", "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
        ids = engine.tokenizer.encode("Hello")[:3]
        assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(ids)
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"] == {"prompt_tokens": len(engine.tokenizer.encode("Hello")), "completion_tokens": 3,
                                     "total_tokens": len(engine.tokenizer.encode("Hello")) + 3}
        # The route hands prepare the body's parameters once; prepare's refusal is the 400.
        assert msgspec.structs.asdict(engine.prepared[-1].params)["max_tokens"] == 3
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 64})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "stream": True, "max_tokens": 2})
        assert r.status_code == 200
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 1 + 2 + 1 + 1  # role, 2 tokens, finish, DONE


async def test_probes_behind_the_key_only_when_asked_and_cors_only_when_allowed(llama_dir):
    engine = FakeEngine(llama_dir)
    key = {"authorization": "Bearer k"}
    open_probes = build_app(ServerState(engine=engine, served_model_name="fake", api_key="k"))
    closed = build_app(ServerState(engine=engine, served_model_name="fake", api_key="k", api_key_probes=True,
                                   allowed_origins=("https://app.example",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_probes), base_url="http://test") as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/version")).status_code == 401
        assert (await client.get("/version", headers={"authorization": "Bearer k2"})).status_code == 401
        assert (await client.get("/version", headers=key)).status_code == 200
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=closed), base_url="http://test") as client:
        assert (await client.get("/health")).status_code == 401
        assert (await client.get("/health", headers=key)).status_code == 200
        preflight = await client.options("/v1/models", headers={"origin": "https://app.example",
                                                                 "access-control-request-method": "GET"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        other = await client.get("/v1/models", headers={**key, "origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


async def test_an_unexpected_error_is_a_500_without_detail(llama_dir):
    engine = FakeEngine(llama_dir)

    def broken(*args, **kwargs):
        raise RuntimeError("secret /etc/aserve/path in a traceback")

    engine.render_chat = broken
    app = build_app(ServerState(engine=engine, served_model_name="fake"))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "internal server error", "type": "internal_error", "param": None,
                                     "code": 500}
        assert "secret" not in r.text and "Traceback" not in r.text


async def test_a_malformed_or_disagreeing_rank_header_is_a_400_beside_the_body_field(llama_dir):
    """vLLM's ``X-data-parallel-rank`` header is checked whenever it is sent: not only when
    the body names no rank (a fuzzed request once had its garbage header ignored)."""
    app = build_app(ServerState(engine=FakeEngine(llama_dir), served_model_name="fake"))
    body = {"prompt": "Hello", "max_tokens": 2}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for headers, extra, status in [({"X-data-parallel-rank": "0"}, {"data_parallel_rank": 0}, 200),
                                       ({"X-data-parallel-rank": "0"}, {}, 200),
                                       ({}, {"data_parallel_rank": 0}, 200),
                                       ({"X-data-parallel-rank": ".5=x"}, {"data_parallel_rank": 0}, 400),
                                       ({"X-data-parallel-rank": ""}, {}, 400),
                                       ({"X-data-parallel-rank": "1"}, {"data_parallel_rank": 0}, 400),
                                       ({"X-data-parallel-rank": "1"}, {}, 400)]:  # one engine: rank 1 is out of range
            r = await client.post("/v1/completions", json={**body, **extra}, headers=headers)
            assert r.status_code == status, (headers, extra, r.text)
            if status == 400:
                assert r.json()["error"]["param"] == "data_parallel_rank"
