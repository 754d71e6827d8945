"""``aserve run --dp N``: several engines behind one endpoint, over the real wires.

- ``--tp 2 --dp 2``: 10 processes, 64 concurrent streams through both API servers, each
  engine serving 30-70% of them, greedy text identical to ``--dp 1``;
- ``kill -9`` of one engine core: its requests fail, ``/health`` is 503, the tree exits
  and leaves nothing behind;
- two nodes on loopback: a front end with one local engine and a headless node with the
  other, over CURVE-authenticated TCP; a node with the wrong secret is refused.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import anyio
import httpx
import pytest

from tests.e2e.server import Server, alive, aserve_dirs, aserve_shm, process_tree

PROMPTS = [f"Request {i}: the quick brown fox" for i in range(64)]
MAX_TOKENS = 12


async def _stream_all(base_url: str, prompts: list[str]) -> list[tuple[str, str, str | None]]:
    """Stream every prompt at once; (text, API server index, finish reason) per prompt."""
    results: list = [None] * len(prompts)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "llama", "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text, finish = "", None
        async with client.stream("POST", base_url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            server = response.headers["x-aserve-api-server"]
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
        results[i] = (text, server, finish)

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client, anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, client, i)
    return results


def _engine_counter(metrics: str, name: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            out[line.split('engine="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def _greedy(base_url: str, prompt: str, **headers: str) -> str:
    r = httpx.post(base_url + "/v1/completions", headers=headers, timeout=60,
                   json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_tp2_dp2_is_ten_processes_balanced_and_identical_to_dp1(llama_dir):
    before = aserve_shm(), aserve_dirs()
    server = Server(llama_dir, "--tp", "2", "--dp", "2")
    try:
        titles = Counter(title for _, title in server.title_list())
        assert titles == {"aserve::supervisor": 1, "aserve::api_server_0": 1, "aserve::api_server_1": 1,
                          "aserve::coordinator": 1, "aserve::engine_core_0": 1, "aserve::engine_core_1": 1,
                          "aserve::worker_tp0": 2, "aserve::worker_tp1": 2}
        results = anyio.run(_stream_all, server.base_url, PROMPTS)
        assert all(finish == "length" and text for text, _, finish in results), results[:5]
        assert {api for _, api, _ in results} == {"0", "1"}  # both API servers answered
        received = _engine_counter(httpx.get(server.base_url + "/metrics").text,
                                   "aserve:engine_requests_received_total")
        assert sum(received.values()) == 64
        for engine in ("0", "1"):
            assert 0.3 * 64 <= received[engine] <= 0.7 * 64, received
        # Pinning a request to either engine gives the same greedy text.
        assert _greedy(server.base_url, PROMPTS[0], **{"X-data-parallel-rank": "0"}) == \
            _greedy(server.base_url, PROMPTS[0], **{"X-data-parallel-rank": "1"}) == results[0][0]
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "data_parallel_rank": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_rank"
    finally:
        assert server.stop() == 0
    single = Server(llama_dir, "--tp", "2")
    try:
        reference = anyio.run(_stream_all, single.base_url, PROMPTS)
    finally:
        assert single.stop() == 0
    assert [text for text, _, _ in results] == [text for text, _, _ in reference]
    assert aserve_shm() <= before[0] and aserve_dirs() <= before[1]


def _stream_on(base_url: str, rank: int, outcome: dict, opened: threading.Event, first_chunk: threading.Event) -> None:
    """Stream 200 tokens from engine ``rank``; ``outcome`` gets "error" (an error event
    or a broken connection), "finish" (the last finish reason) and "done" ([DONE])."""
    body = {"prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True, "min_tokens": 200}
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=30,
                          headers={"X-data-parallel-rank": str(rank)}) as response:
            outcome["status"] = response.status_code
            opened.set()
            for line in response.iter_lines():
                if '"error"' in line:
                    outcome["error"] = line
                    return
                if line == "data: [DONE]":
                    outcome["done"] = True
                elif line.startswith("data: {"):
                    outcome["finish"] = json.loads(line[6:])["choices"][0]["finish_reason"]
                    first_chunk.set()
    except httpx.HTTPError as exc:
        outcome["error"] = repr(exc)
    finally:
        opened.set()
        first_chunk.set()


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_kill_9_of_one_engine_fails_its_requests_and_takes_the_tree_down(llama_dir, loop):
    """Two streams on engine 1 when it is killed: one generating, one sent while the
    engine was stopped (so it cannot have finished before the kill, however slow this host
    is to deliver the signal). Both end with an error, never a clean end of stream."""
    before = aserve_shm(), aserve_dirs()
    server = Server(llama_dir, "--dp", "2", "--loop", loop)
    pids = server.pids()
    victim = server.titles()["aserve::engine_core_1"]
    generating, queued = {}, {}
    events = [threading.Event() for _ in range(4)]
    readers = [threading.Thread(target=_stream_on, args=(server.base_url, 1, generating, events[0], events[1])),
               threading.Thread(target=_stream_on, args=(server.base_url, 1, queued, events[2], events[3]))]
    try:
        readers[0].start()
        assert events[1].wait(30) and "finish" in generating, generating  # tokens are flowing
        os.kill(victim, signal.SIGSTOP)  # engine 1 makes no more steps from here
        readers[1].start()
        assert events[2].wait(30) and queued.get("status") == 200, queued  # headers out, request queued
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        health = httpx.get(server.base_url + "/health", timeout=2)
        while health.status_code == 200 and time.monotonic() - start < 5:
            health = httpx.get(server.base_url + "/health", timeout=2)
        assert health.status_code == 503
        for reader in readers:
            reader.join(15)
        assert not any(r.is_alive() for r in readers), "a stream hung"
        assert "error" in queued, queued
        # The generating stream fails too, unless a stalled host let all 200 tokens out
        # before the SIGSTOP landed: then it must have ended as a whole stream does.
        assert "error" in generating or (generating.get("finish") == "length" and generating.get("done")), generating
        code = server.proc.wait(60)
    finally:
        server.stop(signal.SIGKILL)
    assert code == 1
    assert not any(alive(p) for p in pids)
    assert aserve_shm() <= before[0] and aserve_dirs() <= before[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _headless(llama_dir, port: int, secret: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "aserve", "run", str(llama_dir), "--headless", "--dp", "2", "--dp-size-local", "1",
           "--dp-start-rank", "1", "--dp-rpc-port", str(port), "--dp-secret", secret,
           "--kv-cache-memory", str(1 << 24), "--max-model-len", "256"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_serve_together_and_a_wrong_secret_is_refused(llama_dir):
    before = aserve_shm(), aserve_dirs()
    port, secret = _free_port(), "a-shared-secret-for-tests"
    front = Server(llama_dir, "--dp", "2", "--dp-size-local", "1", "--dp-rpc-port", str(port),
                   "--dp-secret", secret, wait=False)
    node = None
    try:
        wrong = _headless(llama_dir, port, secret + "-wrong")
        out, _ = wrong.communicate(timeout=120)
        assert wrong.returncode == 2
        assert "refused this node's CURVE handshake" in out
        assert httpx.get(front.base_url + "/ready").status_code == 503  # still waiting for engine 1

        node = _headless(llama_dir, port, secret)
        front.wait_ready()
        assert Counter(title for _, title in front.title_list()) == {
            "aserve::supervisor": 1, "aserve::api_server_0": 1, "aserve::api_server_1": 1, "aserve::coordinator": 1,
            "aserve::engine_core_0": 1, "aserve::worker_tp0": 1}
        node_pids = [node.pid, *process_tree(node.pid)]
        assert len(node_pids) == 3  # the node's supervisor, engine core 1 and its worker
        texts = {rank: [_greedy(front.base_url, p, **{"X-data-parallel-rank": rank}) for p in PROMPTS[:4]]
                 for rank in ("0", "1")}
        assert texts["0"] == texts["1"]
        results = anyio.run(_stream_all, front.base_url, PROMPTS[:16])
        assert [text for text, _, _ in results[:4]] == texts["0"]
        received = _engine_counter(httpx.get(front.base_url + "/metrics").text,
                                   "aserve:engine_requests_received_total")
        assert received["0"] >= 4 and received["1"] >= 4 and sum(received.values()) == 24
        assert "refused a peer" in front.output()
    finally:
        code = front.stop()
        if node is not None:
            node_code = node.wait(60)
            node.stdout.close()
    assert code == 0 and node_code == 0
    assert not any(alive(p) for p in node_pids)
    assert aserve_shm() <= before[0] and aserve_dirs() <= before[1]


@pytest.mark.parametrize("flags, message", [
    (["--headless", "--dp", "2", "--dp-size-local", "1", "--dp-start-rank", "1"], "shared secret"),
    (["--dp", "2", "--dp-size-local", "1"], "shared secret"),
    (["--dp", "2", "--dp-start-rank", "1"], "--dp-start-rank is for --headless"),
    (["--dp", "2", "--dp-size-local", "3"], "dp-size-local"),
    (["--dp", "2", "--dp-size-local", "1", "--dp-secret", "short"], "at least 16 bytes"),
])
def test_bad_data_parallel_flags_are_refused_before_anything_starts(llama_dir, flags, message):
    r = subprocess.run([sys.executable, "-m", "aserve", "run", str(llama_dir), *flags], capture_output=True,
                       text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "ASERVE_DP_SECRET"})
    assert r.returncode == 2
    assert message in r.stderr
