"""``aserve run --pp 2 --tp 2``: the process tree the formula gives (supervisor, API
server, engine core, 2 x 2 workers titled by stage and rank), greedy completions equal to
the offline ``LLM``'s, and ``kill -9`` of a worker of the last stage with streams in
flight taking the tree down, leaving nothing behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from aserve import LLM, SamplingParams
from tests.e2e.server import Server, alive, aserve_dirs, aserve_shm
from tests.e2e.test_faults import _stream


def test_pipeline_stages_serve_and_die_as_one_unit(llama_dir):
    want = LLM(str(llama_dir), kv_cache_memory=1 << 22).generate(
        ["Hello there"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    before = aserve_shm(), aserve_dirs()
    server = Server(llama_dir, "--pp", "2", "--tp", "2")
    try:
        processes = server.title_list()
        # A + D + D x P x T with one API server and one engine: 1 + 1 + 4, and the supervisor.
        assert sorted(title for _, title in processes) == [
            "aserve::api_server_0", "aserve::engine_core_0", "aserve::supervisor", "aserve::worker_pp0_tp0",
            "aserve::worker_pp0_tp1", "aserve::worker_pp1_tp0", "aserve::worker_pp1_tp1"]
        assert "aserve::worker_pp1_tp0" in server.output()  # the announced tree
        body = {"model": str(llama_dir), "prompt": "Hello there", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want

        pids = [pid for pid, _ in processes]
        victim = next(pid for pid, title in processes if title == "aserve::worker_pp1_tp0")
        outcomes = [{} for _ in range(2)]
        started = [threading.Event() for _ in range(2)]
        readers = [threading.Thread(target=_stream, args=(server.base_url, 0, outcomes[i], started[i]))
                   for i in range(2)]
        for reader in readers:
            reader.start()
        assert all(s.wait(60) for s in started) and not any(outcomes), outcomes
        os.kill(victim, signal.SIGKILL)
        for reader in readers:
            reader.join(45)
        assert not any(r.is_alive() for r in readers), "a stream hung"
        assert server.proc.wait(60) != 0
        deadline = time.monotonic() + 60
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in pids if alive(p)] == []
    finally:
        for pid, _ in server.title_list():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.stop(signal.SIGKILL)
    assert aserve_shm() <= before[0] and aserve_dirs() <= before[1]
