"""psflow.serve's numeric inputs: a request's numbers (a CTR model's counts) fed to the ONNX
graph beside the pooled rows, checked before they reach it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from psflow.serve.__main__ import parse_numeric
from psflow.serve.dense import export_dense
from psflow.serve.server import BadRequest, Feature, ModelServer, ServerConfig
from tests.unit.test_serve_server import DIM, reference, run_reference, write

pytestmark = pytest.mark.unit

BAGS = [[1, 2], [3], [9], []]
COUNTS = [[0.5, 2.0], [1.0, -3.0], [0.0, 0.0], [7, 1]]


class Head(nn.Module):
    """The export's ``head`` (``Linear(DIM, 1)``) over the pooled rows, plus the counts' sum."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(DIM, 1)

    def forward(self, users: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.head(users) + counts.sum(1, keepdim=True)


def make_server(tmp_path: Path, width: int = 2) -> ModelServer:
    onnx = tmp_path / "head.onnx"
    export_dense(Head(), {"users": DIM, "counts": 2}, onnx)
    config = ServerConfig(
        export_dir=str(tmp_path / "exports"),
        onnx_path=str(onnx),
        features={"users": Feature(table="users", mode="sum")},
        numeric={"counts": width},
    )
    return ModelServer(config)


def test_numeric_inputs_reach_the_graph_beside_the_rows(tmp_path: Path) -> None:
    write(tmp_path / "exports", 0, None, [1, 2, 3, 5])
    srv = make_server(tmp_path)
    assert srv.poll() == [0]
    _, out = srv.predict({"users": BAGS}, {"counts": COUNTS})
    ref = reference(tmp_path / "exports", 0, Feature(table="users", mode="sum"))
    want = run_reference(ref, BAGS) + torch.tensor(COUNTS).sum(1, keepdim=True)
    torch.testing.assert_close(torch.from_numpy(out["output"]), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("numeric", "reason"),
    [
        (None, r"missing \['counts'\]"),
        ({}, r"missing \['counts'\]"),
        ([[1.0, 2.0]], "'numeric' must be an object"),
        ({"counts": COUNTS, "ages": COUNTS}, r"unknown \['ages'\]"),
        ({"counts": COUNTS[:3]}, "expected 4 rows .*, got 3"),
        ({"counts": "1,2"}, "expected 4 rows .*, got str"),
        ({"counts": [*COUNTS[:3], [1.0]]}, "example 3: expected 2 numbers"),
        ({"counts": [*COUNTS[:3], [1.0, "2"]]}, "example 3: expected 2 numbers"),
        ({"counts": [*COUNTS[:3], [1.0, True]]}, "example 3: expected 2 numbers"),
        ({"counts": [*COUNTS[:3], [1.0, float("nan")]]}, "not finite"),
        ({"counts": [*COUNTS[:3], [1.0, 1e300]]}, "not finite"),  # inf as float32
    ],
)
def test_bad_numeric_inputs_are_refused_naming_them(
    tmp_path: Path, numeric: object, reason: str
) -> None:
    write(tmp_path / "exports", 0, None, [1, 2, 3, 5])
    srv = make_server(tmp_path)
    srv.poll()
    with pytest.raises(BadRequest, match=reason) as e:
        srv.predict({"users": BAGS}, numeric)
    assert e.value.status == 400


def test_numeric_settings_that_cannot_fit_the_graph_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"the numeric input 'counts' is \['.*', 2\]"):
        make_server(tmp_path, width=3)
    onnx = tmp_path / "head.onnx"
    for numeric, reason in [
        ({"users": 2}, "'users' is both a feature and a numeric input"),
        ({"counts": 0}, r"numeric\['counts'\] must be a width >= 1, got 0"),
        ({"ages": 2}, r"no input for feature\(s\) \['ages'\]"),
    ]:
        with pytest.raises(ValueError, match=reason):
            ModelServer(ServerConfig(export_dir=str(tmp_path), onnx_path=str(onnx),
                                     features={"users": Feature(table="users")},
                                     numeric=numeric))  # fmt: skip


def test_the_command_line_reads_numeric_inputs() -> None:
    assert parse_numeric("counts=13") == ("counts", 13)
    for bad in ("counts", "=13", "counts=0", "counts=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=WIDTH"):
            parse_numeric(bad)
