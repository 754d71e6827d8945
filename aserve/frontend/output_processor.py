"""Engine outputs in, ``RequestOutput``s out: detokenising, stop strings, logprobs,
and gathering the ``n`` samples of one request.

A request with ``n`` > 1 runs in the engine as ``n`` child requests (ids
``"{i}_{request_id}"``, child i seeded with ``seed + i`` when a seed is given) that share
the prompt's KV blocks through the prefix cache; their outputs are gathered here into
one ``RequestOutput``.

Stop strings are text, which the engine never sees: they are found here, the text is
cut, and the child's id is returned so the caller aborts it in the engine. While a
request streams, the last ``len(longest stop string) - 1`` characters are held back so
a client never sees the start of a stop string that later matches.
"""

from __future__ import annotations

import msgspec

from aserve.frontend.detokenizer import IncrementalDetokenizer
from aserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams
from aserve.frontend.tokenizer import Tokenizer
from aserve.wire.messages import EngineCoreOutput, FinishReason, TokenLogprobs


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)


class _Child:
    """One sample's progress."""

    def __init__(self, index: int, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.index = index
        self.params = params
        self.detok = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
            if params.detokenize else None
        )
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.sent_tokens = 0  # for DELTA outputs
        self.sent_chars = 0
        self.sent_logprobs = 0
        stops = params.stop or []
        self.holdback = max((len(s) for s in stops), default=1) - 1 if not params.include_stop_str_in_output else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text(self) -> str:
        if self.finished or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]


def _check_stop_strings(text: str, new_chars: int, params: SamplingParams) -> tuple[str, int] | None:
    """(matched stop string, length to cut the text to) if a stop string completed
    within the last ``new_chars`` characters."""
    for stop in params.stop or ():
        # Search only where a match could involve the new characters.
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index == -1:
            continue
        return stop, index + len(stop) if params.include_stop_str_in_output else index
    return None


class RequestState:
    """One user-visible request (all ``n`` children of it)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.children = [
            _Child(i, tokenizer, prompt_token_ids, child_params(params, i)) for i in range(params.n)
        ]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.num_cached_tokens = 0
        self.metrics: dict[str, float] = {}

    @property
    def child_ids(self) -> list[str]:
        return [child_request_id(self.request_id, i, self.params.n) for i in range(self.params.n)]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def _logprobs_dict(self, lps: TokenLogprobs) -> PositionLogprobs:
        out: PositionLogprobs = {}
        for token_id, logprob, rank in zip(lps.token_ids, lps.logprobs, lps.ranks):
            if token_id not in out:
                out[token_id] = Logprob(logprob, rank, self.tokenizer.decode([token_id], skip_special_tokens=False))
        return out

    def apply(self, index: int, out: EngineCoreOutput) -> bool:
        """Fold one engine output into child ``index``; True if a stop string just
        finished the child (the caller must abort it in the engine)."""
        child = self.children[index]
        if out.new_prompt_logprobs and self.prompt_logprobs is not None and index == 0:
            self.prompt_logprobs.extend(self._logprobs_dict(lp) for lp in out.new_prompt_logprobs)
        if out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        if out.queue_time is not None and index == 0:
            self.metrics["queue_time"] = out.queue_time
        if child.finished:
            return False
        child.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and child.logprobs is not None:
            for lp in out.new_logprobs:
                child.logprobs.append(self._logprobs_dict(lp))
                child.cumulative_logprob = (child.cumulative_logprob or 0.0) + lp.logprobs[0]
        stopped_by_string = False
        if child.detok is not None:
            delta = child.detok.push(out.new_token_ids)
            if out.finish_reason is not None:
                delta += child.detok.flush()
            child.text += delta
            if delta and len(child.token_ids) > child.params.min_tokens:
                match = _check_stop_strings(child.text, len(delta), child.params)
                if match is not None:
                    child.text = child.text[: match[1]]
                    child.finish_reason, child.stop_reason = "stop", match[0]
                    stopped_by_string = out.finish_reason is None
        if out.finish_reason is not None and not child.finished:
            child.finish_reason = str(FinishReason(out.finish_reason))
            child.stop_reason = out.stop_reason
        return stopped_by_string

    def finish_all(self, reason: str) -> None:
        for child in self.children:
            if not child.finished:
                child.finish_reason = reason

    def make_output(self) -> RequestOutput | None:
        """The RequestOutput to hand out now, per ``output_kind``; None if nothing is due."""
        kind = self.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for c in self.children:
            text = c.visible_text()
            if kind == RequestOutputKind.DELTA:
                completions.append(CompletionOutput(
                    c.index, text[c.sent_chars :], c.token_ids[c.sent_tokens :], c.cumulative_logprob,
                    c.logprobs[c.sent_logprobs :] if c.logprobs is not None else None, c.finish_reason, c.stop_reason,
                ))
                c.sent_chars, c.sent_tokens = len(text), len(c.token_ids)
                c.sent_logprobs = len(c.logprobs) if c.logprobs is not None else 0
            else:
                completions.append(CompletionOutput(
                    c.index, text, list(c.token_ids), c.cumulative_logprob,
                    list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason,
                ))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dict(self.metrics),
        )


class OutputProcessor:
    """Routes engine outputs (by child id) to their ``RequestState``."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self._child_to_parent: dict[str, tuple[RequestState, int]] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for i, child_id in enumerate(state.child_ids):
            self._child_to_parent[child_id] = (state, i)

    def remove(self, request_id: str) -> RequestState | None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for child_id in state.child_ids:
                self._child_to_parent.pop(child_id, None)
        return state

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs due now, child ids the engine must abort for stop strings)."""
        touched, to_abort = self.apply(outputs)
        results = []
        for state in touched:
            output = state.make_output()
            if output is not None:
                results.append(output)
        return results, to_abort

    def apply(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[str]]:
        """Apply engine outputs to their requests without making RequestOutputs: (the
        states that changed, child ids the engine must abort for stop strings). Finished
        states are removed here; their owners still hold them for ``make_output``."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self._child_to_parent.get(out.request_id)
            if entry is None:
                continue  # a request already removed (aborted by the caller)
            state, index = entry
            if state.apply(index, out):
                to_abort.append(out.request_id)
            touched[state.request_id] = state
        for state in touched.values():
            if state.finished:
                self.remove(state.request_id)
        return list(touched.values()), to_abort
