"""HTTP/2: cleartext with prior knowledge (h2c), TLS with ALPN (on Trio), stream resets."""

from __future__ import annotations

import json
import ssl
import subprocess
import time

import httpx
import pytest

from tests.e2e.server import Server

BODY = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "stream": True}


def sse_text(lines) -> str:
    text = ""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["text"] if json.loads(line[6:])["choices"] else ""
    return text


@pytest.fixture(scope="module")
def h2c_server(llama_dir):
    srv = Server(llama_dir)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def tls_server(llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    srv = Server(llama_dir, "--ssl-certfile", str(d / "cert.pem"), "--ssl-keyfile", str(d / "key.pem"),
                 "--loop", "trio", verify=ssl.create_default_context(cafile=str(d / "cert.pem")))
    yield srv
    assert srv.stop() == 0


def test_h2c_prior_knowledge_streams(h2c_server):
    with httpx.Client(http1=False, http2=True, base_url=h2c_server.base_url, timeout=60) as client:
        full = client.post("/v1/completions", json={**BODY, "stream": False})
        assert full.http_version == "HTTP/2"
        with client.stream("POST", "/v1/completions", json=BODY) as r:
            assert r.http_version == "HTTP/2" and r.status_code == 200
            lines = list(r.iter_lines())
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        assert sse_text(lines) == full.json()["choices"][0]["text"]


def test_tls_alpn_negotiates_http2_on_trio(tls_server):
    with httpx.Client(http2=True, base_url=tls_server.base_url, verify=tls_server.verify, timeout=60) as client:
        assert tls_server.base_url.startswith("https://")
        with client.stream("POST", "/v1/completions", json=BODY) as r:
            assert r.http_version == "HTTP/2" and r.status_code == 200
            assert sse_text(list(r.iter_lines()))
        assert client.get("/health").status_code == 200


def _kv_usage(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("aserve:kv_cache_usage_perc{"):
            return float(line.split()[-1])
    raise AssertionError("no kv usage metric")


def test_h2_stream_reset_aborts_the_request(h2c_server):
    with httpx.Client(http1=False, http2=True, base_url=h2c_server.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**BODY, "n": 2, "max_tokens": 200}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
            assert _kv_usage(client) > 0.0
        # Leaving the block resets the HTTP/2 stream; the connection itself stays open.
        deadline = time.monotonic() + 10
        while _kv_usage(client) > 0.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _kv_usage(client) == 0.0
