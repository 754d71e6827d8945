"""Offline output tokens/s of ``LLM`` at a tensor-parallel size and ``tp_comm``, with a
digest of the tokens (equal digests: the same greedy tokens).

    python scripts/tp_comm_bench.py MODEL_DIR --tp 2 --tp-comm shm [--prompts 32] [--dtype float32]

Prompts are random token ids (fixed seed) of ``--input-len`` tokens; each generates
``--output-len`` greedy tokens with ignore_eos. Run the two ``--tp-comm`` values one after
the other, alternating, and compare their ratio (docs/parallelism.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time

from aserve import LLM, SamplingParams
from aserve.config import TP_COMMS


def main(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 400) for _ in range(args.input_len)]}
               for _ in range(args.prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(args.model, dtype=args.dtype, tensor_parallel_size=args.tp, tp_comm=args.tp_comm,
             kv_cache_memory=1 << 28) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, greedy)
        seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps({"tp": args.tp, "tp_comm": args.tp_comm, "dtype": args.dtype, "seconds": round(seconds, 3),
                      "output_tok_s": round(sum(map(len, tokens)) / seconds, 1),
                      "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tp-comm", default="shm", choices=TP_COMMS)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    main(parser.parse_args())
