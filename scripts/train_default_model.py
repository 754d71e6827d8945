#!/usr/bin/env python3
"""Trains aserve's default model: a small Llama on text that ships with Python itself.

    python scripts/train_default_model.py [--out aserve/default_model] [--steps 700]
                                          [--log docs/default-model-training.log]

The corpus is this interpreter's ``pydoc_data.topics`` (the language reference's topics
``help()`` shows) and the docstrings of its standard library's modules, classes and
functions (read with ``ast`` from the source files, nothing imported), in sorted order.
Every 20th document is held out. Besides the plain text, each topic and docstring also
appears once as a ChatML exchange ("Tell me about ..." / "What does ... do?" answered by
its first paragraph), so the model learns the chat template's shape and to end its turn
with ``<|im_end|>``.

Tokenizer: byte-level BPE with 4,096 entries (Hugging Face ``tokenizers``, trained on the
training split) and aserve's special tokens. Model: Llama, hidden 256, 4 layers, 4 heads,
MLP 704, tied embeddings (about 4.3M parameters), trained with AdamW on 256-token
windows, seeded, two threads. Written as float32 safetensors with the tokenizer, the
chat template and ``generation_config.json``; the log states held-out perplexity against
the same architecture with random weights, and a sample. Uses ``transformers`` (a test
dependency) for the model; serving it needs only aserve.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aserve.tiny_tokenizer import (  # noqa: E402
    BOS, EOS, IM_END, IM_START, PAD, SPECIAL_TOKENS, write_tokenizer_files,
)

VOCAB = 4096
SEQ = 256
HELD_OUT_EVERY = 20


def documents() -> list[tuple[str, str]]:
    """(title, text) pairs: the pydoc topics, then every docstring of 80+ characters in the
    standard library (tests, idlelib and site-packages left out), in a fixed order."""
    import pydoc_data.topics

    docs = [(name, text.strip()) for name, text in sorted(pydoc_data.topics.topics.items())]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if {"test", "tests", "idlelib", "site-packages", "lib2to3"} & set(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80:
                    name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                    docs.append((name, doc.strip()))
    return docs


def as_chat(title: str, text: str, rng: random.Random) -> str:
    """One ChatML exchange asking about ``title``, answered by the text's first paragraph."""
    answer = text.split("\n\n")[0].strip()
    question = rng.choice(["Tell me about {}.", "What is {}?", "What does {} do?", "Explain {}."]).format(title)
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model, data: torch.Tensor, batch: int = 16) -> float:
    model.eval()
    n = (data.numel() - 1) // SEQ
    total, count = 0.0, 0
    for start in range(0, n, batch):
        rows = [data[i * SEQ : i * SEQ + SEQ + 1] for i in range(start, min(n, start + batch))]
        x = torch.stack(rows)
        logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train()
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "aserve" / "default_model")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log", type=Path, default=ROOT / "docs" / "default-model-training.log")
    args = parser.parse_args()
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(2)
    rng = random.Random(0)
    log_lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_lines.append(msg)

    began = time.time()
    docs = documents()
    train_docs = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY]
    held_docs = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY == 0]
    train_texts = [text for _, text in train_docs] + [as_chat(t, x, rng) for t, x in train_docs]
    rng.shuffle(train_texts)
    held_texts = [text for _, text in held_docs]
    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
    log(f"corpus: {len(docs)} documents ({sum(len(x) for _, x in docs):,} characters), "
        f"{len(held_docs)} held out")
    tok = train_tokenizer(train_texts)
    train = encode_stream(tok, train_texts)
    held = encode_stream(tok, held_texts)
    log(f"tokenizer: {tok.get_vocab_size()} entries; {train.numel():,} training tokens, {held.numel():,} held out")

    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(PAD), initializer_range=0.02)
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    random_ppl = perplexity(model, held)
    log(f"model: {params:,} parameters; held-out perplexity with random weights {random_ppl:.1f}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    windows = (train.numel() - 1) // SEQ
    gen = torch.Generator().manual_seed(0)
    model.train()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, train.numel() - SEQ - 1, (args.batch,), generator=gen)
        x = torch.stack([train[s : s + SEQ + 1] for s in starts.tolist()])
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).logits.reshape(-1, config.vocab_size),
                                                 x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == 1:
            log(f"step {step:5d}  loss {loss.item():.3f}  lr {sched.get_last_lr()[0]:.2e}  "
                f"{time.time() - began:6.0f} s")
        if step % 500 == 0 and step < args.steps:
            log(f"step {step:5d}  held-out perplexity {perplexity(model, held):.1f}")
    trained_ppl = perplexity(model, held)
    tokens_seen = args.steps * args.batch * SEQ
    log(f"trained: {args.steps} steps of {args.batch} x {SEQ} tokens ({tokens_seen:,}, "
        f"{tokens_seen / train.numel():.1f} passes over {windows:,} windows); held-out perplexity {trained_ppl:.1f} "
        f"against {random_ppl:.1f} random")

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer_files(out, tok)
    generation = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    # A sample, greedy, through the chat template, as `aserve run` will answer.
    prompt = f"{IM_START}user\nWhat is a list comprehension?{IM_END}\n{IM_START}assistant\n"
    ids = tok.encode(prompt).ids
    model.eval()
    with torch.no_grad():
        for _ in range(60):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in generation["eos_token_id"]:
                break
    log("sample (greedy, chat template): " + json.dumps(tok.decode(ids[len(tok.encode(prompt).ids):])))
    log(f"wrote {out} in {time.time() - began:.0f} s")
    args.log.write_text("\n".join(log_lines) + "\n")


if __name__ == "__main__":
    main()
