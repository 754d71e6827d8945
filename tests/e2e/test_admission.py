"""Admission control and deadlines through ``aserve run``: a flood past capacity is
served or refused with 429 and ``Retry-After``, never anything else; expired requests
get 408 and free their engine's blocks."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from tests.e2e.server import Server


def metric(text: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples whose labels contain ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_metric(base: str, name: str, want: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric(httpx.get(base + "/metrics", timeout=5).text, name)
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.1)  # polling a gauge, as Prometheus would


def test_a_flood_is_served_or_refused_with_429_and_the_server_recovers(llama_dir):
    server = Server(llama_dir, "--max-num-queued-reqs", "8", "--max-num-seqs", "4", "--api-server-count", "2")
    base = server.base_url
    try:
        segment = [p.name for p in Path("/dev/shm").glob("aserve_*_admission")]
        assert segment, "the API servers share their counts in shared memory"
        results: list[tuple[int, str, dict]] = []

        async def stream(client: httpx.AsyncClient, i: int) -> None:
            body = {"prompt": f"Hello {i}", "max_tokens": 24, "stream": True, "ignore_eos": True}
            async with client.stream("POST", base + "/v1/completions", json=body) as r:
                text = (await r.aread()).decode()
                results.append((r.status_code, text, dict(r.headers)))

        async def flood() -> None:
            limits = httpx.Limits(max_connections=64)
            with anyio.fail_after(120):
                async with httpx.AsyncClient(timeout=60, limits=limits) as client, anyio.create_task_group() as tg:
                    for i in range(64):
                        tg.start_soon(stream, client, i)

        anyio.run(flood)
        assert len(results) == 64
        done = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(done) + len(refused) == 64, sorted({r[0] for r in results})
        for _, text, _ in done:  # every admitted stream ran to its end
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        for _, text, headers in refused:
            assert 1 <= int(headers["retry-after"]) <= 60
            assert json.loads(text)["error"]["param"] == "max_num_queued_reqs"
        assert len(done) >= 8 and refused, (len(done), len(refused))
        text = httpx.get(base + "/metrics", timeout=5).text
        # Each API server counts its own refusals; /metrics shows the one that answered.
        assert 0 < metric(text, "aserve:num_requests_refused_total", 'reason="max_num_queued_reqs"') <= len(refused)
        assert wait_for_metric(base, "aserve:kv_cache_usage_perc", 0.0) == 0.0
        assert wait_for_metric(base, "aserve:num_requests_running", 0.0) == 0.0
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
    finally:
        server.stop()
    assert not any(Path("/dev/shm", name).exists() for name in segment)


def test_deadlines_abort_requests_with_408_and_free_their_blocks(llama_dir):
    server = Server(llama_dir, "--max-num-seqs", "1", "--request-timeout", "120")
    base = server.base_url
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    long = {"ignore_eos": True}
    try:
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model=str(llama_dir), prompt="Hello", max_tokens=240, extra_body=long,
                                      extra_headers={"X-Request-Timeout": "0.01"})
        assert exc.value.status_code == 408 and exc.value.body["param"] == "request_timeout"
        # Streamed: the error arrives as an event, and the stream still ends with [DONE].
        with httpx.stream("POST", base + "/v1/completions", timeout=60, headers={"X-Request-Timeout": "0.01"},
                          json={"prompt": "Hello", "max_tokens": 240, "stream": True, **long}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["param"] == "request_timeout"

        # One sequence at a time: once a long request runs, those queued behind it wait
        # past their 5 ms and are expired by the engine; the long one finishes.
        statuses: list[tuple[int, str | None]] = []
        holder: dict = {}

        async def hold(running: anyio.Event) -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", base + "/v1/completions",
                                    json={"prompt": "Hello", "max_tokens": 240, "stream": True, **long}) as r:
                    async for line in r.aiter_lines():
                        running.set()
                        holder["last"] = line or holder.get("last")
                    holder["status"] = r.status_code

        async def queued(c: httpx.AsyncClient, i: int) -> None:
            r = await c.post(base + "/v1/completions", headers={"X-Max-Queue-Time": "0.005"},
                             json={"prompt": f"Hi {i}", "max_tokens": 20, **long})
            statuses.append((r.status_code, r.json().get("error", {}).get("param")))

        async def burst() -> None:
            running = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(hold, running)
                await running.wait()
                async with httpx.AsyncClient(timeout=60) as c, anyio.create_task_group() as inner:
                    for i in range(5):
                        inner.start_soon(queued, c, i)

        anyio.run(burst)
        assert statuses == [(408, "max_queue_time")] * 5
        assert holder["status"] == 200 and holder["last"] == "data: [DONE]"
        text = httpx.get(base + "/metrics", timeout=5).text
        assert metric(text, "aserve:request_timeouts_total", 'deadline="request_timeout"') == 2
        assert metric(text, "aserve:request_timeouts_total", 'deadline="max_queue_time"') == 5
        assert wait_for_metric(base, "aserve:kv_cache_usage_perc", 0.0) == 0.0
        assert wait_for_metric(base, "aserve:num_requests_waiting", 0.0) == 0.0
        # Still serving (ignore_eos: a sampled end of text must not make this flaky).
        after = client.completions.create(model=str(llama_dir), prompt="Hello", max_tokens=3,
                                          extra_body={"ignore_eos": True})
        assert after.usage.completion_tokens == 3 and after.choices[0].finish_reason == "length"
    finally:
        server.stop()
    assert re.search(r"Traceback", server.output()) is None
