"""Requests for every route, generated from the server's own ``/openapi.json`` by
Schemathesis (valid ones, and malformed ones: wrong types, missing fields, values out of
range, unknown fields), sent to a running server. The property: never a 5xx, every
answer within ``timeout`` seconds, and the server still serves afterwards.

Used by ``tests/e2e/test_fuzz.py`` (a bounded number of examples, in CI) and by
``scripts/fuzz.py`` (as many as asked).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import httpx
from hypothesis import HealthCheck, given, settings


def fuzz(base_url: str, *, examples: int, timeout: float = 30.0, seed: int | None = None,
         report: Callable[[str, str, int], None] | None = None) -> Counter:
    """Send ``examples`` generated requests per route and mode (valid, malformed) to the
    server at ``base_url``; returns how many got each (path, mode, status). Raises
    AssertionError (Hypothesis shrinks it to a smallest failing request) on a 5xx, and
    the client's timeout error on a hang."""
    import schemathesis
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    counts: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        # A route with no body or parameters has no malformed form to generate.
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method == "post" else [])
        for mode in modes:
            _run(base_url, operation, mode, examples if operation.method == "post" else 1, timeout, seed, counts,
                 report)
    return counts


def _run(base_url: str, operation, mode, examples: int, timeout: float, seed: int | None,  # noqa: ANN001
         counts: Counter, report: Callable[[str, str, int], None] | None) -> None:
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              derandomize=seed is not None)
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case) -> None:  # noqa: ANN001
        response = case.call(base_url=base_url, timeout=timeout)
        counts[(operation.path, mode.value, response.status_code)] += 1
        if report is not None:
            report(operation.path, mode.value, response.status_code)
        assert response.status_code < 500, (operation.path, case.headers, case.body, response.text[:500])

    send()


def still_serves(base_url: str) -> None:
    """The server is healthy and completes a plain request."""
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
