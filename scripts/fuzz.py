#!/usr/bin/env python3
"""Fuzz a server with many generated requests (``tests/fuzzing.py``): every route, valid
and malformed, from its ``/openapi.json``; fails on the first 5xx or hang (Hypothesis
then shrinks it to a smallest request) and checks the server serves on.

    python scripts/fuzz.py --examples 2000 [--url http://127.0.0.1:8000 | --model DIR [--server-args "..."]]

Without ``--url`` it starts ``aserve run MODEL`` itself (the random test model when no
``--model`` is given) and stops it at the end.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fuzzing import fuzz, still_serves  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1000, help="per route and mode (default 1000)")
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default=None, help="the model to serve (default: the tests' random Llama)")
    parser.add_argument("--server-args", default="--max-n 4", help="more flags for aserve run")
    args = parser.parse_args()
    server = None
    base = args.url
    if base is None:
        from tests.e2e.server import Server

        model = args.model
        if model is None:
            from tests.models import build_model

            model = build_model("llama", Path(tempfile.mkdtemp()) / "llama")
        server = Server(Path(model), *shlex.split(args.server_args))
        base = server.base_url
    start = time.monotonic()
    try:
        counts = fuzz(base, examples=args.examples)
        still_serves(base)
    finally:
        if server is not None:
            server.stop()
    for (path, mode, status), n in sorted(counts.items()):
        print(f"{path:24} {mode:9} {status} {n}")
    print(f"{sum(counts.values())} requests in {time.monotonic() - start:.0f} s, none a 5xx; the server serves on")


if __name__ == "__main__":
    main()
