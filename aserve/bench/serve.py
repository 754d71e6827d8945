"""``aserve bench serve``: load for any OpenAI-compatible server, figures named as vLLM's.

Requests arrive by a gamma process (``burstiness`` 1 is Poisson) at ``request_rate``
per second (``inf``: all at once), at most ``max_concurrency`` in flight. Each one
streams (``stream: true`` with ``stream_options.include_usage``), and the client
records the time to the first chunk with a choice (TTFT; its text may be empty), the
gap before every later one (ITL),
the time per output token after the first (TPOT) and the whole latency (E2EL). Output
tokens are the server's ``usage.completion_tokens`` when it reports them, else the
generated text re-tokenised. The result has the field names of vLLM's serving
benchmark, so the JSON of both tools can be set side by side.

A structured load (``structured="json_schema"``) gives a share of the requests
(``structured_fraction``, spread evenly) OpenAI's ``response_format`` with
``BENCH_SCHEMA`` (``response_format`` on chat; vLLM's ``structured_outputs`` on
completions, which OpenAI's API does not constrain): a list of small records with no end,
so the grammar masks every token of every constrained request. The result then also
splits TTFT, ITL and throughput between constrained and unconstrained requests
(``by_kind``), and counts the outputs that hold the schema's start (``schema_shaped``),
so a server that ignored the constraint cannot pass for a fast one.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from aserve.bench.datasets import SampleRequest
from aserve.bench.aiohttp_client import AiohttpClient


#: The structured load's schema: records for ever, so every token is under the grammar.
BENCH_SCHEMA = {
    "type": "array", "minItems": 1,
    "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 16},
        "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"], "additionalProperties": False},
}


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""
    constrained: bool = False  # it carried the structured load's constraint


@dataclass(frozen=True)
class LoadConfig:
    base_url: str
    endpoint: str  # /v1/completions or /v1/chat/completions
    model: str
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    http2: bool = False
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)  # "ttft"/"tpot"/"e2el" -> ms
    timeout: float = 600.0
    api_key: str | None = None
    structured: str | None = None  # "json_schema": constrained requests carry BENCH_SCHEMA
    structured_fraction: float = 1.0  # the share of requests that are constrained

    def is_constrained(self, index: int) -> bool:
        """Request ``index`` carries the constraint: an even spread of the fraction."""
        f = self.structured_fraction if self.structured else 0.0
        return math.floor((index + 1) * f + 1e-9) > math.floor(index * f + 1e-9)


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between request starts: gamma(shape=burstiness, scale=1/(rate*burstiness)),
    mean 1/rate; all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n).tolist()


def _body(cfg: LoadConfig, sample: SampleRequest, constrained: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": sample.expected_output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": cfg.temperature}
    if constrained:
        if cfg.endpoint.endswith("chat/completions"):
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "records", "schema": BENCH_SCHEMA, "strict": True}}
        else:  # OpenAI's completions have no response_format: vLLM's (and aserve's) field
            body["structured_outputs"] = {"json": BENCH_SCHEMA}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM's (and aserve's) extension
    if cfg.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    return body


async def _sse_lines(chunks: Any) -> Any:
    """The lines of a stream of byte chunks, split on b"\n" only: a server may put
    U+2028 or \x1c (which ``str.splitlines`` and httpx's ``aiter_lines`` treat as line
    breaks) unescaped inside a JSON string."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if buffer:
        yield buffer.decode("utf-8", errors="replace")


async def _one(client: Any, cfg: LoadConfig, sample: SampleRequest, tokenizer: Any,
               constrained: bool = False) -> RequestResult:
    """One request, failed (not raised) after ``cfg.timeout`` seconds in all."""
    try:
        with anyio.fail_after(cfg.timeout):
            return await _stream_one(client, cfg, sample, tokenizer, constrained)
    except TimeoutError:
        return RequestResult(sample.prompt_len, error=f"no complete response within {cfg.timeout:g} s",
                             constrained=constrained)


async def _stream_one(client: Any, cfg: LoadConfig, sample: SampleRequest, tokenizer: Any,
                      constrained: bool) -> RequestResult:
    result = RequestResult(sample.prompt_len, constrained=constrained)
    chat = cfg.endpoint.endswith("chat/completions")
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    start = last = time.perf_counter()
    first_seen = False
    usage_tokens = None
    try:
        async with client.stream("POST", cfg.base_url.rstrip("/") + cfg.endpoint,
                                 content=json.dumps(_body(cfg, sample, constrained)).encode(),
                                 headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in _sse_lines(response.aiter_bytes()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                # Every chunk with a choice is a token event, even with empty text (a
                # server holds back text that ends inside a UTF-8 character): timed as
                # vLLM's client times them, so the figures compare.
                text = (choices[0].get("delta") or {}).get("content") if chat else choices[0].get("text")
                now = time.perf_counter()
                if not first_seen:
                    result.ttft, first_seen = now - start, True
                else:
                    result.itl.append(now - last)
                last = now
                result.text += text or ""
        if not first_seen:
            result.error = "the stream ended before its first chunk"
            return result
        result.latency = last - start
        result.output_tokens = usage_tokens if usage_tokens is not None else \
            len(tokenizer.encode(result.text, add_special_tokens=False))
        result.success = True
    except Exception as exc:  # one failed request is a figure, not the end of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(cfg: LoadConfig, samples: list[SampleRequest], tokenizer: Any,
                   progress: Any = None) -> tuple[list[RequestResult], float]:
    """Send every sample; (results in sample order, wall-clock duration in s)."""
    import httpx

    delays = arrival_delays(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = cfg.max_concurrency or len(samples)
    gate = anyio.Semaphore(limit)
    results: list[RequestResult | None] = [None] * len(samples)
    done = 0
    if cfg.http2 or not cfg.base_url.startswith("http://"):
        limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
        client: Any = httpx.AsyncClient(http1=not cfg.http2, http2=cfg.http2, timeout=cfg.timeout, limits=limits)
    else:
        client = AiohttpClient(limit, cfg.timeout)  # vLLM's client library; as lean here as a hand-written one
    async with client:
        async def send(i: int) -> None:
            nonlocal done
            async with gate:
                results[i] = await _one(client, cfg, samples[i], tokenizer, cfg.is_constrained(i))
            done += 1
            if progress is not None:
                progress(done, len(samples))

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i, delay in enumerate(delays):
                if delay:
                    await anyio.sleep(delay)
                tg.start_soon(send, i)
        duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration


def _stats(prefix: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    return {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
            f"std_{prefix}_ms": float(ms.std()), f"p99_{prefix}_ms": float(np.percentile(ms, 99))}


def summarize(cfg: LoadConfig, results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM's serving-benchmark fields (and its per-request lists)."""
    ok = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = 0
    for r in ok:
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        measured = {"ttft": r.ttft * 1000, "tpot": tpot * 1000, "e2el": r.latency * 1000}
        good += all(measured[k] <= v for k, v in cfg.goodput.items())
    out: dict[str, Any] = {
        "backend": "openai-chat" if cfg.endpoint.endswith("chat/completions") else "openai",
        "model_id": cfg.model,
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "request_goodput": good / duration if (duration and cfg.goodput) else None,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
    }
    out |= _stats("ttft", [r.ttft for r in ok]) | _stats("tpot", tpots) | _stats("itl", itls)
    out |= _stats("e2el", [r.latency for r in ok])
    if cfg.structured:
        out["structured"] = cfg.structured
        out["structured_fraction"] = cfg.structured_fraction
        out["by_kind"] = {}
        for kind, flag in (("constrained", True), ("unconstrained", False)):
            part = [r for r in ok if r.constrained is flag]
            if part:
                out["by_kind"][kind] = {"completed": len(part),
                                        # a server that ignored the constraint shows here
                                        "schema_shaped": sum('[{"id":' in r.text for r in part),
                                        "output_throughput": sum(r.output_tokens for r in part) / duration,
                                        **_stats("ttft", [r.ttft for r in part]),
                                        **_stats("itl", [x for r in part for x in r.itl])}
    out |= {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "generated_texts": [r.text for r in results], "errors": [r.error for r in results]}
    return out


def format_summary(result: dict[str, Any]) -> str:
    lines = [
        f"{'Successful requests:':<40}{result['completed']:>12}",
        f"{'Failed requests:':<40}{result['failed']:>12}",
        f"{'Benchmark duration (s):':<40}{result['duration']:>12.2f}",
        f"{'Total input tokens:':<40}{result['total_input_tokens']:>12}",
        f"{'Total generated tokens:':<40}{result['total_output_tokens']:>12}",
        f"{'Request throughput (req/s):':<40}{result['request_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<40}{result['output_throughput']:>12.2f}",
        f"{'Total token throughput (tok/s):':<40}{result['total_token_throughput']:>12.2f}",
    ]
    if result["request_goodput"] is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{result['request_goodput']:>12.2f}")
    for key, name in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                      ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{name + ' (ms) mean / median / p99:':<52}"
                     f"{result[f'mean_{key}_ms']:.2f} / {result[f'median_{key}_ms']:.2f} / {result[f'p99_{key}_ms']:.2f}")
    for kind, part in (result.get("by_kind") or {}).items():
        lines.append(f"{kind + ' requests:':<40}{part['completed']:>12}   output {part['output_throughput']:.2f} tok/s, "
                     f"median TTFT {part['median_ttft_ms']:.2f} ms, median ITL {part['median_itl_ms']:.2f} ms")
    return "\n".join(lines)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    out = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        out[key] = float(value)
    return out
