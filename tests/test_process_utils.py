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
        try:
            text = Path(f"/proc/self/task/{tid}/sched").read_text()
        except (FileNotFoundError, ProcessLookupError):  # a thread that has just exited
            continue
        for line in text.splitlines():
            if line.startswith("se.slice"):
                out[tid] = int(line.split(":")[1])
    return out

def own_nice():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

os.nice(3)
stop = threading.Event()
# A daemon: should anything below raise, the interpreter exits instead of waiting on it.
before = threading.Thread(target=stop.wait, daemon=True)
before.start()
default = set(slices().values())
done = request_short_slice(250_000)
seen, nices = {}, {own_nice(), os.getpriority(os.PRIO_PROCESS, before.native_id)}
def probe():  # by the thread started after the request, while it is alive
    seen.update(slices())
    nices.add(own_nice())
after = threading.Thread(target=probe)
after.start(); after.join()
stop.set(); before.join()
print(json.dumps({"done": done, "default": sorted(default), "now": sorted(set(seen.values())), "nices": sorted(nices)}))
"""


@pytest.mark.skipif(tuple(int(x) for x in os.uname().release.split(".")[:2]) < (6, 12),
                    reason="custom scheduler slices need Linux 6.12 (CI and dev machines run 6.18)")
def test_short_slice_for_every_thread_keeps_nice():
    """Both threads that exist take the slice, a thread started later inherits it, and
    the nice value the process had is kept (sched_setattr would otherwise reset it)."""
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60)
    got = json.loads(out.stdout)
    assert got["done"] == 2
    assert got["default"] != [250_000]
    assert got["now"] == [250_000]
    assert got["nices"] == [3]
