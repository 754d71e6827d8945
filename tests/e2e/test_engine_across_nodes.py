"""One engine across two "nodes" on this machine: ``aserve run --tp 2 --nnodes 2`` on the
head and ``--node-rank 1 --headless`` on the other, each its own process tree with a
private /dev/shm (a mount namespace, ``private_shm.sh``), a TP rank on each, joined
over the real TCP paths: torch.distributed's TCPStore and gloo, and the engine core's
CURVE-authenticated ZeroMQ calls and replies.

Checked: the tokens of the offline ``LLM``; ``kill -9`` of the remote worker and of the
head with streams in flight (every stream ends, no process, segment or instance
directory left on either side); a node with the wrong secret refused; a node waiting in
the rendezvous exits when the head goes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from aserve import LLM, SamplingParams
from tests.e2e.server import Server, alive, aserve_dirs, free_ports, process_tree
from tests.e2e.test_faults import _stream

PRIVATE_SHM = str(Path(__file__).with_name("private_shm.sh"))
SECRET = "a-test-secret-of-the-nodes"


def _can_unshare() -> bool:
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _can_unshare(), reason="needs unshare -m (CAP_SYS_ADMIN) for a private /dev/shm")


def _node(model: Path, shm: Path, port: int, *, secret: str = SECRET, nnodes: int = 2, rank: int = 1,
          split: tuple[str, ...] = ("--tp", "2"), env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [PRIVATE_SHM, str(shm), sys.executable, "-m", "aserve", "run", str(model), *split,
           "--nnodes", str(nnodes), "--node-rank", str(rank), "--headless", "--master-port", str(port),
           "--dp-secret", secret, "--kv-cache-memory", str(1 << 24), "--max-model-len", "256"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def _head(model: Path, shm: Path, port: int, *extra: str, nnodes: int = 2,
          split: tuple[str, ...] = ("--tp", "2")) -> Server:
    return Server(model, *split, "--nnodes", str(nnodes), "--node-rank", "0", "--master-port",
                  str(port), "--dp-secret", SECRET, *extra, launcher=(PRIVATE_SHM, str(shm)), wait=False)


def _stop_both(node: subprocess.Popen, head: Server) -> None:
    """Whatever a test left running of the two trees, stopped and reaped."""
    if node.poll() is None:
        node.kill()
    node.wait()
    node.stdout.close()
    head.stop(signal.SIGKILL)


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("victim", ["remote-worker", "head"])
def test_two_nodes_serve_one_engine_and_fall_together(llama_dir, tmp_path, victim):
    want = LLM(str(llama_dir), kv_cache_memory=1 << 22).generate(
        ["Hello there"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    head_shm, node_shm = tmp_path / "head-shm", tmp_path / "node-shm"
    head_shm.mkdir()
    node_shm.mkdir()
    dirs_before = aserve_dirs()
    port = free_ports(3)
    head = _head(llama_dir, head_shm, port)
    node = _node(llama_dir, node_shm, port)
    pids: list[int] = []
    try:
        head.wait_ready()
        head_pids = head.pids()
        node_pids = [node.pid, *process_tree(node.pid)]
        pids = head_pids + node_pids
        titles = sorted(Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode() for p in node_pids)
        assert titles == ["aserve::supervisor", "aserve::worker_tp1"]  # the node: its supervisor and rank 1
        assert "aserve::worker_tp1" not in [t for _, t in head.title_list()]
        assert list(node_shm.iterdir()) == [] or all(p.name.startswith("aserve_") for p in node_shm.iterdir())

        body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(head.base_url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want

        outcomes = [{} for _ in range(2)]
        started = [threading.Event() for _ in range(2)]
        readers = [threading.Thread(target=_stream, args=(head.base_url, 0, outcomes[i], started[i]))
                   for i in range(2)]
        for reader in readers:
            reader.start()
        assert all(s.wait(60) for s in started) and not any(outcomes), outcomes
        if victim == "remote-worker":
            target = next(p for p in node_pids
                          if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"aserve::worker_tp1"))
        else:
            target = head.proc.pid  # the head's supervisor
        os.kill(target, signal.SIGKILL)
        for reader in readers:
            reader.join(45)
        assert not any(r.is_alive() for r in readers), "a stream hung"
        assert all("end" in o for o in outcomes)
        # The node goes too, either way. Killing the head's supervisor still lets its
        # engine core tell the workers to shut down (it gets SIGTERM from its parent's
        # death), so the node may exit 0 then; a dead worker of its own is a failure.
        node_code = node.wait(60)
        if victim != "head":
            assert node_code != 0
            assert head.proc.wait(60) != 0
        deadline = time.monotonic() + 60
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in pids if alive(p)] == []
    finally:
        _kill_all(pids)
        _stop_both(node, head)
    assert list(head_shm.iterdir()) == [] and list(node_shm.iterdir()) == []
    assert aserve_dirs() <= dirs_before


def test_a_pipeline_stage_per_node_answers_from_the_remote_output_rank(model_dirs, tmp_path):
    """``--pp 2`` over two nodes, as docker/k8s/lws.yaml runs it: the last stage, and so
    the output rank that samples and replies, is on the node without the engine core."""
    model = model_dirs["gemma2"]
    want = LLM(str(model), kv_cache_memory=1 << 22).generate(
        ["Hello there", "Once upon a time"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    shm = [tmp_path / f"shm{i}" for i in range(2)]
    for d in shm:
        d.mkdir()
    dirs_before = aserve_dirs()
    port = free_ports(3)
    head = _head(model, shm[0], port, split=("--pp", "2"))
    node = _node(model, shm[1], port, split=("--pp", "2"))
    try:
        head.wait_ready()
        for prompt, expected in zip(["Hello there", "Once upon a time"], want):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(head.base_url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected.outputs[0].text
        assert head.stop(signal.SIGTERM) == 0  # a clean stop of the head ...
        assert node.wait(60) == 0  # ... stops the node cleanly too
        assert "the head stopped the engine" in node.stdout.read()
    finally:
        _stop_both(node, head)
    assert list(shm[0].iterdir()) == [] and list(shm[1].iterdir()) == []
    assert aserve_dirs() <= dirs_before


# Injected into the other node's worker only (a ``sitecustomize`` on its PYTHONPATH, as
# tests/test_liveness.py does it): each layer of a prefill step, or the whole step, slowed.
_SLOW_REMOTE = {
    "layers": """
import time
import aserve.model.models.llama as llama
_forward = llama.LlamaDecoderLayer.forward
def forward(self, rope, x, residual, kv_cache, meta, rows=None):
    if meta.prefills:
        time.sleep(1.2)
    return _forward(self, rope, x, residual, kv_cache, meta, rows)
llama.LlamaDecoderLayer.forward = forward
""",
    "stuck": """
import time
import aserve.worker.model_runner as runner
_execute = runner.ModelRunner.execute_model
def execute_model(self, sched):
    if any(n > 1 for n in sched.num_scheduled_tokens.values()):
        time.sleep(8)
    return _execute(self, sched)
runner.ModelRunner.execute_model = execute_model
""",
}


@pytest.mark.parametrize("remote_step", ["layers", "stuck"])
def test_a_remote_stage_that_keeps_finishing_layers_outlasts_the_step_bound(tmp_path, remote_step):
    """``--pp 2`` over two nodes with a 3 s step bound, and the remote stage's prefill
    slowed: five layers of 1.2 s each (6 s in all, every layer a progress ping to the
    head) is waited for; 8 s without a layer done is a stuck step, and takes the engine
    down, as on one node."""
    from aserve.model_builder import llama_config, random_llama_weights, write_model_dir
    from aserve.tiny_tokenizer import build_tokenizer

    cfg = llama_config(hidden_size=64, num_layers=10, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       vocab_size=build_tokenizer().get_vocab_size(), max_position_embeddings=256)
    model = tmp_path / "llama-10-layers"
    write_model_dir(model, cfg, random_llama_weights(cfg, seed=0))
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(_SLOW_REMOTE[remote_step])
    shm = [tmp_path / f"shm{i}" for i in range(2)]
    for d in shm:
        d.mkdir()
    dirs_before = aserve_dirs()
    port = free_ports(3)
    head = _head(model, shm[0], port, "--execute-model-timeout", "3", split=("--pp", "2"))
    node = _node(model, shm[1], port, split=("--pp", "2"), env={"PYTHONPATH": str(inject)})
    try:
        head.wait_ready()
        body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        start = time.monotonic()
        reply = httpx.post(head.base_url + "/v1/completions", json=body, timeout=60)
        if remote_step == "layers":
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            assert time.monotonic() - start >= 6  # the step really outlasted the bound
            assert httpx.get(head.base_url + "/health", timeout=5).status_code == 200
        else:
            assert reply.status_code >= 500
            assert time.monotonic() - start < 8  # found stuck at the bound, not after the sleep
            assert head.proc.wait(60) != 0
            assert "made no progress for 3 s" in head.output()
            node.wait(60)  # the node goes too (TimeoutExpired if it stays)
    finally:
        _stop_both(node, head)  # "layers": the node's supervisor still runs, and is killed with SIGKILL
    assert list(shm[0].iterdir()) == [] and list(shm[1].iterdir()) == []
    assert aserve_dirs() <= dirs_before  # no instance directory of either tree is left


def test_a_node_with_the_wrong_secret_is_refused(llama_dir, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    head_shm = tmp_path / "head-shm"
    head_shm.mkdir()
    port = free_ports(3)
    head = _head(llama_dir, head_shm, port)
    try:
        node = _node(llama_dir, shm, port, secret="not-the-secret-of-the-head")
        out, _ = node.communicate(timeout=60)
        assert node.returncode != 0
        assert "secret" in out
        assert list(shm.iterdir()) == []
        # The head never got its second rank: it is not ready.
        assert httpx.get(head.base_url + "/ready", timeout=5).status_code == 503
    finally:
        head.stop(signal.SIGTERM)


def test_a_node_waiting_in_the_rendezvous_exits_when_the_head_goes(model_dirs, tmp_path):
    """Three nodes of one pipeline stage each (Gemma 2's three layers), of which only two
    start: the rendezvous cannot complete. When the head is killed, the waiting node
    exits within seconds, not at its start-up timeout (vLLM's headless nodes hang on
    here)."""
    dirs_before = aserve_dirs()
    port = free_ports(3)
    shm = [tmp_path / f"shm{i}" for i in range(2)]
    for d in shm:
        d.mkdir()
    model, split = model_dirs["gemma2"], ("--pp", "3")
    head = _head(model, shm[0], port, nnodes=3, split=split)
    node = _node(model, shm[1], port, nnodes=3, rank=1, split=split)
    try:
        for line in node.stdout:  # the node's worker says when it enters the rendezvous
            if "joining the engine's process group" in line:
                break
        assert node.poll() is None
        pids = head.pids()
        os.kill(head.proc.pid, signal.SIGKILL)
        started = time.monotonic()
        assert node.wait(30) != 0
        assert time.monotonic() - started < 15  # seen at once; a worker stuck in the rendezvous is killed after 5 s
        _kill_all([p for p in pids if alive(p)])
    finally:
        _stop_both(node, head)
    assert list(shm[1].iterdir()) == []
    assert aserve_dirs() <= dirs_before
