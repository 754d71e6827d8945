"""``aserve generate`` and the embedded default model, as a new user meets them."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import aserve
from aserve.envs import read_env
from aserve.model_builder import ensure_default_model


def run_cli(*args, cache_dir):
    """``aserve ARGS`` with ``cache_dir`` as its cache, which shares the suite's compiled
    kernels: compiling them again took most of a first ``generate`` (18-19 s on Zen 1,
    3 s once built)."""
    shared = read_env().cache_dir / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    if not (cache_dir / "kernels").exists():
        (cache_dir / "kernels").symlink_to(shared, target_is_directory=True)
    env = {**os.environ, "ASERVE_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-m", "aserve", *args], capture_output=True, text=True, env=env, timeout=300)


def test_generate_with_the_default_model(tmp_path):
    proc = run_cli("generate", "Hello, my name is", "--max-tokens", "8", cache_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "the default model (4.3M parameters trained on Python's own documentation" in proc.stderr
    assert proc.stdout.strip() != ""
    again = run_cli("generate", "Hello, my name is", "--max-tokens", "8", cache_dir=tmp_path)
    assert again.stdout == proc.stdout  # greedy by default: the same text


def test_generate_reports_bad_input(tmp_path):
    proc = run_cli("generate", "x", "--model", str(tmp_path / "missing"), cache_dir=tmp_path)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


def test_version():
    proc = subprocess.run([sys.executable, "-m", "aserve", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"aserve {aserve.__version__}"


def test_the_committed_default_model_is_what_run_serves_without_one():
    from aserve.default_model import default_model_dir
    from aserve.engine.args import resolve_model_path
    from aserve.model.hf_config import load_arch_config

    path = default_model_dir()
    assert resolve_model_path(None) == str(path)
    arch = load_arch_config(path)
    assert arch.architecture == "LlamaForCausalLM" and arch.vocab_size == 4096
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in path.iterdir()}


def test_random_test_model_is_built_deterministically(tmp_path):
    def digest(path):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}

    first = ensure_default_model(tmp_path / "a")
    second = ensure_default_model(tmp_path / "b")
    assert digest(first) == digest(second)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(digest(first))


def test_public_api_is_explicit():
    assert aserve.__all__ == sorted(aserve.__all__)
    for name in aserve.__all__:
        assert getattr(aserve, name) is not None
    assert {"LLM", "SamplingParams", "RequestOutput"} <= set(aserve.__all__)


def test_run_refuses_a_prefix_cache_reserve_outside_0_to_1(llama_dir, tmp_path):
    # The flag reaches the engine's config, which names it before any process starts.
    proc = run_cli("run", str(llama_dir), "--port", "0", "--prefix-cache-reserve", "1.5", cache_dir=tmp_path)
    assert proc.returncode == 2
    assert "prefix_cache_reserve must be in [0, 1], got 1.5" in proc.stderr


def test_run_checks_the_flags_of_an_engine_across_nodes(llama_dir, tmp_path):
    """Before any process starts: a head without the wires' secret, a worker node without
    --headless, and --headless on the head are each refused, naming the flag."""
    env_free = {k: v for k, v in os.environ.items() if k != "ASERVE_DP_SECRET"}
    cases = [
        (["--tp", "2", "--nnodes", "2"], "shared secret"),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dp-secret", "x" * 20], "add --headless"),
        (["--tp", "2", "--nnodes", "2", "--headless", "--dp-secret", "x" * 20], "--node-rank > 0"),
        (["--tp", "3", "--nnodes", "2", "--dp-secret", "x" * 20], "split evenly"),
    ]
    for extra, message in cases:
        proc = subprocess.run([sys.executable, "-m", "aserve", "run", str(llama_dir), "--port", "0", *extra],
                              capture_output=True, text=True, timeout=120,
                              env={**env_free, "ASERVE_CACHE_DIR": str(tmp_path)})
        assert proc.returncode == 2, (extra, proc.stderr)
        assert message in proc.stderr, (extra, proc.stderr)
