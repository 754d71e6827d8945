"""A headless node's watch over its head and its workers (``aserve.launch.worker_node.
watch``), against a real ZeroMQ publisher standing for the head's and stand-ins for the
worker processes (only their ``exitcode`` is read).

The case that matters: on a clean stop the head tells every worker to shut down, then
stops its own workers, and only then closes the connection the node watches. So the
node can see its worker exit 0 before the head goes, and that must still count as the
head's stop (the node exits 0), not as a worker's failure."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import zmq

from aserve.distributed.remote_workers import CallSubscriber
from aserve.launch.worker_node import watch


@dataclass
class FakeWorker:
    exitcode: int | None = None
    name: str = "worker_tp1"


@pytest.fixture
def head():
    """(the head's publisher, a node's subscriber to it, connected)."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = CallSubscriber(ctx, f"tcp://127.0.0.1:{port}", None, subscribe=False)
    sub.wait_connected(10)
    yield pub, sub
    sub.close()
    pub.close(linger=0)
    ctx.term()


def test_a_worker_that_exits_0_before_the_head_goes_is_the_heads_clean_stop(head):
    pub, sub = head
    workers = [FakeWorker(exitcode=0), FakeWorker()]
    seen_exit = threading.Event()

    def clock() -> float:  # read first when watch sees the exit: only then does the head go
        seen_exit.set()
        return 0.0

    result = []
    watcher = threading.Thread(target=lambda: result.append(watch(sub, workers, tick=0.05, clock=clock)))
    watcher.start()
    assert seen_exit.wait(10)
    pub.close(linger=0)  # the head, its own workers stopped, closes its publisher
    watcher.join(10)
    assert result == [True]


def test_a_worker_that_exits_0_with_the_head_still_there_is_a_failure(head):
    _, sub = head
    now = [0.0]

    def clock() -> float:  # 10 s a tick: past the wait on the third look
        now[0] += 10.0
        return now[0]

    assert watch(sub, [FakeWorker(exitcode=0), FakeWorker()], tick=0.01, head_stop_wait=15.0, clock=clock) is False
    assert now[0] == 30.0  # it waited for the head (two looks) before giving up


def test_a_worker_that_fails_stops_the_node_at_once(head):
    _, sub = head

    def clock() -> float:
        raise AssertionError("a failed worker is not waited on")

    assert watch(sub, [FakeWorker(exitcode=0), FakeWorker(exitcode=1)], tick=0.01, clock=clock) is False


def test_the_head_going_with_workers_running_is_the_heads_stop(head):
    pub, sub = head
    pub.close(linger=0)
    assert watch(sub, [FakeWorker(), FakeWorker()], tick=0.05) is True
