from __future__ import annotations

import os
from pathlib import Path

# Triton's interpreter must be chosen before triton is first imported (PLATFORM-NOTES):
# the Triton kernels' tests run on CPU tensors through it. Nothing else imports triton
# unless ASERVE_TRITON=1 asks for it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.models import VARIANTS, build_model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(name, root / name) for name in VARIANTS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def sharded_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("sharded") / "llama", shard=True)


@pytest.fixture
def bf16_llama_dir(llama_dir: Path, tmp_path: Path) -> Path:
    """The test llama (float32 weights) with a config.json that names bfloat16."""
    import json

    for path in llama_dir.iterdir():
        (tmp_path / path.name).symlink_to(path)
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.fixture
def set_threads():
    """``torch.set_num_threads`` for the test; the count is restored after it."""
    import torch

    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)
