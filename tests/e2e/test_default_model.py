"""``aserve run`` with no model answers a chat request with readable text: the committed
default model (aserve/default_model, docs/default-model.md), checked by what the text is
made of, with the random 7M model as the control the same check must reject."""

from __future__ import annotations

import re

import openai

from aserve.model_builder import ensure_default_model
from tests.e2e.server import Server

QUESTION = "What is a list comprehension?"


def english_words() -> set[str]:
    """Words of Python's own reference topics (an English word list that ships with it)."""
    import pydoc_data.topics

    return {w.lower() for text in pydoc_data.topics.topics.values() for w in re.findall(r"[A-Za-z]{2,}", text)}


def readable(text: str, vocabulary: set[str]) -> tuple[bool, str]:
    """Mostly printable ASCII, mostly words, mostly English ones; (verdict, why)."""
    if not text.strip():
        return False, "empty"
    printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text) / len(text)
    tokens = text.split()
    wordy = [t for t in tokens if re.fullmatch(r"[\"'(\[]*[A-Za-z][A-Za-z'-]*[.,;:!?)\]\"']*", t)]
    words = [w.lower() for t in wordy for w in re.findall(r"[A-Za-z]{2,}", t)]
    known = sum(w in vocabulary for w in words) / max(1, len(words))
    why = f"printable {printable:.2f}, {len(wordy)}/{len(tokens)} tokens are words, {known:.2f} of them known"
    return printable >= 0.95 and len(tokens) >= 3 and len(wordy) >= 0.7 * len(tokens) and known >= 0.8, why


def ask(server: Server) -> str:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=48, temperature=0)
    return reply.choices[0].message.content


def test_run_without_a_model_answers_readably(tmp_path):
    vocabulary = english_words()
    server = Server(None)
    try:
        answer = ask(server)
        assert "the default model" in server.output()
    finally:
        assert server.stop() == 0
    ok, why = readable(answer, vocabulary)
    assert ok, f"{why}: {answer!r}"
    # The control: the random-weight model of the tests fails the same check.
    random_server = Server(ensure_default_model(tmp_path))
    try:
        noise = ask(random_server)
    finally:
        assert random_server.stop() == 0
    ok, why = readable(noise, vocabulary)
    assert not ok, f"{why}: {noise!r}"
