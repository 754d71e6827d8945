from __future__ import annotations

import os
import time
from pathlib import Path

from aserve.devices import cuda_device_count  # noqa: E402  (imports no triton)

# Triton's interpreter must be chosen before triton is first imported (PLATFORM-NOTES):
# without a GPU the Triton kernels' tests run on CPU tensors through it. With one they are
# compiled, as they serve: the interpreter would also reach the workers (they inherit the
# environment), and it neither checks what the compiler refuses nor runs at a GPU's speed.
# Nothing else imports triton unless ASERVE_TRITON=1 asks for it.
if cuda_device_count() == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.e2e.server import aserve_dirs, aserve_shm
from tests.models import VARIANTS, build_model


def aserve_traces() -> set[str]:
    """What aserve leaves on this machine while it runs: instance directories in the
    temporary directory, shared-memory segments, and processes titled ``aserve::``
    (other than this one)."""
    found = {f"dir {name}" for name in aserve_dirs()} | {f"segment {name}" for name in aserve_shm()}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                title = (proc / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if title.startswith(b"aserve::"):
                found.add(f"process {proc.name} {title.decode(errors='replace')}")
    return found


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind():
    """Every test module leaves no aserve process, segment or instance directory that it
    did not find: a fault or a stop that leaves one fails the module, whichever test it
    came from. Processes killed at the end of a test may still be exiting, and an
    orphaned engine core removes its instance as it exits, so what is left is looked at
    again for up to 30 s before it counts. The names are the machine's, not this
    session's: an aserve server started by hand while the suite runs is counted too.
    """
    before = aserve_traces()
    yield
    deadline = time.monotonic() + 30
    while (left := aserve_traces() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind by this module: {sorted(left)}"


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
