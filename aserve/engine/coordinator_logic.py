"""The data-parallel coordinator's logic: engines' load figures, publish timing, DP waves.

No I/O and no clock of its own: the coordinator process (``aserve.engine.coordinator``) feeds it messages and
``now`` and sends what it returns.

Publishing: every engine reports (waiting, running, KV usage) when they change; the
coordinator publishes all engines' figures to every API server at most once per
``publish_interval`` (100 ms) while anything changes, and not at all while nothing does.

Waves (kept for MoE lockstep; dense engines never wait on them): engines are either
running a wave or paused. A request that reaches a paused engine set starts the current
wave (START_DP_WAVE to every engine but the one that got the request); when the engines
report the wave finished, the wave counter moves on and the engines count as paused.
"""

from __future__ import annotations

from dataclasses import dataclass


PUBLISH_INTERVAL = 0.1


@dataclass
class EngineLoad:
    """One engine's figures as the load balancers see them (``aserve.frontend.load_balancer``)."""

    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0


@dataclass(frozen=True)
class Publication:
    loads: tuple[EngineLoad, ...]
    wave: int
    engines_running: bool


class CoordinatorLogic:
    def __init__(self, num_engines: int, *, publish_interval: float = PUBLISH_INTERVAL) -> None:
        self.loads = [EngineLoad() for _ in range(num_engines)]
        self.publish_interval = publish_interval
        self.wave = 0
        self.engines_running = False
        self._changed = False
        self._last_publish: float | None = None

    def on_engine_stats(self, engine: int, waiting: int, running: int, kv_cache_usage: float) -> None:
        new = EngineLoad(waiting, running, kv_cache_usage)
        if new != self.loads[engine]:
            self.loads[engine] = new
            self._changed = True

    def next_publish_in(self, now: float) -> float | None:
        """Seconds until a publication is due (0: now); None while nothing changed."""
        if not self._changed:
            return None
        if self._last_publish is None:
            return 0.0
        return max(0.0, self._last_publish + self.publish_interval - now)

    def publish(self, now: float) -> Publication | None:
        """The figures to send now, or None if none are due."""
        due = self.next_publish_in(now)
        if due is None or due > 0:
            return None
        self._changed = False
        self._last_publish = now
        return Publication(tuple(self.loads), self.wave, self.engines_running)

    def on_request_for_wave(self, wave: int, engine: int) -> tuple[int, int] | None:
        """A request for ``wave`` reached ``engine``. Returns (wave, engine to exclude) to
        broadcast as START_DP_WAVE when that starts the engines, else None."""
        if wave < self.wave or self.engines_running:
            return None  # an old wave, or already running: nothing to start
        self.wave = wave
        self.engines_running = True
        self._changed = True
        return wave, engine

    def on_wave_complete(self, wave: int) -> None:
        """The engines finished ``wave`` and paused."""
        if wave == self.wave:
            self.wave += 1
            self.engines_running = False
            self._changed = True
