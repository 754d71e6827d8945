"""Prometheus metrics with vLLM's names under the ``aserve:`` prefix, labelled by engine."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, engine_label: str = "0") -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["engine"]
        self.engine = engine_label
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

    def observe_stats(self, stats: dict[str, float]) -> None:
        self.num_requests_running.labels(self.engine).set(stats["num_running"])
        self.num_requests_waiting.labels(self.engine).set(stats["num_waiting"])
        self.kv_cache_usage_perc.labels(self.engine).set(stats["kv_cache_usage"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
