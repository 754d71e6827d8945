"""The step's inputs packed into one copy to the device (aserve/worker/step_inputs.py).

On a GPU the host side is pinned and the copy non-blocking (scripts/cuda_check.sh runs
the engine through it there); here the packing, the views and the buffers' reuse run on
the CPU, where the "device" buffer is a second host tensor."""

from __future__ import annotations

import pytest
import torch

from aserve.worker.step_inputs import StepInputs


def test_the_views_hold_the_inputs_in_their_shapes_after_one_copy():
    inputs = StepInputs(torch.device("cpu"))
    table = torch.arange(12, dtype=torch.long).view(3, 4)
    ids, none, columns, lens = inputs.send([torch.tensor([5, 6, 7]), None, table[:, :2], torch.tensor([9])])
    assert none is None
    assert ids.tolist() == [5, 6, 7] and lens.tolist() == [9]
    assert columns.shape == (3, 2) and columns.tolist() == [[0, 1], [4, 5], [8, 9]]
    assert inputs.copies == 1
    # The views are of one buffer, in order: a copy, not the caller's tensors.
    assert ids.data_ptr() + 3 * 8 == columns.data_ptr() and ids.data_ptr() != table.data_ptr()


def test_the_buffers_grow_and_are_reused():
    inputs = StepInputs(torch.device("cpu"))
    small = inputs.send([torch.ones(10, dtype=torch.long)])[0]
    first = small.data_ptr()
    again = inputs.send([torch.full((7,), 3, dtype=torch.long)])[0]
    assert again.data_ptr() == first and again.tolist() == [3] * 7  # reused, not reallocated
    big = inputs.send([torch.arange(5000, dtype=torch.long), torch.arange(4, dtype=torch.long).view(2, 2)])
    assert big[0].tolist() == list(range(5000)) and big[1].tolist() == [[0, 1], [2, 3]]
    assert inputs.copies == 3


def test_only_int64_is_packed():
    with pytest.raises(TypeError, match="int64"):
        StepInputs(torch.device("cpu")).send([torch.zeros(2, dtype=torch.float32)])
