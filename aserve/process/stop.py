"""Stopping a set of child processes: the one way every owner of children does it.

Asked (optionally) -> SIGTERM (with SIGCONT, so a stopped process handles it) ->
SIGKILL, with one deadline per stage for the whole set,
so stopping N processes never takes N grace periods. Every process is reaped before the
call returns, so none is left as a zombie or an orphan.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Sequence

import anyio.to_thread

logger = logging.getLogger("aserve.process")


def stop_processes(procs: Sequence[mp.process.BaseProcess], *, grace: float, asked_first: float = 0.0) -> None:
    """Stop ``procs`` and reap them.

    ``asked_first``: seconds for processes already asked to exit another way (a shutdown
    message, ``ENGINE_CORE_DEAD``) to do so on their own. Then every one still alive gets
    SIGTERM, all at once (a child cleans up what it owns on SIGTERM), and up to ``grace``
    seconds; whatever is left is killed with SIGKILL and a warning names it.
    """
    _join_all(procs, asked_first)
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
            _continue(proc)  # a stopped process (SIGSTOP, a debugger) acts on SIGTERM only once it runs
    _join_all(procs, grace)
    for proc in procs:
        if proc.exitcode is None:
            logger.warning("%s (pid %s) did not exit within %.0f s of SIGTERM; killing it", proc.name, proc.pid, grace)
            proc.kill()
            proc.join()


async def stop_processes_async(procs: Sequence[mp.process.BaseProcess], *, grace: float,
                               asked_first: float = 0.0) -> None:
    """:func:`stop_processes` from an event loop: it waits in a worker thread. Callers
    shield it (``anyio.CancelScope(shield=True)``): stopping must finish even when they
    are being cancelled."""
    await anyio.to_thread.run_sync(functools.partial(stop_processes, procs, grace=grace, asked_first=asked_first))


def _continue(proc: mp.process.BaseProcess) -> None:
    try:
        os.kill(proc.pid, signal.SIGCONT)
    except (ProcessLookupError, TypeError):  # gone already, or never started
        pass


def _join_all(procs: Sequence[mp.process.BaseProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        if proc.exitcode is None:
            proc.join(max(0.0, deadline - time.monotonic()))
