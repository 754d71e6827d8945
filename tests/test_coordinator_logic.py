"""The DP coordinator's publish timing and wave logic."""

from __future__ import annotations

from aserve.engine.coordinator_logic import CoordinatorLogic
from aserve.engine.coordinator_logic import EngineLoad


def test_publishes_at_most_every_100_ms_while_counts_change():
    c = CoordinatorLogic(2)
    assert c.next_publish_in(0.0) is None and c.publish(0.0) is None  # nothing changed yet
    c.on_engine_stats(0, 1, 0, 0.1)
    pub = c.publish(0.0)
    assert pub is not None and pub.loads[0] == EngineLoad(1, 0, 0.1)
    c.on_engine_stats(0, 0, 1, 0.1)
    assert abs(c.next_publish_in(0.03) - 0.07) < 1e-9
    assert c.publish(0.05) is None  # too soon
    pub = c.publish(0.1)
    assert pub is not None and pub.loads[0] == EngineLoad(0, 1, 0.1)
    assert c.publish(0.5) is None  # no change since: silent
    c.on_engine_stats(1, 0, 1, 0.0)
    assert c.next_publish_in(0.5) == 0.0  # quiet for a while: due at once
    c.on_engine_stats(1, 0, 1, 0.0)  # the same figures again: not a change
    assert c.publish(0.5).loads[1] == EngineLoad(0, 1, 0.0)
    assert c.next_publish_in(0.6) is None


def test_waves_start_once_and_advance_on_completion():
    c = CoordinatorLogic(2)
    assert c.on_request_for_wave(0, engine=1) == (0, 1)  # start wave 0 on the others
    assert c.engines_running
    assert c.on_request_for_wave(0, engine=0) is None  # already running
    c.on_wave_complete(0)
    assert c.wave == 1 and not c.engines_running
    assert c.on_request_for_wave(0, engine=0) is None  # a stale wave number
    assert c.on_request_for_wave(1, engine=0) == (1, 0)
    c.on_wave_complete(0)  # a late report for an old wave changes nothing
    assert c.wave == 1 and c.engines_running
    pub = c.publish(1.0)
    assert pub.wave == 1 and pub.engines_running
