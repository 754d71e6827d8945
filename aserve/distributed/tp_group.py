"""The tensor-parallel group a model is built against, passed explicitly to every layer.

A model built with ``TPGroup.single()`` runs in one process and its collectives are
no-ops. Worker processes build one over a ``torch.distributed`` process group (gloo on
CPU, NCCL on CUDA) or, on CPU by default, over a shared-memory communicator that the
gloo group set up (:mod:`aserve.distributed.shm_comm`). No layer reads a global: the
group is a constructor argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    process_group: Any = None  # torch.distributed.ProcessGroup, when size > 1 and no comm
    comm: Any = None  # a ShmCommunicator: used instead of process_group

    @classmethod
    def single(cls) -> TPGroup:
        return cls(rank=0, size=1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        if self.comm is not None:
            return self.comm.all_reduce(x)
        if self.size > 1:
            dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        if self.comm is not None:
            return self.comm.all_gather_last_dim(x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str = "dimension") -> tuple[int, int]:
        """The [start, end) range of ``total`` that this rank owns; ``total`` must divide."""
        if total % self.size:
            raise ValueError(f"{what} of {total} does not divide over tensor parallel size {self.size}")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per
