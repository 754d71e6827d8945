#!/usr/bin/env python3
"""Offline throughput: aserve ``LLM.generate`` against ``transformers`` ``generate``.

    python scripts/bench_offline.py [--model DIR] [--dtypes bfloat16 float32] [--num-prompts 32]
                                    [--input-len 128] [--output-len 128] [--threads 2] [--skip-hf]

Each runs in a fresh process of its own, one after the other (aserve tunes its
process's malloc, which must not speed up the baseline), on the same model directory (built
by ``make_bench_model.py`` when ``--model`` is not given), with the same random prompts
(fixed seed), greedy, ignoring EOS, so both produce exactly num_prompts x output_len
tokens. Prints output tokens/s for each and their ratio, and one JSON line per dtype.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from make_bench_model import config_for  # noqa: E402


def ensure_model(path: Path) -> Path:
    from aserve.model_builder import random_llama_weights, write_model_dir

    if not (path / "model.safetensors").is_file():
        cfg = config_for("152m")
        write_model_dir(path, cfg, random_llama_weights(cfg, seed=0))
    return path


def make_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    # Skip the special tokens at the start of the vocabulary.
    return [[rng.randrange(8, vocab) for _ in range(length)] for _ in range(n)]


def bench_aserve(model: Path, dtype: str, prompts: list[list[int]], output_len: int) -> float:
    from aserve import LLM, SamplingParams

    llm = LLM(str(model), dtype=dtype, kv_cache_memory=2 << 30)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    del llm
    gc.collect()
    return len(prompts) * output_len / elapsed


def bench_transformers(model: Path, dtype: str, prompts: list[list[int]], output_len: int) -> float:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=2)
    with torch.inference_mode():
        hf.generate(ids[:2], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + output_len
    del hf
    gc.collect()
    return len(prompts) * output_len / elapsed


def _run_with_threads(conn, fn, threads: int, *args) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(threads)
    conn.send(fn(*args))
    conn.close()


def _isolated(fn, threads: int, *args) -> float:  # type: ignore[no-untyped-def]
    """Run one measurement in a fresh process: aserve tunes the process's malloc
    (aserve.worker.cpu_memory), which must not speed up the transformers baseline.
    A plain process and a pipe: a Pool's locks would outlive the child's resource
    tracker, which aserve keeps from starting, and be reported as leaked."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_with_threads, args=(send, fn, threads, *args))
    proc.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        raise RuntimeError(f"the measurement process failed (exit code {proc.join() or proc.exitcode})") from None
    finally:
        proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("bench-models/llama-152m"))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true", help="measure aserve only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = ensure_model(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, args.num_prompts, args.input_len)
    print(f"model {model}, {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
          f"{args.threads} threads, torch {torch.__version__}")
    print(f"{'dtype':<10} {'aserve tok/s':>13} {'transformers tok/s':>19} {'ratio':>7}")
    for dtype in args.dtypes:
        ours = _isolated(bench_aserve, args.threads, model, dtype, prompts, args.output_len)
        theirs = None if args.skip_hf else _isolated(bench_transformers, args.threads, model, dtype, prompts, args.output_len)
        ratio = ours / theirs if theirs else float("nan")
        print(f"{dtype:<10} {ours:>13.1f} {theirs or float('nan'):>19.1f} {ratio:>7.2f}")
        print(json.dumps({"dtype": dtype, "aserve_tok_s": round(ours, 1),
                          "transformers_tok_s": None if theirs is None else round(theirs, 1),
                          "ratio": None if theirs is None else round(ratio, 3)}))


if __name__ == "__main__":
    main()
