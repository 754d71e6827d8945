"""The grammar-mask kernel (``cpu_token_mask.c``) and the torch form the GPU path uses
(``aserve.worker.sampler.apply_token_bitmask_torch``), each against the numpy twin."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aserve.kernels import token_mask
from aserve.worker.sampler import apply_token_bitmask_torch


@pytest.fixture(scope="module")
def kernel():
    loaded = token_mask.load()
    if loaded is None:
        pytest.skip("needs a C compiler (gcc) to build the kernel")
    return loaded


def _bits(rng: np.random.Generator, k: int, words: int, density: float) -> np.ndarray:
    allowed = rng.random((k, words * 32)) < density
    return np.packbits(allowed, axis=1, bitorder="little").view(np.int32).copy()


@pytest.mark.parametrize("vocab, words", [(427, 14), (64, 2), (100, 3), (100, 4), (1000, 20)],
                         ids=["vocab-427", "whole-words", "vocab-past-words", "words-past-vocab", "mask-narrower"])
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_the_kernel_masks_as_its_twin_does(kernel, vocab, words, density):
    rng = np.random.default_rng(vocab * 7 + words)
    logits = torch.from_numpy(rng.standard_normal((9, vocab)).astype(np.float32))
    logits[2, :] = float("-inf")  # a row min_tokens left with nothing: the grammar wins
    logits[5, : vocab // 2] = float("-inf")
    rows = [7, 2, 0, 5]
    bits = _bits(rng, len(rows), words, density)
    expected = logits.clone()
    dead_twin = token_mask.apply_token_bitmask_numpy(expected.numpy(), rows, bits)
    got = logits.clone()
    dead = kernel.apply(got, rows, bits)
    assert dead == dead_twin
    assert torch.equal(got, expected)
    untouched = [r for r in range(9) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])


@pytest.mark.parametrize("vocab, words", [(427, 14), (100, 3), (100, 4), (1000, 20)],
                         ids=["vocab-427", "vocab-past-words", "words-past-vocab", "mask-narrower"])
@pytest.mark.parametrize("density", [0.0, 0.03, 1.0])
def test_the_torch_form_masks_as_the_twin_does(vocab, words, density):
    rng = np.random.default_rng(vocab * 5 + words)
    logits = torch.from_numpy(rng.standard_normal((6, vocab)).astype(np.float32))
    logits[2, :] = float("-inf")  # nothing finite: the grammar wins
    rows = [4, 2, 0]
    bits = _bits(rng, len(rows), words, density)
    expected = logits.clone()
    dead_twin = token_mask.apply_token_bitmask_numpy(expected.numpy(), rows, bits)
    got = logits.clone()
    assert apply_token_bitmask_torch(got, rows, bits) == dead_twin
    assert torch.equal(got, expected)


def test_the_kernel_keeps_only_what_the_mask_allows(kernel):
    logits = torch.zeros(2, 70)
    bits = np.zeros((1, 3), dtype=np.int32)
    bits.view(np.uint32)[0, 0] = 1 << 31  # token 31
    bits.view(np.uint32)[0, 2] = 1 << 5  # token 69
    assert kernel.apply(logits, [1], bits) == 0
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [31, 69]
    assert torch.isfinite(logits[0]).all()


def test_the_kernel_checks_what_it_is_given(kernel):
    bits = np.zeros((1, 1), dtype=np.int32)
    with pytest.raises(ValueError):
        kernel.apply(torch.zeros(2, 8, dtype=torch.bfloat16), [0], bits)
    with pytest.raises(ValueError):
        kernel.apply(torch.zeros(2, 8), [2], bits)
    with pytest.raises(ValueError):
        kernel.apply(torch.zeros(2, 8), [0, 1], bits)
