"""``aserve run`` pins a worker to cores of its own when its threads leave cores free."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import Server


def allowed_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of ``pid``."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores (CI and dev machines have two)")
def test_one_thread_worker_gets_a_core_of_its_own(llama_dir: Path):
    cpus = sorted(os.sched_getaffinity(0))
    server = Server(llama_dir, "--worker-threads", "1")
    try:
        titles = server.titles()
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200
        worker = allowed_cpus(titles["aserve::worker_tp0"])
        front = allowed_cpus(titles["aserve::api_server_0"]) | allowed_cpus(titles["aserve::engine_core_0"])
        # Every thread of the worker (torch's pool included) on the last core; every
        # thread of the API server and the engine core on the others.
        assert worker == {frozenset(cpus[-1:])}
        assert front == {frozenset(cpus[:-1])}
    finally:
        server.stop(signal.SIGTERM)


def test_no_pinning_when_switched_off(llama_dir: Path):
    cpus = frozenset(os.sched_getaffinity(0))
    server = Server(llama_dir, "--worker-threads", "1", "--no-cpu-affinity")
    try:
        titles = server.titles()
        for title in ("aserve::worker_tp0", "aserve::api_server_0", "aserve::engine_core_0"):
            assert allowed_cpus(titles[title]) == {cpus}
    finally:
        server.stop(signal.SIGTERM)
