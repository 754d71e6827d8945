"""The package's layers: imports follow the request downwards, never back up.

A request goes cli -> launch -> api -> frontend -> engine -> executor -> worker -> model,
and every layer may use the shared ones under it (wire, config, distributed; kernels;
process primitives). An import from a lower layer into a higher one couples the bottom
of the stack to the top (a worker that imports the scheduler, an engine core that loads
the HTTP front end), so this test reads every module's imports (with ``ast``, nothing is
imported) and lists each one that runs back up. The same table is drawn in
``docs/architecture.md``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "aserve"

#: Top to bottom; a module may import its own layer and any layer below it. The longest
#: matching prefix wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("aserve.cli", "aserve.__main__", "aserve.bench")),
    ("launch", ("aserve.launch",)),
    ("api", ("aserve.api",)),
    ("frontend", ("aserve.frontend",)),
    ("engine", ("aserve.engine",)),
    ("executor", ("aserve.executor",)),
    ("worker", ("aserve.worker",)),
    ("model", ("aserve.model", "aserve.model_builder", "aserve.tiny_tokenizer", "aserve.default_model")),
    ("wire/config/distributed", ("aserve.wire", "aserve.config", "aserve.devices", "aserve.distributed",
                                 "aserve.sampling_params", "aserve.outputs")),
    ("kernels", ("aserve.kernels",)),
    ("process primitives", ("aserve.process", "aserve.envs", "aserve.errors", "aserve.progress")),
]


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)")
    return best


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported module) for every ``aserve`` import, at any depth (lazy ones too).
    ``from aserve import X`` counts as importing what the package exports as X."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "aserve"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "aserve":
                found += [(node.lineno, f"aserve.{alias.name}") for alias in node.names]
            elif node.module.startswith("aserve."):
                found.append((node.lineno, node.module))
    return found


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if module == "aserve":
            continue  # the public face re-exports from every layer, lazily
        own = layer_of(module)
        for line, target in imports_of(path):
            if target == "aserve.__version__":
                continue
            if layer_of(target) < own:
                bad.append(f"{module}:{line} ({LAYERS[own][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    return bad


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        if module_name(path) != "aserve":
            layer_of(module_name(path))


def test_no_import_runs_back_up():
    assert upward_imports() == []


@pytest.mark.parametrize("module,imported,expected", [
    ("aserve.worker.worker", "aserve.engine.scheduler", True),
    ("aserve.engine.scheduler", "aserve.wire.messages", False),
    ("aserve.model_builder", "aserve.frontend.llm", True),
])
def test_the_rule_itself(module, imported, expected):
    assert (layer_of(imported) < layer_of(module)) is expected
