"""Process start-up helpers (aserve/launch/process_utils.py) that change how Linux runs us."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.proc_threads import needs_custom_slices

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, os, threading
from aserve.process.utils import request_short_slice
from tests.proc_threads import thread_slices as slices

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


@needs_custom_slices
def test_short_slice_for_every_thread_keeps_nice():
    """Both threads that exist take the slice, a thread started later inherits it, and
    the nice value the process had is kept (sched_setattr would otherwise reset it)."""
    # From the repository root, so the child imports the same tests.proc_threads.
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60,
                         cwd=ROOT)
    got = json.loads(out.stdout)
    assert got["done"] == 2
    assert got["default"] != [250_000]
    assert got["now"] == [250_000]
    assert got["nices"] == [3]


def test_an_instance_without_ipc_makes_no_directory_and_removes_its_segments():
    import os

    import pytest

    from aserve.process.instance import Instance

    with_dir, without = Instance.create(), Instance.create(ipc=False)
    try:
        assert os.path.isdir(with_dir.dir) and with_dir.ipc("x") == f"ipc://{with_dir.dir}/x"
        assert without.dir is None
        with pytest.raises(ValueError, match="without an IPC directory"):
            without.ipc("x")
        segment = Path("/dev/shm") / without.segment("tp")
        segment.write_bytes(b"\0")
        without.cleanup()
        assert not segment.exists()
    finally:
        with_dir.cleanup()
    assert not os.path.exists(with_dir.dir)
