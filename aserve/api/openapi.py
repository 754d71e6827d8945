"""The OpenAPI 3.1 document of aserve's HTTP API, served at ``/openapi.json``.

The request bodies' schemas come from the msgspec structs the routes decode with
(``aserve.api.protocol``), so the document describes exactly what is accepted: a field
it does not list is refused. Responses are described by status only, plus OpenAI's error
body. The fuzz tests (``tests/test_fuzz.py``, ``scripts/fuzz.py``) generate requests from
it with Schemathesis.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from aserve import __version__
from aserve.api.limits import ServerLimits
from aserve.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}
#: What a generation route may answer besides 200 (docs/serving.md, "HTTP" and "Limits").
_GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 503)


def _responses(statuses: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": "OK"}}
    for status in statuses:
        out[str(status)] = {"description": "an error", "content": {"application/json": {"schema": _ERROR}}}
    return out


def _body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def _constrain(components: dict[str, Any], served: tuple[str, ...], limits: ServerLimits, max_model_len: int,
               vocab_size: int, num_engines: int) -> None:
    """The ranges the routes enforce (SamplingParams' checks, the server's limits), which
    msgspec's types alone do not say."""
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    shared = {
        "model": _nullable({"enum": list(served)}),
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n, "default": 1},
        "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": limits.max_n}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 2}),
        "seed": _nullable({"type": "integer", "minimum": 0, "maximum": 2**63 - 1}),
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len - 1}),
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": max_model_len - 1, "default": 0},
        "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars},
                                     {"type": "array", "maxItems": limits.max_stop,
                                      "items": {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}}]}),
        "stop_token_ids": _nullable({"type": "array", "items": token}),
        "logit_bias": _nullable({"type": "object", "maxProperties": limits.max_logit_bias,
                                 "propertyNames": {"pattern": "^[0-9]+$"},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}),
        "data_parallel_rank": _nullable({"type": "integer", "minimum": 0, "maximum": num_engines - 1}),
    }
    completion = components["CompletionRequest"]
    completion["properties"].update(shared)
    completion["properties"]["logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": limits.max_logprobs})
    completion["properties"]["prompt"] = {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "maxItems": limits.max_prompts, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": token},
        {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
         "items": {"type": "array", "minItems": 1, "items": token}}]}
    chat = components["ChatCompletionRequest"]
    chat["properties"].update(shared)
    chat["properties"]["max_completion_tokens"] = shared["max_tokens"]
    chat["properties"]["top_logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": limits.max_logprobs})
    chat["properties"]["messages"]["minItems"] = 1
    chat["properties"]["messages"]["maxItems"] = limits.max_messages
    message = components["ChatMessage"]["properties"]
    # Any role reaches the chat template (``developer`` as ``system`` where it never names
    # it: aserve.frontend.tokenizer), which may refuse it: a 400 naming messages.
    message["role"] = {"type": "string", "examples": ["system", "developer", "user", "assistant", "tool"]}
    message["content"] = _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]})
    components["DetokenizeRequest"]["properties"]["tokens"] = {"type": "array", "items": token}
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        components[name]["additionalProperties"] = False  # an unknown field is a 400


@functools.cache
def openapi_document(served: tuple[str, ...], limits: ServerLimits, max_model_len: int, vocab_size: int,
                     num_engines: int) -> dict[str, Any]:
    """The document for a server serving ``served`` under ``limits``."""
    structs = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
    _, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    _constrain(components, served, limits, max_model_len, vocab_size, num_engines)
    post = {
        "/v1/completions": ("CompletionRequest", _GENERATION_ERRORS),
        "/v1/chat/completions": ("ChatCompletionRequest", _GENERATION_ERRORS),
        "/tokenize": ("TokenizeRequest", (400, 401, 404, 413, 503)),
        "/detokenize": ("DetokenizeRequest", (400, 401, 413, 503)),
    }
    paths: dict[str, Any] = {path: {"post": {"operationId": path.strip("/").replace("/", "_"), "requestBody": _body(name),
                                             "responses": _responses(errors)}}
                             for path, (name, errors) in post.items()}
    seconds = {"type": "string", "pattern": r"^[1-9][0-9]{0,3}(\.[0-9]{1,3})?$"}  # a positive number
    headers = {"X-Request-Timeout": seconds, "X-Max-Queue-Time": seconds,
               "X-data-parallel-rank": {"type": "string", "pattern": f"^[0-{min(num_engines, 10) - 1}]$"}}
    for path in ("/v1/completions", "/v1/chat/completions"):
        paths[path]["post"]["parameters"] = [{"name": name, "in": "header", "required": False, "schema": schema}
                                             for name, schema in headers.items()]
    for path in ("/v1/models", "/version", "/health", "/ready", "/metrics", "/openapi.json"):
        paths[path] = {"get": {"operationId": path.strip("/").replace("/", "_").replace(".", "_"),
                               "responses": _responses((401, 503))}}
    return {"openapi": "3.1.0", "info": {"title": "aserve", "version": __version__}, "paths": paths,
            "components": {"schemas": components}}
