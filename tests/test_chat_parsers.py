"""Tool-call parsers, the forced-call stream and the reasoning parsers, on text in the
formats real chat templates produce; each read whole and one character at a time."""

from __future__ import annotations

import json

import pytest

from aserve.api.reasoning import ReasoningStream, prompt_closed_thinking
from aserve.api.tool_parsers import ArgumentsDelta, CallStart, ContentDelta, get_parser
from aserve.api.tools import NamedCallStream, RequiredCallsStream


def read(stream, text: str, *, piecewise: bool):
    pieces = list(text) if piecewise else [text]
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list] = {}
    for d in deltas:
        if isinstance(d, CallStart):
            assert d.index == len(calls) and d.id.startswith("call_")
            calls[d.index] = [d.name, ""]
        elif isinstance(d, ArgumentsDelta):
            assert d.index in calls, "arguments before their call's start"
            calls[d.index][1] += d.text
    return content, [(name, json.loads(args)) for name, args in calls.values()]


QWEN_OUTPUT = ('I will check both.\n<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
               '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
               '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>')
CASES = [
    ("hermes", QWEN_OUTPUT, "I will check both.\n\n", [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    ("hermes", "No tools needed: 4 < 5.", "No tools needed: 4 < 5.", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("llama3_json", '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": '
                    '"Fahrenheit"}}', "", [("get_current_conditions", {"location": "San Francisco, CA",
                                                                        "unit": "Fahrenheit"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "",
     [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                '"format": "celsius"}}]', "Sure. ", [("get_current_weather", {"location": "Paris, France",
                                                                           "format": "celsius"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
]


@pytest.mark.parametrize("piecewise", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parsers_read_real_formats(parser, text, content, calls, piecewise):
    assert read(get_parser(parser)(), text, piecewise=piecewise) == (content, calls)


@pytest.mark.parametrize("piecewise", [False, True], ids=["whole", "streamed"])
def test_forced_calls(piecewise):
    text = '[{"name":"get_weather","parameters":{"city":"Pa\\"ris}","days":[1,2]}},{"name":"noop","parameters":{}}]'
    assert read(RequiredCallsStream(), text, piecewise=piecewise) == (
        "", [("get_weather", {"city": 'Pa"ris}', "days": [1, 2]}), ("noop", {})])
    assert read(NamedCallStream("f"), '{"a":[1,{"b":2}]}', piecewise=piecewise) == ("", [("f", {"a": [1, {"b": 2}]})])


def test_required_calls_stream_arguments_as_they_are_written():
    stream = RequiredCallsStream()
    assert stream.feed('[{"name":"get_wea') == []  # the name is not whole yet
    start, args = stream.feed('ther","parameters":{"ci')
    assert isinstance(start, CallStart) and start.name == "get_weather"
    assert args == ArgumentsDelta(0, '{"ci')
    assert stream.feed('ty":"x"}}]') == [ArgumentsDelta(0, 'ty":"x"}')]


REASONING = [
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "\n\nIt is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),  # thinking off: no tags at all
    ("qwen3", "<think>still going", "still going", ""),  # cut short inside the thinking
    ("deepseek_r1", "Okay, 2 + 2.</think>It is 4.", "Okay, 2 + 2.", "It is 4."),
    ("deepseek_r1", "Okay, 2 + 2 is", "Okay, 2 + 2 is", ""),
    ("deepseek_r1", "a < b </thin", "a < b </thin", ""),
]


@pytest.mark.parametrize("piecewise", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("parser,text,reasoning,content", REASONING)
def test_reasoning_apart_from_content(parser, text, reasoning, content, piecewise):
    stream = ReasoningStream(parser)
    parts = [stream.feed(c) for c in (list(text) if piecewise else [text])] + [stream.finish()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content)


def test_a_prompt_that_closed_the_thinking():
    assert prompt_closed_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_closed_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_closed_thinking("<|im_start|>assistant\n")


def test_cli_lists_the_parsers():
    from aserve import cli
    from aserve.api import reasoning, tool_parsers

    assert cli.TOOL_PARSERS == tool_parsers.PARSERS and cli.REASONING_PARSERS == reasoning.PARSERS
