"""Structured outputs, tool calls and reasoning through ``aserve run`` and the official
``openai`` client, on one engine, at TP = 2 and with two DP engines.

The models have random (or scripted) weights: only the grammar makes their output valid,
so every constrained output is checked against its constraint.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server import Server
from tests.models import SCRIPT, build_scripted_model, with_tools_template

RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "count": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99},
                   "flag": {"type": "boolean"}},
    "required": ["name", "count", "flag"], "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # the answer is constrained from its start
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
FLAGS = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3",
         "--max-model-len", "2048"]  # tools in the prompt: a long system message


@pytest.fixture(scope="module", params=[[], ["--tp", "2"], ["--dp", "2"]], ids=["tp1", "tp2", "dp2"])
def server(request, llama_dir, tmp_path_factory):
    model = with_tools_template(llama_dir, tmp_path_factory.mktemp("tools") / "tiny-tools")
    srv = Server(model, *FLAGS, *request.param)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    # Closed, not left to the garbage collector: a pooled connection it finds open warns.
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0) as client:
        yield client


def model_name(client):
    return client.models.list().data[0].id


def chat(client, **kwargs):
    kwargs.setdefault("extra_body", {})
    kwargs["extra_body"] = {**NO_THINKING, **kwargs["extra_body"]}
    return client.chat.completions.create(model=model_name(client), messages=kwargs.pop("messages", USER), **kwargs)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5), dict(temperature=1.2)],
                         ids=["greedy", "seeded", "sampled"])
def test_json_schema_chat_always_validates(client, sampling):
    out = chat(client, n=3, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}, **sampling)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), RECORD)


def test_json_schema_streamed(client):
    stream = chat(client, stream=True, max_tokens=80, temperature=1.0,
                  response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), RECORD)


def test_completions_endpoint_and_every_constraint_kind(client):
    model = model_name(client)

    def complete(**body):
        body = {"max_tokens": 60, "temperature": 1.0, "seed": 3, **body}
        out = client.completions.create(model=model, prompt="Once upon a time", **body)
        return out.choices[0]

    jsonschema.validate(json.loads(complete(extra_body={"response_format": {  # the client's completions lack it
        "type": "json_schema", "json_schema": {"name": "r", "schema": RECORD}}}).text), RECORD)
    assert complete(extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}}).text in ("alpha", "beta")
    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", complete(extra_body={"guided_regex": r"[0-9]{2}:[0-9]{2}"}).text)
    assert complete(extra_body={"guided_choice": ["yes", "no"]}).text in ("yes", "no")
    assert complete(extra_body={"structured_outputs": {"grammar": 'root ::= "on" | "off"'}}).text in ("on", "off")
    assert complete(extra_body={"guided_grammar": 'start: "x" "y"+\n'}, max_tokens=5).text.startswith("xy")
    obj = chat(client, response_format={"type": "json_object"}, temperature=0, max_tokens=60).choices[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
    schema = complete(extra_body={"guided_json": RECORD})
    jsonschema.validate(json.loads(schema.text), RECORD)


def test_named_tool_call(client):
    out = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
               temperature=1.0, max_tokens=60).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    (call,) = out.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_calls(client, parallel):
    out = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, temperature=1.0,
               seed=2, max_tokens=120).choices[0]
    calls = out.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    if not parallel:
        assert out.finish_reason == "tool_calls"
    complete = calls if out.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut by max_tokens
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_tool_calls_in_the_models_format(client):
    # The model's own (Hermes) format, forced by a grammar so a random model writes it;
    # the server's --tool-call-parser reads it.
    hermes = r'Sure\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    out = chat(client, tools=TOOLS, tool_choice="auto", temperature=1.0, max_tokens=80,
               extra_body={"structured_outputs": {"regex": hermes}}).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Sure.\n"
    (call,) = out.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    plain = chat(client, tools=TOOLS, temperature=0, max_tokens=20,
                 extra_body={"structured_outputs": {"regex": "[a-z ]{5,20}"}}).choices[0]
    assert plain.message.tool_calls is None and re.fullmatch("[a-z ]{5,20}", plain.message.content)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_tool_calls_accumulate_into_valid_arguments(client, tool_choice):
    with client.chat.completions.stream(model=model_name(client), messages=USER, tools=TOOLS, tool_choice=tool_choice,
                                        parallel_tool_calls=False, temperature=1.0, max_tokens=80,
                                        extra_body=NO_THINKING) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    fragments = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(fragments) > 1  # the arguments arrive in pieces as they are generated
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert "".join(f.arguments_delta for f in fragments) == call.function.arguments


def test_tool_history_reaches_the_template(client):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0)
    assert out.choices[0].message.tool_calls is None
    tokens = out.usage.prompt_tokens
    bare = chat(client, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0).usage.prompt_tokens
    assert tokens > bare  # the call and its result are in the prompt


def test_a_schema_with_an_integer_past_64_bits_is_served(client):
    """The schema travels as compiled grammar text, never as the request's JSON: a number
    msgpack cannot carry (past 64 bits) in it is matched like any other. (Before, the
    request was accepted and then failed to reach the engine: a 500.)"""
    big = 123456789012345678901234567890
    schema = {"type": "integer", "minimum": 0, "maximum": big}
    out = chat(client, max_tokens=40, temperature=0,
               response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}).choices[0]
    # (llguidance reads JSON numbers as doubles, so a bound this large is matched to a
    # double's precision: an exact `enum` of it would not be.)
    assert out.finish_reason == "stop" and 0 <= json.loads(out.message.content) <= big


BAD = [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     "response_format", "Invalid type"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}), "response_format", "missing"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex", "regex"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: nowhere"}}), "structured_outputs", "nowhere"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs", "exactly one"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex", "one output"),
    (dict(response_format={"type": "xml"}), "response_format", "must be text"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools", "bad name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]), "tools",
     "Invalid type"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools", "must be 'function'"),
    (dict(extra_body={"guided_decoding_backend": "outlines", "guided_regex": "a"}), "guided_decoding_backend",
     "outlines"),
]


@pytest.mark.parametrize("body,param,needle", BAD, ids=[b[1] + "-" + b[2] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(client, body, param, needle):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=5, **body)
    error = info.value.body
    assert error["param"] == param and needle in error["message"], error
    assert chat(client, max_tokens=2).choices[0].message is not None  # still serving


def test_served_under_its_path_and_its_name(server, client):
    path = str(server.model_path)
    for name in (path, server.model_path.name):
        r = httpx.post(server.base_url + "/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert client.models.list().data[0].id == server.model_path.name
    assert httpx.post(server.base_url + "/v1/completions", json={"model": "other", "prompt": "Hi"}).status_code == 404


# -- reasoning, on a model that thinks on cue ---------------------------------------------------


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model = build_scripted_model(tmp_path_factory.mktemp("scripted") / "thinker")
    srv = Server(model, "--reasoning-parser", "qwen3", "--tp", "2", "--max-model-len", "2048")
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0) as client:
        yield client
    assert srv.stop() == 0


def test_reasoning_apart_from_content(thinker):
    out = thinker.chat.completions.create(model="thinker", messages=USER, temperature=0, max_tokens=20)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == ("".join(SCRIPT[1:3]), SCRIPT[4])
    stream = thinker.chat.completions.create(model="thinker", messages=USER, temperature=0, max_tokens=20, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "ab"
    assert "".join(d.content or "" for d in deltas) == "c"


def test_the_constraint_starts_after_the_thinking(thinker):
    out = thinker.chat.completions.create(model="thinker", messages=USER, temperature=0, max_tokens=60,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "r", "schema": RECORD}})
    message = out.choices[0].message
    assert message.reasoning_content == "ab"  # the script's thinking, unconstrained
    jsonschema.validate(json.loads(message.content), RECORD)  # then the grammar's answer
    closed = thinker.chat.completions.create(model="thinker", messages=USER, temperature=0, max_tokens=60,
                                             extra_body={"guided_choice": ["c", "d"], **NO_THINKING})
    assert (closed.choices[0].message.reasoning_content, closed.choices[0].message.content) == (None, "c")
