"""The ``aserve`` command.

    aserve generate "PROMPT" [--model PATH] [--max-tokens N] [--temperature T]

prints the completion of PROMPT. With no ``--model`` it uses the embedded default
model, built on first use into ``$ASERVE_CACHE_DIR`` (random weights: its text is
nonsense, which stderr says).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from aserve.config import DTYPES
from aserve.errors import AserveError


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face-format model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="weight and activation dtype (default: the checkpoint's)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest sequence (prompt + output) to serve")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (default 4 GiB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's random generator")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aserve", description="LLM inference with the OpenAI API's shapes.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt", help="the text to complete")
    _add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")

    run = sub.add_parser("run", help="serve a model over the OpenAI HTTP API",
                         description="Serve MODEL (a Hugging Face-format directory; the embedded default model when "
                                     "omitted) over the OpenAI HTTP API.")
    run.add_argument("model", nargs="?", default=None, help="model directory (default: the embedded model)")
    run.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="tensor-parallel ranks")
    run.add_argument("--dp", "--data-parallel-size", dest="dp", type=int, default=1,
                     help="data-parallel engines, each with its own TP group (default 1)")
    run.add_argument("--api-server-count", type=int, default=None,
                     help="API server processes sharing the port (default: the DP size)")
    run.add_argument("--dp-size-local", "--data-parallel-size-local", dest="dp_size_local", type=int, default=None,
                     help="engines on this node (default: all); the rest run on headless nodes")
    run.add_argument("--dp-start-rank", "--data-parallel-start-rank", dest="dp_start_rank", type=int, default=0,
                     help="DP rank of this node's first engine (headless nodes)")
    run.add_argument("--dp-address", "--data-parallel-address", dest="dp_address", default="127.0.0.1",
                     help="the front-end node's address for the TCP wires between nodes (default 127.0.0.1)")
    run.add_argument("--dp-rpc-port", "--data-parallel-rpc-port", dest="dp_rpc_port", type=int, default=None,
                     help="the front-end node's handshake port for headless nodes (default 13345)")
    run.add_argument("--headless", action="store_true",
                     help="run engines and workers only, serving the front-end node at --dp-address")
    run.add_argument("--dp-secret", default=None,
                     help="shared secret of the TCP wires between nodes (or --dp-secret-file, or ASERVE_DP_SECRET)")
    run.add_argument("--dp-secret-file", default=None, help="file holding the shared secret")
    run.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    run.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    run.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    run.add_argument("--served-model-name", default=None, help="model name in the API (default: the directory name)")
    run.add_argument("--dtype", default="auto", choices=DTYPES, help="weight and activation dtype")
    run.add_argument("--max-model-len", type=int, default=None, help="longest sequence (prompt + output)")
    run.add_argument("--max-num-seqs", type=int, default=256, help="requests in one step")
    run.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
    run.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (default 4 GiB)")
    run.add_argument("--seed", type=int, default=0, help="seed of the engine's random generator")
    run.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may take to finish after SIGTERM (default 30)")
    run.add_argument("--heartbeat-timeout", type=float, default=30.0,
                     help="seconds without a heartbeat after which an engine process counts as dead (default 30)")
    run.add_argument("--ssl-certfile", default=None, help="TLS certificate (enables HTTPS with HTTP/2 by ALPN)")
    run.add_argument("--ssl-keyfile", default=None, help="TLS private key")
    run.add_argument("--loop", choices=("auto", "asyncio", "uvloop", "trio"), default="auto",
                     help="event loop (default auto: uvloop when installed, else asyncio)")
    run.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def _generate(args: argparse.Namespace) -> int:
    from aserve import LLM, SamplingParams
    from aserve.config import DEFAULT_CPU_KV_CACHE_MEMORY

    if args.model is None:
        print("aserve: using the embedded default model (random weights: its output is nonsense)", file=sys.stderr)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed,
    )
    llm = LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
        kv_cache_memory=args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY,
    )
    output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0


def _data_parallel(args: argparse.Namespace) -> Any:
    """The DataParallelLaunch of ``aserve run``'s DP flags; ConfigError when they clash."""
    from aserve.envs import read_env
    from aserve.errors import ConfigError
    from aserve.launch.supervisor import DEFAULT_DP_RPC_PORT, DataParallelLaunch
    from aserve.wire.auth import read_secret

    local = args.dp if args.dp_size_local is None else args.dp_size_local
    if args.dp < 1 or not 1 <= local <= args.dp:
        raise ConfigError("need --dp >= 1 and 1 <= --dp-size-local <= --dp", param="dp_size_local")
    if args.api_server_count is not None and args.api_server_count < 1:
        raise ConfigError("--api-server-count must be >= 1", param="api_server_count")
    if args.headless:
        if args.dp_size_local is None or args.dp_start_rank < 1 or args.dp_start_rank + local > args.dp:
            raise ConfigError("--headless needs --dp-size-local and a --dp-start-rank in [1, dp - dp_size_local]",
                              param="dp_start_rank")
    elif args.dp_start_rank != 0:
        raise ConfigError("--dp-start-rank is for --headless nodes; the front end has ranks 0..dp_size_local-1",
                          param="dp_start_rank")
    secret_flag = args.dp_secret if args.dp_secret is not None or args.dp_secret_file else read_env().dp_secret
    secret = read_secret(secret_flag, args.dp_secret_file)
    dp = DataParallelLaunch(size=args.dp, size_local=local, start_rank=args.dp_start_rank,
                            api_server_count=args.api_server_count, address=args.dp_address,
                            rpc_port=args.dp_rpc_port or DEFAULT_DP_RPC_PORT, secret=secret, headless=args.headless)
    if dp.multi_node and secret is None:
        raise ConfigError("a server on several nodes needs a shared secret for its TCP wires: --dp-secret, "
                          "--dp-secret-file or ASERVE_DP_SECRET", param="dp_secret")
    return dp


def _run(args: argparse.Namespace) -> int:
    from aserve.api.server import ApiServerConfig
    from aserve.config import DEFAULT_CPU_KV_CACHE_MEMORY
    from aserve.frontend.engine_args import resolve_model_path
    from aserve.launch.supervisor import model_name, run_headless, run_server

    dp = _data_parallel(args)
    if args.model is None:
        print("aserve: serving the embedded default model (random weights: its output is nonsense)", file=sys.stderr)
    model = resolve_model_path(args.model)
    engine_kwargs = dict(
        model=model, tensor_parallel_size=args.tp, data_parallel_size=args.dp, dtype=args.dtype, max_model_len=args.max_model_len,
        seed=args.seed, kv_cache_memory=args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        heartbeat_timeout=args.heartbeat_timeout,
    )
    served_model_name = args.served_model_name or model_name(args.model)
    if dp.headless:
        return run_headless(engine_kwargs, served_model_name, dp, args.log_level)
    loop = args.loop
    if loop == "auto":
        import importlib.util

        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    cfg = ApiServerConfig(
        engine_kwargs=engine_kwargs, served_model_name=served_model_name,
        api_key=args.api_key, loop=loop, shutdown_timeout=args.shutdown_timeout,
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, log_level=args.log_level,
    )
    return run_server(cfg, args.host, args.port, dp)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "run":
            return _run(args)
    except AserveError as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
