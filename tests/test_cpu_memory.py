"""The worker's malloc tuning: freed memory stays for the next step, until
``release_free_memory`` hands it back (done once, after loading the weights).

Run in a child process: the tuning is process-wide and would change this one's heap.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import os
from aserve.worker.cpu_memory import keep_freed_memory, release_free_memory

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

assert keep_freed_memory()
base = rss_mib()
# 1 MiB buffers: under the raised mmap threshold, so they come from the heap.
blocks = [bytearray(b"\x01") * (1 << 20) for _ in range(256)]
held = rss_mib()
del blocks
freed = rss_mib()
assert release_free_memory()
released = rss_mib()
print(round(held - base), round(freed - base), round(released - base))
"""


def test_freed_heap_stays_until_released():
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True).stdout.split()
    held, freed, released = (int(x) for x in out)
    assert held >= 240  # the 256 MiB were written
    assert freed >= 200  # kept for reuse: no page faults on the next step's temporaries
    assert released <= 40  # handed back to the kernel
