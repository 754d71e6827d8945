"""Prometheus metrics with vLLM's names under the ``aserve:`` prefix, labelled by engine."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

#: Totals each engine core counts itself (``EngineCore.get_stats``): the same whichever
#: API server answers the scrape. (name, stats key, help)
_ENGINE_TOTALS = (
    ("aserve:engine_requests_received", "num_requests_received", "Requests the engine core received"),
    ("aserve:engine_requests_finished", "num_requests_finished", "Requests the engine core finished (any reason)"),
    ("aserve:engine_prompt_tokens", "num_prompt_tokens", "Prompt tokens of the requests the engine core received"),
    ("aserve:engine_generation_tokens", "num_generation_tokens", "Tokens the engine core generated"),
)


class _EngineTotals(Collector):
    def __init__(self) -> None:
        self.stats: dict[str, dict[str, float]] = {}

    def collect(self):  # type: ignore[no-untyped-def]
        for name, key, help_text in _ENGINE_TOTALS:
            family = CounterMetricFamily(name, help_text, labels=["engine"])
            for engine, stats in sorted(self.stats.items()):
                if key in stats:
                    family.add_metric([engine], stats[key])
            yield family

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class Metrics:
    """One API server's metrics. Gauges and engine totals come from every engine at each
    scrape; the request histograms and counters cover the requests of this API server
    (with several API servers, each answers for its own), labelled by serving engine."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["engine"]
        self._totals = _EngineTotals()
        r.register(self._totals)
        self.num_requests_running = Gauge("aserve:num_requests_running", "Requests in the running set", labels, registry=r)
        self.num_requests_waiting = Gauge("aserve:num_requests_waiting", "Requests waiting to run", labels, registry=r)
        self.kv_cache_usage_perc = Gauge("aserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", labels,
                                         registry=r)
        self.prompt_tokens = Counter("aserve:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("aserve:generation_tokens", "Tokens generated", labels, registry=r)
        self.request_success = Counter("aserve:request_success", "Finished requests by finish reason",
                                       [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("aserve:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("aserve:inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("aserve:e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("aserve:request_queue_time_seconds", "Arrival to first scheduling", labels,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.client_disconnected = Counter("aserve:http_requests_client_disconnected",
                                           "HTTP requests whose client went away before the answer", registry=r)
        self.requests_refused = Counter("aserve:num_requests_refused", "Requests refused by admission control (429)",
                                        ["reason"], registry=r)
        self.request_timeouts = Counter("aserve:request_timeouts", "Requests aborted at a deadline (408)",
                                        ["deadline"], registry=r)

    def observe_stats(self, engine: int, stats: dict[str, float]) -> None:
        label = str(engine)
        self.num_requests_running.labels(label).set(stats["num_running"])
        self.num_requests_waiting.labels(label).set(stats["num_waiting"])
        self.kv_cache_usage_perc.labels(label).set(stats["kv_cache_usage"])
        self._totals.stats[label] = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
