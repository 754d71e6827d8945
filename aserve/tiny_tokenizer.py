"""A small byte-level BPE tokenizer, trained deterministically from text shipped here.

The embedded default model and the test models use it, so a new machine can run
aserve without downloading anything. Training is a plain, ordered BPE: the most frequent
adjacent pair wins, ties go to the lexicographically smallest pair, so the same corpus
always gives the same vocabulary byte for byte.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)

# ChatML, as many small chat models use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens
and predicts the next one. Serving a model means accepting requests from many users at
once, scheduling their tokens into batches, and streaming the answers back as they are
produced. The scheduler decides which requests run in each step; the key and value cache
keeps what the model has already computed, in fixed blocks of memory, so that a request
can grow without moving its history. When memory runs out, the newest request is paused
and its work is recomputed later. Every process of the server belongs to one tree: when
one part fails, the whole server stops cleanly and tells the truth about its health.
Once upon a time there was a small town by the sea. The people of the town were fishers
and bakers, teachers and builders. In the morning the boats went out, and in the evening
they came back with the day's catch. Children played on the beach and the old sat on
their porches, telling stories of storms and of calm summer nights. What is the capital
of France? Paris is the capital of France. How many days are in a week? There are seven
days in a week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 2025 2026. Hello, world! Hello there.
def main(): print("hello world") return 0 import os, sys; for i in range(10): x = i * 2
The user asked a question and the assistant answered it politely, clearly and briefly.
"""


def _train_merges(words: Counter[tuple[str, ...]], num_merges: int) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += freq
        if not pairs:
            break
        best_count = max(pairs.values())
        if best_count < 2:
            break
        best = min(pair for pair, count in pairs.items() if count == best_count)
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, freq in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += freq
        words = merged
    return merges


def build_tokenizer(num_merges: int = 400) -> Tokenizer:
    """A byte-level BPE ``Tokenizer`` with ``<s>`` added in front of every encoding."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words: Counter[tuple[str, ...]] = Counter()
    for piece, _ in pre.pre_tokenize_str(CORPUS):
        words[tuple(piece)] += 1
    merges = _train_merges(words, num_merges)
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return tok


def write_tokenizer_files(model_dir: Path, tokenizer: Tokenizer | None = None) -> Tokenizer:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)."""
    tok = tokenizer or build_tokenizer()
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok
