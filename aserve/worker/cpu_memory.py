"""Keep freed memory in the process for the next step's tensors (CPU only).

glibc hands every allocation above its mmap threshold (128 KiB at first) its own
mapping and unmaps it on free, and trims the heap's free top back to the kernel. A
model step allocates the same large temporaries every step (a prefill's activations
are tens of MB a layer), so each step faults every one of their pages in again, and
on this VM a page fault costs more than the arithmetic done on the page: a 32 x 128
token prefill of the 152M model took 1.55 s with the defaults and 1.15 s with
:func:`keep_freed_memory`.

Allocations above 32 MiB (glibc's largest threshold) still get their own mapping
(splitting the MLP of a large batch into row chunks to stay under it was slower: the
chunks' outputs must be concatenated).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger("aserve.worker")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's upper limit for M_MMAP_THRESHOLD on 64-bit Linux.
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top beyond this goes back to the kernel.
TRIM_THRESHOLD = 1 << 30


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6")  # OSError without glibc


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this whole process; returns whether
    it could (False without glibc). The cost is resident memory: up to the peak of one
    step's temporaries stays allocated between steps, as with vLLM's tcmalloc."""
    try:
        libc = _libc()
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.debug("could not tune malloc; large temporaries will be page-faulted in every step")
    return ok


def release_free_memory() -> bool:
    """Give the heap's free pages back to the kernel now (``malloc_trim(0)``); returns
    whether it could. Called once after loading: the weights were read into heap
    tensors and then copied into their packed form, and with :func:`keep_freed_memory`'s
    thresholds the freed originals (a model's size) would stay resident for good."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
