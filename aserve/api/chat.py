"""``POST /v1/chat/completions``: a conversation through the model's chat template,
streamed (SSE) or not, with ``n`` samples, OpenAI's chat ``logprobs``, output
constraints (``docs/structured-outputs.md``), tool calls (``docs/tool-calling.md``) and,
with ``--reasoning-parser``, the thinking apart from the answer.

Without ``max_tokens`` (or ``max_completion_tokens``) a reply may run to
``max_model_len``, as OpenAI's and vLLM's do.

Each choice's text goes through the same reader streamed or not (:class:`_Reply`): the
reasoning parser splits off the thinking, then the tool-call stream separates calls from
content; a streamed reply sends what each delta yields, a whole one gathers it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from starlette.requests import Request

from aserve.api import tools as tool_calls
from aserve.api.generation import (
    ServerState,
    check_model,
    check_serving,
    disconnected,
    dp_rank,
    read_body,
    run_prompts,
    usage_body,
)
from aserve.api.limits import Deadlines, check_chat
from aserve.api.protocol import ChatCompletionRequest, RequestError, decode_body
from aserve.api.reasoning import END as THINK_END
from aserve.api.reasoning import ReasoningStream, prompt_closed_thinking
from aserve.api.responses import SSE_DONE, ComputedJSONResponse, EventStreamResponse, sse_event
from aserve.api.tool_parsers import ArgumentsDelta, CallStart, ContentDelta, ToolCallStream
from aserve.outputs import PositionLogprobs


class _Reply:
    """One choice's text, read as it arrives: thinking, content and tool calls."""

    def __init__(self, index: int, reasoning: ReasoningStream | None, calls: ToolCallStream | None) -> None:
        self.index = index
        self.reasoning_stream = reasoning
        self.call_stream = calls
        self.content = ""
        self.reasoning = ""
        self.calls: list[dict[str, Any]] = []
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] = []
        self.finish_reason: str | None = None

    @property
    def plain(self) -> bool:
        """No parser reads this reply: every delta is content."""
        return self.reasoning_stream is None and self.call_stream is None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas (OpenAI ``delta`` objects) this piece of text yields."""
        if self.reasoning_stream is not None:
            thinking, answer = self.reasoning_stream.feed(text)
        else:
            thinking, answer = "", text
        return self._split(thinking, answer, final=False)

    def finish(self) -> list[dict[str, Any]]:
        thinking, answer = self.reasoning_stream.finish() if self.reasoning_stream is not None else ("", "")
        return self._split(thinking, answer, final=True)

    def _split(self, thinking: str, answer: str, *, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if thinking:
            self.reasoning += thinking
            deltas.append({"reasoning_content": thinking})
        if self.call_stream is None:
            if answer:
                self.content += answer
                deltas.append({"content": answer})
            return deltas
        pieces = self.call_stream.feed(answer) if answer else []
        if final:
            pieces += self.call_stream.finish()
        for piece in pieces:
            if isinstance(piece, ContentDelta):
                self.content += piece.text
                deltas.append({"content": piece.text})
            elif isinstance(piece, CallStart):
                self.calls.append({"id": piece.id, "type": "function",
                                   "function": {"name": piece.name, "arguments": ""}})
                deltas.append({"tool_calls": [{"index": piece.index, "id": piece.id, "type": "function",
                                               "function": {"name": piece.name, "arguments": ""}}]})
            elif isinstance(piece, ArgumentsDelta):
                self.calls[piece.index]["function"]["arguments"] += piece.text
                deltas.append({"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]})
        return deltas

    def reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` when the reply ended in calls."""
        if engine_reason == "stop" and self.calls:
            return "tool_calls"
        return engine_reason


async def create_chat_completion(state: ServerState, request: Request) -> Any:
    start = time.monotonic()
    check_serving(state)
    req: ChatCompletionRequest = decode_body(await read_body(request, state.max_body_bytes), ChatCompletionRequest)
    check_model(state, req.model)
    check_chat(state.limits, req)
    deadlines = Deadlines.of(state.limits, request.headers, start)
    engine = state.engine
    tok = engine.tokenizer
    tools = tool_calls.check_tools(req.tools)
    parser = state.tool_call_parser if state.enable_auto_tool_choice else None
    choice = tool_calls.resolve_choice(req.tool_choice, tools, parser)
    forced = tool_calls.forced_constraint(choice, tools, req.parallel_tool_calls)
    constraint = req.output_constraint()
    if forced is not None and constraint is not None:
        raise RequestError(f"tool_choice {'required' if choice == 'required' else 'of a named function'} "
                           f"constrains the output already: drop {constraint[0]}", param=constraint[0])
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(max_tokens=req.requested_max_tokens(), logprobs=logprobs)
    if forced is not None:
        params = msgspec.structs.replace(params, structured_outputs=forced)
    rank = dp_rank(state, request, req)
    ticket = state.admission.reserve(params.n)  # before the template is rendered
    try:
        prompt = engine.render_chat(tool_calls.template_messages(req.messages),
                                    add_generation_prompt=req.add_generation_prompt,
                                    tools=[msgspec.to_builtins(t) for t in req.tools] if req.tools else None,
                                    template_kwargs=req.chat_template_kwargs)
        grammar_after: tuple[int, ...] = ()
        if state.reasoning_parser is not None and not prompt_closed_thinking(prompt["prompt"]):
            grammar_after = tuple(tok.encode(THINK_END, add_special_tokens=False))  # constrain the answer only
        source = constraint[0] if constraint else "tools" if forced is not None else "structured_outputs"
        prepared = engine.prepare(prompt, params, grammar_after=grammar_after, constraint_param=source)
        ticket.add_prompt_tokens([len(prepared.token_ids)])
    except BaseException:
        ticket.release(finished=False)
        raise
    rid, created, model, n = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.served_model_name, params.n
    replies = [_Reply(i, ReasoningStream(state.reasoning_parser) if state.reasoning_parser else None,
                      tool_calls.call_stream(choice, parser)) for i in range(n)]
    usage = {"prompt_tokens": len(prepared.token_ids), "completion_tokens": 0}
    with_reasoning = state.reasoning_parser is not None

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
                    reply = replies[c.index]
                    usage["completion_tokens"] += len(c.token_ids)
                    lps = chat_logprobs(c.logprobs or [], c.token_ids) if req.logprobs else None
                    deltas = reply.feed(c.text) if c.text else []
                    if c.finish_reason is not None:
                        deltas += reply.finish()
                    if not deltas and c.token_ids and (lps is not None or reply.plain):
                        deltas = [{"content": ""}]  # tokens whose text is held back (and their logprobs)
                    for k, delta in enumerate(deltas):
                        await write(chunk(c.index, delta, None, lps if k == 0 else None))
                    if c.finish_reason is not None:
                        await write(chunk(c.index, {}, reply.reason(c.finish_reason)))

            await run_prompts(state, [prepared], req.priority, on_output, rank, ticket=ticket, deadlines=deadlines)
            if req.include_usage:
                await write(sse_event({"id": rid, "object": "chat.completion.chunk", "created": created,
                                       "model": model, "choices": [], "usage": usage_body(usage)}))
            await write(SSE_DONE)

        return EventStreamResponse(produce, disconnected(state))

    texts = [""] * n

    async def compute() -> tuple[int, Any]:
        async def on_output(i: int, out: Any) -> None:
            for c in out.outputs:
                reply = replies[c.index]
                texts[c.index] += c.text
                reply.token_ids += c.token_ids
                reply.logprobs += c.logprobs or []
                if c.finish_reason is not None:
                    reply.finish_reason = c.finish_reason

        await run_prompts(state, [prepared], req.priority, on_output, rank, ticket=ticket, deadlines=deadlines)
        body_choices = []
        for reply, text in zip(replies, texts):
            reply.feed(text)
            reply.finish()
            message: dict[str, Any] = {"role": "assistant",
                                       "content": reply.content if reply.content or not reply.calls else None}
            if reply.calls:
                message["tool_calls"] = reply.calls
            if with_reasoning:
                message["reasoning_content"] = reply.reasoning or None
            body_choices.append({"index": reply.index, "message": message,
                                 "logprobs": chat_logprobs(reply.logprobs, reply.token_ids) if req.logprobs else None,
                                 "finish_reason": reply.reason(reply.finish_reason)})
        usage["completion_tokens"] = sum(len(r.token_ids) for r in replies)
        return 200, {"id": rid, "object": "chat.completion", "created": created, "model": model,
                     "choices": body_choices, "usage": usage_body(usage)}

    return ComputedJSONResponse(compute, disconnected(state))
