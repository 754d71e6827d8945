"""A Gemma 3 and a Qwen3-MoE test model served end to end: ``aserve run`` (TP = 2, driven
by the openai client, completions and streamed chat) and ``AsyncLLM`` in an asyncio
application, each giving transformers' greedy tokens."""

from __future__ import annotations

import anyio
import openai
import pytest

from aserve import LLM, SamplingParams
from aserve.frontend.async_llm import AsyncLLM
from tests.e2e.server import Server
from tests.hf_reference import hf_greedy, load_hf
from tests.models import EAGER

ARCHS = ["gemma3", "qwen3_moe"]
#: Longer than the test Gemma 3's 8-token window.
PROMPT = "Once upon a time there was a small town by the sea, and the people of the town"
MAX_NEW = 10


@pytest.fixture(scope="module")
def expected(model_dirs):
    """arch -> (prompt ids, transformers' greedy tokens, the offline engine's text of them)."""
    out = {}
    for arch in ARCHS:
        llm = LLM(str(model_dirs[arch]), kv_cache_memory=1 << 22)
        ids = llm.get_tokenizer().encode(PROMPT)
        want = hf_greedy(load_hf(model_dirs[arch], eager=arch in EAGER), ids, MAX_NEW)
        offline = llm.generate([ids], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))[0].outputs[0]
        assert offline.token_ids == want
        out[arch] = (ids, want, offline.text)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_served_at_tp2_through_the_openai_client(arch, model_dirs, expected):
    ids, _, text = expected[arch]
    server = Server(model_dirs[arch], "--tp", "2", "--served-model-name", arch)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(model=arch, prompt=ids, max_tokens=MAX_NEW, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == text and out.usage.completion_tokens == MAX_NEW
        stream = client.chat.completions.create(model=arch, messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=MAX_NEW, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        whole = client.chat.completions.create(model=arch, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True})
        assert text == whole.choices[0].message.content and whole.usage.completion_tokens == MAX_NEW
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_async_llm_in_an_asyncio_application(arch, model_dirs, expected):
    ids, want, _ = expected[arch]

    async def main() -> list[int]:
        async with AsyncLLM(str(model_dirs[arch]), kv_cache_memory=1 << 24) as engine:
            final = None
            async for out in engine.generate(ids, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                                             request_id="r"):
                final = out
            return final.outputs[0].token_ids

    assert anyio.run(main, backend="asyncio") == want
