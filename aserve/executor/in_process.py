"""Runs the model in the caller's process: the executor of offline ``LLM`` at TP = 1."""

from __future__ import annotations

from aserve.config import EngineConfig
from aserve.distributed.tp_group import TPGroup
from aserve.wire.worker_messages import GrammarMasks, RunnerOutput, SchedulerOutput
from aserve.worker.worker import Worker


class InProcessExecutor:
    """The model runs in :meth:`wait_model`, on the caller's thread: nothing overlaps,
    so the engine keeps one step in flight."""

    max_inflight = 1

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.worker_threads is not None:
            import torch

            torch.set_num_threads(config.parallel.worker_threads)  # the caller asked: this process is the worker
        self.worker = Worker(config, TPGroup.single())
        self._pending: SchedulerOutput | None = None
        self._masks: GrammarMasks | None = None
        self.worker.runner.fetch_masks = self._take_masks

    def submit_model(self, sched: SchedulerOutput) -> None:
        assert self._pending is None, "one step at a time"
        self._pending = sched

    def submit_masks(self, masks: GrammarMasks) -> None:
        """The masks of the step submitted (the engine sends them before it waits)."""
        self._masks = masks

    def _take_masks(self) -> GrammarMasks:
        masks, self._masks = self._masks, None
        assert masks is not None, "a step that asked for grammar masks was run without them"
        return masks

    def wait_model(self) -> RunnerOutput:
        sched, self._pending = self._pending, None
        assert sched is not None, "no step submitted"
        return self.worker.execute_model(sched)

    def collective_rpc(self, method: str, arg: int | str | None = None, *, timeout: float = 0.0) -> str | None:
        """A worker utility (sleep, wake_up, start_profile, stop_profile), called here."""
        worker = self.worker
        methods = {"sleep": worker.sleep, "wake_up": worker.wake_up, "start_profile": worker.start_profile,
                   "stop_profile": worker.stop_profile}
        result = methods[method](*(() if arg is None else (arg,)))
        return None if result is None else str(result)

    def shutdown(self) -> None:
        pass
