"""Small helpers every aserve process uses at start: its title, parent-death, threads."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def set_process_title(title: str) -> None:
    """Set the title ``ps`` shows (``aserve::engine_core_0``); a no-op without setproctitle."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def exit_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies.

    SIGTERM rather than SIGKILL, so the child still cleans up what it owns (shared
    memory, sockets) on the way out. Exits at once if the parent is already gone.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(1)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
