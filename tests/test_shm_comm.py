"""The shared-memory collectives between real processes: sums bit-identical on every
rank and equal to float32 sums in rank order, chunking past the slot size, gathers in
rank order, no file left in /dev/shm, and a dead peer raising instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from aserve.distributed.shm_comm import ShmCommunicator, TPPeerLostError, load_collectives

SLOT_BYTES = 4096  # small, so the larger cases take several generations
# (shape, dtype): the all-reduce cases; 3000 float32 elements are 3 slots.
REDUCE_CASES = [((7,), "float32"), ((3, 1000), "float32"), ((5, 333), "bfloat16"), ((4, 2100), "bfloat16"),
                ((9, 129), "float16")]
GATHER_CASES = [((3, 5), "float32"), ((40, 100), "bfloat16")]  # 40 rows of 200 bytes: 2 slots


def _input(rank: int, case: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * case + rank)
    return (torch.randn(shape, generator=gen) * 3).to(getattr(torch, dtype))


def _rank_main(name: str, init_file: str, rank: int, size: int, out_dir: str, cache_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    comm = ShmCommunicator(load_collectives(Path(cache_dir)), name, rank, size, dist.barrier, slot_bytes=SLOT_BYTES)
    dist.destroy_process_group()
    for case, (shape, dtype) in enumerate(REDUCE_CASES):
        x = _input(rank, case, shape, dtype)
        assert comm.all_reduce(x) is x
        np.save(f"{out_dir}/reduce{case}_rank{rank}.npy", x.float().numpy())
    # A transposed (non-contiguous) tensor is summed in place too.
    x = _input(rank, 99, (6, 50), "float32").t()
    comm.all_reduce(x)
    np.save(f"{out_dir}/strided_rank{rank}.npy", x.numpy())
    for case, (shape, dtype) in enumerate(GATHER_CASES):
        out = comm.all_gather_last_dim(_input(rank, 50 + case, shape, dtype))
        np.save(f"{out_dir}/gather{case}_rank{rank}.npy", out.float().numpy())
    comm.close()


def _run_ranks(size: int, tmp_path: Path, target=_rank_main, extra: tuple = ()) -> tuple[str, list[mp.Process]]:
    name = f"aserve-test-{uuid.uuid4().hex[:12]}"
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=target, args=(name, str(tmp_path / "init"), rank, size, str(tmp_path),
                                                 str(tmp_path / "kernels"), *extra)) for rank in range(size)]
    for proc in procs:
        proc.start()
    return name, procs


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("kernels")
    assert load_collectives(cache) is not None, "gcc must build cpu_shm_collectives.c"
    return cache


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_match_rank_order_float32_sums_on_every_rank(size, tmp_path, built):
    name, procs = _run_ranks(size, tmp_path)
    for proc in procs:
        proc.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * size
    assert not Path(f"/dev/shm/{name}").exists()
    for case, (shape, dtype) in enumerate(REDUCE_CASES):
        parts = [_input(rank, case, shape, dtype).float() for rank in range(size)]
        expected = parts[0]
        for part in parts[1:]:
            expected = expected + part
        expected = expected.to(getattr(torch, dtype)).float().numpy()
        for rank in range(size):
            got = np.load(tmp_path / f"reduce{case}_rank{rank}.npy")
            assert got.tobytes() == expected.tobytes(), (case, rank)
    strided = sum(_input(rank, 99, (6, 50), "float32").t() for rank in range(size))
    for rank in range(size):
        np.testing.assert_allclose(np.load(tmp_path / f"strided_rank{rank}.npy"), strided.numpy(), rtol=1e-6)
    for case, (shape, dtype) in enumerate(GATHER_CASES):
        expected = torch.cat([_input(rank, 50 + case, shape, dtype) for rank in range(size)], dim=-1).float().numpy()
        for rank in range(size):
            assert np.array_equal(np.load(tmp_path / f"gather{case}_rank{rank}.npy"), expected)


def _lonely_rank(name: str, init_file: str, rank: int, size: int, out_dir: str, cache_dir: str) -> None:
    """Rank 1 sets up and exits; rank 0 then all-reduces alone and records what happened."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    comm = ShmCommunicator(load_collectives(Path(cache_dir)), name, rank, size, dist.barrier, slot_bytes=SLOT_BYTES)
    dist.destroy_process_group()
    if rank == 1:
        os._exit(0)
    try:
        comm.all_reduce(torch.ones(10))
        outcome = "returned"
    except TPPeerLostError as exc:
        outcome = f"lost: {exc}"
    Path(out_dir, "outcome").write_text(outcome)


def test_a_dead_peer_raises_instead_of_hanging(tmp_path, built):
    # Rank 1 stays a zombie (this process does not reap it until join): that counts as
    # dead, as for a worker whose engine core has not yet noticed.
    name, procs = _run_ranks(2, tmp_path, target=_lonely_rank)
    procs[0].join(timeout=60)
    procs[1].join(timeout=5)
    assert procs[0].exitcode == 0
    outcome = (tmp_path / "outcome").read_text()
    assert outcome.startswith("lost: tensor-parallel peer rank 1 (pid ")
    assert not Path(f"/dev/shm/{name}").exists()


def test_rejects_a_group_of_one_and_odd_slot_sizes(built):
    lib = load_collectives(built)
    with pytest.raises(ValueError, match="2 or more ranks"):
        ShmCommunicator(lib, "unused", 0, 1, lambda: None)
    with pytest.raises(ValueError, match="multiple of 64"):
        ShmCommunicator(lib, "unused", 0, 2, lambda: None, slot_bytes=100)
