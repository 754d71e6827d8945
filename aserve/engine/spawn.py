"""Starting the engine side of a server: engine-core processes and the DP coordinator.

Used by whoever owns the engines: ``aserve run`` (the supervisor, a headless node) and
an ``AsyncLLM`` that starts its own (``aserve.frontend.core_client``). Every child is a
``spawn`` process that exits when its parent dies; each is handed the fitted config,
so none fits it again.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection

from aserve.engine.coordinator import CoordinatorConfig, run_coordinator
from aserve.engine.core_process import EngineCoreProcConfig, run_engine_core
from aserve.engine.fit import FittedConfig
from aserve.process.heartbeat import create_segment, segment_name
from aserve.process.instance import Instance
from aserve.wire.addresses import WireAddresses


def create_heartbeats(instance: Instance, world_size: int, ranks: range) -> str:
    """The instance's heartbeat segment with a slot for every engine core and worker of
    ``ranks`` (``world_size`` workers an engine; slots are indexed by global DP rank);
    removed by ``Instance.cleanup``."""
    name = segment_name(instance.id)
    create_segment(name, ranks.stop * (1 + world_size))
    return name


def spawn_engine_cores(
    fitted: FittedConfig,
    addresses: WireAddresses,
    ranks: range,
    *,
    instance: Instance,
    heartbeat_name: str | None,
    secret: bytes | None = None,
) -> dict[int, mp.process.BaseProcess]:
    """Start the engine cores of DP ranks ``ranks``, each connected to every API server
    (and to the coordinator when ``addresses`` has one). They send READY once loaded."""
    spawn = mp.get_context("spawn")
    procs = {}
    for rank in ranks:
        cfg = EngineCoreProcConfig(
            fitted=fitted, engine_index=rank, input_addresses=addresses.api_inputs,
            output_addresses=addresses.api_outputs, instance=instance,
            heartbeat_name=heartbeat_name, coordinator_input=addresses.coordinator_input,
            coordinator_stats=addresses.coordinator_stats, secret=secret,
        )
        proc = spawn.Process(target=run_engine_core, args=(cfg,), name=f"engine_core_{rank}")
        proc.start()
        procs[rank] = proc
    return procs


def spawn_coordinator(
    num_engines: int,
    addresses: WireAddresses,
    *,
    secret: bytes | None = None,
    report: multiprocessing.connection.Connection | None = None,
) -> mp.process.BaseProcess:
    assert addresses.coordinator_input and addresses.coordinator_stats and addresses.coordinator_publish
    cfg = CoordinatorConfig(num_engines, addresses.coordinator_input, addresses.coordinator_stats,
                            addresses.coordinator_publish, secret, report)
    proc = mp.get_context("spawn").Process(target=run_coordinator, args=(cfg,), name="coordinator")
    proc.start()
    return proc
