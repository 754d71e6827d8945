"""``aserve run`` pins a worker to cores of its own when its threads leave cores free, and
asks the scheduler to run the engine core promptly when it wakes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from aserve.engine.core_process import ENGINE_CORE_SLICE_NS
from tests.e2e.server import Server
from tests.proc_threads import needs_custom_slices, thread_slices


def allowed_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of ``pid`` (a thread that exits while we look is
    left out)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:
            continue
    return out


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


def slices(pid: int) -> set[int]:
    """The scheduler slices (ns) of ``pid``'s threads."""
    return set(thread_slices(pid).values())


@needs_custom_slices
def test_engine_core_threads_run_with_a_short_slice(llama_dir: Path):
    default = slices(os.getpid())
    server = Server(llama_dir, "--worker-threads", "1")
    try:
        titles = server.titles()
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200  # the busy loop's thread exists by now
        assert slices(titles["aserve::engine_core_0"]) == {ENGINE_CORE_SLICE_NS}
        # The worker (started by the engine core before it asks) and the API server keep
        # the kernel's default.
        assert slices(titles["aserve::worker_tp0"]) == default != {ENGINE_CORE_SLICE_NS}
        assert slices(titles["aserve::api_server_0"]) == default
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
