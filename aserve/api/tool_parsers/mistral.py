"""Mistral's tool calls: ``[TOOL_CALLS]`` and then a JSON list of calls::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

(and, from tokenizer v11, ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}``, one call per
marker). Text before the marker is content; what follows it is read when the reply ends.
"""

from __future__ import annotations

import json

from aserve.api.tool_parsers import ContentDelta, Delta, ToolCallStream, held_back, parse_call

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralStream(ToolCallStream):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._calls = False

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        if self._calls:
            return []
        at = self._buffer.find(MARKER)
        if at >= 0:
            content, self._buffer, self._calls = self._buffer[:at], self._buffer[at:], True
            return [ContentDelta(content)] if content else []
        keep = held_back(self._buffer, MARKER)
        content, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
        return [ContentDelta(content)] if content else []

    def finish(self) -> list[Delta]:
        text, self._buffer = self._buffer, ""
        if not self._calls:
            return [ContentDelta(text)] if text else []
        calls = self._parse(text)
        if calls is None:
            return [ContentDelta(text)]
        out: list[Delta] = []
        for call in calls:
            out += self._call(*call)
        return out

    @staticmethod
    def _parse(text: str) -> list[tuple[str, object]] | None:
        pieces = [p.strip() for p in text.split(MARKER) if p.strip()]
        calls = []
        for piece in pieces:
            if ARGS in piece:  # v11: name[ARGS]{...}
                name, _, args = piece.partition(ARGS)
                try:
                    calls.append((name.strip(), json.loads(args)))
                except ValueError:
                    return None
                continue
            try:
                obj = json.loads(piece)
            except ValueError:
                return None
            for item in obj if isinstance(obj, list) else [obj]:
                call = parse_call(item)
                if call is None:
                    return None
                calls.append(call)
        return calls
