"""Admission control: how much work the HTTP server takes on before it refuses (429).

Two limits, with vLLM's names and meanings, each off unless set (``--max-num-queued-reqs``,
``--max-num-queued-tokens``):

- ``max_num_queued_reqs``: requests in the server, waiting or running. A request counts
  one per prompt and per ``n`` (a completion of 3 prompts with ``n=2`` is 6).
- ``max_num_queued_tokens``: prompt tokens of requests whose prefill has not finished
  (no first token yet): the backlog a new request's time to first token waits behind.

Both count the whole server, every API server and every DP engine together: a load
balancer sees one endpoint. A request is checked and its slots are *reserved* before
its chat template is rendered or its prompt tokenised (:meth:`Admission.reserve`), so a
burst cannot make every API server render work it will then refuse (vLLM checks before
but counts after: vLLM #58192); its prompt tokens are added once they are known
(:meth:`Ticket.add_prompt_tokens`, which may still refuse it), leave the token count when
its first token arrives (:meth:`Ticket.prefilled`) and everything leaves when it ends
(:meth:`Ticket.release`, idempotent, also on the ticket's collection).

Across API servers the counts live in shared memory (``/dev/shm/<instance>_admission``,
created by the supervisor, removed with the instance): one slot per API server, written
only by its owner, summed by every reader. No lock is taken, so two API servers that
check in the same instant may both admit the last free slot: the limits are exact for
one API server and may be exceeded by at most one request per other API server.

A refusal carries ``Retry-After``: the seconds until, at the rate requests (or prefill
tokens) have left the server over the last ``RATE_WINDOW`` seconds, enough would have
left to admit this one; between 1 and 60, and 5 when nothing has left lately.

Slot layout (little-endian int64): ``[requests, queued prompt tokens, requests finished
(ever), prompt tokens prefilled (ever)]``.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from aserve.errors import RequestRefusedError

#: Seconds of history behind the drain rates that Retry-After is estimated from.
RATE_WINDOW = 10.0
RETRY_MIN, RETRY_MAX, RETRY_UNKNOWN = 1, 60, 5
_FIELDS = 4  # int64s per slot
_REQS, _TOKENS, _FINISHED, _PREFILLED = range(_FIELDS)


def segment_name(instance_id: str) -> str:
    return f"{instance_id}_admission"


def create_segment(name: str, num_slots: int) -> None:
    """Create the zeroed counters (the supervisor; removed by ``Instance.cleanup``)."""
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, num_slots * _FIELDS * 8)
    finally:
        os.close(fd)


class AdmissionCounters:
    """The server's counts: slot ``index`` is this API server's. Over the shared segment
    ``name``, or, with no name, over private memory (one API server, or tests)."""

    def __init__(self, *, index: int = 0, num_slots: int = 1, name: str | None = None) -> None:
        if name is None:
            self._map: mmap.mmap | None = None
            self._table = np.zeros((num_slots, _FIELDS), dtype=np.int64)
        else:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self._table = np.frombuffer(self._map, dtype=np.int64).reshape(-1, _FIELDS)
        if not 0 <= index < self._table.shape[0]:
            raise ValueError(f"slot {index} of {self._table.shape[0]}")
        self._mine = self._table[index]

    def totals(self) -> np.ndarray:
        """[requests, queued tokens, finished, prefilled], summed over the API servers."""
        return self._table.sum(axis=0)

    def add(self, field: int, value: int) -> None:
        self._mine[field] += value  # this slot's only writer

    def close(self) -> None:
        self._mine = self._table = None  # type: ignore[assignment]
        if self._map is not None:
            self._map.close()
            self._map = None


@dataclass(frozen=True)
class AdmissionLimits:
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    @property
    def enabled(self) -> bool:
        return self.max_num_queued_reqs is not None or self.max_num_queued_tokens is not None


class Admission:
    """The admission decisions of one API server (one event loop: no locking here)."""

    def __init__(self, limits: AdmissionLimits, counters: AdmissionCounters, *,
                 on_refused: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.counters = counters
        self._on_refused = on_refused
        self._clock = clock
        self._history: deque[tuple[float, int, int]] = deque()  # (time, finished, prefilled)

    def reserve(self, slots: int) -> Ticket:
        """Room for ``slots`` requests, taken now, before any rendering or tokenising;
        ``RequestRefusedError`` when there is none (nothing is taken then)."""
        limits = self.limits
        if not limits.enabled:
            return Ticket(self, 0)
        reqs, tokens, _, _ = self._observe()
        if limits.max_num_queued_reqs is not None and reqs + slots > limits.max_num_queued_reqs:
            self._refuse("max_num_queued_reqs", f"the server holds {reqs} requests and allows "
                         f"{limits.max_num_queued_reqs} (--max-num-queued-reqs); this one needs {slots}",
                         excess=reqs + slots - limits.max_num_queued_reqs, rate_field=_FINISHED)
        if limits.max_num_queued_tokens is not None and tokens >= limits.max_num_queued_tokens:
            self._refuse("max_num_queued_tokens", f"{tokens} prompt tokens wait for their prefill and the server "
                         f"allows {limits.max_num_queued_tokens} (--max-num-queued-tokens)",
                         excess=tokens - limits.max_num_queued_tokens + 1, rate_field=_PREFILLED)
        self.counters.add(_REQS, slots)
        return Ticket(self, slots)

    def _observe(self) -> tuple[int, int, int, int]:
        totals = self.counters.totals()
        now = self._clock()
        history = self._history
        history.append((now, int(totals[_FINISHED]), int(totals[_PREFILLED])))
        while len(history) > 2 and history[1][0] < now - RATE_WINDOW:
            history.popleft()
        return int(totals[_REQS]), int(totals[_TOKENS]), int(totals[_FINISHED]), int(totals[_PREFILLED])

    def retry_after(self, excess: int, rate_field: int) -> int:
        """Seconds until ``excess`` requests (``rate_field`` _FINISHED) or prompt tokens
        (_PREFILLED) leave, at the rate of the last ``RATE_WINDOW`` seconds."""
        (t0, finished0, prefilled0), (t1, finished1, prefilled1) = self._history[0], self._history[-1]
        left = (finished1 - finished0) if rate_field == _FINISHED else (prefilled1 - prefilled0)
        if left <= 0 or t1 <= t0:
            return RETRY_UNKNOWN
        return min(RETRY_MAX, max(RETRY_MIN, math.ceil(excess / (left / (t1 - t0)))))

    def _refuse(self, reason: str, message: str, *, excess: int, rate_field: int) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)
        raise RequestRefusedError(f"the server is at capacity: {message}", reason=reason,
                                  retry_after=self.retry_after(excess, rate_field))


class Ticket:
    """One request's share of the counts, from :meth:`Admission.reserve` to :meth:`release`."""

    def __init__(self, admission: Admission, slots: int) -> None:
        self._admission = admission
        self._slots = slots
        self._queued: dict[int, int] = {}  # prompt index -> its tokens still counted

    def add_prompt_tokens(self, per_prompt: list[int]) -> None:
        """The prompts' token counts, now known; ``RequestRefusedError`` (and the ticket
        released) when they would take the queued tokens past the limit. A request that
        alone exceeds the limit is admitted when nothing else waits for a prefill, so it
        is never refused for ever."""
        admission = self._admission
        if not self._slots:
            return
        limit = admission.limits.max_num_queued_tokens
        total = sum(per_prompt)
        if limit is not None:
            _, tokens, _, _ = admission._observe()
            if tokens + total > limit and tokens > 0:
                self.release(finished=False)
                admission._refuse("max_num_queued_tokens", f"{tokens} prompt tokens wait for their prefill, this "
                                  f"request brings {total} and the server allows {limit} (--max-num-queued-tokens)",
                                  excess=tokens + total - limit, rate_field=_PREFILLED)
        self._queued = dict(enumerate(per_prompt))
        admission.counters.add(_TOKENS, total)

    def prefilled(self, index: int) -> None:
        """Prompt ``index`` has its first token: its tokens leave the queued count."""
        tokens = self._queued.pop(index, 0)
        if tokens:
            counters = self._admission.counters
            counters.add(_TOKENS, -tokens)
            counters.add(_PREFILLED, tokens)

    def release(self, *, finished: bool = True) -> None:
        """The request ended (any way): everything it holds leaves the counts."""
        if not self._slots:
            return
        counters = self._admission.counters
        if self._queued:
            counters.add(_TOKENS, -sum(self._queued.values()))
            self._queued = {}
        counters.add(_REQS, -self._slots)
        if finished:
            counters.add(_FINISHED, self._slots)
        self._slots = 0

    def __del__(self) -> None:
        # A path that never reached release (a response Starlette never ran) must not
        # hold its slots for ever.
        try:
            self.release(finished=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the counters may be gone
            pass
