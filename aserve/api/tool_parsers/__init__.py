"""Tool calls in a model's own output format, for ``tool_choice: "auto"``.

A parser reads the model's text as it streams and separates plain content from tool
calls; ``aserve run --tool-call-parser NAME`` picks one. Each format is one small module:

=============== ========================================================================
``hermes``      ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5 and 3, Hermes)
``llama3_json`` a bare ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3), ``;``-separated
``mistral``     ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral)
=============== ========================================================================

Every parser is a :class:`ToolCallStream`: ``feed(text)`` takes the next piece of the
output and returns what can be said of it now, ``finish()`` the rest. The same object
serves a streamed response (each delta fed as it comes) and a whole one (fed once), so
both read the output alike. ``tool_choice`` ``required`` and named functions do not go
through these: their output is grammar-constrained to aserve's own format
(``aserve.api.tools``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallStart:
    """A tool call begins: its index in the message, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    """More of call ``index``'s arguments (a JSON text; the pieces concatenate to it)."""

    index: int
    text: str


Delta = ContentDelta | CallStart | ArgumentsDelta


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Base: a parser's state over one choice's output."""

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> list[Delta]:
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        return []

    def _call(self, name: str, arguments: Any) -> list[Delta]:
        """One whole call: its start, then its arguments in one piece."""
        index = self.num_calls
        self.num_calls += 1
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return [CallStart(index, call_id(), name), ArgumentsDelta(index, text)]


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (kept back from
    the content until the next piece says whether the marker follows)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_call(obj: Any, args_key: str = "arguments") -> tuple[str, Any] | None:
    """(name, arguments) of one call object as models write it, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], arguments if arguments is not None else {}


def get_parser(name: str) -> type[ToolCallStream]:
    from aserve.api.tool_parsers import hermes, llama3_json, mistral

    parsers = {"hermes": hermes.HermesStream, "llama3_json": llama3_json.Llama3JsonStream,
               "mistral": mistral.MistralStream}
    return parsers[name]


PARSERS = ("hermes", "llama3_json", "mistral")
