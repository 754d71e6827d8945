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

The next masks are computed at the end of a step, right after the sampled tokens are
consumed, while the matchers' data is still in the cache, and kept for the next step's
:meth:`GrammarState.allowed` (which computes on the spot only the rows it has none for:
a request new to the step). Measured in the worker (``docs/performance.md``), a mask
computed after a forward pass has flushed the caches costs several times one computed
warm; xgrammar's masks cost the same as llguidance's there. A thread computing the masks
during the forward pass was measured three times and not kept: on two busy cores it took
more CPU in all (0.64 s against 0.45 s a load) and the steps were no shorter; pinned to
the front end's core beside a one-call forward pass that holds no GIL, the unconstrained
requests' ITL in a half-constrained load measured the same as without it (Zen 5), or
12% worse (Zen 1, where the step then waited for a thread queued behind the API server).
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
    recent: list[int] = field(default_factory=list)  # the last len(after) tokens, while inactive


class GrammarState:
    """The matchers of one worker's constrained requests; only the worker's thread calls it.

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
        self._words = (vocab_size + 31) // 32
        # The masks computed at the end of the last step: req id -> its row of _next_bits
        # (dropped when the request leaves or comes back, so a row always belongs to the
        # request's current matcher).
        self._next: dict[str, int] = {}
        self._next_bits = np.zeros((0, self._words), dtype=np.int32)

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
        self.remove(req_id)
        state = _Constrained(self._matcher_for(grammar), tuple(after))
        self._requests[req_id] = state
        if not after:
            self._active.add(req_id)
        for token in output_ids:
            self._feed(req_id, state, token)

    def remove(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._active.discard(req_id)
        self._errors.discard(req_id)
        self._next.pop(req_id, None)

    def _feed(self, req_id: str, state: _Constrained, token: int) -> None:
        if req_id in self._active:
            if not state.matcher.consume_token(token):
                # A refused token (a row the engine drops anyway): the matcher stays in error.
                self._errors.add(req_id)
            return
        state.recent.append(token)
        del state.recent[: -len(state.after)]
        if tuple(state.recent) == state.after:
            state.recent = []
            self._active.add(req_id)

    def after_step(self, sampled: list[tuple[str, int]]) -> None:
        """The step's sampled ``(req id, token)`` pairs (those of unconstrained requests are
        ignored): advance the matchers, then compute their next masks while warm."""
        requests = self._requests
        active: list[tuple[str, _Constrained]] = []
        for rid, token in sampled:
            state = requests.get(rid)
            if state is not None:
                self._feed(rid, state, token)
                if rid in self._active:
                    active.append((rid, state))
        bits = np.empty((len(active), self._words), dtype=np.int32)
        base, row_bytes = bits.ctypes.data, self._words * 4
        for k, (_, state) in enumerate(active):
            state.matcher.unsafe_compute_mask_ptr(base + k * row_bytes, row_bytes)
        self._next_bits = bits
        self._next = {rid: k for k, (rid, _) in enumerate(active)}

    def allowed(self, req_ids: list[str]) -> tuple[list[int], np.ndarray] | None:
        """For the sampling rows ``req_ids``: (indices of the rows under an active grammar,
        int32 [k, words] of their packed masks: bit ``t % 32`` of word ``t // 32`` set where
        token ``t`` may come next), or None when no row is. A matcher in error (it refused
        a token: a row the engine drops anyway) may end the sequence, so its row is never
        empty."""
        active = self._active
        if not active:
            return None
        rows = [i for i, rid in enumerate(req_ids) if rid in active]
        if not rows:
            return None
        nxt = self._next
        kept = [nxt.get(req_ids[i], -1) for i in rows]
        if -1 not in kept:
            # Usually the rows come in the order the masks were computed: no copy.
            bits = self._next_bits if kept == list(range(len(self._next_bits))) else self._next_bits[kept]
        else:
            bits = np.empty((len(rows), self._words), dtype=np.int32)
            row_bytes = self._words * 4
            for k, (i, row) in enumerate(zip(rows, kept)):
                if row >= 0:
                    bits[k] = self._next_bits[row]
                else:  # a request new to the step
                    self._requests[req_ids[i]].matcher.unsafe_compute_mask_ptr(bits.ctypes.data + k * row_bytes,
                                                                               row_bytes)
        if self._errors:
            words = bits.view(np.uint32)
            ends = [t for t in self.eos_token_ids if t < self.vocab_size] or [0]
            for k, i in enumerate(rows):
                if req_ids[i] in self._errors:
                    for t in ends:
                        words[k, t // 32] |= np.uint32(1 << (t % 32))
        return rows, bits
