"""The API-server process: an ``AsyncLLM`` attached to the supervisor's engines, the
Starlette app, and Hypercorn on the listening socket the supervisor bound.

Shutdown (SIGTERM from the supervisor; SIGINT is ignored, see ``interrupt_on_termination``): ``/ready`` turns 503 and new requests get 503 at once;
requests in flight may finish until ``shutdown_timeout``; then Hypercorn stops, which
cancels what is left (aborting it in the engine), and the engine processes are stopped.
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

import anyio

from aserve.api.admission import AdmissionCounters
from aserve.api.app import ServerState, build_app
from aserve.api.limits import ServerLimits
from aserve.process.utils import exit_with_parent, ignore_termination, pin_to_cpus, set_process_title

logger = logging.getLogger("aserve.api_server")

DEAD_ENGINE_GRACE = 2.0  # seconds a server with a dead engine keeps answering 503


@dataclass(frozen=True)
class ApiServerConfig:
    served_model_names: tuple[str, ...]  # the first is reported; requests may give any
    api_key: str | None
    loop: str  # asyncio | uvloop | trio
    shutdown_timeout: float
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    index: int = 0
    log_level: str = "INFO"
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    api_key_probes: bool = False  # --api-key-probes: the key on /health, /ready, /metrics too
    allowed_origins: tuple[str, ...] = ()  # --allowed-origins: CORS (empty: off)
    limits: ServerLimits = ServerLimits()  # admission, deadlines, request bounds (aserve.api.limits)
    enable_dev_endpoints: bool = False  # --enable-dev-endpoints (aserve.api.dev)
    profiler_dir: str | None = None  # --profiler-dir
    # The server-wide admission counts (aserve.api.admission): the segment and how many
    # API servers have a slot in it; None without admission limits.
    admission_segment: str | None = None
    admission_slots: int = 1
    fitted: Any = None  # FittedConfig: the supervisor fitted it, once, for every process
    attach: Any = None  # EngineAttachment: the engine cores the supervisor started

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]


class _InFlight:
    """Counts HTTP requests in progress, so a drain can wait for zero, and names the API
    server that answered in an ``x-aserve-api-server`` header (several share the port)."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self.count = 0
        self.idle = anyio.Event()
        self._header = (b"x-aserve-api-server", str(index).encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self._header]
            await send(message)

        self.count += 1
        try:
            await self.app(scope, receive, send_with_header)
        finally:
            self.count -= 1
            if self.count == 0:
                self.idle.set()


async def serve(cfg: ApiServerConfig, sock: socket.socket) -> None:
    """Serve HTTP at once and the engines once they are ready.

    The HTTP server starts before the engines have sent READY, so probes get a truthful
    503 from ``/ready`` (and requests a 503) while they load, on one machine or while a
    headless node is still missing, rather than a connection nobody accepts.
    """
    from hypercorn.config import Config

    from aserve.frontend.async_llm import AsyncLLM

    engine = AsyncLLM.attached(cfg.fitted, cfg.attach)
    pin_to_cpus(engine.config.parallel.frontend_cpus(), all_threads=True)  # off the workers' cores
    counters = None
    if cfg.admission_segment is not None:
        counters = AdmissionCounters(index=cfg.index, num_slots=cfg.admission_slots, name=cfg.admission_segment)
    state = ServerState(engine=engine, served_model_name=cfg.served_model_name, api_key=cfg.api_key,
                        api_key_probes=cfg.api_key_probes, allowed_origins=cfg.allowed_origins,
                        served_model_names=cfg.served_model_names, tool_call_parser=cfg.tool_call_parser,
                        enable_auto_tool_choice=cfg.enable_auto_tool_choice, reasoning_parser=cfg.reasoning_parser,
                        limits=cfg.limits, admission_counters=counters,
                        enable_dev_endpoints=cfg.enable_dev_endpoints, profiler_dir=cfg.profiler_dir)
    app = _InFlight(build_app(state), cfg.index)
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.graceful_timeout = cfg.shutdown_timeout
    config.accesslog = None
    config.loglevel = cfg.log_level
    if cfg.ssl_certfile:
        config.certfile, config.keyfile = cfg.ssl_certfile, cfg.ssl_keyfile
        config.alpn_protocols = ["h2", "http/1.1"]
    stop_server = anyio.Event()
    engine_scope = anyio.CancelScope()

    async def drain_on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                break
        ignore_termination()  # one drain: a second signal must not cut it (or the cleanup) short
        logger.info("draining: waiting up to %.0f s for %d request(s)", cfg.shutdown_timeout, app.count)
        state.draining = True
        with anyio.move_on_after(cfg.shutdown_timeout):
            while app.count:
                app.idle = anyio.Event()
                await app.idle.wait()
        stop_server.set()

    async def run_engine(scope: anyio.CancelScope) -> None:
        # The engines live until the HTTP server has stopped (in-flight requests need
        # them while it drains); run_http cancels engine_scope then.
        with engine_scope:
            async with engine:
                # By default the whole server goes down with its engines, after a short
                # grace in which /health and every request answer 503, so probes and
                # clients see why rather than a refused connection.
                await engine.dead_event.wait()
                logger.error("an engine died; shutting down in %.0f s", DEAD_ENGINE_GRACE)
                await anyio.sleep(DEAD_ENGINE_GRACE)
                stop_server.set()
                await anyio.sleep_forever()
        scope.cancel()

    if cfg.loop == "trio":
        from hypercorn.trio import serve as hypercorn_serve
    else:
        from hypercorn.asyncio import serve as hypercorn_serve

    async def run_http() -> None:
        # In a task of its own: Hypercorn's asyncio server cancels tasks with plain
        # asyncio calls, which must not reach the task that owns the engine.
        await hypercorn_serve(app, config, shutdown_trigger=stop_server.wait)
        logger.info("the HTTP server stopped")
        engine_scope.cancel()

    # Everything imported and built so far lives as long as the process: keep the
    # collector from scanning it again. Unfrozen, a 200-request 7M run had two full
    # collections of 16-17 ms each in this process, a pause for every stream; frozen,
    # one of 2.3 ms (docs/performance.md). The engine core does the same.
    gc.collect()
    gc.freeze()
    async with anyio.create_task_group() as tg:
        tg.start_soon(drain_on_signal)
        tg.start_soon(run_engine, tg.cancel_scope)
        logger.info("serving on %s", sock.getsockname())
        tg.start_soon(run_http)
    if engine.failure is not None:
        raise SystemExit(1)


def run_api_server(cfg: ApiServerConfig, sock: socket.socket) -> None:
    """Process entry point (a ``spawn`` target); ``sock`` is already listening."""
    set_process_title(f"aserve::api_server_{cfg.index}")
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's: it drains us with SIGTERM
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    backend = "trio" if cfg.loop == "trio" else "asyncio"
    options = {"use_uvloop": True} if cfg.loop == "uvloop" else {}
    try:
        anyio.run(serve, cfg, sock, backend=backend, backend_options=options)
    except SystemExit as exc:
        sys.exit(exc.code)
    except KeyboardInterrupt:
        pass
    sys.exit(0)
