"""``aserve run`` as a unit: a dead worker brings it down; SIGTERM drains it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import Server, alive, aserve_shm


def _stream(base_url: str, outcome: dict, opened: threading.Event, first_chunk: threading.Event) -> None:
    """Stream 200 tokens through the ``openai`` client; ``outcome`` gets "opened" (the
    response started), "finish" (the last chunk's finish reason), then "ended" or "error"."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    try:
        stream = client.completions.create(model="llama", prompt="Hello", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True, "min_tokens": 200})
        outcome["opened"] = True
        opened.set()
        for chunk in stream:
            outcome["finish"] = chunk.choices[0].finish_reason
            first_chunk.set()
        outcome["ended"] = True
    except Exception as exc:  # the stream must end in an error, not hang
        outcome["error"] = exc
    finally:
        opened.set()
        first_chunk.set()
        client.close()


@pytest.mark.parametrize("victim, tp", [("aserve::worker_tp0", 1), ("aserve::engine_core_0", 1),
                                        # its peer waits for it in a shared-memory all-reduce
                                        ("aserve::worker_tp1", 2)])
def test_kill_9_fails_health_and_takes_the_tree_down(llama_dir, victim, tp):
    before = aserve_shm()
    server = Server(llama_dir, "--tp", str(tp))
    pids = server.pids()
    titles = server.titles()
    # A plain `aserve run` is 4 processes; each TP rank past the first adds a worker.
    assert sorted(titles) == ["aserve::api_server_0", "aserve::engine_core_0", "aserve::supervisor",
                              *[f"aserve::worker_tp{rank}" for rank in range(tp)]]
    generating, queued = {}, {}
    events = [threading.Event() for _ in range(4)]
    readers = [threading.Thread(target=_stream, args=(server.base_url, generating, events[0], events[1])),
               threading.Thread(target=_stream, args=(server.base_url, queued, events[2], events[3]))]
    try:
        readers[0].start()
        assert events[1].wait(30) and "finish" in generating, generating  # tokens are flowing
        # Stopped first, so that the second stream, sent now, is surely in flight at the
        # kill, however slowly this host delivers the signal.
        os.kill(titles[victim], signal.SIGSTOP)
        readers[1].start()
        assert events[2].wait(30) and "opened" in queued, queued
        os.kill(titles[victim], signal.SIGKILL)
        start = time.monotonic()
        health = httpx.get(server.base_url + "/health", timeout=2)
        while health.status_code == 200 and time.monotonic() - start < 5:
            health = httpx.get(server.base_url + "/health", timeout=2)
        assert health.status_code == 503 and time.monotonic() - start < 5
        assert health.json()["error"]["code"] == 503
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and "dead" in r.json()["error"]["message"]
        for reader in readers:
            reader.join(15)
        assert not any(r.is_alive() for r in readers), "a stream hung"
        assert isinstance(queued.get("error"), openai.APIError), queued  # the client raises the error event
        # The first stream fails too, unless a stalled host let all 200 tokens out before
        # the SIGSTOP landed: then it must have ended as a whole stream does.
        assert "error" in generating or (generating.get("finish") == "length" and "ended" in generating), generating
        code = server.proc.wait(30)
    finally:
        server.stop(signal.SIGKILL)
    assert code != 0
    assert not any(alive(p) for p in pids)
    assert aserve_shm() <= before


def test_sigterm_drains_then_exits_0(llama_dir):
    before = aserve_shm()
    server = Server(llama_dir, "--shutdown-timeout", "30")
    pids = server.pids()
    result = {}

    def long_request():
        # Long enough to still be running when the drain is checked below (the model's
        # limit is 256 tokens): with asynchronous scheduling the tiny model decodes 60
        # tokens in well under 100 ms, and the server could finish draining first.
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 250, "ignore_eos": True})
        result["status"] = r.status_code
        result["body"] = r.json()

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while "aserve:num_requests_running{" not in httpx.get(server.base_url + "/metrics").text or \
                _running(server) < 1:
            assert time.monotonic() < deadline
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(server.base_url + "/ready").status_code == 200:
            assert time.monotonic() < deadline, server.output()
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        worker.join(60)
        assert result["status"] == 200
        assert result["body"]["choices"][0]["finish_reason"] == "length"  # finished, not cut off
        assert server.stop() == 0
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)
    survivors = [(p, Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0]) for p in pids if alive(p)]
    assert survivors == []
    assert aserve_shm() <= before


def _running(server) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith("aserve:num_requests_running{"):
            return float(line.split()[-1])
    return 0.0


def test_requests_past_the_shutdown_timeout_are_cut_off(llama_dir):
    before = aserve_shm()
    # 8 streams of 480 tokens, one at a time (--max-num-seqs 1): ~3,800 decode steps, far
    # more than the tiny model gets through in the 0.3 s drain (8 streams side by side
    # came close to finishing inside it).
    server = Server(llama_dir, "--shutdown-timeout", "0.3", "--max-model-len", "512", "--max-num-seqs", "1")
    pids = server.pids()
    seen = {"events": 0, "done": False}

    def long_stream():
        try:
            with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                              json={"prompt": ["Hello", "World"], "n": 4, "max_tokens": 480, "ignore_eos": True,
                                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        seen["events"] += 1
                    seen["done"] |= line == "data: [DONE]"
        except httpx.HTTPError:
            pass  # the connection is closed under it: expected

    reader = threading.Thread(target=long_stream)
    reader.start()
    deadline = time.monotonic() + 30
    while seen["events"] < 2:
        assert time.monotonic() < deadline
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    reader.join(30)
    assert not reader.is_alive()
    assert not seen["done"]  # cut off, not finished
    assert server.stop() == 0
    assert time.monotonic() - start < 20
    assert not any(alive(p) for p in pids)
    assert aserve_shm() <= before
