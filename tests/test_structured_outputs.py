"""Structured outputs in the library: only the grammar makes a random-weight model's
output valid, so every output here is checked against its constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from aserve import LLM, SamplingParams
from aserve.frontend.structured_outputs import StructuredOutputError, compile_grammar
from aserve.sampling_params import StructuredOutputsParams as SO
from aserve.worker.grammar import GrammarState

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "admin"],
    "additionalProperties": False,
}
PROMPTS = ["Hello", "Describe someone", "x y z", "The quick brown fox"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(str(llama_dir), kv_cache_memory=1 << 24) as llm:
        yield llm


def texts(llm, constraint, *, n_prompts=4, **kwargs):
    params = SamplingParams(max_tokens=kwargs.pop("max_tokens", 120), structured_outputs=constraint, **kwargs)
    return [o.outputs[0] for o in llm.generate(PROMPTS[:n_prompts], params)]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3),
                                      dict(temperature=1.3, top_p=0.9)], ids=["greedy", "seeded", "sampled"])
def test_json_schema_always_validates(llm, sampling):
    for out in texts(llm, SO(json=PERSON), **sampling):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), PERSON)
        assert " " not in out.text.replace(json.loads(out.text)["name"], "")  # compact: no free whitespace


def test_json_object_choice_regex_and_grammars(llm):
    # Any object: a random model may write one key for ever (``length``); what ends, parses.
    finished = [out for out in texts(llm, SO(json_object=True), temperature=0) if out.finish_reason == "stop"]
    assert len(finished) >= 2 and all(isinstance(json.loads(out.text), dict) for out in finished)
    for out in texts(llm, SO(choice=["red", "green", "blue & \"light\""]), temperature=1.0, seed=2):
        assert out.text in ("red", "green", 'blue & "light"')
    for out in texts(llm, SO(regex=r"[0-9]{3}-[a-z]{2,4}"), temperature=1.0, seed=3):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.text)
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/'
    for out in texts(llm, SO(grammar=lark), temperature=1.0, seed=4, max_tokens=40):
        assert out.finish_reason == "length" or re.fullmatch(r"\([a-c](,[a-c])*\)", out.text)
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    for out in texts(llm, SO(grammar=gbnf), temperature=1.0, seed=5):
        assert out.text in ("yes", "no", "maybe")


def test_free_whitespace_on_request(llm):
    out = texts(llm, SO(json=PERSON, disable_any_whitespace=False), n_prompts=1, temperature=0, max_tokens=200)[0]
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), PERSON)


def test_a_grammar_that_cannot_finish_ends_with_length(llm):
    out = texts(llm, SO(regex=r"a{50}"), n_prompts=1, max_tokens=10)[0]
    assert (out.finish_reason, out.text) == ("length", "a" * len(out.token_ids))


def test_unconstrained_rows_are_unchanged(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    mixed = llm.generate(PROMPTS, [greedy, SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=PERSON)),
                                   greedy, SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(regex="[ab]+"))])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == [alone[0], alone[2]]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), PERSON)


def test_preempted_constrained_requests_resume_their_grammar(llama_dir):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=90, structured_outputs=SO(json=PERSON))
    with LLM(str(llama_dir), kv_cache_memory=1 << 24) as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, params)]
    per_block = 2 * 2 * 4 * 2 * 32 * 4  # layers * (k, v) * block * kv heads * head_dim * fp32
    with LLM(str(llama_dir), kv_cache_memory=34 * per_block, block_size=4, max_model_len=128,
             enable_prefix_caching=False) as tight:
        got = tight.generate(PROMPTS, params)
        assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == expected
    for out in got:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_tensor_parallel_ranks_mask_alike(llama_dir, llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=SO(json=PERSON)) for s in range(4)]
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(llama_dir), kv_cache_memory=1 << 24, tensor_parallel_size=2) as tp2:
        got = tp2.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == expected


@pytest.mark.parametrize("constraint,needle", [
    (SO(json={"type": "objekt"}), "Invalid type"),
    (SO(json="{not json"), "not valid JSON"),
    (SO(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "nowhere"),
    (SO(regex="a(b"), "unclosed group"),
    (SO(grammar="start: undefined_rule"), "undefined_rule"),
    (SO(grammar="root ::= (("), "grammar"),
])
def test_what_does_not_compile_is_refused_by_name(llm, constraint, needle):
    with pytest.raises(StructuredOutputError) as info:
        llm.generate("Hi", SamplingParams(structured_outputs=constraint))
    assert info.value.param == "structured_outputs" and needle in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_exactly_one_constraint():
    with pytest.raises(Exception, match="exactly one of"):
        SO(json=PERSON, regex="a")
    with pytest.raises(Exception, match="exactly one of"):
        SO()


def test_compiled_grammars_are_cached():
    before = compile_grammar.__wrapped__ if hasattr(compile_grammar, "__wrapped__") else None
    assert before is None  # the cache is inside, on the constraint's text
    from aserve.frontend import structured_outputs

    first = compile_grammar(SO(json={"type": "integer", "minimum": 7}))
    hits = structured_outputs._compile.cache_info().hits
    assert compile_grammar(SO(json={"type": "integer", "minimum": 7})) == first
    assert structured_outputs._compile.cache_info().hits == hits + 1


def test_the_grammar_starts_after_its_marker(llama_dir):
    from aserve.frontend.tokenizer import Tokenizer

    tok = Tokenizer(Path(llama_dir))
    state = GrammarState(Path(llama_dir), tok.vocab_size, ())
    marker = tok.encode("</think>", add_special_tokens=False)
    state.add("r", compile_grammar(SO(choice=["yes"])), marker, tok.encode("I think", add_special_tokens=False))
    assert state.allowed(["r"]) is None  # still thinking: free
    state.after_step([("r", token) for token in marker])
    rows, bits = state.allowed(["free", "r"])
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : tok.vocab_size]
    assert rows == [1] and allowed[0].sum() >= 1
    assert all(tok.decode([t]) and "yes".startswith(tok.decode([t])) for t in allowed[0].nonzero()[0].tolist())


def test_masks_kept_from_the_last_step_equal_masks_computed_on_the_spot(llama_dir):
    """The same walk through two GrammarStates, one using the masks it computed at the end
    of the last step and one made to compute every mask on the spot: requests join
    mid-walk, leave, come back after preemption (a new matcher fed the tokens so far), and
    one starts its grammar after a marker."""
    from aserve.frontend.tokenizer import Tokenizer

    tok = Tokenizer(Path(llama_dir))
    person, digits = compile_grammar(SO(json=PERSON)), compile_grammar(SO(regex="[0-9]{1,40}"))
    marker = tok.encode("</think>", add_special_tokens=False)
    kept = GrammarState(Path(llama_dir), tok.vocab_size, (tok.eos_token_id,))
    fresh = GrammarState(Path(llama_dir), tok.vocab_size, (tok.eos_token_id,))
    rng = np.random.default_rng(0)
    outputs: dict[str, list[int]] = {}
    grammars: dict[str, tuple[str, list[int]]] = {}

    def add(rid, grammar, after=()):
        grammars[rid] = (grammar, list(after))
        for state in (kept, fresh):
            state.add(rid, grammar, list(after), list(outputs.setdefault(rid, [])))

    add("a", person)
    add("b", digits)
    add("think", person, marker)
    reused = 0
    for step in range(60):
        if step == 5:
            add("c", person)
        if step == 20:  # "b" is preempted, then comes back with its tokens so far
            kept.remove("b"), fresh.remove("b")
            add("b", *grammars["b"])
        if step == 30:
            kept.remove("c"), fresh.remove("c")
        if step == 8:  # the marker arrives: "think" is constrained from now on
            outputs["think"] += marker
            kept.after_step([("think", t) for t in marker]), fresh.after_step([("think", t) for t in marker])
            continue
        rids = sorted(outputs) + ["free"]
        rids = [r for r in rids if r in kept or r == "free"]
        reused += sum(1 for r in rids if r in kept._next)
        fresh._next = {}
        got, expected = kept.allowed(rids), fresh.allowed(rids)
        assert got is not None and expected is not None
        assert got[0] == expected[0]
        assert np.array_equal(got[1], expected[1]), f"step {step}"
        sampled = []
        for row, mask in zip(got[0], got[1]):
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: tok.vocab_size].nonzero()[0]
            sampled.append((rids[row], int(rng.choice(allowed))))
        if "think" not in [r for r, _ in sampled]:  # still thinking: free tokens
            sampled.append(("think", int(rng.integers(tok.vocab_size))))
        for rid, t in sampled:
            outputs[rid].append(t)
        kept.after_step(sampled + [("free", 5)])
        fresh.after_step(sampled + [("free", 5)])
    assert reused > 100  # the kept masks were used, not recomputed


def test_a_matcher_that_refused_a_token_may_still_end(llama_dir):
    """A refused token (an in-flight row the engine drops) leaves the matcher in error;
    its row then allows the end of sequence, never nothing, and the other rows keep their
    masks."""
    from aserve.frontend.tokenizer import Tokenizer

    tok = Tokenizer(Path(llama_dir))
    digits = compile_grammar(SO(regex="[0-9]{1,40}"))
    state = GrammarState(Path(llama_dir), tok.vocab_size, (tok.eos_token_id,))
    state.add("bad", digits, [], [])
    state.add("good", digits, [], [])
    letter = tok.encode("x", add_special_tokens=False)[0]
    one = tok.encode("1", add_special_tokens=False)[0]
    state.after_step([("bad", letter), ("good", one)])
    rows, bits = state.allowed(["good", "bad"])
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : tok.vocab_size]
    assert rows == [0, 1]
    assert allowed[1][tok.eos_token_id] == 1
    assert all(tok.decode([t]).isdigit() or t == tok.eos_token_id for t in allowed[1].nonzero()[0].tolist())
    assert allowed[0][one] == 1  # the good row still takes digits
    state.remove("bad")  # gone: its error with it
    assert state.allowed(["good", "bad"])[0] == [0]
