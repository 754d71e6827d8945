"""Timing helpers the measuring scripts share (decode_roofline.py, prefill_roofline.py,
cuda_bench.py): the wall time of every call of a method, and the best of a few calls."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator


@contextlib.contextmanager
def timed_calls(cls: type, name: str, sink: list[float]) -> Iterator[list[float]]:
    """While open, every call of ``cls.name`` (in this process) appends its seconds to
    ``sink``; the method is put back on exit."""
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    setattr(cls, name, wrapper)
    try:
        yield sink
    finally:
        setattr(cls, name, inner)


def best_seconds(runs: list[Callable[[], object]], calls: int = 5) -> float:
    """The fastest of ``calls`` timed calls of each of ``runs`` (each called once first, untimed)."""
    best = float("inf")
    for run in runs:
        run()
        for _ in range(calls):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
    return best
