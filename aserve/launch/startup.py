"""What ``aserve run`` checks before any process starts, and the listening socket.

Everything that can be known from the command line and the model directory is checked
here, in the command's own process: the DP flags, the engine options (``EngineArgs``),
the model (``fit_config``: config.json, the checkpoint's headers, the lengths, the KV
budget), the tokenizer, the TLS files, and the port (bound here, then handed to every
API server). A mistake is an ``AserveError`` naming the flag or the file, which the CLI
prints as one line; nothing has been started, so nothing is left behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import socket
import ssl
from pathlib import Path

from aserve.api.limits import ServerLimits
from aserve.api.server import ApiServerConfig
from aserve.engine.args import EngineArgs, resolve_model_path
from aserve.engine.fit import FittedConfig, fit_config
from aserve.envs import read_env
from aserve.errors import ConfigError
from aserve.frontend.tokenizer import Tokenizer
from aserve.launch.common import DEFAULT_DP_RPC_PORT, DataParallelLaunch
from aserve.wire.auth import read_secret


def model_name(model: str | None) -> str:
    return Path(model).name if model else "aserve-default"


def served_model_names(model: str | None, names: list[str] | None) -> tuple[str, ...]:
    """``--served-model-name``'s names, or else the model directory's name and the model
    argument as typed (vLLM serves a path under itself: ``vllm bench serve --model PATH``
    asks for it so). The first is the one the server reports."""
    if names:
        return tuple(dict.fromkeys(names))
    return tuple(dict.fromkeys([model_name(model), *([model] if model else [])]))


def check_tool_flags(args: argparse.Namespace) -> None:
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)",
                          param="tool_call_parser")


def _secret(args: argparse.Namespace) -> bytes | None:
    secret_flag = args.dp_secret if args.dp_secret is not None or args.dp_secret_file else read_env().dp_secret
    return read_secret(secret_flag, args.dp_secret_file)


def prepare_worker_node(engine_args: EngineArgs, args: argparse.Namespace) -> tuple[FittedConfig, bytes]:
    """A worker-only node of an engine across machines (``--nnodes N --node-rank K
    --headless``, K > 0): its fitted config and the wires' secret; ConfigError when the
    flags clash."""
    if not args.headless:
        raise ConfigError("a node with --node-rank > 0 runs only workers: add --headless", param="node_rank")
    secret = _secret(args)
    if secret is None:
        raise ConfigError("an engine on several nodes needs a shared secret for its TCP wires: --dp-secret, "
                          "--dp-secret-file or ASERVE_DP_SECRET", param="dp_secret")
    config = engine_args.create_engine_config("server", model=resolve_model_path(engine_args.model))
    return fit_config(config), secret


def data_parallel(args: argparse.Namespace) -> DataParallelLaunch:
    """The DataParallelLaunch of ``aserve run``'s DP flags; ConfigError when they clash."""
    size = args.data_parallel_size
    local = size if args.dp_size_local is None else args.dp_size_local
    if size < 1 or not 1 <= local <= size:
        raise ConfigError(f"need 1 <= --dp-size-local <= --dp, got {local} and {size}", param="dp_size_local")
    if args.api_server_count is not None and args.api_server_count < 1:
        raise ConfigError("--api-server-count must be >= 1", param="api_server_count")
    nnodes = getattr(args, "nnodes", 1)
    if args.headless and nnodes > 1:
        raise ConfigError("--headless with --nnodes is for the nodes after the head (--node-rank > 0)",
                          param="node_rank")
    if args.headless:
        if args.dp_size_local is None or args.dp_start_rank < 1 or args.dp_start_rank + local > size:
            raise ConfigError("--headless needs --dp-size-local and a --dp-start-rank in [1, dp - dp_size_local]",
                              param="dp_start_rank")
    elif args.dp_start_rank != 0:
        raise ConfigError("--dp-start-rank is for --headless nodes; the front end has ranks 0..dp_size_local-1",
                          param="dp_start_rank")
    secret = _secret(args)
    dp = DataParallelLaunch(size=size, size_local=local, start_rank=args.dp_start_rank,
                            api_server_count=args.api_server_count, address=args.dp_address,
                            rpc_port=args.dp_rpc_port or DEFAULT_DP_RPC_PORT, secret=secret, headless=args.headless)
    if (dp.multi_node or nnodes > 1) and secret is None:
        raise ConfigError("a server on several nodes needs a shared secret for its TCP wires: --dp-secret, "
                          "--dp-secret-file or ASERVE_DP_SECRET", param="dp_secret")
    return dp


def fit_for_node(engine_args: EngineArgs, dp: DataParallelLaunch) -> FittedConfig:
    """The engine config of this node's engines, fitted to the model (once, here)."""
    if engine_args.model is None:
        import sys

        from aserve.default_model import NOTE

        print(NOTE, file=sys.stderr)
    config = engine_args.create_engine_config("server", data_parallel_size_local=dp.local,
                                              model=resolve_model_path(engine_args.model))
    return fit_config(config)


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    if certfile is None and keyfile is None:
        return
    if certfile is None:
        raise ConfigError("--ssl-keyfile needs --ssl-certfile", param="ssl_certfile")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS certificate {certfile!r} (key {keyfile!r}): {exc}",
                          param="ssl_certfile") from None


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound and listening, that every API server will share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is in use: stop what listens there, or pick another --port "
                              "(0 picks a free one)", param="port") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise ConfigError(f"no permission to listen on port {port}: use a port above 1023", param="port") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; check --host", param="host") from None
    except (socket.gaierror, OverflowError) as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}; check --host and --port", param="host") from None
    return sock


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """``aserve run``'s admission, deadline and request-bound flags; ConfigError naming
    the flag for a value out of range."""
    return ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})


def prepare_server(engine_args: EngineArgs, args: argparse.Namespace, *,
                   loop: str) -> tuple[ApiServerConfig, socket.socket, DataParallelLaunch]:
    """A front-end node's config, its bound socket and its DP launch, every check done."""
    dp = data_parallel(args)
    fitted = fit_for_node(engine_args, dp)
    Tokenizer(Path(fitted.config.model.model))  # the API servers' tokenizer: a missing or bad one fails now
    check_tls(args.ssl_certfile, args.ssl_keyfile)
    check_tool_flags(args)
    cfg = ApiServerConfig(
        served_model_names=served_model_names(engine_args.model, args.served_model_name), api_key=args.api_key,
        api_key_probes=args.api_key_probes, allowed_origins=tuple(args.allowed_origins or ()),
        loop=loop, shutdown_timeout=args.shutdown_timeout, ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile, log_level=args.log_level, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser,
        limits=server_limits(args), enable_dev_endpoints=args.enable_dev_endpoints,
        profiler_dir=None if args.profiler_dir is None else str(Path(args.profiler_dir).resolve()), fitted=fitted,
    )
    return cfg, bind_listening_socket(args.host, args.port), dp


def prepare_headless(engine_args: EngineArgs,
                     args: argparse.Namespace) -> tuple[FittedConfig, str, DataParallelLaunch]:
    """A headless node's fitted config, served model name and DP launch."""
    dp = data_parallel(args)
    return fit_for_node(engine_args, dp), served_model_names(engine_args.model, args.served_model_name)[0], dp
