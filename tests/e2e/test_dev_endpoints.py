"""``--enable-dev-endpoints``: sleep and wake the engines over HTTP, requests meanwhile
get a 503 saying why, profiles land in ``--profiler-dir``; without the flag the routes do
not exist."""

from __future__ import annotations

import httpx

from tests.e2e.server import Server


def test_sleep_wake_and_profile_over_http(llama_dir, tmp_path):
    server = Server(llama_dir, "--dp", "2", "--enable-dev-endpoints", "--profiler-dir", str(tmp_path))
    base = server.base_url
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        before = httpx.post(base + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        assert httpx.post(base + "/sleep?level=3", timeout=30).json()["error"]["param"] == "level"
        assert httpx.post(base + "/sleep?level=1", timeout=30).status_code == 200
        assert httpx.get(base + "/is_sleeping", timeout=30).json() == {"is_sleeping": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
        assert httpx.post(base + "/wake_up", timeout=30).status_code == 200
        assert httpx.get(base + "/is_sleeping", timeout=30).json() == {"is_sleeping": False}
        assert httpx.post(base + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"] == before

        assert httpx.post(base + "/start_profile", timeout=30).status_code == 200
        for rank in (0, 1):
            r = httpx.post(base + "/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)}, timeout=30)
            assert r.status_code == 200
        assert httpx.post(base + "/stop_profile", timeout=30).status_code == 200
        assert httpx.post(base + "/stop_profile", timeout=30).status_code == 409  # none running now
    finally:
        server.stop()
    assert sorted(p.name.split("_")[1] for p in tmp_path.glob("worker_*.json")) == ["dp0", "dp1"]


def test_without_the_flag_there_are_no_dev_routes(llama_dir):
    server = Server(llama_dir)
    try:
        for path in ("/sleep", "/wake_up", "/start_profile", "/stop_profile"):
            assert httpx.post(server.base_url + path, timeout=30).status_code == 404
    finally:
        server.stop()
