"""The import graph: arrows run downward only, and the pure cores do no I/O.

Layers, lowest first: ``schemas`` (the wire and the vocabulary), ``broker`` (what the front door
and the workers share: settings, streams, admission), then ``api`` (the front door) and
``workers`` beside it, neither importing the other, then ``kvgate`` (the composition root: the
command, ``kvgate up``), ``loadtests`` and, on top, ``tests``. A module may import its own
package and any package below it. No module imports a test module: what tests share lives in a
module of its own. Every import counts, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANK = {"schemas": 0, "broker": 1, "api": 2, "workers": 2, "kvgate": 3, "loadtests": 4, "tests": 5}
PURE_CORES = (
    "broker/admission/policy.py",
    "broker/admission/objectives.py",
    "workers/headroom.py",
    "workers/pullplan.py",
    "workers/core.py",
)
"""Pure decision code: the clock and every reading are arguments, so a test steps it."""
IO_MODULES = frozenset(
    {"nats", "redis", "fastapi", "starlette", "sqlalchemy", "sqlmodel", "vllm", "httpx",
     "aiohttp", "asyncio", "socket", "subprocess", "time"}
)  # fmt: skip


def modules() -> list[Path]:
    return sorted(p for package in RANK for p in (ROOT / package).rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, and every name it imports from one, dotted in full. The
    project imports absolutely (a relative import would be read as its bare name)."""
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_the_walk_sees_every_layer_and_reads_imports_inside_functions(tmp_path: Path) -> None:
    found = {p.relative_to(ROOT).parts[0] for p in modules()}
    assert found == set(RANK)
    sample = tmp_path / "sample.py"
    sample.write_text("import os\n\ndef f():\n    from api.app import create_app\n")
    assert {"os", "api.app", "api.app.create_app"} <= imported(sample)


def test_imports_run_downward_and_never_into_a_test_module() -> None:
    wrong: list[str] = []
    for path in modules():
        rel = path.relative_to(ROOT)
        own = rel.parts[0]
        for name in imported(path):
            parts = name.split(".")
            if parts[0] in RANK and parts[0] != own and RANK[parts[0]] >= RANK[own]:
                wrong.append(f"{rel} imports {name}, a layer not below its own")
            if parts[0] == "tests" and len(parts) > 1 and parts[1].startswith("test_"):
                wrong.append(f"{rel} imports the test module {name}")
    assert wrong == []


@pytest.mark.parametrize("core", PURE_CORES)
def test_a_pure_core_imports_no_io(core: str) -> None:
    io = {name for name in imported(ROOT / core) if name.split(".")[0] in IO_MODULES}
    assert io == set(), f"{core} imports {sorted(io)}"


def test_the_map_of_the_code_names_every_module() -> None:
    """``docs/architecture.md`` is where a newcomer looks a behaviour up: a module it does not
    name is one they cannot find."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = [
        str(path.relative_to(ROOT))
        for path in modules()
        if path.parts[len(ROOT.parts)] in {"schemas", "broker", "api", "workers", "kvgate"}
        and path.name != "__init__.py"
        and "migrations" not in path.parts
        and f"`{path.name}`" not in text
        and f"{path.relative_to(ROOT)}`" not in text
    ]
    assert unnamed == []
