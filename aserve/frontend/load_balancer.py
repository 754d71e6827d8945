"""Which engine gets a request: the data-parallel load-balancing score (docs/design.md, section 7).

Each API server keeps a view of every engine's waiting and running counts and its own
in-flight requests per engine, and picks the engine with the lowest score::

    score = max(client_count * in_flight, waiting + running)
            + KV_FULL_PENALTY * waiting        (only when that engine's KV cache is full)

Ties go to the first engine of a scan that starts at
``(n_engines * client_index) // client_count`` and rotates by one after every pick, so
API servers spread their first requests over different engines. After a pick the
server adds ``client_count`` to that engine's waiting guess (every server may be
sending to it at once) and 1 to its own in-flight count; the coordinator's published
figures replace the guesses. Pure logic: no I/O, no clock.
"""

from __future__ import annotations

from aserve.engine.coordinator_logic import EngineLoad
from aserve.errors import InvalidInputError

#: An engine whose KV cache is at least this full counts as full.
KV_FULL_THRESHOLD = 0.99
#: Extra score per waiting request on a full engine: those requests cannot start until
#: others finish, so a full engine with a queue should lose ties it would otherwise win.
KV_FULL_PENALTY = 4


class LoadBalancer:
    def __init__(self, num_engines: int, *, client_index: int = 0, client_count: int = 1) -> None:
        if num_engines < 1:
            raise ValueError("there must be at least one engine")
        self.num_engines = num_engines
        self.client_index = client_index
        self.client_count = client_count
        self.loads = [EngineLoad() for _ in range(num_engines)]
        self.in_flight = [0] * num_engines
        self.start = (num_engines * client_index) // client_count

    def score(self, engine: int) -> int:
        load = self.loads[engine]
        score = max(self.client_count * self.in_flight[engine], load.waiting + load.running)
        if load.kv_cache_usage >= KV_FULL_THRESHOLD:
            score += KV_FULL_PENALTY * load.waiting
        return score

    def pick(self, data_parallel_rank: int | None = None) -> int:
        """The engine for a new request (``data_parallel_rank`` pins one); records the pick."""
        if data_parallel_rank is not None:
            if not 0 <= data_parallel_rank < self.num_engines:
                raise InvalidInputError(
                    f"data_parallel_rank must be in [0, {self.num_engines}), got {data_parallel_rank}",
                    param="data_parallel_rank",
                )
            chosen = data_parallel_rank
        else:
            order = [(self.start + k) % self.num_engines for k in range(self.num_engines)]
            chosen = order[0]
            best = self.score(chosen)
            for engine in order[1:]:
                score = self.score(engine)
                if score < best:  # strictly smaller: ties stay with the earlier engine of the scan
                    chosen, best = engine, score
        self.loads[chosen].waiting += self.client_count
        self.in_flight[chosen] += 1
        self.start = (self.start + 1) % self.num_engines
        return chosen

    def finished(self, engine: int) -> None:
        """One of this server's requests on ``engine`` finished (or was aborted)."""
        self.in_flight[engine] = max(0, self.in_flight[engine] - 1)

    def update(self, loads: list[EngineLoad]) -> None:
        """The coordinator's published figures replace the local guesses."""
        if len(loads) != self.num_engines:
            raise ValueError(f"expected {self.num_engines} engine loads, got {len(loads)}")
        self.loads = [EngineLoad(x.waiting, x.running, x.kv_cache_usage) for x in loads]
