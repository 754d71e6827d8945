"""A worker's place in its engine's pipeline, and the point-to-point traffic between stages.

Worker ``r`` of an engine with TP size ``t`` is stage ``r // t``, TP rank ``r % t``. Every
rank of a stage holds the same hidden states after its layers (the TP all-reduce makes
them whole), so TP rank ``k`` of stage ``s`` sends its copy to TP rank ``k`` of stage
``s + 1``: the hidden state and the residual stacked into one tensor, one
``torch.distributed`` send a step (gloo on CPU, NCCL on GPUs). The sizes are not sent:
every stage runs the same ``SchedulerOutput`` and knows the step's token count.

Only the last stage samples; its first TP rank (the engine's output rank) replies to the
engine core. The stages before learn the sampled tokens from the engine core, in the next
step that schedules each request (``CachedRequestData.new_token_ids``), so nothing flows
backwards between stages and a stage that has sent a step's hidden states moves on to
the next batch while the later stages work on this one. ``send`` returns once the next
stage has taken the tensor (gloo's and NCCL's point-to-point wait for the receiver), so a
stage runs at most one step ahead of the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PPGroup:
    stage: int
    size: int
    tp_rank: int
    tp_size: int
    process_group: Any = None  # the engine's process group of every worker (None: one stage)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def rank(self) -> int:
        """This worker's rank in the engine's process group."""
        return self.stage * self.tp_size + self.tp_rank

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """``(hidden, residual)`` ([T, H] each) to the same TP rank of the next stage."""
        dist.send(torch.stack((hidden, residual)), dst=self.rank + self.tp_size, group=self.process_group)

    def recv(self, tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's ``(hidden, residual)`` for a step of ``tokens`` tokens."""
        both = torch.empty(2, tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(both, src=self.rank - self.tp_size, group=self.process_group)
        return both[0], both[1]
