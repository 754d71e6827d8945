"""Structured outputs, front-end side: from ``StructuredOutputsParams`` to the grammar
the engine enforces, checked before anything is sent.

A grammar library does the matching: llguidance (``docs/structured-outputs.md`` says
why it and not xgrammar, with the figures). Here each request's constraint becomes one
llguidance grammar (its JSON form, a string), which is validated (a JSON Schema that is
not one, a feature llguidance cannot compile, a regex or grammar that does not parse: an
``InvalidInputError`` naming ``param``, a 400 over HTTP) and cached by its text, so a
schema seen before costs a dictionary lookup. The string goes to the engine with the
request (``EngineCoreRequest.grammar``); the engine core compiles it once for its tokenizer and
computes the masks that the workers apply to the logits (``aserve.engine.grammar``).

JSON is compact by default: llguidance's ``whitespace_flexible`` is off, so separators
are exactly ``,`` and ``:`` and no whitespace can run on between tokens; a small model
with random weights then still produces a whole object within a few dozen tokens.
"""

from __future__ import annotations

import functools
import json as jsonlib
from typing import Any

from aserve.errors import InvalidInputError
from aserve.sampling_params import StructuredOutputsParams

#: Grammars compiled and checked, by their text (a schema's JSON, a regex, ...).
CACHE_SIZE = 1024


class StructuredOutputError(InvalidInputError):
    """A constraint that cannot be compiled: a bad schema, regex or grammar."""


def compile_grammar(params: StructuredOutputsParams, *, param: str = "structured_outputs") -> str:
    """The llguidance grammar (a string) for ``params``; ``StructuredOutputError`` naming
    ``param`` when it does not compile."""
    compact = params.disable_any_whitespace
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = jsonlib.loads(schema)
            except ValueError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError("a JSON schema must be an object", param=param)
        return _json_grammar(jsonlib.dumps(schema), compact, param)
    if params.json_object:
        return _json_grammar('{"type": "object"}', compact, param)
    if params.regex is not None:
        return _checked("regex", params.regex, param)
    if params.choice is not None:
        return _checked("lark", "start: " + " | ".join(jsonlib.dumps(c) for c in params.choice), param)
    assert params.grammar is not None
    return _checked("grammar", params.grammar, param)


def json_schema_grammar(schema: dict[str, Any], *, param: str, compact: bool = True) -> str:
    """The grammar of one JSON Schema (tool calls build theirs this way)."""
    return _json_grammar(jsonlib.dumps(schema), compact, param)


def _json_grammar(schema_text: str, compact: bool, param: str) -> str:
    return _checked("json_compact" if compact else "json", schema_text, param)


def _checked(kind: str, text: str, param: str) -> str:
    grammar, error = _compile(kind, text)
    if error:
        raise StructuredOutputError(f"cannot compile the {_WHAT[kind]}: {error}", param=param)
    return grammar


_WHAT = {"json_compact": "JSON schema", "json": "JSON schema", "regex": "regex", "lark": "choice",
         "grammar": "grammar"}


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compile(kind: str, text: str) -> tuple[str, str]:
    """(grammar, error message or ""), cached by the constraint's text."""
    import llguidance  # imported on first use: servers that never constrain never load it

    matcher = llguidance.LLMatcher
    try:
        if kind in ("json", "json_compact"):
            grammar = matcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": kind == "json"})
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(text)
        else:
            if kind == "grammar" and "::=" in text:  # GBNF, as llama.cpp and xgrammar write it
                from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

                try:
                    text = gbnf_to_lark(text)
                except GbnfToLarkError as exc:
                    return "", f"not valid GBNF: {exc}"
            grammar = matcher.grammar_from_lark(text)
    except (ValueError, TypeError, RuntimeError) as exc:
        return "", str(exc)
    error = matcher.validate_grammar(grammar, None)
    return grammar, _first_line(error)


def _first_line(error: str) -> str:
    """llguidance's messages can carry a source excerpt over several lines; keep them on
    one line for an error body."""
    return " ".join(line.strip() for line in error.splitlines() if line.strip())
