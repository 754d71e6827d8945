"""Structured outputs, worker side: each constrained request's grammar state, the mask
of the tokens it may sample next, and its advance on the token it sampled.

Why in the worker (``docs/design.md`` §12): a worker samples the token itself, so its
matcher can advance at once and the next step's mask needs nothing from the engine core.
The engine keeps two steps in flight whatever the requests are; an engine-core matcher
would learn a step's token only after the next step was already sent, so a constrained
request could run only every other step. Every TP rank holds the same matchers, fed the
same tokens, so every rank masks alike and samples the same token.

The grammar text comes with the request (compiled and checked by the front end,
``aserve.frontend.structured_outputs``); this worker builds llguidance's matcher for it
once per text (later requests copy it) against the model's vocabulary read from
``tokenizer.json``. A request whose ``grammar_after`` is set (a reasoning section's end)
runs free until those tokens appear in its output. A preempted request comes back with
its tokens so far, and its matcher is rebuilt and fed them again.

The masks are computed in the step, for the batch's constrained rows in one llguidance
call. Computing them ahead, on a thread, while the next forward pass ran was measured and
not kept: on two busy cores it gave the same throughput (``docs/performance.md``), since
the work still takes a core someone needs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("aserve.worker")

#: Compiled grammars kept (by text) for later requests to copy.
COMPILED_CACHE = 256


@dataclass
class _Constrained:
    matcher: Any  # llguidance.LLMatcher
    after: tuple[int, ...]  # the grammar starts after these output tokens (empty: at once)
    active: bool
    recent: list[int] = field(default_factory=list)  # the last len(after) tokens, while inactive


class GrammarState:
    """The matchers of one worker's constrained requests."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self.eos_token_ids = eos_token_ids
        self._tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._requests: dict[str, _Constrained] = {}
        self._words = (vocab_size + 31) // 32
        self._executor_: Any = None

    @property
    def _executor(self) -> Any:
        if self._executor_ is None:
            import llguidance

            # One thread: the batch's masks take microseconds each, and more threads
            # would take cores from the forward pass.
            self._executor_ = llguidance.LLExecutor(num_threads=1)
        return self._executor_

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def _matcher_for(self, grammar: str) -> Any:
        import llguidance

        if self._tokenizer is None:
            # Read once per worker (a few ms for a small vocabulary, about a second for 150k).
            self._tokenizer = llguidance.LLTokenizer((self.model_dir / "tokenizer.json").read_text(),
                                                     n_vocab=self.vocab_size,
                                                     eos_token=list(self.eos_token_ids) or None)
            self.eos_token_ids = tuple(self._tokenizer.eos_tokens)
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            # The first mask builds the lexer's tables (about 2 ms for a small schema);
            # built on the template, they serve every copy, so no request's step pays it.
            scratch = np.zeros(self._words, dtype=np.int32)
            template.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            self._compiled[grammar] = template
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return template.deep_copy()

    def add(self, req_id: str, grammar: str, after: list[int], output_ids: list[int]) -> None:
        """A request new to this worker (or back after preemption, with ``output_ids``)."""
        state = _Constrained(self._matcher_for(grammar), tuple(after), active=not after)
        self._requests[req_id] = state
        for token in output_ids:
            self._feed(state, token)

    def remove(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def advance(self, req_id: str, token: int) -> None:
        state = self._requests.get(req_id)
        if state is not None:
            self._feed(state, token)

    def _feed(self, state: _Constrained, token: int) -> None:
        if state.active:
            state.matcher.consume_token(token)  # a refused token (a dropped in-flight row) leaves it in error: harmless
            return
        state.recent.append(token)
        del state.recent[: -len(state.after)]
        if tuple(state.recent) == state.after:
            state.active, state.recent = True, []

    def allowed(self, req_ids: list[str]) -> tuple[list[int], np.ndarray] | None:
        """For the sampling rows ``req_ids``: (indices of the rows under an active grammar,
        numpy bool [k, vocab] of the tokens each may sample), or None when no row is."""
        rows: list[int] = []
        matchers: list[tuple[Any, int]] = []
        for i, rid in enumerate(req_ids):
            state = self._requests.get(rid)
            if state is not None and state.active:
                matchers.append((state.matcher, len(rows)))
                rows.append(i)
        if not rows:
            return None
        bits = np.zeros((len(rows), self._words), dtype=np.int32)
        # One call for the batch, with the GIL released (a matcher in error yields an empty mask).
        self._executor.unsafe_compute_mask_ptr(matchers, bits.ctypes.data, self._words * 4, len(rows))
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size].view(bool)
        empty = ~allowed.any(axis=1)
        if empty.any():
            # A matcher in error (a token it refused, from a row the engine drops anyway):
            # let the row end rather than sample from nothing.
            allowed[np.nonzero(empty)[0][:, None], [t for t in self.eos_token_ids if t < self.vocab_size] or [0]] = True
        return rows, allowed
