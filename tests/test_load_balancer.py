"""The data-parallel load-balancing score and scan order, against hand-worked cases."""

from __future__ import annotations

import pytest

from aserve.errors import InvalidInputError
from aserve.engine.coordinator_logic import EngineLoad
from aserve.frontend.load_balancer import LoadBalancer


def test_two_api_servers_two_idle_engines_split_their_first_requests():
    # The reference walk-through: both engines idle, every score 0, ties to the scan's
    # first engine, which is (2 * index) // 2: engine 0 for server 0, engine 1 for server 1.
    server0 = LoadBalancer(2, client_index=0, client_count=2)
    server1 = LoadBalancer(2, client_index=1, client_count=2)
    assert server0.pick() == 0
    assert server1.pick() == 1
    # Each added client_count=2 to its choice's waiting guess and 1 to its in-flight count.
    assert server0.loads[0].waiting == 2 and server0.in_flight == [1, 0]
    assert server1.loads[1].waiting == 2 and server1.in_flight == [0, 1]


def test_scores_follow_the_formula():
    lb = LoadBalancer(3, client_index=0, client_count=2)
    lb.update([EngineLoad(waiting=1, running=2), EngineLoad(waiting=0, running=1), EngineLoad(3, 0, 1.0)])
    lb.in_flight = [0, 2, 0]
    assert lb.score(0) == 3  # max(2 * 0, 1 + 2)
    assert lb.score(1) == 4  # max(2 * 2, 0 + 1)
    assert lb.score(2) == 3 + 4 * 3  # full KV cache: 4 per waiting request on top


def test_rotation_spreads_ties_and_guesses_balance_a_burst():
    lb = LoadBalancer(3, client_index=0, client_count=1)
    picks = [lb.pick() for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    assert lb.in_flight == [2, 2, 2]


def test_coordinator_figures_replace_guesses():
    lb = LoadBalancer(2, client_index=0, client_count=1)
    assert lb.pick() == 0
    assert lb.pick() == 1  # engine 0's guess made it busier
    lb.update([EngineLoad(0, 0), EngineLoad(5, 5)])
    lb.finished(0)
    lb.finished(1)
    assert lb.pick() == 0  # engine 1 is truly loaded
    assert lb.pick() == 0  # scan starts at 1 now, but 0's score (1) is still lower than 1's (10)


def test_full_kv_cache_loses_a_tie():
    lb = LoadBalancer(2, client_index=0, client_count=1)
    lb.update([EngineLoad(waiting=1, running=1, kv_cache_usage=1.0), EngineLoad(waiting=0, running=2)])
    assert lb.pick() == 1


def test_pinned_rank():
    lb = LoadBalancer(2)
    assert lb.pick(data_parallel_rank=1) == 1
    assert lb.in_flight == [0, 1]
    with pytest.raises(InvalidInputError, match="data_parallel_rank"):
        lb.pick(data_parallel_rank=2)
