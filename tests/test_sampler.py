"""The sampler's pieces that the GPU path relies on, checked on CPU tensors: logprobs for
a batch found at once (one transfer) against the row-by-row definition."""

from __future__ import annotations

import pytest
import torch

from aserve.worker.sampler import batched_logprobs


def _one_row(logprobs: torch.Tensor, token: int, n: int) -> tuple[list[int], list[float], list[int]]:
    """The definition, one row at a time: the chosen token, its logprob and rank, then the top n."""
    chosen = float(logprobs[token])
    ids, lps, ranks = [token], [chosen], [int((logprobs > chosen).sum()) + 1]
    values, indices = logprobs.topk(n)
    return ids + indices.tolist(), lps + values.tolist(), ranks + list(range(1, n + 1))


@pytest.mark.parametrize("top_n", [[0, 0, 0], [3, 0, 5], [20, 1, 2]], ids=["none", "mixed", "wide"])
def test_batched_logprobs_equal_the_row_by_row_definition(top_n):
    gen = torch.Generator().manual_seed(3)
    logprobs = torch.log_softmax(torch.randn(3, 97, generator=gen), dim=-1)
    tokens = [int(logprobs[0].argmax()), 5, 96]  # the most likely, and two others
    got = batched_logprobs(logprobs, tokens, top_n)
    for row, (lp, token, n) in enumerate(zip(got, tokens, top_n)):
        ids, values, ranks = _one_row(logprobs[row], token, n)
        assert lp.token_ids == ids and lp.ranks == ranks
        assert lp.logprobs == pytest.approx(values, abs=0)
    assert got[0].ranks[0] == 1


def test_batched_logprobs_of_no_rows_is_empty():
    assert batched_logprobs(torch.zeros(0, 10), [], []) == []
