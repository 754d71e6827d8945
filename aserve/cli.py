"""The ``aserve`` command.

    aserve run [MODEL] [--tp N] [--dp N] ...       serve the OpenAI API (docs/serving.md)
    aserve generate "PROMPT" [--model PATH] ...    print the completion of PROMPT
    aserve bench serve|throughput|latency ...     benchmarks (docs/benchmarks.md)

The engine flags of ``run``, ``generate`` and ``bench throughput|latency`` are generated
from ``EngineArgs`` (``aserve.engine.args``), so each has the same name, default and
check as the keyword of ``LLM`` and ``AsyncLLM``. With no model, the default model in
the package (``aserve.default_model``: 4.3M parameters trained on Python's own
documentation) answers, and stderr says so.

A mistake (a bad flag, a missing or corrupt model file, a port in use, a length over the
model's limit) prints one line, ``aserve: error: ...``, naming the flag or the file, and
exits with status 2 before any process starts; ``--log-level DEBUG`` adds the traceback.

Module-level imports stay light: a spawned child of ``aserve run`` imports this module
again (``multiprocessing`` re-imports the main script), so everything heavy is imported
inside the command that needs it.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any, NoReturn

from aserve.api.limits import ServerLimits
from aserve.engine.args import add_cli_arguments, from_cli
from aserve.errors import AserveError, ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Kept here, not imported: the parsers' modules are the API server's.
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line in aserve's one-line form (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"aserve: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    from aserve import __version__

    parser = _Parser(prog="aserve", description="LLM inference with the OpenAI API's shapes.")
    parser.add_argument("--version", action="version", version=f"aserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt", help="the text to complete")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    gen.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS)
    add_cli_arguments(gen, model_positional=False)

    run = sub.add_parser("run", help="serve a model over the OpenAI HTTP API",
                         description="Serve MODEL (a Hugging Face-format directory; the trained default model when "
                                     "omitted) over the OpenAI HTTP API.")
    server = run.add_argument_group("server options")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health, /ready and /metrics")
    server.add_argument("--api-key-probes", action="store_true",
                        help="with --api-key, require the key on /health, /ready and /metrics too")
    server.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="answer CORS requests from these origins ('*' for any); default: CORS off")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="names a request's model may give, the first reported by /v1/models (default: the "
                             "directory's name, and MODEL as typed)")
    server.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                        help="the model's tool-call format, read for tool_choice auto (docs/tool-calling.md)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model decide to call tools (tool_choice auto; needs --tool-call-parser)")
    server.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="return the model's thinking as reasoning_content, apart from content")
    server.add_argument("--api-server-count", type=int, default=None,
                        help="API server processes sharing the port (default: the DP size)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM (default 30)")
    server.add_argument("--ssl-certfile", default=None, help="TLS certificate (enables HTTPS with HTTP/2 by ALPN)")
    server.add_argument("--ssl-keyfile", default=None, help="TLS private key")
    server.add_argument("--loop", choices=("auto", "asyncio", "uvloop", "trio"), default="auto",
                        help="event loop (default auto: uvloop when installed, else asyncio)")
    server.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    server.add_argument("--enable-dev-endpoints", action="store_true",
                        help="serve POST /sleep, /wake_up, /start_profile, /stop_profile and GET /is_sleeping "
                             "(for development: anyone who may call the API may call them)")
    server.add_argument("--profiler-dir", default=None,
                        help="where /stop_profile writes each worker's torch.profiler trace")
    _add_limit_arguments(run)
    nodes = run.add_argument_group("data parallelism across nodes (docs/data-parallel.md)")
    nodes.add_argument("--dp-size-local", "--data-parallel-size-local", dest="dp_size_local", type=int, default=None,
                       help="engines on this node (default: all); the rest run on headless nodes")
    nodes.add_argument("--dp-start-rank", "--data-parallel-start-rank", dest="dp_start_rank", type=int, default=0,
                       help="DP rank of this node's first engine (headless nodes)")
    nodes.add_argument("--dp-address", "--data-parallel-address", dest="dp_address", default="127.0.0.1",
                       help="the front-end node's address for the TCP wires between nodes (default 127.0.0.1)")
    nodes.add_argument("--dp-rpc-port", "--data-parallel-rpc-port", dest="dp_rpc_port", type=int, default=None,
                       help="the front-end node's handshake port for headless nodes (default 13345)")
    nodes.add_argument("--headless", action="store_true",
                       help="run engines and workers only, serving the front-end node at --dp-address")
    nodes.add_argument("--dp-secret", default=None,
                       help="shared secret of the TCP wires between nodes (or --dp-secret-file, or ASERVE_DP_SECRET)")
    nodes.add_argument("--dp-secret-file", default=None, help="file holding the shared secret")
    add_cli_arguments(run, model_positional=True)
    _add_bench_parser(sub)
    return parser


def _add_limit_arguments(run: Any) -> None:
    """``ServerLimits``' fields, one flag each (aserve.api.limits, docs/serving.md)."""
    d = ServerLimits()
    limits = run.add_argument_group("admission, deadlines and request limits (docs/serving.md, \"Limits\")")
    limits.add_argument("--max-num-queued-reqs", type=int, default=None,
                        help="requests the whole server holds, waiting or running, before it answers 429 (default: "
                             "no limit); a request counts once per prompt and per n")
    limits.add_argument("--max-num-queued-tokens", type=int, default=None,
                        help="prompt tokens waiting for their prefill, server-wide, before new requests get 429 "
                             "(default: no limit)")
    limits.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may take in all before it is aborted with 408 (default: none; "
                             "a request may shorten it with the X-Request-Timeout header)")
    limits.add_argument("--max-queue-time", type=float, default=None,
                        help="seconds a request may wait for its first engine step before it is aborted with 408 "
                             "(default: none; X-Max-Queue-Time shortens it)")
    for flag, name, what in (("--max-n", "max_n", "n"), ("--max-prompts", "max_prompts", "prompts"),
                             ("--max-stop", "max_stop", "stop strings"),
                             ("--max-stop-chars", "max_stop_chars", "characters of one stop string"),
                             ("--max-logprobs", "max_logprobs", "logprobs / top_logprobs"),
                             ("--max-logit-bias", "max_logit_bias", "logit_bias entries"),
                             ("--max-messages", "max_messages", "chat messages"),
                             ("--max-message-chars", "max_message_chars", "characters of all messages together")):
        limits.add_argument(flag, dest=name, type=int, default=getattr(d, name),
                            help=f"the most {what} a request may ask for (default {getattr(d, name)}); more is a 400")


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
    serve.add_argument("--structured", choices=("json_schema",), default=None,
                       help="constrain requests with response_format json_schema (a list of records: every token "
                            "under the grammar)")
    serve.add_argument("--structured-fraction", type=float, default=1.0,
                       help="the share of requests --structured constrains (default 1: all)")
    serve.add_argument("--http2", action="store_true", help="HTTP/2 (h2c with prior knowledge, or ALPN over TLS)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--result-filename", default=None, help="write the result JSON here")
    serve.add_argument("--no-progress", action="store_true")
    serve.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                       help="the load generator's event loop (default auto: uvloop when installed, else asyncio; "
                            "uvloop takes ~10%% less CPU from the machine under test)")

    for name, text in (("throughput", "offline throughput through LLM"), ("latency", "one batch, time per step")):
        p = kinds.add_parser(name, help=text)
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        if name == "throughput":
            p.add_argument("--num-prompts", type=int, default=200)
        else:
            p.add_argument("--batch-size", type=int, default=8)
            p.add_argument("--num-iters-warmup", type=int, default=1)
            p.add_argument("--num-iters", type=int, default=3)
        p.add_argument("--output-json", default=None, help="write the result JSON here")
        p.add_argument("--log-level", default="WARNING", choices=LOG_LEVELS)
        add_cli_arguments(p, model_positional=False)


def _configure_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def _generate(args: argparse.Namespace) -> int:
    from aserve.frontend.llm import LLM
    from aserve.sampling_params import SamplingParams

    _configure_logging(args.log_level)
    if args.model is None:
        from aserve.default_model import NOTE

        print(NOTE, file=sys.stderr)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed,
    )
    llm = LLM(**vars(from_cli(args)))
    output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    if args.bench_command == "serve":
        return _bench_serve(args)
    from aserve.bench import offline
    from aserve.frontend.llm import LLM

    _configure_logging(args.log_level)
    llm = LLM(**vars(from_cli(args)))
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
    import time
    from pathlib import Path

    import anyio

    from aserve.bench import datasets
    from aserve.bench.serve import LoadConfig, format_summary, parse_goodput, run_load, summarize
    from aserve.frontend.tokenizer import Tokenizer
    from aserve.progress import ProgressBar

    if not 0.0 <= args.structured_fraction <= 1.0:
        raise ConfigError("--structured-fraction must be in [0, 1]", param="structured_fraction")
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
                     api_key=args.api_key, structured=args.structured, structured_fraction=args.structured_fraction)
    progress = None if args.no_progress else ProgressBar("requests")
    options = {"use_uvloop": True} if _resolve_loop(args.loop) == "uvloop" else {}
    cpu_before = time.process_time()
    results, duration = anyio.run(run_load, cfg, samples, tokenizer, progress, backend_options=options)
    client_cpu = time.process_time() - cpu_before
    result = summarize(cfg, results, duration)
    # The generator's own CPU (it shares the machine it measures), per streamed event.
    events = sum(len(r.itl) + 1 for r in results if r.success)
    result["client_cpu_s"] = client_cpu
    result["client_cpu_us_per_event"] = client_cpu / events * 1e6 if events else None
    print(format_summary(result))
    if args.result_filename:
        Path(args.result_filename).write_text(json.dumps(result))
    errors = [e for e in result["errors"] if e]
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    return 0 if result["completed"] else 1


def _run(args: argparse.Namespace) -> int:
    from aserve.launch.startup import prepare_server, prepare_headless
    from aserve.launch.supervisor import run_headless, run_server

    engine_args = from_cli(args)
    if engine_args.nnodes > 1 and engine_args.node_rank > 0:
        # A node of an engine across machines that runs only workers.
        from aserve.launch.startup import prepare_worker_node
        from aserve.launch.worker_node import run_worker_node

        fitted, secret = prepare_worker_node(engine_args, args)
        return run_worker_node(fitted, secret, args.log_level)
    if args.headless:
        fitted, served_model_name, dp = prepare_headless(engine_args, args)
        return run_headless(fitted, served_model_name, dp, args.log_level)
    cfg, sock, dp = prepare_server(engine_args, args, loop=_resolve_loop(args.loop))
    return run_server(cfg, sock, args.host, dp)


def _flags(parser: argparse.ArgumentParser, command: str | None) -> dict[str, str]:
    """dest -> its flags, as ``--max-model-len`` or ``--tensor-parallel-size/--tp``."""
    found: dict[str, str] = {}
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            parsers.append(action.choices[command])
            for nested in action.choices[command]._actions:
                if isinstance(nested, argparse._SubParsersAction):
                    parsers.extend(nested.choices.values())
    for p in parsers:
        for action in p._actions:
            if action.option_strings:
                found.setdefault(action.dest, "/".join(s for s in action.option_strings if not s.startswith("--no-")))
    return found


def _error_line(exc: AserveError, flags: dict[str, str]) -> str:
    param = getattr(exc, "param", None)
    flag = flags.get(param) if param else None
    return f"aserve: error: {flag}: {exc}" if flag else f"aserve: error: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "run":
            return _run(args)
        if args.command == "bench":
            return _bench(args)
    except AserveError as exc:
        if getattr(args, "log_level", None) == "DEBUG":
            traceback.print_exc()
        print(_error_line(exc, _flags(parser, args.command)), file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
