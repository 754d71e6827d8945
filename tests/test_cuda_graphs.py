"""Decode steps through persistent buffers and bucketed batch sizes (aserve/worker/cuda_graphs.py).

On a GPU these are CUDA graphs (``scripts/cuda_check.sh`` compares graphs on and off
there). Here the same path runs with :class:`EagerReplay` over the Triton kernels in
Triton's interpreter: the buckets, the persistent inputs, the padding rows (slot -1,
length 1) and the fall-back to eager steps are the code a graph replays, and they must
give the tokens of the path without them."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs triton (the test extra)")

import torch  # noqa: E402

from aserve import LLM, SamplingParams  # noqa: E402
from aserve.worker.cuda_graphs import DecodeGraphs, EagerReplay, capture_sizes  # noqa: E402


@pytest.mark.parametrize("max_size, sizes", [(1, [1]), (3, [1, 2, 4]), (4, [1, 2, 4]), (5, [1, 2, 4, 8]),
                                             (20, [1, 2, 4, 8, 16, 24]), (256, [1, 2, 4] + list(range(8, 257, 8)))])
def test_capture_sizes_are_vllms_buckets(max_size, sizes):
    assert capture_sizes(max_size) == sizes


def test_capture_sizes_refuse_nothing():
    with pytest.raises(ValueError):
        capture_sizes(0)


class _Echo(torch.nn.Module):
    """A "model" whose hidden state is what it was given: token, position, slot, length
    and the first two table entries of each row."""

    def forward(self, ids, positions, kv, meta):
        return torch.stack([ids, positions, meta.slot_mapping, meta.decode_seq_lens,
                            meta.decode_block_table[:, 0], meta.decode_block_table[:, 1]], dim=1)


@pytest.mark.parametrize("mirror", [False, True])
def test_a_step_fills_the_persistent_inputs_and_pads_to_its_bucket(mirror):
    """In place (the CPU's way) and through the host mirror (a GPU's: one copy of the
    header and the step's own table, packed at its width, then the table's rows put in
    place on the device)."""
    graphs = DecodeGraphs(_Echo(), [], sizes=capture_sizes(8), max_blocks=3, device=torch.device("cpu"),
                          backend=EagerReplay(), mirror=mirror)
    graphs.capture()
    table = torch.tensor([[4, 7], [9, 0], [2, 3]])
    got = graphs.run(torch.tensor([11, 12, 13]), torch.tensor([20, 5, 31]), torch.tensor([71, 145, 47]), table,
                     torch.tensor([21, 6, 32]))
    assert got.tolist() == [[11, 20, 71, 21, 4, 7], [12, 5, 145, 6, 9, 0], [13, 31, 47, 32, 2, 3]]
    # Mirrored, the copy is the header (4 x 8 rows) and the 3 x 2 table, not 3 x 3 or 8 x 3.
    assert graphs.sent_elements == (4 * 8 + 3 * 2 if mirror else 0)
    # The bucket of 3 rows is 4: the fourth row is padding, stored nowhere (slot -1; block 0
    # is reserved and stays zero), one key long.
    assert graphs.input_ids[3] == 0 and graphs.positions[3] == 0
    assert graphs.slot_mapping[3] == -1 and graphs.seq_lens[3] == 1
    # After a step of 3 rows, a step of 1 row pads rows 1 .. 0 of its own bucket only.
    assert graphs.run(torch.tensor([1]), torch.tensor([2]), torch.tensor([3]), table[:1, :1],
                      torch.tensor([3])).tolist() == [[1, 2, 3, 3, 4, 7]]
    assert graphs.sent_elements == (4 * 8 + 1 if mirror else 0)
    assert graphs.replayed == 2
    # Wider tables than captured and batches past the largest bucket are not replayed.
    assert graphs.run(torch.tensor([1]), torch.tensor([2]), torch.tensor([3]), torch.zeros(1, 4, dtype=torch.long),
                      torch.tensor([3])) is None
    assert graphs.run(*(torch.zeros(9, dtype=torch.long),) * 3, torch.zeros(9, 1, dtype=torch.long),
                      torch.ones(9, dtype=torch.long)) is None
    assert graphs.replayed == 2


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_decode_steps_through_the_captured_path_give_the_eager_tokens(arch, model_dirs, monkeypatch):
    """Five requests finishing at different lengths: the decode batch shrinks from 5 rows
    (past the largest bucket: eager) through 4, 3 (padded to 4) and 2, with greedy and
    seeded rows; the tokens equal those of the plain engine (no Triton, no captured
    steps), which gives the Triton kernels' tokens (test_triton_kernels.py) in a
    hundredth of the time the interpreter takes."""
    prompts = [[(3 * i + 5 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((9, 21, 5, 17, 12))]
    # Each count one more than the last but the two that end together: one decode step at
    # each of 5, 4 and 3 rows, then two at 2 (the Triton interpreter makes every step cost).
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (2, 3, 4, 6, 6)]
    params[3] = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_memory=1 << 22, block_size=16, max_model_len=128)
    with LLM(str(model_dirs[arch]), **kwargs) as eager:
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    monkeypatch.setenv("ASERVE_TRITON", "1")
    with LLM(str(model_dirs[arch]), **kwargs) as llm:
        runner = llm.engine.executor.worker.runner
        graphs = runner.capture_decode_graphs(max_size=4, max_blocks=128 // 16, backend=EagerReplay())
        assert graphs.sizes == [1, 2, 4]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        # 5 rows: eager; then 4, 4 (3 padded), 2, 2 (the last two requests): replayed.
        assert graphs.replayed == 4
        assert graphs.bucket(5) is None and graphs.bucket(3) == 4
    assert got == want


def test_a_sleep_drops_the_captured_steps_and_waking_captures_them_again(llama_dir, monkeypatch):
    monkeypatch.setenv("ASERVE_TRITON", "1")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(llama_dir), dtype="float32", kv_cache_memory=1 << 22, max_model_len=64) as llm:
        runner = llm.engine.executor.worker.runner
        runner.capture_decode_graphs(max_size=2, max_blocks=4, backend=EagerReplay())
        before = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
        llm.sleep(level=1)
        assert runner.graphs is None
        llm.wake_up()
        assert runner.graphs is not None and runner.graphs.replayed == 0
        assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == before
        assert runner.graphs.replayed > 0
