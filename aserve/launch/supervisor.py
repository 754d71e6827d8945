"""``aserve run``: the supervisor owns the process tree, the listening socket and signals.

It starts the engine core (which starts its workers), binds the HTTP socket once and
hands it to the API-server process, which connects to the engine over the instance's
IPC addresses. It watches every child: one that exits on its own brings the tree down.
SIGTERM/SIGINT drain the API server (see ``aserve.api.server``), then stop the engine.
Children exit when their parent dies; the supervisor removes the instance's shared
memory and IPC files on every exit path it survives (and an orphaned engine core does
it when the supervisor does not).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import signal
import socket
import tempfile
import uuid
from pathlib import Path

from aserve.api.server import DEAD_ENGINE_GRACE, ApiServerConfig, run_api_server
from aserve.engine.core_process import EngineCoreProcConfig, run_engine_core
from aserve.frontend.async_llm import EngineAttachment, engine_addresses
from aserve.frontend.engine_args import make_engine_config
from aserve.launch.heartbeat import create_segment, segment_name
from aserve.launch.process_utils import cleanup_instance, ignore_termination, set_process_title, skip_resource_tracker

logger = logging.getLogger("aserve.supervisor")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def run_server(cfg: ApiServerConfig, host: str, port: int) -> int:
    """Start the tree, run until it stops, return the exit status.

    Any child that exits on its own takes the whole tree down (SIGTERM to the others,
    SIGKILL after a grace period) and the status is 1; SIGTERM/SIGINT drain the API
    server first, then stop the engine, and the status is 0.
    """
    set_process_title("aserve::supervisor")
    skip_resource_tracker()
    instance_id = f"aserve_{uuid.uuid4().hex[:12]}"
    instance_dir = tempfile.mkdtemp(prefix=f"{instance_id}-")
    try:
        return _run_tree(cfg, host, port, instance_id, instance_dir)
    finally:
        cleanup_instance(instance_id, instance_dir)


def _stop(proc: mp.process.BaseProcess, grace: float) -> None:
    if proc.exitcode is None:
        proc.terminate()
        proc.join(grace)
    if proc.exitcode is None:
        logger.error("%s did not stop in %.0f s; killing it", proc.name, grace)
        proc.kill()
        proc.join()


def _run_tree(cfg: ApiServerConfig, host: str, port: int, instance_id: str, instance_dir: str) -> int:
    sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    spawn = mp.get_context("spawn")
    input_address, output_address = engine_addresses(instance_dir)
    engine_config = make_engine_config(**{k: v for k, v in cfg.engine_kwargs.items() if k != "heartbeat_timeout"})
    tp = engine_config.parallel.tensor_parallel_size
    create_segment(segment_name(instance_id), 1 + tp)  # removed by cleanup_instance
    engine_cfg = EngineCoreProcConfig(
        engine=engine_config, engine_index=0, input_addresses=(input_address,),
        output_addresses=(output_address,), instance_dir=instance_dir, instance_id=instance_id,
        heartbeat_name=segment_name(instance_id),
    )
    engine = spawn.Process(target=run_engine_core, args=(engine_cfg,), name="engine_core_0")
    engine.start()
    api_cfg = dataclasses.replace(cfg, attach=EngineAttachment(instance_id, instance_dir, engine.pid))
    api = spawn.Process(target=run_api_server, args=(api_cfg, sock), name="api_server_0")
    api.start()
    sock.close()  # the API server holds its own copy
    scheme = "https" if cfg.ssl_certfile else "http"
    print(f"aserve: serving {cfg.served_model_name} at {scheme}://{host}:{bound_port}/v1", flush=True)
    print("aserve: process tree: aserve::supervisor -> [aserve::api_server_0, aserve::engine_core_0 -> "
          f"{', '.join(f'aserve::worker_tp{r}' for r in range(tp))}]", flush=True)

    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping and api.exitcode is None:
            api.terminate()  # at once: /ready must turn 503 now, not at the next loop turn
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    children = [api, engine]
    while not stopping and all(p.exitcode is None for p in children):
        mp_connection.wait([p.sentinel for p in children], timeout=1.0)
    ignore_termination()
    if stopping:
        # Drain: the API server finishes (or aborts) its requests, then the engine stops.
        _stop(api, cfg.shutdown_timeout + 60)
        _stop(engine, 60)
        return 0
    died = [p for p in children if p.exitcode is not None]
    logger.error("%s exited (code %s); stopping the server", died[0].name, died[0].exitcode)
    if api.exitcode is None:
        # The API server saw it too: let it answer 503 for its grace period and exit.
        api.join(DEAD_ENGINE_GRACE + 10)
    for proc in children:
        _stop(proc, 30)
    return 1


def model_name(model: str | None) -> str:
    return Path(model).name if model else "aserve-default"
