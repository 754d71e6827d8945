#!/usr/bin/env python3
"""Which modules each process of an ``aserve run`` tree has loaded.

    python scripts/spawned_modules.py [--model DIR] [--tp 2] [--dp 2] [RUN FLAGS ...]

Starts ``aserve run`` with a ``sitecustomize`` on ``PYTHONPATH`` that, in every process
of the tree (children are spawned and inherit the environment), writes the process's
title and its ``sys.modules`` to a file when the process exits. Waits for ``/ready``,
stops the tree with SIGTERM, and prints one JSON line per process title: how many
modules it loaded, how many of aserve's, and which front-end modules (``FRONT_END``):
an engine core, the coordinator and a worker should load none. aserve itself is not
changed for this; the hook lives only in the temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

#: Modules that belong to the HTTP front end: the API layer, the library front end, the
#: composition root, and the libraries only they need.
FRONT_END = ("aserve.api", "aserve.frontend", "aserve.launch", "aserve.bench", "tokenizers", "jinja2", "starlette",
             "hypercorn", "h11", "h2", "prometheus_client")

_HOOK = '''
import atexit, os, sys

def _aserve_dump_modules():
    try:
        with open("/proc/self/cmdline", "rb") as f:
            title = f.read().split(b"\\0")[0].decode()
    except OSError:
        title = "?"
    path = os.path.join({out!r}, f"{{os.getpid()}}.txt")  # one file per process
    with open(path, "w") as f:
        f.write(title + "\\n" + "\\n".join(sorted(sys.modules)))

atexit.register(_aserve_dump_modules)
'''


def is_front_end(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in FRONT_END)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loaded_modules(model: str | None, run_args: list[str], timeout: float = 180) -> list[tuple[str, list[str]]]:
    """(process title, sorted module names) for every process of one ``aserve run`` tree."""
    with tempfile.TemporaryDirectory(prefix="aserve-modules-") as tmp:
        hook, out = Path(tmp, "hook"), Path(tmp, "out")
        hook.mkdir()
        out.mkdir()
        (hook / "sitecustomize.py").write_text(_HOOK.format(out=str(out)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])}
        port = free_port()
        cmd = [sys.executable, "-m", "aserve", "run", *([model] if model else []), "--port", str(port),
               "--log-level", "WARNING", *run_args]
        log = Path(tmp, "stderr")
        with open(log, "w") as stderr:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"aserve run exited while starting:\n{log.read_text()}")
                if time.monotonic() > deadline:
                    raise TimeoutError("aserve run did not become ready")
                time.sleep(0.1)  # a readiness probe's period
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        result = []
        for path in sorted(out.glob("*.txt")):
            title, *modules = path.read_text().splitlines()
            result.append((title, modules))
        return sorted(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--tp", default="2")
    parser.add_argument("--dp", default="2")
    args, rest = parser.parse_known_args()
    for title, modules in loaded_modules(args.model, ["--tp", args.tp, "--dp", args.dp, *rest]):
        front = [m for m in modules if is_front_end(m)]
        print(json.dumps({"process": title, "modules": len(modules),
                          "aserve_modules": sum(m.split(".")[0] == "aserve" for m in modules),
                          "front_end_modules": len(front), "front_end_sample": front[:8]}))


if __name__ == "__main__":
    main()
