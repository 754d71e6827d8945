"""Reading the scheduler state of a process's threads from ``/proc`` (shared by the
scheduler-slice tests, in this process and in child processes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: Custom scheduler slices (``sched_setattr``'s runtime for SCHED_OTHER) are Linux 6.12's.
needs_custom_slices = pytest.mark.skipif(
    tuple(int(x) for x in os.uname().release.split(".")[:2]) < (6, 12),
    reason="custom scheduler slices need Linux 6.12 (CI and dev machines run 6.18)")


def thread_slices(pid: int | str = "self") -> dict[str, int]:
    """Thread id -> scheduler slice (ns) of every thread of ``pid``, from
    ``/proc/PID/task/TID/sched``; a thread that exits while we look is left out."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/sched").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in text.splitlines():
            if line.startswith("se.slice"):
                out[tid] = int(line.split(":")[1])
    return out
