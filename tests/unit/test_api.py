"""The API reference (docs/api.md) stays true: every name on it exists, and it lists every name
``psflow`` exports, every ``ctx`` property, session setting, row optimizer and variable."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import psflow
import psflow.nn
from psflow import env
from psflow.protocol import ROW_OPTIMIZERS
from psflow.train.session_config import SETTINGS as SESSION_SETTINGS

pytestmark = pytest.mark.unit

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
TEXT = PAGE.read_text()
_DOTTED = re.compile(r"(?<![\w.])psflow(?:\.[A-Za-z_]\w*)+")
_CODE = re.compile(r"`([^`\n]+)`")


def resolve_name(dotted: str) -> Any:
    """What ``dotted`` names: the longest importable module, then attributes (a dataclass field
    without a default, which is no class attribute, counts)."""
    parts = dotted.split(".")
    obj: Any = None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        rest = parts[i:]
        break
    assert isinstance(obj, ModuleType), dotted
    for name in rest:
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
            obj = dataclasses.MISSING
        else:
            raise AttributeError(f"{dotted}: {obj!r} has no {name!r}")
    return obj


def code_spans() -> list[str]:
    return _CODE.findall(TEXT)


def test_resolve_name_finds_modules_attributes_and_fields() -> None:
    assert resolve_name("psflow.nn.TableConfig") is psflow.nn.TableConfig
    assert resolve_name("psflow.nn.TableConfig.embedding_dim") is dataclasses.MISSING
    assert resolve_name("psflow.data.ctr.ctr_batches").__name__ == "ctr_batches"
    with pytest.raises(AttributeError, match="nowhere"):
        resolve_name("psflow.nowhere")


def test_every_psflow_name_on_the_page_exists() -> None:
    names = sorted(set(_DOTTED.findall(TEXT)))
    assert len(names) > 40
    missing = []
    for name in names:
        try:
            resolve_name(name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name} ({e})")
    assert not missing, missing


def test_every_exported_name_is_on_the_page() -> None:
    shown = set(_DOTTED.findall(TEXT))
    exports = [f"psflow.{n}" for n in psflow.__all__]
    exports += [f"psflow.nn.{n}" for n in psflow.nn.__all__]
    assert not [n for n in exports if n not in shown]


def test_the_script_names_come_from_psflow_and_psflow_nn() -> None:
    # What a script needs, not from psflow.protocol or a module path.
    assert psflow.Mode.SYNC == "sync" and psflow.auc(np.array([0.1, 0.9]), np.array([0, 1])) == 1.0
    assert psflow.nn.RowOptimizerSpec is importlib.import_module("psflow.protocol").RowOptimizerSpec
    assert "psflow.protocol" not in TEXT


def test_every_ctx_property_is_on_the_page() -> None:
    ctx_names = {m.group(1) for m in re.finditer(r"\bctx\.(\w+)", TEXT)}
    ctx = psflow.TaskContext.alone()
    assert not [n for n in ctx_names if not hasattr(ctx, n)]
    public = {
        n
        for n, v in vars(psflow.TaskContext).items()
        if isinstance(v, property) and not n.startswith("_")
    } | {f.name for f in dataclasses.fields(psflow.TaskContext)}
    assert not sorted(public - ctx_names)


def test_every_sess_name_exists() -> None:
    """``sess.<name>``: a class attribute of the session or one set on ``self`` in its code."""
    cls = psflow.TrainingSession
    source = "".join(inspect.getsource(c) for c in cls.__mro__ if c is not object)
    names = {m.group(1) for m in re.finditer(r"\bsess\.(\w+)", TEXT)}
    assert {"should_stop", "step", "zero_grad", "pull", "save", "global_step"} <= names
    missing = [
        n
        for n in names
        if not hasattr(cls, n) and not re.search(rf"self\.{n}\b[^=\n]*=(?!=)", source)
    ]
    assert not missing, missing


def test_every_session_setting_is_on_the_page() -> None:
    spans = set(code_spans())
    fields = [f.name for f in dataclasses.fields(psflow.SessionConfig)]
    assert not [f for f in fields if f not in spans]
    # Every flat setting too: the nested configs' fields and the training's keywords.
    settings = SESSION_SETTINGS
    assert not [s for s in settings if s not in spans and s not in TEXT], settings
    params = [p for p in inspect.signature(psflow.TrainingSession).parameters if p != "settings"]
    assert not [p for p in params if p not in TEXT]


def test_the_row_optimizer_table_gives_each_optimizer_with_its_defaults() -> None:
    rows = {}
    for line in TEXT.splitlines():
        m = re.match(r'\| `"(\w+)"`[^|]*\| ([^|]+) \|', line)
        if m:
            settings = re.findall(r"`(\w+)=([^`]+)`", m.group(2))
            rows[m.group(1)] = {k: ast.literal_eval(v) for k, v in settings}
    assert rows == ROW_OPTIMIZERS


def test_every_variable_psflow_reads_is_on_the_page() -> None:
    variables = {v for k, v in vars(env).items() if k.startswith("PSFLOW_") and isinstance(v, str)}
    shown = set(re.findall(r"`(PSFLOW_\w+)", TEXT))
    assert variables and not sorted(variables - shown)
    assert not sorted(shown - variables)
    assert env.TF_CONFIG in shown or f"`{env.TF_CONFIG}`" in TEXT
