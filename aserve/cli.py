"""The ``aserve`` command.

    aserve generate "PROMPT" [--model PATH] [--max-tokens N] [--temperature T]

prints the completion of PROMPT. With no ``--model`` it uses the embedded default
model, built on first use into ``$ASERVE_CACHE_DIR`` (random weights: its text is
nonsense, which stderr says).

    aserve run [MODEL] [--tp N] [--dp N] ...       serve the OpenAI API (docs/serving.md)
    aserve bench serve|throughput|latency ...     benchmarks (docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from aserve.config import DEFAULT_PREFIX_CACHE_RESERVE, DTYPES, TP_COMMS
from aserve.devices import DEVICES
from aserve.errors import AserveError


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face-format model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="weight and activation dtype (default: the checkpoint's)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest sequence (prompt + output) to serve")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (default 4 GiB)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=DTYPES,
                        help="dtype the KV cache stores keys and values in (default: the model's). bfloat16 under a float32 "
                        "model halves the cache's memory and the bytes a decode step reads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's random generator")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="where the model runs (default auto: CUDA when a GPU is visible, else the CPU)")


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
    run.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="token budget of one step (default: 2048 x the TP size, as vLLM's CPU server)")
    run.add_argument("--worker-threads", type=int, default=None,
                     help="torch threads per worker (default: this node's cores / its workers). On a small "
                          "machine a tiny model serves faster with fewer, leaving cores to the API server")
    run.add_argument("--no-cpu-affinity", dest="cpu_affinity", action="store_false",
                     help="do not pin workers to cores of their own when their threads leave cores free "
                          "(the API servers and engine cores then share those; see docs/configuration.md)")
    run.add_argument("--device", default="auto", choices=DEVICES,
                     help="where the workers run (default auto: CUDA when a GPU is visible, else the CPU)")
    run.add_argument("--tp-comm", choices=TP_COMMS, default="auto",
                     help="how the workers of one engine exchange activations: shm (CPU shared memory), nccl (CUDA), "
                          "gloo (gloo's TCP for every collective, either device); default auto: shm on CPU, nccl on CUDA")
    run.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (default 4 GiB)")
    run.add_argument("--kv-cache-dtype", default="auto", choices=DTYPES,
                     help="dtype the KV cache stores keys and values in (default: the model's). bfloat16 under a float32 "
                     "model halves the cache's memory and the bytes a decode step reads")
    run.add_argument("--prefix-cache-reserve", type=float, default=DEFAULT_PREFIX_CACHE_RESERVE,
                     help="share of the KV pool that freed, cached prefixes may fill before blocks never used "
                          f"yet are touched (default {DEFAULT_PREFIX_CACHE_RESERVE}; 1.0: all of it)")
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
    _add_bench_parser(sub)
    return parser


def _add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks: a serving load generator, offline throughput and latency")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    serve = kinds.add_parser("serve", help="load any OpenAI-compatible server; vLLM's result fields")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    serve.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    serve.add_argument("--model", required=True, help="the model name the server serves")
    serve.add_argument("--tokenizer", default=None,
                       help="Hugging Face-format directory with tokenizer.json (default: --model, if a directory)")
    serve.add_argument("--dataset-name", choices=("random", "sharegpt", "prefix"), default="random")
    serve.add_argument("--dataset-path", default=None, help="ShareGPT-shaped JSON file (--dataset-name sharegpt)")
    serve.add_argument("--random-input-len", type=int, default=1024)
    serve.add_argument("--random-output-len", type=int, default=128)
    serve.add_argument("--random-range-ratio", type=float, default=0.0)
    serve.add_argument("--prefix-len", type=int, default=256, help="shared prefix tokens (--dataset-name prefix)")
    serve.add_argument("--sharegpt-output-len", type=int, default=None)
    serve.add_argument("--num-prompts", type=int, default=1000)
    serve.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    serve.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 is Poisson")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--ignore-eos", action="store_true")
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                       help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    serve.add_argument("--http2", action="store_true", help="HTTP/2 (h2c with prior knowledge, or ALPN over TLS)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--result-filename", default=None, help="write the result JSON here")
    serve.add_argument("--no-progress", action="store_true")
    serve.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                       help="the load generator's event loop (default auto: uvloop when installed, else asyncio; "
                            "uvloop takes ~10%% less CPU from the machine under test)")

    for name, text in (("throughput", "offline throughput through LLM"), ("latency", "one batch, time per step")):
        p = kinds.add_parser(name, help=text)
        _add_engine_args(p)
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        if name == "throughput":
            p.add_argument("--num-prompts", type=int, default=200)
        else:
            p.add_argument("--batch-size", type=int, default=8)
            p.add_argument("--num-iters-warmup", type=int, default=1)
            p.add_argument("--num-iters", type=int, default=3)
        p.add_argument("--output-json", default=None, help="write the result JSON here")


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
        kv_cache_memory=args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY, kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
    )
    output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    if args.bench_command == "serve":
        return _bench_serve(args)
    from aserve import LLM
    from aserve.bench import offline
    from aserve.config import DEFAULT_CPU_KV_CACHE_MEMORY

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
              kv_cache_memory=args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY, kv_cache_dtype=args.kv_cache_dtype,
              device=args.device)
    if args.bench_command == "throughput":
        result = offline.throughput(llm, num_prompts=args.num_prompts, input_len=args.input_len,
                                    output_len=args.output_len, seed=args.seed)
        print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} "
              f"total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    else:
        result = offline.latency(llm, batch_size=args.batch_size, input_len=args.input_len,
                                 output_len=args.output_len, num_iters_warmup=args.num_iters_warmup,
                                 num_iters=args.num_iters, seed=args.seed)
        print(f"Avg latency: {result['avg_latency']:.4f} s ({result['avg_step_ms']:.2f} ms per step)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


def _resolve_loop(loop: str) -> str:
    """``--loop``: ``auto`` is uvloop when it is installed, else asyncio."""
    if loop == "auto":
        import importlib.util

        return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return loop


def _bench_serve(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import anyio

    from aserve.bench import datasets
    from aserve.bench.serve import LoadConfig, format_summary, parse_goodput, run_load, summarize
    from aserve.errors import ConfigError
    from aserve.launch.process_utils import ProgressBar
    from aserve.tokenizer import Tokenizer

    tokenizer_dir = args.tokenizer or args.model
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise ConfigError(f"no tokenizer.json in {tokenizer_dir!r}: pass --tokenizer DIR", param="tokenizer")
    tokenizer = Tokenizer(Path(tokenizer_dir))
    try:
        goodput = parse_goodput(args.goodput)
    except ValueError as exc:
        raise ConfigError(str(exc), param="goodput") from None
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ConfigError("--dataset-name sharegpt needs --dataset-path", param="dataset_path")
        samples = datasets.sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, args.seed,
                                             args.sharegpt_output_len)
    else:
        samples = datasets.random_requests(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
            args.seed, prefix_len=args.prefix_len if args.dataset_name == "prefix" else 0)
    cfg = LoadConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model, request_rate=args.request_rate,
                     burstiness=args.burstiness, max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
                     temperature=args.temperature, http2=args.http2, seed=args.seed, goodput=goodput,
                     api_key=args.api_key)
    progress = None if args.no_progress else ProgressBar("requests")
    options = {"use_uvloop": True} if _resolve_loop(args.loop) == "uvloop" else {}
    results, duration = anyio.run(run_load, cfg, samples, tokenizer, progress, backend_options=options)
    result = summarize(cfg, results, duration)
    print(format_summary(result))
    if args.result_filename:
        Path(args.result_filename).write_text(json.dumps(result))
    errors = [e for e in result["errors"] if e]
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    return 0 if result["completed"] else 1


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
    from aserve.config import DEFAULT_CPU_KV_CACHE_MEMORY, SERVER_MAX_NUM_BATCHED_TOKENS_PER_RANK
    from aserve.frontend.engine_args import resolve_model_path
    from aserve.launch.supervisor import model_name, run_headless, run_server

    dp = _data_parallel(args)
    if args.model is None:
        print("aserve: serving the embedded default model (random weights: its output is nonsense)", file=sys.stderr)
    model = resolve_model_path(args.model)
    engine_kwargs = dict(
        model=model, tensor_parallel_size=args.tp, data_parallel_size=args.dp, dtype=args.dtype, max_model_len=args.max_model_len,
        seed=args.seed, kv_cache_memory=args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY,
        kv_cache_dtype=args.kv_cache_dtype, device=args.device,
        max_num_seqs=args.max_num_seqs, prefix_cache_reserve=args.prefix_cache_reserve,
        max_num_batched_tokens=args.max_num_batched_tokens or SERVER_MAX_NUM_BATCHED_TOKENS_PER_RANK * args.tp,
        worker_threads=args.worker_threads, cpu_affinity=args.cpu_affinity, tp_comm=args.tp_comm,
        heartbeat_timeout=args.heartbeat_timeout,
    )
    served_model_name = args.served_model_name or model_name(args.model)
    if dp.headless:
        return run_headless(engine_kwargs, served_model_name, dp, args.log_level)
    loop = _resolve_loop(args.loop)
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
        if args.command == "bench":
            return _bench(args)
    except AserveError as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
