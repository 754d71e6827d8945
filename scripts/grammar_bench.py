#!/usr/bin/env python3
"""llguidance against xgrammar on this CPU: a JSON schema's compile time, and the time
to compute one token mask, at a vocabulary's size.

    python scripts/grammar_bench.py [--tokenizer DIR ...] [--steps 200] [--runs 5]

For each tokenizer (``tokenizer.json`` in each DIR; default: the benchmark models',
``bench-models/llama-7m``, and a 32,000-token byte-level BPE this script trains on
Python's own documentation, for a size like real models') and each library that
imports: the median of ``--runs`` cold compiles (no cache) of four schemas (a flat
record, a nested one, the structured benchmark load's list of records, a tool-call list), then masks along a random valid walk through
each grammar (compute the mask, pick an allowed token, consume it), ``--steps`` steps,
p50 and p99 in microseconds. One thread, as a worker computes a row's mask.
JSON on the last line. xgrammar needs torch and transformers; it is not a dependency of
aserve, so run this from a venv that has both libraries.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCHEMAS = {
    "record": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"}, "admin": {"type": "boolean"}},
        "required": ["name", "age", "email", "admin"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                "price": {"type": "number"}}, "required": ["sku", "qty", "price"], "additionalProperties": False}},
            "status": {"enum": ["new", "paid", "shipped"]}}, "required": ["id", "items", "status"],
            "additionalProperties": False}}, "required": ["order"], "additionalProperties": False},
    # aserve bench serve --structured json_schema's schema (aserve.bench.serve.BENCH_SCHEMA)
    "records": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999}, "name": {"type": "string", "maxLength": 16},
        "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"], "additionalProperties": False}},
    "tool_calls": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": f"tool_{i}"}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city"], "additionalProperties": False}},
         "required": ["name", "parameters"], "additionalProperties": False} for i in range(8)]}},
}


def train_bpe(size: int) -> Path:
    """A byte-level BPE of ``size`` tokens over pydoc's topics and the stdlib's docstrings."""
    import pydoc_data.topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = list(pydoc_data.topics.topics.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts * 4, trainer)
    out = Path(tempfile.mkdtemp(prefix="grammar-bench-")) / f"bpe{size}"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return out


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_us": round(ordered[len(ordered) // 2] * 1e6, 1),
            "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 1)}


def bench_llguidance(tokenizer_dir: Path, steps: int, runs: int, rng: random.Random) -> dict:
    import llguidance
    import numpy as np

    t = time.perf_counter()
    tok = llguidance.LLTokenizer((tokenizer_dir / "tokenizer.json").read_text())
    result: dict = {"tokenizer_ms": round((time.perf_counter() - t) * 1e3, 1)}
    words = (tok.vocab_size + 31) // 32
    for name, schema in SCHEMAS.items():
        compiles = []
        for _ in range(runs):
            t = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                     defaults={"whitespace_flexible": False})
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
            compiles.append(time.perf_counter() - t)
        masks, buf = [], np.zeros(words, dtype=np.int32)
        for _ in range(runs):
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
            for _ in range(steps):
                if matcher.is_stopped():
                    break
                t = time.perf_counter()
                matcher.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
                masks.append(time.perf_counter() - t)
                allowed = np.nonzero(np.unpackbits(buf.view(np.uint8), bitorder="little")[: tok.vocab_size])[0]
                matcher.consume_token(int(rng.choice(allowed)))
        result[name] = {"compile_ms": round(statistics.median(compiles) * 1e3, 2), **percentiles(masks),
                        "masks": len(masks)}
    return result


def bench_xgrammar(tokenizer_dir: Path, steps: int, runs: int, rng: random.Random) -> dict:
    import numpy as np
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"),
                                              eos_token="</s>")
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    result: dict = {"tokenizer_ms": round((time.perf_counter() - t) * 1e3, 1)}
    for name, schema in SCHEMAS.items():
        compiles = []
        for _ in range(runs):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            t = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            compiles.append(time.perf_counter() - t)
        masks = []
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        for _ in range(runs):
            matcher = xgr.GrammarMatcher(compiled)
            for _ in range(steps):
                if matcher.is_terminated():
                    break
                t = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                masks.append(time.perf_counter() - t)
                row = bitmask[0].numpy().view("uint8")
                allowed = np.nonzero(np.unpackbits(row, bitorder="little")[: info.vocab_size])[0]
                if not matcher.accept_token(int(rng.choice(allowed))):
                    break
        result[name] = {"compile_ms": round(statistics.median(compiles) * 1e3, 2), **percentiles(masks),
                        "masks": len(masks)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", nargs="*", default=None, help="directories with tokenizer.json")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    dirs = [Path(d) for d in args.tokenizer] if args.tokenizer else [ROOT / "bench-models" / "llama-7m", train_bpe(32000)]
    out = {}
    for d in dirs:
        for library, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            try:
                figures = bench(d, args.steps, args.runs, random.Random(0))
            except ImportError as exc:
                print(f"{library}: not importable ({exc}); skipped")
                continue
            key = f"{d.name} {library}"
            out[key] = figures
            print(key, json.dumps(figures))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
