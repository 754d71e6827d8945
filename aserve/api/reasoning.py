"""Reasoning parsers: the model's thinking, apart from its answer (``reasoning_content``
beside ``content``, as vLLM and DeepSeek's API return it).

``aserve run --reasoning-parser NAME``:

============== ==========================================================================
``qwen3``      ``<think>...</think>`` then the answer; a reply with no ``</think>`` is all
               answer (Qwen 3 without thinking, or a template that closed it already)
``deepseek_r1`` the template opens ``<think>``: the reply is thinking until ``</think>``,
               then the answer; a reply with no ``</think>`` is all thinking (cut short)
============== ==========================================================================

A :class:`ReasoningStream` reads the reply as it streams (holding back what could be the
start of a tag) and says which part each piece belongs to; a whole reply is fed once.
A structured-output constraint applies to the answer only: the chat route sends the
tokens of ``</think>`` as the grammar's starting point (``grammar_after``), unless the
rendered prompt has closed the thinking already.
"""

from __future__ import annotations

from aserve.api.tool_parsers import held_back

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class ReasoningStream:
    """``feed(text) -> (reasoning, content)`` pieces; ``finish()`` the rest."""

    def __init__(self, name: str) -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}")
        self.name = name
        # deepseek_r1 starts inside the thinking; qwen3 only once it reads <think>.
        self._thinking = name == "deepseek_r1"
        self._started = name == "deepseek_r1"
        self._buffer = ""
        self._seen_end = False
        self._pending: list[str] = []  # qwen3: text before any tag, undecided until END or the end

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        while self._buffer:
            if self._thinking:
                at = self._buffer.find(END)
                if at < 0:
                    keep = held_back(self._buffer, END)
                    reasoning += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                reasoning += self._buffer[:at]
                self._buffer, self._thinking, self._seen_end = self._buffer[at + len(END):], False, True
                continue
            if not self._started:  # qwen3 before any tag: <think> may still come
                stripped = self._buffer.lstrip()
                if stripped.startswith(START):
                    self._buffer, self._thinking, self._started = stripped[len(START):], True, True
                    continue
                if START.startswith(stripped):
                    break  # whitespace, or the start of <think>, so far
                self._started = True  # the answer, without thinking
            content += self._buffer
            self._buffer = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._thinking:
            return rest, ""
        return "", rest


def prompt_closed_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an already closed ``<think></think>``
    (Qwen 3's template with thinking off): the answer then starts at once."""
    tail = prompt_text.rstrip()
    return tail.endswith(END)
