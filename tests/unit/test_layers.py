"""Import layering: psflow keeps its layers contract, and no two of its modules import each other.

The contract (import-linter, run by ``scripts/test.sh`` as ``lint-imports`` and here again so
``pytest`` alone catches an upward import) says which package may import which. A cycle inside
one package is no layers matter, so this file also fails on every group of psflow modules that
reach each other through imports. Both count an import under ``if TYPE_CHECKING:`` and one inside
a function: each is still an arrow a reader has to follow, and either can become a real one.

The checks are themselves tested on small synthetic packages, so they are shown able to fail.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest
from importlinter import api as importlinter_api

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def build_graph(package: str) -> grimp.ImportGraph:
    """The import graph of ``package``, as import-linter builds it for the contract."""
    # Both arguments as grimp's defaults have them, spelled out: imports under TYPE_CHECKING are
    # arrows too, and a cache here would be one more directory in the checkout.
    return grimp.build_graph(package, exclude_type_checking_imports=False, cache_dir=None)


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every strongly connected component of more than one module, each sorted, in sorted order.

    Tarjan's algorithm, iterative so that a deep import chain cannot exhaust the stack.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def imported_by(module: str) -> Iterator[str]:
        return iter(sorted(graph.find_modules_directly_imported_by(module)))

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)

    for root in sorted(graph.modules):
        if root in index:
            continue
        visit(root)
        work = [(root, imported_by(root))]
        while work:
            module, children = work[-1]
            for child in children:
                if child not in index:
                    visit(child)
                    work.append((child, imported_by(child)))
                    break
                if child in on_stack:
                    low[module] = min(low[module], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return sorted(cycles)


def describe_cycle(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    """The cycle's modules, then each import between them with its line."""
    lines = ["cycle: " + ", ".join(cycle)]
    members = set(cycle)
    for importer in cycle:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            details = graph.get_import_details(importer=importer, imported=imported)
            for d in details:
                lines.append(
                    f"  {importer} -> {imported} (l.{d['line_number']}: {d['line_contents']})"
                )
            if not details:
                lines.append(f"  {importer} -> {imported}")
    return "\n".join(lines)


def lint_imports(config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the packages under ``cwd``, with the contracts in ``config``."""
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} missing: install requirements/test.txt"
    env = dict(os.environ)
    # cwd first, so that an installed psflow elsewhere is never the one checked; wide columns so
    # that the report's lines are not wrapped in the middle of a module name.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), env.get("PYTHONPATH")) if p)
    env.update(COLUMNS="500", NO_COLOR="1")
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# --- psflow itself ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def psflow_graph() -> grimp.ImportGraph:
    spec = importlib.util.find_spec("psflow")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).parent == ROOT / "psflow", f"psflow resolves to {spec.origin}"
    return build_graph("psflow")


def test_psflow_modules_import_no_cycle(psflow_graph: grimp.ImportGraph) -> None:
    cycles = import_cycles(psflow_graph)
    assert not cycles, "import cycles in psflow:\n" + "\n".join(
        describe_cycle(psflow_graph, c) for c in cycles
    )


def test_psflow_keeps_its_layers_contract() -> None:
    config = importlinter_api.read_configuration(str(ROOT / "pyproject.toml"))
    assert "layers" in {c["type"] for c in config["contracts_options"]}
    proc = lint_imports(ROOT / "pyproject.toml", cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_contract_catches_upward_imports_of_every_kind(tmp_path: Path) -> None:
    """psflow's own contract, on a copy of psflow with three upward imports added."""
    shutil.copytree(
        ROOT / "psflow", tmp_path / "psflow", ignore=shutil.ignore_patterns("__pycache__")
    )
    # New modules, so that the test does not depend on what the packages' modules are called.
    added = {
        # At module level, transport up to worker.
        "transport/_upward.py": "import psflow.worker\n",
        # Only for the type checker, between the independent ps and worker.
        "ps/_upward.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import psflow.worker\n"
        ),
        # Inside a function, from the vocabulary that imports nothing of psflow.
        "protocol/_upward.py": "def f() -> None:\n    from psflow import env\n",
    }
    for name, text in added.items():
        (tmp_path / "psflow" / name).write_text(text)
    proc = lint_imports(ROOT / "pyproject.toml", cwd=tmp_path)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 1, report
    for edge in (
        "psflow.transport._upward -> psflow.worker",
        "psflow.ps._upward -> psflow.worker",
        "psflow.protocol._upward -> psflow.env",
    ):
        assert edge in report, report


# --- the checks, on a synthetic package ---------------------------------------------------------


def test_import_cycles_names_each_cycle_and_nothing_else() -> None:
    graph = grimp.ImportGraph()
    for importer, imported in [
        ("pkg.a", "pkg.b"),
        ("pkg.b", "pkg.a"),  # a two-module cycle,
        ("pkg.b", "pkg.h"),
        ("pkg.h", "pkg.b"),  # and another sharing pkg.b: one component
        ("pkg.c", "pkg.d"),
        ("pkg.d", "pkg.e"),
        ("pkg.e", "pkg.c"),  # a three-module one
        ("pkg.e", "pkg.f"),  # leaving a cycle is fine
        ("pkg.f", "pkg.g"),
        ("pkg.a", "pkg.g"),
    ]:
        graph.add_import(importer=importer, imported=imported)
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.h"], ["pkg.c", "pkg.d", "pkg.e"]]
    assert describe_cycle(graph, ["pkg.a", "pkg.b", "pkg.h"]).splitlines() == [
        "cycle: pkg.a, pkg.b, pkg.h",
        "  pkg.a -> pkg.b",
        "  pkg.b -> pkg.a",
        "  pkg.b -> pkg.h",
        "  pkg.h -> pkg.b",
    ]

    clean = grimp.ImportGraph()
    for importer, imported in [("pkg.a", "pkg.b"), ("pkg.a", "pkg.c"), ("pkg.b", "pkg.d")]:
        clean.add_import(importer=importer, imported=imported)
    clean.add_import(importer="pkg.c", imported="pkg.d")  # a diamond, not a cycle
    assert import_cycles(clean) == []


# The toy package: `high` imports `low`; `low` imports `high` back in the ways a real one would.
_LOW = {
    "clean": "",
    "module_level": "import layertoy.high\n",
    "type_checking": (
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from layertoy.high import H\n"
    ),
    "in_function": "def f():\n    from layertoy import high\n\n    return high\n",
}

_TOY_CONTRACT = """\
[tool.importlinter]
root_package = "layertoy"

[[tool.importlinter.contracts]]
id = "layers"
name = "toy layers"
type = "layers"
layers = ["layertoy.high", "layertoy.low"]
"""


def _toy(tmp_path: Path, how: str) -> Path:
    pkg = tmp_path / "layertoy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "high.py").write_text("from layertoy.low import L\n\nH = L\n")
    (pkg / "low.py").write_text(_LOW[how] + "\nL = 1\n")
    (tmp_path / "pyproject.toml").write_text(_TOY_CONTRACT)
    return tmp_path


@pytest.mark.parametrize("how", sorted(_LOW))
def test_both_checks_fail_on_an_upward_import_and_pass_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    root = _toy(tmp_path, how)
    monkeypatch.syspath_prepend(str(root))
    upward = how != "clean"

    assert import_cycles(build_graph("layertoy")) == (
        [["layertoy.high", "layertoy.low"]] if upward else []
    )

    proc = lint_imports(root / "pyproject.toml", cwd=root)
    report = proc.stdout + proc.stderr
    assert proc.returncode == (1 if upward else 0), report
    assert ("layertoy.low -> layertoy.high" in report) == upward, report
