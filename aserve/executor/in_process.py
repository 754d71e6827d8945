"""Runs the model in the caller's process: the executor of offline ``LLM`` at TP = 1."""

from __future__ import annotations

from aserve.config import EngineConfig
from aserve.distributed.tp_group import TPGroup
from aserve.engine.scheduler import RunnerOutput
from aserve.engine.scheduler_output import SchedulerOutput
from aserve.worker.worker import Worker


class InProcessExecutor:
    """The model runs in :meth:`wait_model`, on the caller's thread: nothing overlaps,
    so the engine keeps one step in flight."""

    max_inflight = 1

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config, TPGroup.single())
        self._pending: SchedulerOutput | None = None

    def submit_model(self, sched: SchedulerOutput) -> None:
        assert self._pending is None, "one step at a time"
        self._pending = sched

    def wait_model(self) -> RunnerOutput:
        sched, self._pending = self._pending, None
        assert sched is not None, "no step submitted"
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        pass
