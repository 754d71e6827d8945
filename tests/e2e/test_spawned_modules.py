"""An engine core, the coordinator and a worker load none of the front end.

The tree is a real ``aserve run --tp 2 --dp 2``; ``scripts/spawned_modules.py`` records
every process's ``sys.modules`` as it exits (a ``sitecustomize`` hook in a temporary
directory, nothing in aserve itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from spawned_modules import is_front_end, loaded_modules  # noqa: E402


def test_engine_side_processes_load_no_front_end_module(llama_dir):
    processes = loaded_modules(str(llama_dir), ["--tp", "2", "--dp", "2", "--kv-cache-memory", str(1 << 22)])
    titles = sorted(title for title, _ in processes)
    # Each DP engine is its own TP group, so both engines' workers are worker_tp0 and _tp1.
    assert titles == ["aserve::api_server_0", "aserve::api_server_1", "aserve::coordinator", "aserve::engine_core_0",
                      "aserve::engine_core_1", "aserve::supervisor", "aserve::worker_tp0", "aserve::worker_tp0",
                      "aserve::worker_tp1", "aserve::worker_tp1"], titles
    for title, names in processes:
        front = [m for m in names if is_front_end(m)]
        if title.startswith(("aserve::engine_core", "aserve::coordinator", "aserve::worker")):
            assert front == [], (title, front)
            assert "aserve.engine.core_process" in names or "aserve.engine.coordinator" in names \
                or "aserve.worker.worker_process" in names, title
    # The measurement sees front-end modules where they belong.
    api_server = dict(processes)["aserve::api_server_0"]
    assert "aserve.api.app" in api_server and "tokenizers" in api_server
