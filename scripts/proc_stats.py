"""/proc readings the measurement scripts share: a process tree, its CPU time, its PSS.

Imported by ``idle_cpu.py``, ``serve_probe.py`` and ``bench_compare.py`` (run as
``python scripts/NAME.py``, which puts this directory on ``sys.path``). A process that
exits while being read counts as empty.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant, depth first."""
    out = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return out
    for child in children:
        out += process_tree(int(child))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pss_mib(pids: list[int]) -> float:
    """Proportional set size of the processes together (shared pages split), MiB."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return total / 1024
