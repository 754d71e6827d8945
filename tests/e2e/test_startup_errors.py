"""Mistakes a user makes starting ``aserve run``: one line naming the flag or the file,
exit status 2, and nothing started (no process, no shared memory) -- the traceback only
with ``--log-level DEBUG``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def session_processes(sid: int) -> list[int]:
    """Processes still alive in session ``sid`` (the command's own, and any child)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session id
            alive.append(int(entry.name))
    return alive


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("aserve_*")}


def run_aserve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[int]]:
    before = segments()
    proc = subprocess.Popen([sys.executable, "-m", "aserve", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    out, err = proc.communicate(timeout=120)
    left = session_processes(proc.pid)
    assert segments() - before == set()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), left


def copy_model(llama_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama_dir, tmp_path / "model"))


def truncate_weights(model: Path) -> None:
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])


def garble_weights(model: Path) -> None:
    (model / "model.safetensors").write_bytes(b"this is not a safetensors file at all")


def remove_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").unlink()


def garble_config(model: Path) -> None:
    (model / "config.json").write_text("{not json")


def unknown_architecture(model: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(cfg))


def quantized(model: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model / "config.json").write_text(json.dumps(cfg))


def yarn_rope(model: Path) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (model / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("spoil,flags,expected", [
    (None, ["--max-model-len", "100000"], "--max-model-len: max_model_len=100000 exceeds the model's limit of 512"),
    (None, ["--tp", "0"], "--tensor-parallel-size/--tp: tensor_parallel_size must be >= 1, got 0"),
    (None, ["--tp", "3"], "--tensor-parallel-size/--tp: tensor_parallel_size=3 does not divide this model's 4 attention heads"),
    (None, ["--kv-cache-memory", "1024"], "--kv-cache-memory: kv_cache_memory=1024 bytes is too small"),
    (None, ["--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    (None, ["--tp", "two"], "argument --tensor-parallel-size/--tp: invalid int value: 'two'"),
    (None, ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (None, ["--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-certfile: cannot load the TLS certificate"),
    (None, ["--dp", "2", "--dp-size-local", "3"], "--dp-size-local/--data-parallel-size-local: need 1 <= --dp-size-local"),
    (truncate_weights, [], "model.safetensors is not a valid safetensors file"),
    (garble_weights, [], "model.safetensors is not a valid safetensors file"),
    (remove_tokenizer, [], "tokenizer.json not found in"),
    (garble_config, [], "config.json is not valid JSON"),
    (unknown_architecture, [], "architecture 'GPT2LMHeadModel' is not supported"),
    (quantized, [], "config.json: quantization_config (gptq) is not supported"),
    (yarn_rope, [], "rope type 'yarn' (rope_scaling) is not supported"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_one_line_and_nothing_started(llama_dir, tmp_path, spoil, flags, expected):
    model = llama_dir
    if spoil is not None:
        model = copy_model(llama_dir, tmp_path)
        spoil(model)
    result, left = run_aserve(str(model), "--port", "0", *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("aserve: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert left == []


def test_a_missing_model_directory(tmp_path):
    result, left = run_aserve(str(tmp_path / "nowhere"), "--port", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"aserve: error: model directory {tmp_path / 'nowhere'} does not exist: give a Hugging Face-format "
        "directory (config.json, *.safetensors, tokenizer.json)"]
    assert left == []


def test_a_port_in_use(llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, left = run_aserve(str(llama_dir), "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"aserve: error: --port: port {port} on 127.0.0.1 is in use: stop what listens there, or pick another "
        "--port (0 picks a free one)"]
    assert left == []


def test_the_traceback_only_with_debug(llama_dir):
    result, left = run_aserve(str(llama_dir), "--port", "0", "--max-model-len", "100000", "--log-level", "DEBUG")
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("aserve: error: --max-model-len: ")
    assert left == []
