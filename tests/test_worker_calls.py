"""A worker's loop over the engine's calls (``aserve.worker.worker_process._serve_calls``):
a step that asked for grammar masks reads them from the ring, reading ahead past a later
step the engine wrote first and answering that step after; masks that no step waits for
are skipped by a stage that does not sample and refused by one that does."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from aserve.wire.worker_messages import (
    REPLY_DECODER, GrammarMasks, RunnerOutput, SchedulerOutput, WorkerCall,
)
from aserve.worker.worker_process import _serve_calls


class _Ring:
    def __init__(self, calls: list[WorkerCall]) -> None:
        encoder = msgspec.msgpack.Encoder()
        self.payloads = [encoder.encode(call) for call in calls]

    def read(self) -> bytes:
        return self.payloads.pop(0)


class _Replies:
    def __init__(self) -> None:
        self.replies = []

    def wait_for_readers(self, timeout: float) -> None:
        pass

    def write(self, payload: bytes) -> None:
        self.replies.append(REPLY_DECODER.decode(payload))


class _Worker:
    """Answers a step with the masks it read: one 'token' per masked request."""

    def __init__(self, samples: bool) -> None:
        self.runner = SimpleNamespace(samples=samples, fetch_masks=None)
        self.sleep = self.wake_up = self.start_profile = self.stop_profile = lambda *args: None

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        # As the model runner: only a rank that samples reads the masks.
        ids = self.runner.fetch_masks().req_ids if sched.masks_follow and self.runner.samples else []
        return RunnerOutput(ids, [len(sched.num_scheduled_tokens)] * len(ids), {}, {})


def _step(rid: str, masks_follow: bool) -> WorkerCall:
    sched = SchedulerOutput(num_scheduled_tokens={rid: 1}, total_num_scheduled_tokens=1, masks_follow=masks_follow)
    return WorkerCall("execute_model", sched)


def _masks(*ids: str) -> WorkerCall:
    return WorkerCall("grammar_masks", masks=GrammarMasks(list(ids), 1, b"\0\0\0\0" * len(ids)))


def _serve(calls: list[WorkerCall], *, samples: bool = True) -> list[list[str]]:
    replies = _Replies()
    _serve_calls(SimpleNamespace(rank=0), _Worker(samples), _Ring(calls), replies)
    assert replies.replies[0].output is None  # the ready reply
    return [r.output.req_ids for r in replies.replies[1:]]


def test_a_step_reads_its_masks_past_a_later_step_and_answers_that_one_after():
    calls = [_step("a", True), _step("b", False), _masks("a"), _step("c", True), _masks("c"),
             WorkerCall("shutdown")]
    assert _serve(calls) == [["a"], [], ["c"]]


def test_a_stage_that_does_not_sample_skips_masks_and_a_sampling_one_refuses_stray_ones():
    calls = [_step("a", True), _masks("a"), _step("b", False), WorkerCall("shutdown")]
    assert _serve(calls, samples=False) == [[], []]
    with pytest.raises(RuntimeError, match="no step waiting"):
        _serve([_step("a", False), _masks("a"), WorkerCall("shutdown")], samples=True)


def test_a_shutdown_while_a_step_waits_for_its_masks_ends_the_loop():
    assert _serve([_step("a", True), WorkerCall("shutdown")]) == []
