"""Structured outputs, engine side: each constrained request's grammar state, advanced
on the tokens the request is given, and the masks of what its next token may be.

Why in the engine core (``docs/design.md`` §12): the engine keeps two steps in flight,
so when it learns step N's tokens, step N + 1 is already running. Its masks are not
needed until step N + 1 samples, a whole forward pass later, so the engine core advances
the matchers on step N's tokens and sends step N + 1's masks behind it on the broadcast
ring (``WorkerCall("grammar_masks")``); the workers read them just before they sample.
The grammar's work is then done once per engine, in the engine core's process, on the
front end's core, where the workers had each done it on their own, in the step: on a
host whose worker core is the busy one, in every step of every request in the batch
(``docs/performance.md``). Every TP rank gets the same masks, so every rank samples the
same token.

The grammar text comes with the request (compiled and checked by the front end,
``aserve.frontend.structured_outputs``); a matcher is built once per text against the
model's vocabulary read from ``tokenizer.json`` (later requests copy it). A request
whose ``grammar_after`` is set (a reasoning section's end) runs free until those tokens
appear in its output. A preempted request keeps its matcher: the engine core only ever
feeds it the tokens the request keeps.

Only the engine core's step thread calls it. torch-free, like the rest of the engine core.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Compiled grammars kept (by text) for later requests to copy.
COMPILED_CACHE = 256


@dataclass
class _Constrained:
    matcher: Any  # llguidance.LLMatcher
    after: tuple[int, ...]  # the grammar starts after these output tokens (empty: at once)
    recent: list[int] = field(default_factory=list)  # the last len(after) tokens, while inactive


class GrammarState:
    """The matchers of one engine's constrained requests.

    The bookkeeping is in sets and dicts keyed by request id, so a step costs a few
    lookups a row beyond llguidance's own work: at 16 constrained rows of 32 that Python
    was as much as the masks themselves (``docs/performance.md``)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self.eos_token_ids = eos_token_ids
        self._tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._requests: dict[str, _Constrained] = {}
        self._active: set[str] = set()  # requests whose grammar has started
        self._errors: set[str] = set()  # requests whose matcher is in error
        self.words = (vocab_size + 31) // 32  # int32 words in one packed mask

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def _matcher_for(self, grammar: str) -> Any:
        import llguidance

        if self._tokenizer is None:
            # Read once per engine (a few ms for a small vocabulary, about a second for 150k).
            self._tokenizer = llguidance.LLTokenizer((self.model_dir / "tokenizer.json").read_text(),
                                                     n_vocab=self.vocab_size,
                                                     eos_token=list(self.eos_token_ids) or None)
            self.eos_token_ids = tuple(self._tokenizer.eos_tokens)
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            # The first mask builds the lexer's tables (about 2 ms for a small schema);
            # built on the template, they serve every copy, so no request's step pays it.
            scratch = np.zeros(self.words, dtype=np.int32)
            template.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            self._compiled[grammar] = template
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return template.deep_copy()

    def add(self, req_id: str, grammar: str, after: list[int]) -> None:
        """A request new to the engine, before it has any output token."""
        self.remove(req_id)
        self._requests[req_id] = _Constrained(self._matcher_for(grammar), tuple(after))
        if not after:
            self._active.add(req_id)

    def remove(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._active.discard(req_id)
        self._errors.discard(req_id)

    def consume(self, req_id: str, tokens: list[int]) -> None:
        """The output tokens the request was given (none of an unconstrained one's)."""
        state = self._requests.get(req_id)
        if state is None:
            return
        for token in tokens:
            if req_id in self._active:
                if not state.matcher.consume_token(token):
                    # A refused token (a row whose mask the workers did not apply): the
                    # matcher stays in error, and its masks allow the end of the sequence.
                    self._errors.add(req_id)
                continue
            state.recent.append(token)
            del state.recent[: -len(state.after)]
            if tuple(state.recent) == state.after:
                state.recent = []
                self._active.add(req_id)

    def any_of(self, req_ids: Iterable[str]) -> bool:
        """Whether any of ``req_ids`` has a grammar (started or not)."""
        requests = self._requests
        return bool(requests) and any(rid in requests for rid in req_ids)

    def masks(self, req_ids: Iterable[str]) -> tuple[list[str], np.ndarray]:
        """The requests among ``req_ids`` under a started grammar, and int32 [k, words] of
        their packed masks: bit ``t % 32`` of word ``t // 32`` set where token ``t`` may
        come next. A matcher in error (it refused a token) may end the sequence, so its
        row is never empty."""
        active = self._active
        ids = [rid for rid in req_ids if rid in active]
        bits = np.empty((len(ids), self.words), dtype=np.int32)
        base, row_bytes = bits.ctypes.data, self.words * 4
        requests = self._requests
        for k, rid in enumerate(ids):
            requests[rid].matcher.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
        if self._errors:
            words = bits.view(np.uint32)
            ends = [t for t in self.eos_token_ids if t < self.vocab_size] or [0]
            for k, rid in enumerate(ids):
                if rid in self._errors:
                    for t in ends:
                        words[k, t // 32] |= np.uint32(1 << (t % 32))
        return ids, bits
