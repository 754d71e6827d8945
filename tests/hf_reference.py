"""Greedy decoding and logprobs with ``transformers``: the correctness reference."""

from __future__ import annotations

from pathlib import Path

import torch

from aserve.sampling_params import SamplingParams

#: Prompts of 2 to 48 tokens: with a small step budget the longer ones prefill in chunks,
#: the later chunks over cached context.
PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. A language model reads a sequence",
    "Once upon a time there was a small town by the sea. The people of the town were fishers and bakers, "
    "teachers and builders. In the morning the boats went out",
]
#: 16 greedy tokens with the chosen token's logprob.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)


def load_hf(model_dir: Path, *, eager: bool = False):
    """``eager``: transformers' eager attention (Gemma 2's soft-capping has no other)."""
    import transformers

    kwargs = {"attn_implementation": "eager"} if eager else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens, ignoring EOS, with a full forward pass per token (no cache tricks)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-softmax of the logits at every position."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
