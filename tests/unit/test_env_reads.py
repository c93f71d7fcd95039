"""psflow reads environment variables only through :mod:`psflow.env`.

``psflow/env.py`` names every variable psflow honours and reads each with a typed reader that
refuses a bad value naming the variable and the value. A read anywhere else would skip both, so
this file walks every module of psflow but ``env.py`` with :mod:`ast` and fails, naming
``file:line``, on each read of the environment by key, whatever the key (a ``PSFLOW_`` literal,
``envvars.PSFLOW_TIMEOUT``, ``"TF_CONFIG"`` or a variable holding a name):

- ``os.environ[key]``, ``key in os.environ`` (and ``not in``);
- ``os.environ.get``, ``.pop``, ``.setdefault``, ``.__getitem__``, ``.__contains__``, called or
  passed on;
- ``os.getenv`` (and ``os.getenvb``, ``os.environb``);
- the same through an alias: ``import os as o``, ``from os import environ, getenv``,
  ``env = os.environ``, or a choice that may give it (``(os.environ if m is None else m)``);
- the same on any mapping named ``environ``: in psflow that name means "the environment, or a
  stand-in for it that a test passes", and such a mapping is read with
  ``psflow.env.text(name, environ=environ)`` (or ``port``), never by hand.

Not reads, so not flagged: copying the whole environment (``dict(os.environ)``,
``{**os.environ}``, ``os.environ.copy()``), writing or deleting a variable
(``os.environ[key] = v``, ``del os.environ[key]``), and anything done to a child's own ``env``
dict.

A second check holds the readers to the named constants: ``envvars.text("LD_PRELOAD")`` goes
through a reader, yet names a variable that ``env.py`` does not list, so a call of a reader
(any function of ``env.py`` whose first parameter is ``name``) with a string literal for the
name fails too. Both checkers are themselves tested on planted sources, each form caught at its
line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from psflow import env as envvars

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

_ENVIRON = frozenset({"environ", "environb"})
"""``os``'s environment mappings; also the name psflow gives a mapping that stands for one."""
_GETENV = frozenset({"getenv", "getenvb"})
_READ_METHODS = frozenset({"get", "pop", "setdefault", "__getitem__", "__contains__"})


class _Aliases(ast.NodeVisitor):
    """The names a module binds to ``os``, to its environment and to ``getenv``."""

    def __init__(self) -> None:
        self.os = {"os"}
        self.environ = set(_ENVIRON)
        self.getenv: set[str] = set()

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name == "os":
                self.os.add(a.asname or "os")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module != "os":
            return
        for a in node.names:
            if a.name in _ENVIRON:
                self.environ.add(a.asname or a.name)
            elif a.name in _GETENV:
                self.getenv.add(a.asname or a.name)

    def is_environ(self, node: ast.expr) -> bool:
        """``node`` is the environment: a name or ``os`` attribute for it, or a choice
        (``a if c else b``, ``a or b``) that may give it."""
        if isinstance(node, ast.Name):
            return node.id in self.environ
        if isinstance(node, ast.IfExp):
            return self.is_environ(node.body) or self.is_environ(node.orelse)
        if isinstance(node, ast.BoolOp):
            return any(self.is_environ(v) for v in node.values)
        return (
            isinstance(node, ast.Attribute)
            and node.attr in _ENVIRON
            and isinstance(node.value, ast.Name)
            and node.value.id in self.os
        )


def _aliases(tree: ast.Module) -> _Aliases:
    aliases = _Aliases()
    aliases.visit(tree)
    # `env = os.environ` (and a chain of such names): repeat until no new name appears.
    while True:
        before = len(aliases.environ)
        for node in ast.walk(tree):
            value = getattr(node, "value", None)
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if aliases.is_environ(value):
                    aliases.environ.update(t.id for t in targets if isinstance(t, ast.Name))
        if len(aliases.environ) == before:
            return aliases


def environment_reads(source: str, filename: str) -> list[str]:
    """Each read of the environment by key in ``source``, as ``filename:line: code``."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    lines: set[int] = set()
    for node in ast.walk(tree):
        read = False
        if isinstance(node, ast.Subscript):
            read = isinstance(node.ctx, ast.Load) and aliases.is_environ(node.value)
        elif isinstance(node, ast.Attribute):
            read = (node.attr in _READ_METHODS and aliases.is_environ(node.value)) or (
                node.attr in _GETENV
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases.os
            )
        elif isinstance(node, ast.Name):
            read = isinstance(node.ctx, ast.Load) and node.id in aliases.getenv
        elif isinstance(node, ast.Compare):
            read = any(
                isinstance(op, ast.In | ast.NotIn) and aliases.is_environ(right)
                for op, right in zip(node.ops, node.comparators, strict=True)
            )
        if read:
            lines.add(node.lineno)
    code = source.splitlines()
    return [f"{filename}:{n}: {code[n - 1].strip()}" for n in sorted(lines)]


def readers(env_source: str) -> frozenset[str]:
    """The readers ``env.py`` defines: its public functions whose first parameter is ``name``."""
    return frozenset(
        node.name
        for node in ast.parse(env_source).body
        if isinstance(node, ast.FunctionDef)
        and not node.name.startswith("_")
        and node.args.args[:1]
        and node.args.args[0].arg == "name"
    )


def unnamed_variables(
    source: str, filename: str, readers: frozenset[str], package: str = "psflow"
) -> list[str]:
    """Each call in ``source`` of one of ``package``'s env ``readers`` that spells the variable
    as a string literal instead of naming the module's constant, as ``filename:line: code``."""
    tree = ast.parse(source, filename)
    modules: set[str] = set()  # names bound to the env module
    functions: set[str] = set()  # names bound to its readers
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == package:
            modules.update(a.asname or a.name for a in node.names if a.name == "env")
        elif isinstance(node, ast.ImportFrom) and node.module == f"{package}.env":
            functions.update(a.asname or a.name for a in node.names if a.name in readers)
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name == f"{package}.env" and a.asname)
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        reader = (isinstance(f, ast.Name) and f.id in functions) or (
            isinstance(f, ast.Attribute)
            and f.attr in readers
            and isinstance(f.value, ast.Name)
            and f.value.id in modules
        )
        named = [k.value for k in node.keywords if k.arg == "name"]
        first = node.args[0] if node.args else (named[0] if named else None)
        if reader and isinstance(first, ast.Constant | ast.JoinedStr):
            lines.add(node.lineno)
    code = source.splitlines()
    return [f"{filename}:{n}: {code[n - 1].strip()}" for n in sorted(lines)]


def package_reads(package: Path) -> tuple[list[Path], list[str]]:
    """The modules of ``package`` checked (all but its ``env.py``), and what both checkers find
    in them."""
    modules = [p for p in sorted(package.rglob("*.py")) if p != package / "env.py"]
    env_readers = readers((package / "env.py").read_text(encoding="utf-8"))
    found: list[str] = []
    for path in modules:
        name = path.relative_to(package.parent).as_posix()
        source = path.read_text(encoding="utf-8")
        found += environment_reads(source, name)
        found += unnamed_variables(source, name, env_readers, package.name)
    return modules, found


# --- psflow itself ------------------------------------------------------------------------------


def test_psflow_reads_the_environment_only_through_env_py() -> None:
    modules, reads = package_reads(ROOT / "psflow")
    checked = {p.relative_to(ROOT).as_posix() for p in modules}
    # The walk found the package, not an empty directory, and skipped env.py alone.
    assert {"psflow/cluster/resolve.py", "psflow/allocator.py", "psflow/cli/__init__.py"} <= checked
    assert "psflow/env.py" not in checked and len(checked) > 50
    assert not reads, (
        "read these through psflow.env's typed readers (env.text(name, environ=...) for a "
        "mapping that stands for the environment), naming each variable by its constant "
        "there:\n" + "\n".join(reads)
    )


def test_env_py_itself_is_where_the_reads_are() -> None:
    """The one file left out does read the environment: the checker sees its reads."""
    source = (ROOT / "psflow" / "env.py").read_text(encoding="utf-8")
    assert environment_reads(source, "psflow/env.py")


# --- the checker, on planted sources ------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        'import os\nx = os.environ["PSFLOW_TIMEOUT"]\n',
        'import os\nx = os.environ.get("PSFLOW_TIMEOUT", "60")\n',
        "import os\nfrom psflow import env as envvars\nx = os.environ.get(envvars.PSFLOW_SHM)\n",
        "import os\nfrom psflow import env\nx = os.getenv(env.PSFLOW_SHM)\n",
        "import os\nfrom psflow.env import PSFLOW_MODE\nx = os.environ[PSFLOW_MODE]\n",
        'import os\nx = "PSFLOW_SHM" not in os.environ\n',
        'import os\nx = (os.environ if m is None else m).get("PSFLOW_SHM")\n',
        'import os\nx = (m or os.environ)["PSFLOW_SHM"]\n',
        'import os\nx = os.environ.pop("PSFLOW_SHM", None)\n',
        'import os\nx = os.environ.setdefault("PSFLOW_SHM", "1")\n',
        'import os\nx = os.environ.__getitem__("TF_CONFIG")\n',
        'import os\nx = os.environb[b"PSFLOW_SHM"]\n',
        'import os\nx = os.getenvb(b"PSFLOW_SHM")\n',
        'import os as o\nx = o.environ["LD_PRELOAD"]\n',
        'from os import environ\nx = environ.get("PSFLOW_SHM")\n',
        'from os import environ as e\nx = e["PSFLOW_SHM"]\n',
        'from os import getenv\nx = getenv("PSFLOW_SHM")\n',
        'from os import getenv as g\nx = g("PSFLOW_SHM")\n',
        'import os\nenv = os.environ\nx = env.get("PSFLOW_SHM")\n',
        'import os\nenv = os.environ\nmine = env\nx = mine["PSFLOW_SHM"]\n',
        "import os\nread = os.environ.get\n",
        'import functools\nimport os\nread = functools.partial(os.getenv, "PSFLOW_SHM")\n',
        "def f(environ, name):\n    return environ.get(name)\n",
        "def f(environ, name):\n    return environ[name]\n",
        "def f(environ):\n    return envvars.PSFLOW_LOG_LEVEL in environ\n",
    ],
)
def test_the_checker_catches_each_form(source: str) -> None:
    last = len(source.splitlines())
    assert [r.split(": ")[0] for r in environment_reads(source, "planted.py")] == [
        f"planted.py:{last}"
    ]


@pytest.mark.parametrize(
    "source",
    [
        "import os\nenv = dict(os.environ)\n",
        "import os\nenv = {**os.environ}\n",
        "import os\nenv = os.environ.copy()\n",
        'import os\nenv = {**os.environ}\nenv["PSFLOW_MODE"] = "sync"\nx = env.get("PSFLOW_MODE")\n',
        'import os\nos.environ["PSFLOW_SHM"] = "0"\n',
        'import os\ndel os.environ["PSFLOW_SHM"]\n',
        'import os\nos.environ.update(PSFLOW_SHM="0")\n',
        "import subprocess\nsubprocess.run(['true'], env={'PSFLOW_SHM': '0'})\n",
        "from psflow import env as envvars\nx = envvars.text(envvars.PSFLOW_SHM)\n",
        "def f(environ):\n    return envvars.text(envvars.TF_CONFIG, environ=environ)\n",
        "def f(config):\n    return config.env.get(envvars.PSFLOW_KEYS_DIR)\n",
        'import os\nx = os.path.join("PSFLOW_SHM", "a")\n',
    ],
)
def test_the_checker_passes_what_is_no_read(source: str) -> None:
    assert environment_reads(source, "planted.py") == []


_READERS = readers((ROOT / "psflow" / "env.py").read_text(encoding="utf-8"))


def test_readers_are_env_py_s_readers() -> None:
    assert {"text", "flag", "choice", "port", "seconds", "seconds_or_none", "micros"} <= _READERS
    assert "threads_per_task" not in _READERS


@pytest.mark.parametrize(
    "source",
    [
        'from psflow import env as envvars\nx = envvars.text("LD_PRELOAD")\n',
        'from psflow import env\nx = env.flag("PSFLOW_SHM", True)\n',
        'import psflow.env as e\nx = e.port(name="PSFLOW_METRICS_PORT")\n',
        'from psflow.env import seconds as s\nx = s(f"PSFLOW_{kind}_TIMEOUT", 1.0)\n',
    ],
)
def test_the_name_check_catches_a_literal(source: str) -> None:
    last = len(source.splitlines())
    found = unnamed_variables(source, "planted.py", _READERS)
    assert [r.split(": ")[0] for r in found] == [f"planted.py:{last}"]


@pytest.mark.parametrize(
    "source",
    [
        "from psflow import env as envvars\nx = envvars.text(envvars.LD_PRELOAD)\n",
        "from psflow.env import PSFLOW_SHM, flag\nx = flag(PSFLOW_SHM, True)\n",
        'from psflow import env as envvars\nx = envvars.threads_per_task("2")\n',
        'from other import env\nx = env.text("LD_PRELOAD")\n',
    ],
)
def test_the_name_check_passes_a_constant(source: str) -> None:
    assert unnamed_variables(source, "planted.py", _READERS) == []


def test_the_walk_names_the_file_and_line_and_skips_env_py(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "env.py").write_text(
        'import os\n\n\ndef text(name):\n    return os.environ["PSFLOW_SHM"]\n'
    )
    (package / "sub" / "mod.py").write_text(
        '"""Doc."""\n\nimport os\n\nfrom pkg import env\n\n'
        'x = os.getenv("PSFLOW_SHM")\ny = env.text("PSFLOW_SHM")\n'
    )
    modules, found = package_reads(package)
    assert modules == [package / "sub" / "mod.py"]
    assert found == [
        'pkg/sub/mod.py:7: x = os.getenv("PSFLOW_SHM")',
        'pkg/sub/mod.py:8: y = env.text("PSFLOW_SHM")',
    ]


# --- the reader a mapping goes through ----------------------------------------------------------


def test_text_reads_the_mapping_given_and_not_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = envvars.PSFLOW_CLUSTER_FILE
    monkeypatch.setenv(name, "/from/the/process")
    assert envvars.text(name, environ={name: "/from/the/mapping"}) == "/from/the/mapping"
    assert envvars.text(name, environ={}) is None
    assert envvars.text(name, "default", environ={name: " "}) == "default"
    assert envvars.text(name) == "/from/the/process"
