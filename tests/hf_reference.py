"""Greedy decoding and logprobs with ``transformers``: the correctness reference."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(model_dir: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
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
