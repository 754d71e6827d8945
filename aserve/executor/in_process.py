"""Runs the model in the caller's process: the executor of offline ``LLM`` at TP = 1."""

from __future__ import annotations

from aserve.config import EngineConfig
from aserve.distributed.tp_group import TPGroup
from aserve.engine.scheduler import RunnerOutput
from aserve.engine.scheduler_output import SchedulerOutput
from aserve.worker.worker import Worker


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config, TPGroup.single())

    def execute_model(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        pass
