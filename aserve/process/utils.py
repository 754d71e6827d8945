"""Small helpers every aserve process uses at start: its title, parent death, signals,
cores and scheduling. The bottom layer: it imports nothing of aserve."""

from __future__ import annotations

import ctypes
import os
import signal
import struct

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
    memory, sockets) on the way out. Exits at once if the parent is already gone: the
    process's parent is then no longer the one multiprocessing started it from. (Not
    ``getppid() == 1``: in a container the supervisor is PID 1 itself.)
    """
    import multiprocessing

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)


def interrupt_on_termination() -> None:
    """For a child process: turn the first SIGTERM into KeyboardInterrupt and ignore any
    after it, so the cleanup that the interrupt unwinds through is not cut short.

    SIGINT is ignored: Ctrl-C in a terminal reaches every process of the foreground
    group, and only the supervisor (or the application that owns an ``AsyncLLM``) may
    act on it, so that a drain is not cut short by engines stopping on their own. A
    child stops when its parent sends SIGTERM (or dies)."""

    def interrupt(signum: int, frame: object) -> None:
        ignore_termination()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def ignore_termination() -> None:
    """From here on SIGTERM/SIGINT are ignored: call it before cleanup that must finish
    (unlinking shared memory). A parent that dies can deliver SIGTERM more than once."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def skip_resource_tracker() -> None:
    """Keep ``multiprocessing`` from starting its resource-tracker process.

    ``spawn`` starts one per tree to clean up leaked semaphores and shared memory of
    ``multiprocessing`` itself, which aserve does not use (it names and removes its own
    segments). Without this, ``aserve run`` would have one more process than the
    process count of docs/design.md §1. The tracker's pipe is pointed at /dev/null instead; children inherit it.
    """
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if tracker._fd is None:
        tracker._fd = os.open(os.devnull, os.O_WRONLY)
        tracker._pid = None


def pin_to_cpus(cpus: tuple[int, ...] | None, *, all_threads: bool = False) -> None:
    """Restrict this thread, and the threads it starts from now on, to ``cpus`` (no-op
    for None); with ``all_threads``, every thread the process already has too. Call it
    first thing in a process, before torch starts its thread pool."""
    if not cpus:
        return
    tids = [0]
    if all_threads:
        try:
            tids = [int(tid) for tid in os.listdir("/proc/self/task")]
        except OSError:
            pass
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except (AttributeError, OSError):  # not Linux, cores outside this cgroup, a thread gone
            pass


# sched_setattr(2), which Python's os module does not wrap.
_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


def request_short_slice(slice_ns: int) -> int:
    """Ask Linux for a scheduler slice of ``slice_ns`` for every thread this process has
    now (threads started later inherit it); returns how many threads took it.

    Why: under EEVDF (Linux 6.12 and later) a thread with a shorter slice gets an
    earlier deadline, so when it wakes it runs ahead of threads that woke before it,
    without a larger share of the CPU (its nice value is kept). The engine core is such
    a thread: it works ~0.5 ms a step, then sleeps until the worker answers, and every
    delay before it schedules the next step can leave the worker idle while the API
    server and the clients keep the front end's core busy. Older kernels accept the call
    and ignore the slice; where the call fails (another OS, a seccomp filter) nothing
    changes.
    """
    number = _SYS_SCHED_SETATTR.get(os.uname().machine)
    if number is None:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return 0
    done = 0
    for tid in tids:
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:  # the thread is gone
            continue
        # struct sched_attr, first version (48 bytes): size, policy (SCHED_OTHER), flags,
        # nice, priority, runtime (the slice, for SCHED_OTHER), deadline, period.
        attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQ", 48, 0, 0, nice, 0, slice_ns, 0, 0), 48)
        if libc.syscall(number, tid, attr, 0) == 0:
            done += 1
    return done


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
