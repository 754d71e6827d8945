"""Llama 3.1-3.3's JSON tool calls: the whole reply is the call (or calls, separated by
``;``), optionally after ``<|python_tag|>``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A reply that does not start with ``{`` (after the tag and whitespace) is content, and is
streamed as such from its first character; one that does is held until it ends, then
read as calls (or, if it does not parse, returned as content).
"""

from __future__ import annotations

import json

from aserve.api.tool_parsers import ContentDelta, Delta, ToolCallStream, parse_call

TAG = "<|python_tag|>"


class Llama3JsonStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._mode: str | None = None  # None: undecided; "content" or "calls"

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        if self._mode is None:
            head = self._buffer.lstrip()
            if head.startswith(TAG):
                head = head[len(TAG):].lstrip()
            if not head or TAG.startswith(head):
                return []  # only whitespace, or the tag's start, so far
            self._mode = "calls" if head.startswith("{") else "content"
        if self._mode == "content":
            text, self._buffer = self._buffer, ""
            return [ContentDelta(text)] if text else []
        return []

    def finish(self) -> list[Delta]:
        text, self._buffer = self._buffer, ""
        if self._mode != "calls":
            return [ContentDelta(text)] if text else []
        body = text.strip().removeprefix(TAG)
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        body = body.strip()
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except ValueError:
                return [ContentDelta(text)]
            call = parse_call(obj, "parameters")
            if call is None:
                return [ContentDelta(text)]
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        out: list[Delta] = []
        for call in calls:
            out += self._call(*call)
        return out
