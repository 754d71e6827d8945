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
from aserve.engine.grammar import GrammarState

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


def test_pipeline_stages_sample_under_the_same_masks(model_dirs):
    """Three stages (Gemma 2's three layers): three steps in flight, so the engine writes
    the next step before a step's masks (they wait for the output of the step before),
    and the last stage reads ahead to them; the other stages skip them."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=SO(json=PERSON))
              for s in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    with LLM(str(model_dirs["gemma2"]), kv_cache_memory=1 << 24) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
    with LLM(str(model_dirs["gemma2"]), kv_cache_memory=1 << 24, pipeline_parallel_size=3) as pp3:
        got = pp3.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == expected
    for out in got[:3]:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


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
    state.add("r", compile_grammar(SO(choice=["yes"])), marker)
    state.consume("r", tok.encode("I think", add_special_tokens=False))
    assert state.masks(["r"])[0] == []  # still thinking: free
    state.consume("r", marker)
    ids, bits = state.masks(["free", "r"])
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : tok.vocab_size]
    assert ids == ["r"] and allowed[0].sum() >= 1
    assert all(tok.decode([t]) and "yes".startswith(tok.decode([t])) for t in allowed[0].nonzero()[0].tolist())


class _TwoInFlight:
    """An in-process executor run with two steps in flight, as worker processes run
    them, recording the order of what the engine sends: a step, its masks, its output."""

    max_inflight = 2

    def __init__(self, inner):
        self.inner = inner
        self.queue = []
        self.events = []

    def submit_model(self, sched):
        number = sum(1 for e in self.events if e[0] == "step")
        self.queue.append((number, sched))
        self.events.append(("step", number, sched.masks_follow))

    def submit_masks(self, masks):
        self.events.append(("masks", self.queue[0][0], tuple(masks.req_ids)))
        self.inner.submit_masks(masks)

    def wait_model(self):
        number, sched = self.queue.pop(0)
        self.inner.submit_model(sched)
        out = self.inner.wait_model()
        self.events.append(("output", number, None))
        return out

    def shutdown(self):
        pass


def test_the_masks_of_a_step_follow_it_once_the_step_before_is_done(llama_dir, llm):
    """With two steps in flight the engine core sends a step's masks after the output of
    the step before it and before the step after it, only for steps that asked; the
    tokens are the one-step-at-a-time engine's, and every output is valid."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=SO(json=PERSON))
              for s in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))  # free, and the last to end
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(llama_dir), kv_cache_memory=1 << 24) as two:
        executor = two.engine.executor = _TwoInFlight(two.engine.executor)
        two.engine.max_inflight = 2
        got = two.generate(PROMPTS, params)
        assert len(two.engine.grammars) == 0  # every matcher left with its request
    assert [o.outputs[0].token_ids for o in got] == expected
    for out in got[:3]:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)

    events = executor.events
    steps = [step for kind, step, _ in events if kind == "step"]
    asked = {step for kind, step, follow in events if kind == "step" and follow}
    assert len(asked) > 20 and len(asked) < len(steps)  # the free request's last steps ask nothing
    assert [step for kind, step, _ in events if kind == "masks"] == sorted(asked)
    for k, (kind, step, _) in enumerate(events):
        if kind == "masks":
            i = steps.index(step)
            seen = events[:k]
            assert i == 0 or ("output", steps[i - 1], None) in seen  # after the step before it ...
            # ... and ahead of the next
            assert i + 1 == len(steps) or not any(e[0] == "step" and e[1] == steps[i + 1] for e in seen)
            assert ("output", step, None) not in seen


def test_a_matcher_that_refused_a_token_may_still_end(llama_dir):
    """A refused token (an in-flight row the engine drops) leaves the matcher in error;
    its row then allows the end of sequence, never nothing, and the other rows keep their
    masks."""
    from aserve.frontend.tokenizer import Tokenizer

    tok = Tokenizer(Path(llama_dir))
    digits = compile_grammar(SO(regex="[0-9]{1,40}"))
    state = GrammarState(Path(llama_dir), tok.vocab_size, (tok.eos_token_id,))
    state.add("bad", digits, [])
    state.add("good", digits, [])
    letter = tok.encode("x", add_special_tokens=False)[0]
    one = tok.encode("1", add_special_tokens=False)[0]
    state.consume("bad", [letter])
    state.consume("good", [one])
    ids, bits = state.masks(["good", "bad"])
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : tok.vocab_size]
    assert ids == ["good", "bad"]
    assert allowed[1][tok.eos_token_id] == 1
    assert all(tok.decode([t]).isdigit() or t == tok.eos_token_id for t in allowed[1].nonzero()[0].tolist())
    assert allowed[0][one] == 1  # the good row still takes digits
    state.remove("bad")  # gone: its error with it
    assert state.masks(["good", "bad"])[0] == ["good"]
