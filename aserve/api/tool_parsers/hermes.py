"""Hermes' tool-call format, used by Qwen 2.5 and Qwen 3 templates::

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content; each tag pair holds one JSON call. A call that does
not parse stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json

from aserve.api.tool_parsers import ContentDelta, Delta, ToolCallStream, held_back, parse_call

START, END = "<tool_call>", "</tool_call>"


class HermesStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(START)
                if at < 0:
                    keep = held_back(self._buffer, START)
                    content, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                    if content:
                        out.append(ContentDelta(content))
                    return out
                if at:
                    out.append(ContentDelta(self._buffer[:at]))
                self._buffer, self._in_call = self._buffer[at + len(START):], True
            at = self._buffer.find(END)
            if at < 0:
                return out
            body, self._buffer, self._in_call = self._buffer[:at], self._buffer[at + len(END):], False
            out += self._one(body)

    def _one(self, body: str) -> list[Delta]:
        try:
            call = parse_call(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            return [ContentDelta(START + body + END)]
        return self._call(*call)

    def finish(self) -> list[Delta]:
        rest, self._buffer = self._buffer, ""
        if self._in_call:  # cut off inside a call (max_tokens): say what was written
            return [ContentDelta(START + rest)] if rest else [ContentDelta(START)]
        return [ContentDelta(rest)] if rest else []
