"""ParallelConfig: data-parallel sizes and the torch threads each worker gets."""

from __future__ import annotations

import pytest

from aserve.config import ParallelConfig
from aserve.errors import ConfigError


def test_threads_share_the_node_between_its_workers():
    assert ParallelConfig().threads_per_worker(2) == 2
    assert ParallelConfig(tensor_parallel_size=2).threads_per_worker(2) == 1
    tp2dp2 = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
    assert tp2dp2.local_world_size == 4 and tp2dp2.threads_per_worker(2) == 1 and tp2dp2.threads_per_worker(16) == 4
    remote_half = ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, data_parallel_size_local=2)
    assert remote_half.local_engines == 2 and remote_half.threads_per_worker(16) == 4
    assert ParallelConfig(worker_threads=1).threads_per_worker(2) == 1  # an explicit count wins


@pytest.mark.parametrize("kwargs, param", [
    ({"data_parallel_size": 0}, "data_parallel_size"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "data_parallel_size_local"),
    ({"worker_threads": 0}, "worker_threads"),
    ({"tp_comm": "mpi"}, "tp_comm"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
    ({"pipeline_parallel_size": 2, "pp_layer_partition": (1, 1, 1)}, "pp_layer_partition"),
    ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, "node_rank"),
    ({"nnodes": 2, "tensor_parallel_size": 3}, "nnodes"),  # 3 workers do not split over 2 nodes
    ({"nnodes": 2, "tensor_parallel_size": 2, "data_parallel_size": 2}, "nnodes"),
    ({"master_port": 65535}, "master_port"),
])
def test_bad_values_name_their_field(kwargs, param):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kwargs)
    assert info.value.param == param


def test_an_engine_across_nodes_splits_its_ranks_in_order():
    """Worker r of an engine is stage r // tp, TP rank r % tp; node k runs ranks
    k * W / n onwards, and the threads of a node are shared by its own workers."""
    head = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2)
    node = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=1)
    assert (head.world_size, head.workers_per_node, head.output_rank) == (4, 2, 2)
    assert head.local_ranks == range(0, 2) and node.local_ranks == range(2, 4)
    assert node.local_world_size == 2 and node.threads_per_worker(2) == 1
    assert node.local_worker_index(0, 3) == 1  # its second local worker: its cores, its GPU


def test_shared_memory_collectives_stay_on_one_machine():
    from aserve.devices import resolve_tp_comm

    assert resolve_tp_comm("auto", "cpu", tp_spans_nodes=True) == "gloo"
    assert resolve_tp_comm("auto", "cpu", tp_spans_nodes=False) == "shm"
    with pytest.raises(ConfigError) as info:
        resolve_tp_comm("shm", "cpu", tp_spans_nodes=True)
    assert info.value.param == "tp_comm"


@pytest.mark.parametrize("owner", ["LLM", "AsyncLLM"])
def test_the_library_refuses_an_engine_across_nodes(llama_dir, owner):
    import aserve

    with pytest.raises(ConfigError) as info:
        getattr(aserve, owner)(str(llama_dir), nnodes=2, tensor_parallel_size=2)
    assert info.value.param == "nnodes"


def test_step_budget_defaults_scale_with_tensor_parallelism(llama_dir):
    from aserve.engine.args import EngineArgs

    assert EngineArgs(str(llama_dir)).create_engine_config().scheduler.max_num_batched_tokens == 4096
    assert EngineArgs(str(llama_dir), tensor_parallel_size=2).create_engine_config().scheduler.max_num_batched_tokens == 8192
    assert EngineArgs(str(llama_dir), max_num_batched_tokens=100).create_engine_config().scheduler.max_num_batched_tokens == 100


def test_a_servers_step_budget_depends_on_its_device(llama_dir):
    from aserve.engine.args import EngineArgs, default_step_budget

    def budget(**kwargs):
        return EngineArgs(str(llama_dir), device="cpu", **kwargs).create_engine_config("server").scheduler.max_num_batched_tokens

    assert budget() == 1024
    assert budget(tensor_parallel_size=2) == 2048
    assert budget(max_num_batched_tokens=3000) == 3000
    assert default_step_budget("server", "cuda", 1) == 2048
    assert default_step_budget("server", "cuda", 4) == 8192
    assert default_step_budget("library", "cuda", 1) == default_step_budget("library", "cpu", 1) == 4096


def test_cpu_plan_pins_workers_only_when_cores_are_left_over():
    two = (0, 1)
    # The 7M benchmark's setup: one worker thread on two cores.
    assert ParallelConfig(worker_threads=1, node_cpus=two).cpu_plan() == ((0,), [(1,)])
    # Workers that use every core (the default) or more: nothing is pinned.
    assert ParallelConfig(node_cpus=two).cpu_plan() is None
    assert ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, node_cpus=two).cpu_plan() is None
    # Cores of their own per worker, from the end; the front end keeps the rest.
    cpus = tuple(range(4, 12))
    plan = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, worker_threads=1, node_cpus=cpus).cpu_plan()
    assert plan == ((4, 5, 6, 7), [(11,), (10,), (9,), (8,)])
    assert ParallelConfig(worker_threads=3, node_cpus=cpus).cpu_plan() == ((4, 5, 6, 7, 8), [(9, 10, 11)])
    # Switched off, or the cores unknown.
    assert ParallelConfig(worker_threads=1, node_cpus=two, cpu_affinity=False).cpu_plan() is None
    assert ParallelConfig(worker_threads=1).cpu_plan() is None
    # What each process pins itself to: engine k's rank r is worker k * tp + r.
    tp2dp2 = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, worker_threads=1, node_cpus=cpus)
    assert tp2dp2.frontend_cpus() == (4, 5, 6, 7)
    assert [tp2dp2.worker_cpus(dp, r) for dp in (0, 1) for r in (0, 1)] == [(11,), (10,), (9,), (8,)]
    assert ParallelConfig(node_cpus=two).frontend_cpus() is None
    assert ParallelConfig(node_cpus=two).worker_cpus(0, 0) is None
    # threads_per_worker counts the node's cores, not the caller's (a pinned process's) share.
    assert ParallelConfig(node_cpus=cpus).threads_per_worker(1) == 8
