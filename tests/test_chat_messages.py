"""Chat messages as the template gets them: a ``developer`` message given as ``system`` to
a template that never names that role, any other role as it is, and text content parts
that hold no string refused by name (the fuzzer found ``"text": []`` rendered as "[]")."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from aserve.api.protocol import ChatCompletionRequest, RequestError
from aserve.api.tools import template_messages
from aserve.frontend.tokenizer import Tokenizer


def _with_template(model_dir: Path, out_dir: Path, template: str) -> Path:
    out_dir.mkdir()
    for path in model_dir.iterdir():
        (out_dir / path.name).symlink_to(path)
    (out_dir / "chat_template.jinja").write_text(template)
    return out_dir


def _messages(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in pairs]


def test_a_developer_message_is_the_system_prompt_of_a_template_without_that_role(llama_dir):
    tok = Tokenizer(llama_dir)  # ChatML: writes whatever role it is given
    assert "developer" not in tok.chat_template
    as_developer = tok.apply_chat_template(_messages(("developer", "Be brief."), ("user", "Hi")))
    as_system = tok.apply_chat_template(_messages(("system", "Be brief."), ("user", "Hi")))
    assert as_developer == as_system and "<|im_start|>system\nBe brief." in as_developer


def test_a_template_that_names_the_developer_role_gets_it_and_others_pass_as_they_are(llama_dir, tmp_path):
    template = ("{% for m in messages %}{% if m['role'] == 'developer' %}[dev]{% endif %}"
                "{{ m['role'] }}:{{ m['content'] }};{% endfor %}")
    tok = Tokenizer(_with_template(llama_dir, tmp_path / "m", template))
    assert tok.apply_chat_template(_messages(("developer", "a"), ("ipython", "b")),
                                   add_generation_prompt=False) == "[dev]developer:a;ipython:b;"
    # A role the plain template does not know reaches it unchanged too.
    assert "<|im_start|>ipython\nout" in Tokenizer(llama_dir).apply_chat_template(_messages(("ipython", "out")))


def _request(content) -> ChatCompletionRequest:
    return msgspec.json.decode(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": content}]}),
                               type=ChatCompletionRequest)


@pytest.mark.parametrize("part,says", [
    ({"type": "text"}, "needs 'text', a string"),
    ({"type": "text", "text": []}, "not list"),
    ({"type": "text", "text": 7}, "not int"),
    ({"type": "text", "text": None}, "needs 'text', a string"),
])
def test_a_text_part_without_a_string_is_refused_naming_messages(part, says):
    with pytest.raises(RequestError, match=says) as info:
        template_messages(_request([{"type": "text", "text": "fine"}, part]).messages)
    assert info.value.param == "messages"


def test_text_parts_join_into_the_message_content():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert template_messages(_request(parts).messages) == [{"role": "user", "content": "Hello, world"}]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_over_http_a_bad_text_part_is_a_400_and_a_developer_message_is_served(llama_dir, anyio_backend):
    import httpx

    from aserve.api.app import ServerState, build_app
    from tests.test_api_fake_engine import FakeEngine

    engine = FakeEngine(llama_dir)
    app = build_app(ServerState(engine=engine, served_model_name="fake"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = await client.post(path, json={"messages": [{"role": "user", "content": [{"type": "text", "text": []}]}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        r = await client.post("/tokenize", json={"messages": [{"role": "developer", "content": "Be brief."},
                                                              {"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        system = await client.post("/tokenize", json={"messages": [{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "Hi"}]})
        assert r.json()["tokens"] == system.json()["tokens"]
