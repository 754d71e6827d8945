"""``POST /v1/completions``: OpenAI's legacy completions, streamed (SSE) or not.

Every prompt of the body (a string, strings, token ids, or lists of them) is prepared
before any is sent; ``n`` samples each; ``echo`` puts the prompt before the text;
``logprobs`` in the legacy shape (tokens, token_logprobs, top_logprobs, text_offset).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request

from aserve.api.generation import (
    Choice,
    ServerState,
    check_model,
    check_serving,
    disconnected,
    dp_rank,
    read_body,
    run_prompts,
    usage_body,
)
from aserve.api.limits import Deadlines, check_completion
from aserve.api.protocol import CompletionRequest, decode_body
from aserve.api.responses import SSE_DONE, ComputedJSONResponse, EventStreamResponse, sse_event
from aserve.outputs import PositionLogprobs
from aserve.sampling_params import DEFAULT_MAX_TOKENS


async def create_completion(state: ServerState, request: Request) -> Any:
    start = time.monotonic()
    check_serving(state)
    req: CompletionRequest = decode_body(await read_body(request, state.max_body_bytes), CompletionRequest)
    check_model(state, req.model)
    prompts = req.prompts()
    check_completion(state.limits, req, len(prompts))
    deadlines = Deadlines.of(state.limits, request.headers, start)
    engine = state.engine
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = req.sampling_params(max_tokens=max_tokens, logprobs=req.logprobs)
    constraint = req.output_constraint()
    source = constraint[0] if constraint else "structured_outputs"
    rank = dp_rank(state, request, req)
    ticket = state.admission.reserve(len(prompts) * params.n)  # before any tokenising
    try:
        prepared = [engine.prepare(prompt, params, constraint_param=source) for prompt in prompts]
        ticket.add_prompt_tokens([len(p.token_ids) for p in prepared])
    except BaseException:
        ticket.release(finished=False)
        raise
    rid, created, model, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.served_model_name, params.n
    tok = engine.tokenizer
    choices = [Choice(i) for i in range(len(prepared) * n)]
    usage = {"prompt_tokens": sum(len(p.token_ids) for p in prepared), "completion_tokens": 0}

    def prompt_text(i: int) -> str:
        p = prepared[i]
        return p.text if p.text is not None else tok.decode(p.token_ids)

    def legacy_logprobs(start_offset: int, positions: list[PositionLogprobs], ids: list[int]) -> dict:
        tokens, token_lps, tops, offsets, offset = [], [], [], [], start_offset
        for token, pos in zip(ids, positions):
            text = tok.decode([token], skip_special_tokens=False)
            tokens.append(text)
            token_lps.append(pos[token].logprob)
            tops.append({lp.decoded_token or "": lp.logprob for t, lp in pos.items() if t != token or
                         lp.rank is not None and lp.rank <= (req.logprobs or 0)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chunk(index: int, text: str, logprobs: Any, finish_reason: str | None) -> bytes:
        return sse_event({"id": rid, "object": "text_completion", "created": created, "model": model,
                          "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                       "finish_reason": finish_reason}]})

    if req.stream:
        async def produce(write: Any) -> None:
            if req.echo:
                for i in range(len(prepared)):
                    for j in range(n):
                        await write(chunk(i * n + j, prompt_text(i), None, None))

            async def on_output(i: int, out: Any) -> None:
                for c in out.outputs:
                    choice = choices[i * n + c.index]
                    usage["completion_tokens"] += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    lps = (legacy_logprobs(len(choice.text), c.logprobs or [], c.token_ids)
                           if req.logprobs is not None else None)
                    choice.text += c.text
                    await write(chunk(choice.index, c.text, lps, c.finish_reason))

            await run_prompts(state, prepared, req.priority, on_output, rank, ticket=ticket, deadlines=deadlines)
            if req.include_usage:
                await write(sse_event({"id": rid, "object": "text_completion", "created": created, "model": model,
                                       "choices": [], "usage": usage_body(usage)}))
            await write(SSE_DONE)

        return EventStreamResponse(produce, disconnected(state))

    async def compute() -> tuple[int, Any]:
        async def on_output(i: int, out: Any) -> None:
            for c in out.outputs:
                choices[i * n + c.index].add(c)

        await run_prompts(state, prepared, req.priority, on_output, rank, ticket=ticket, deadlines=deadlines)
        body_choices = []
        for choice in choices:
            prefix = prompt_text(choice.index // n) if req.echo else ""
            lps = legacy_logprobs(len(prefix), choice.logprobs, choice.token_ids) if req.logprobs is not None else None
            usage["completion_tokens"] += len(choice.token_ids)
            body_choices.append({"index": choice.index, "text": prefix + choice.text, "logprobs": lps,
                                 "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
        return 200, {"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": body_choices, "usage": usage_body(usage)}

    return ComputedJSONResponse(compute, disconnected(state))
