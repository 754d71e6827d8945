"""Process start-up helpers (aserve/launch/process_utils.py) that change how Linux runs us."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = r"""
import json, os, threading
from pathlib import Path
from aserve.launch.process_utils import request_short_slice

def slices():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        for line in Path(f"/proc/self/task/{tid}/sched").read_text().splitlines():
            if line.startswith("se.slice"):
                out[tid] = int(line.split(":")[1])
    return out

os.nice(3)
stop = threading.Event()
before = threading.Thread(target=stop.wait)
before.start()
default = set(slices().values())
done = request_short_slice(250_000)
seen = {}
after = threading.Thread(target=lambda: seen.update(slices()))
after.start(); after.join()
nices = {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
stop.set(); before.join()
print(json.dumps({"done": done, "default": sorted(default), "now": sorted(set(seen.values())), "nices": sorted(nices)}))
"""


@pytest.mark.skipif(tuple(int(x) for x in os.uname().release.split(".")[:2]) < (6, 12),
                    reason="custom scheduler slices need Linux 6.12 (CI and dev machines run 6.18)")
def test_short_slice_for_every_thread_keeps_nice():
    """Both threads that exist take the slice, a thread started later inherits it, and
    the nice value the process had is kept (sched_setattr would otherwise reset it)."""
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["done"] == 2
    assert got["default"] != [250_000]
    assert got["now"] == [250_000]
    assert got["nices"] == [3]
