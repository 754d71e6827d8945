"""The container's command line, run as a container would run it: ``docker/Dockerfile``'s
ENTRYPOINT as PID 1 of a new PID namespace (``unshare --pid``), serving, then draining
under SIGTERM and exiting 0; and the Grafana dashboard querying only metrics that
``/metrics`` exports."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import Server

ROOT = Path(__file__).resolve().parents[2]


def entrypoint() -> list[str]:
    line = next(line for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines()
                if line.startswith("ENTRYPOINT"))
    return json.loads(line.removeprefix("ENTRYPOINT"))


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare(1) and the right to create PID namespaces")
def test_entrypoint_as_pid_1_serves_and_drains_on_sigterm(llama_dir):
    argv = entrypoint()
    # The image's aserve is this environment's; the port the kernel picks (the image's
    # 8000 may be taken here). Everything else is the Dockerfile's.
    argv[0] = str(Path(sys.executable).with_name("aserve"))
    argv[argv.index("--port") + 1] = "0"
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *argv, str(llama_dir),
           "--kv-cache-memory", str(1 << 24), "--max-model-len", "256", "--shutdown-timeout", "30"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    base = ""
    while not base:
        line = proc.stdout.readline()
        assert line, "".join(log)
        log.append(line)
        match = re.search(r"at (https?://\S+)/v1", line)
        base = match.group(1).replace("0.0.0.0", "127.0.0.1") if match else ""
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        # unshare's one child is the supervisor, PID 1 inside the namespace.
        supervisor = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
        status = Path(f"/proc/{supervisor}/status").read_text()
        assert re.search(r"NSpid:\s+\d+\s+1\b", status), status
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "".join(log)
            time.sleep(0.2)  # polled as a readiness probe would
        result = {}

        def long_request():
            r = httpx.post(base + "/v1/completions", timeout=60,
                           json={"prompt": "Hello", "max_tokens": 250, "ignore_eos": True})
            result["body"] = r.json()

        worker = threading.Thread(target=long_request)
        worker.start()
        deadline = time.monotonic() + 30
        while 'aserve:num_requests_running{engine="0"} 1.0' not in httpx.get(base + "/metrics").text:
            assert time.monotonic() < deadline
        subprocess.run(["kill", "-TERM", str(supervisor)], check=True)
        worker.join(60)
        assert result["body"]["choices"][0]["finish_reason"] == "length"  # drained, not cut off
        assert proc.wait(60) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        reader.join(10)
        proc.stdout.close()


def test_grafana_dashboard_queries_only_exported_metrics(llama_dir):
    dashboard = json.loads((ROOT / "docker" / "grafana" / "aserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {m for e in exprs for m in re.findall(r"aserve:[a-z_:]+", e)}
    assert len(queried) >= 9
    server = Server(llama_dir)
    try:
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        exported = set(re.findall(r"^(aserve:[a-z_:]+)", httpx.get(server.base_url + "/metrics").text, re.M))
    finally:
        assert server.stop() == 0
    assert queried <= exported, sorted(queried - exported)
