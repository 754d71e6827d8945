"""``POST /v1/chat/completions``: a conversation through the model's chat template,
streamed (SSE) or not, with ``n`` samples and OpenAI's chat ``logprobs``.

Without ``max_tokens`` (or ``max_completion_tokens``) a reply may run to
``max_model_len``, as OpenAI's and vLLM's do.
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
from aserve.api.protocol import ChatCompletionRequest, decode_body
from aserve.api.responses import SSE_DONE, ComputedJSONResponse, EventStreamResponse, sse_event
from aserve.outputs import PositionLogprobs


async def create_chat_completion(state: ServerState, request: Request) -> Any:
    check_serving(state)
    req: ChatCompletionRequest = decode_body(await read_body(request, state.max_body_bytes), ChatCompletionRequest)
    check_model(state, req.model)
    engine = state.engine
    tok = engine.tokenizer
    prompt = engine.render_chat([{"role": m.role, "content": m.text()} for m in req.messages],
                                add_generation_prompt=req.add_generation_prompt)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(max_tokens=req.requested_max_tokens(), logprobs=logprobs)
    prepared = engine.prepare(prompt, params)
    rank = dp_rank(state, request, req)
    rid, created, model, n = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.served_model_name, params.n
    choices = [Choice(i) for i in range(n)]
    usage = {"prompt_tokens": len(prepared.token_ids), "completion_tokens": 0}

    def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int]) -> dict:
        content = []
        for token, pos in zip(token_ids, positions):
            s = tok.decode([token], skip_special_tokens=False)
            top = [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                    "bytes": list((lp.decoded_token or "").encode())}
                   for t, lp in pos.items() if t != token or (lp.rank or 0) <= (req.top_logprobs or 0)]
            content.append({"token": s, "logprob": pos[token].logprob, "bytes": list(s.encode()),
                            "top_logprobs": top[: req.top_logprobs or 0]})
        return {"content": content}

    def chunk(index: int, delta: dict, finish_reason: str | None = None, lps: Any = None) -> bytes:
        return sse_event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                          "choices": [{"index": index, "delta": delta, "logprobs": lps,
                                       "finish_reason": finish_reason}]})

    if req.stream:
        async def produce(write: Any) -> None:
            for j in range(n):
                await write(chunk(j, {"role": "assistant", "content": ""}))

            async def on_output(i: int, out: Any) -> None:
                for c in out.outputs:
                    usage["completion_tokens"] += len(c.token_ids)
                    lps = chat_logprobs(c.logprobs or [], c.token_ids) if req.logprobs else None
                    if c.text or c.token_ids:
                        await write(chunk(c.index, {"content": c.text}, None, lps))
                    if c.finish_reason is not None:
                        await write(chunk(c.index, {}, c.finish_reason))

            await run_prompts(state, [prepared], req.priority, on_output, rank)
            if req.include_usage:
                await write(sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                                       "model": model, "choices": [], "usage": usage_body(usage)}))
            await write(SSE_DONE)

        return EventStreamResponse(produce, disconnected(state))

    async def compute() -> tuple[int, Any]:
        async def on_output(i: int, out: Any) -> None:
            for c in out.outputs:
                choices[c.index].add(c)

        await run_prompts(state, [prepared], req.priority, on_output, rank)
        usage["completion_tokens"] = sum(len(c.token_ids) for c in choices)
        return 200, {"id": rid, "object": "chat.completion", "created": created, "model": model,
                     "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                                  "logprobs": chat_logprobs(c.logprobs, c.token_ids) if req.logprobs else None,
                                  "finish_reason": c.finish_reason} for c in choices],
                     "usage": usage_body(usage)}

    return ComputedJSONResponse(compute, disconnected(state))
