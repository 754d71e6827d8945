"""Incremental detokenization: token ids in, text deltas out, right at every step.

Byte-level tokenizers split one multi-byte UTF-8 character over several tokens, and
SentencePiece decoders change how a token reads depending on what precedes it. So each
step decodes a short window twice (the text already emitted and the same window plus
the new tokens) and emits the difference, holding it back while it ends in an
incomplete character (U+FFFD). A few prompt tokens prime the window so the first
generated token decodes as it would inside the full text.
"""

from __future__ import annotations

from aserve.frontend.tokenizer import Tokenizer

_PRIME_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._tokens = list(prompt_token_ids[-_PRIME_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        """Add new token ids; return the text they complete (possibly empty)."""
        self._tokens.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the request: emit whatever is held back, even if incomplete."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._tokens):
            return ""
        decode = self._tokenizer.decode
        prefix = decode(self._tokens[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = decode(self._tokens[self._prefix_offset :], skip_special_tokens=self._skip)
        if not final and (len(full) <= len(prefix) or full.endswith(_REPLACEMENT)):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.text += delta
        return delta
