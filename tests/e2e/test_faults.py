"""The fault suite at ``--tp 2 --dp 2`` (ten processes), with streams in flight on both
engines: ``kill -9`` of each process kind, ``SIGKILL`` of the supervisor, ``SIGSTOP`` of
a worker and of an engine core. Each must end every stream (an error, never a hang),
and leave no process, no shared-memory segment and no socket file behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.server import Server, alive, aserve_dirs, aserve_shm

STREAMS = 4


def _stream(base: str, rank: int, outcome: dict, started: threading.Event) -> None:
    body = {"prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True, "min_tokens": 200}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60,
                          headers={"X-data-parallel-rank": str(rank)}) as response:
            for line in response.iter_lines():
                if '"error"' in line:
                    outcome["end"] = "error event"
                    return
                if line.startswith("data: {"):
                    started.set()
            outcome["end"] = "ended"
    except httpx.HTTPError as exc:
        outcome["end"] = type(exc).__name__
    finally:
        started.set()


@pytest.mark.parametrize("victim, sig", [
    ("aserve::api_server_1", signal.SIGKILL),
    ("aserve::coordinator", signal.SIGKILL),
    ("aserve::engine_core_1", signal.SIGKILL),
    ("aserve::worker_tp1", signal.SIGKILL),
    ("aserve::supervisor", signal.SIGKILL),
    ("aserve::worker_tp1", signal.SIGSTOP),
    ("aserve::engine_core_0", signal.SIGSTOP),
], ids=["kill-api-server", "kill-coordinator", "kill-engine-core", "kill-worker", "kill-supervisor",
        "stop-worker", "stop-engine-core"])
def test_a_fault_takes_the_tree_down_and_leaves_nothing(llama_dir, victim, sig):
    before = aserve_shm(), aserve_dirs()
    server = Server(llama_dir, "--tp", "2", "--dp", "2")
    try:
        processes = server.title_list()
        assert len(processes) == 10, processes
        pids = [pid for pid, _ in processes]
        victim_pid = next(pid for pid, title in processes if title == victim)  # the first of its title
        outcomes = [{} for _ in range(STREAMS)]
        started = [threading.Event() for _ in range(STREAMS)]
        readers = [threading.Thread(target=_stream, args=(server.base_url, i % 2, outcomes[i], started[i]))
                   for i in range(STREAMS)]
        for reader in readers:
            reader.start()
        assert all(s.wait(60) for s in started) and not any(outcomes), outcomes  # all four streaming
        os.kill(victim_pid, sig)
        for reader in readers:
            reader.join(45)  # a stopped process is seen within the 4 s heartbeat timeout
        assert not any(r.is_alive() for r in readers), "a stream hung"
        assert all("end" in o for o in outcomes)
        if victim != "aserve::supervisor":
            assert server.proc.wait(60) != 0
        deadline = time.monotonic() + 60
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)  # orphans notice their parent's death on their own
        assert [p for p in pids if alive(p)] == []
    finally:
        for pid, _ in server.title_list():
            try:
                os.kill(pid, signal.SIGKILL)  # whatever a failed assertion left: not the next test's problem
            except ProcessLookupError:
                pass
        server.stop(signal.SIGKILL)
    assert aserve_shm() <= before[0] and aserve_dirs() <= before[1]
