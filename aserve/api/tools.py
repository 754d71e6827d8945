"""Tool calls on ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``,
the constraint a forced call generates under, and the streams that read the output.

``tool_choice``:

- ``"none"``: the tools reach the template, the reply is plain content;
- ``"auto"`` (the default with tools): the model answers in its own format, which the
  server's ``--tool-call-parser`` reads (``aserve.api.tool_parsers``); without one a 400;
- ``"required"``: the output is grammar-constrained to a JSON list of calls,
  ``[{"name": ..., "parameters": {...}}, ...]`` (one item when ``parallel_tool_calls`` is
  false), each call's parameters held to its function's schema;
- ``{"type": "function", "function": {"name": N}}``: the output is N's arguments, held to
  N's ``parameters`` schema.

So a required or named call's arguments always parse and validate; what the model
writes of them streams as argument fragments that concatenate to the whole.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from aserve.api.protocol import NamedToolChoice, RequestError, Tool
from aserve.api.tool_parsers import ArgumentsDelta, CallStart, Delta, ToolCallStream, call_id, get_parser
from aserve.frontend.structured_outputs import json_schema_grammar
from aserve.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_tools(tools: list[Tool] | None) -> dict[str, Tool]:
    """The tools by name; a 400 naming ``tools`` for a malformed one (a wrong type, a bad
    or repeated name, ``parameters`` that are not a JSON Schema llguidance can compile)."""
    by_name: dict[str, Tool] = {}
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise RequestError(f"tools[{i}].type must be 'function', not {tool.type!r}", param="tools")
        name = tool.function.name
        if not _NAME.match(name):
            raise RequestError(f"tools[{i}].function.name {name!r} must be 1-64 letters, digits, _ or -",
                               param="tools")
        if name in by_name:
            raise RequestError(f"tools[{i}].function.name {name!r} appears twice", param="tools")
        if tool.function.parameters is not None:
            json_schema_grammar(tool.function.parameters, param="tools")  # a 400 if it does not compile
        by_name[name] = tool
    return by_name


def resolve_choice(tool_choice: Any, tools: dict[str, Tool], parser: str | None) -> str | Tool:
    """``"none"``, ``"auto"``, ``"required"`` or the named ``Tool``; a 400 naming
    ``tool_choice`` for a choice that cannot be served."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(f"tool_choice must be none, auto, required or a function, not {tool_choice!r}",
                               param="tool_choice")
        if tool_choice != "none" and not tools:
            raise RequestError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        if tool_choice == "auto" and parser is None:
            raise RequestError("tool_choice 'auto' needs the server started with --tool-call-parser (hermes, "
                               "llama3_json or mistral); 'required' or a named function work without one",
                               param="tool_choice")
        return tool_choice
    try:
        named = msgspec.convert(tool_choice, NamedToolChoice)
    except msgspec.ValidationError as exc:
        raise RequestError(f"tool_choice: {exc}", param="tool_choice") from None
    if named.type != "function":
        raise RequestError(f"tool_choice.type must be 'function', not {named.type!r}", param="tool_choice")
    tool = tools.get(named.function.name)
    if tool is None:
        raise RequestError(f"tool_choice names {named.function.name!r}, which is not in tools "
                           f"({', '.join(tools) or 'none'})", param="tool_choice")
    return tool


def forced_constraint(choice: str | Tool, tools: dict[str, Tool], parallel: bool) -> StructuredOutputsParams | None:
    """The output constraint of a required or named choice (None for none and auto)."""
    if isinstance(choice, Tool):
        return StructuredOutputsParams(json=choice.function.parameters or _ANY_OBJECT)
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                                "parameters": tool.function.parameters or _ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, tool in tools.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The conversation as Hugging Face chat templates take it: ``tool`` messages with
    their ``tool_call_id``, and an assistant's ``tool_calls`` with ``arguments`` as an
    object (templates write it with ``tojson``; a string that is not JSON stays a string)."""
    out = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text() if m.content is not None else None}
        if m.role != "assistant" or m.tool_calls is None:
            entry["content"] = entry["content"] or ""
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, name) is not None:
                entry[name] = getattr(m, name)
        if m.tool_calls is not None:
            calls = []
            for call in m.tool_calls:
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments)
                    except ValueError:
                        pass
                calls.append({**call, "function": function})
            entry["tool_calls"] = calls
        out.append(entry)
    return out


class NamedCallStream(ToolCallStream):
    """The output is the arguments of one known function."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        if self.num_calls == 0:
            self.num_calls = 1
            out.append(CallStart(0, call_id(), self._name))
        if text:
            out.append(ArgumentsDelta(0, text))
        return out


class RequiredCallsStream(ToolCallStream):
    """Reads ``[{"name": ..., "parameters": {...}}, ...]`` as it grows: a call starts once
    its name is known, and its parameters stream as they are written."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._sent: list[int] = []  # per started call: characters of its parameters sent

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        out: list[Delta] = []
        for index, (name, params) in enumerate(_scan_calls(self._text)):
            if name is None:
                break
            if index == len(self._sent):
                out.append(CallStart(index, call_id(), name))
                self._sent.append(0)
                self.num_calls += 1
            if len(params) > self._sent[index]:
                out.append(ArgumentsDelta(index, params[self._sent[index]:]))
                self._sent[index] = len(params)
        return out


def _scan_calls(text: str) -> list[tuple[str | None, str]]:
    """For each call object of a (possibly partial) JSON list ``[{...}, ...]``: its name,
    once the whole string is there (else None), and its ``parameters`` value's text so
    far (which only grows as the text does)."""
    calls: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    depth, i, n = 0, 0, len(text)
    key: str | None = None  # the key whose value comes next, inside a call object
    value_start: int | None = None  # where the parameters object starts
    while i < n:
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end < 0:
                break  # a string still being written
            if depth == 2 and current is not None:
                if key is None:
                    key = json.loads(text[i:end + 1])
                elif key == "name":
                    current["name"], key = json.loads(text[i:end + 1]), None
            i = end + 1
            continue
        if c in "{[":
            depth += 1
            if depth == 2 and c == "{":
                current = {"name": None, "params": ""}
                calls.append(current)
                key = None
            elif depth == 3 and key == "parameters":
                value_start = i
        elif c in "}]":
            if depth == 3 and value_start is not None and current is not None:
                current["params"], value_start, key = text[value_start:i + 1], None, None
            depth -= 1
        elif c == "," and depth == 2:
            key = None
        i += 1
    if value_start is not None and current is not None:
        current["params"] = text[value_start:]
    return [(call["name"], call["params"]) for call in calls]


def _string_end(text: str, start: int) -> int:
    """The index of the quote closing the JSON string that opens at ``start``, or -1."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i
        i += 1
    return -1


def call_stream(choice: str | Tool, parser: str | None) -> ToolCallStream | None:
    """The stream that reads one choice's output for ``choice`` (None: plain content)."""
    if isinstance(choice, Tool):
        return NamedCallStream(choice.function.name)
    if choice == "required":
        return RequiredCallsStream()
    if choice == "auto" and parser is not None:
        return get_parser(parser)()
    return None
