"""Vocabulary-parallel embedding and the parallel LM head.

Each rank owns a contiguous range of (padded) vocabulary rows. The embedding looks up
the tokens in its range, writes zeros for the others and all-reduces; the LM head
computes logits for its rows and all-gathers them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.tp_group import TPGroup
from aserve.model.layers.linear import PackedMatmul
from aserve.model.layers.weights import TensorSource, check_shape, expect_full_shape, new_param


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, *, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        # Pad so every rank owns the same number of rows; padded rows are zero and
        # their logits are cut off before sampling.
        self.padded_vocab = -(-vocab_size // tp.size) * tp.size
        self.rows_per_rank = self.padded_vocab // tp.size
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = new_param(self.rows_per_rank, hidden, dtype=dtype, loader=self._load)

    def _load(self, param: torch.Tensor, source: TensorSource, shard_id: Any = None) -> None:
        expect_full_shape(source, (self.vocab_size, param.shape[1]))
        start = self.vocab_start
        end = min(start + self.rows_per_rank, self.vocab_size)
        param.data.zero_()
        if end <= start:
            return
        loaded = source.read(slice(start, end))
        target = param.data[: end - start]
        check_shape(target, loaded, source.name)
        target.copy_(loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(PackedMatmul, VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary, on every rank.

    With tied embeddings the model points ``weight`` at the embedding's parameter. Either
    way the head gets the linear layers' fast weight layouts from
    :func:`~aserve.model.layers.linear.prepack_linears`; a tied one as a second copy.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # hidden: [N, hidden] -> logits [N, vocab]
        logits = self.tp.all_gather_last_dim(self._matmul(hidden, None))
        return logits[..., : self.vocab_size]
