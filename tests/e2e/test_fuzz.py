"""A bounded fuzz run in CI (``tests/fuzzing.py``; ``scripts/fuzz.py`` runs many more):
generated requests for every route of a real ``aserve run``, valid and malformed, never
get a 5xx or hang, and the server serves on."""

from __future__ import annotations

from tests.e2e.server import Server
from tests.fuzzing import fuzz, still_serves

EXAMPLES = 40  # per route and mode: about 330 requests


def test_generated_requests_never_get_a_5xx_and_the_server_serves_on(llama_dir):
    server = Server(llama_dir, "--max-n", "4", "--max-num-queued-reqs", "64", "--request-timeout", "20")
    try:
        counts = fuzz(server.base_url, examples=EXAMPLES, seed=0)
        still_serves(server.base_url)
    finally:
        server.stop()
    # Both kinds reached the server: valid requests that generated, malformed ones refused.
    assert counts[("/v1/completions", "positive", 200)] > 0 and counts[("/v1/chat/completions", "positive", 200)] > 0
    assert counts[("/v1/completions", "negative", 400)] > 0 and counts[("/v1/chat/completions", "negative", 400)] > 0
    assert not [key for key in counts if key[2] >= 500]
