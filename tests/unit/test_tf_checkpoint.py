"""TensorFlow checkpoints read without TensorFlow, against files TensorFlow wrote
(``tests/fixtures/make_tf_checkpoint.py``) and what its own reader gives for them."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import psflow.nn as pnn
from psflow.train.tf_checkpoint import TFCheckpoint
from tests import tf_index
from tests.multiproc.support import CLI_MAIN, run_forked

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parent.parent / "fixtures" / "tf_checkpoint"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())
PREFIX = str(FIXTURE / EXPECTED["prefix"])
INDEX = EXPECTED["prefix"] + ".index"
DATA = EXPECTED["prefix"] + ".data-00000-of-00001"


def copy(tmp_path: Path) -> str:
    for f in (INDEX, DATA):
        shutil.copy(FIXTURE / f, tmp_path / f)
    return str(tmp_path / EXPECTED["prefix"])


def test_every_tensor_is_what_tensorflows_reader_gives() -> None:
    ckpt = TFCheckpoint(PREFIX)
    assert ckpt.names() == sorted(EXPECTED["tensors"])
    for name, want in EXPECTED["tensors"].items():
        got = ckpt.tensor(name)
        assert str(got.dtype) == f"torch.{want['dtype']}", name
        assert list(got.shape) == want["shape"] == list(ckpt.shape(name)), name
        assert ckpt.dtype(name) == got.dtype
        assert torch.equal(got, torch.tensor(want["values"], dtype=got.dtype).reshape(got.shape))
    # The partitioned variables and their Adagrad slots were saved in slices.
    assert ckpt.partitions("items") == ckpt.partitions("items/Adagrad") == [(0, 4), (4, 4), (8, 3)]
    assert ckpt.partitions("users") == [(0, 4), (4, 3)]
    assert ckpt.partitions("dense/kernel") == []


def test_a_table_comes_in_id_order_for_the_strategy_it_was_trained_with() -> None:
    ckpt = TFCheckpoint(PREFIX)
    for name, want in EXPECTED["rows_in_id_order"].items():
        rows = torch.tensor(want["values"])
        strategy = want["partition_strategy"]
        assert torch.equal(ckpt.embedding(name, strategy), rows), name
        # The saved order is partition order: id order only for "div".
        other = "div" if strategy == "mod" else "mod"
        assert not torch.equal(ckpt.embedding(name, other), rows), name
        # What a psflow job starts from: the rows TensorFlow's lookups returned, by id.
        table = pnn.Embedding.from_pretrained(ckpt.embedding(name, strategy), freeze=False)
        ids = torch.tensor([3, 0, 3, len(rows) - 1])
        assert torch.equal(table(ids), rows[ids])
    assert torch.equal(ckpt.embedding("dense/kernel"), ckpt.tensor("dense/kernel"))  # whole
    with pytest.raises(ValueError, match="not an embedding table"):
        ckpt.embedding("scale")
    with pytest.raises(ValueError, match="partition_strategy must be 'mod' or 'div'"):
        ckpt.embedding("items", "hash")


def test_a_variable_split_along_its_columns_comes_back_whole_and_is_no_table() -> None:
    ckpt = TFCheckpoint(PREFIX)
    assert ckpt.slices("wide") == [((0, 3), (0, 3)), ((0, 3), (3, 5))]
    assert ckpt.slices("items") == [((0, 4), (0, 4)), ((4, 8), (0, 4)), ((8, 11), (0, 4))]
    assert ckpt.slices("scale") == []
    with pytest.raises(ValueError, match="'wide' is partitioned along another dimension"):
        ckpt.embedding("wide")


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        ("data byte", ValueError, r"CRC32C of '.*' does not match"),
        ("data truncated", ValueError, r"past the file's \d+ (bytes )?\(truncated\?\)"),
        ("data missing", FileNotFoundError, "data-00000-of-00001"),
        ("index byte", ValueError, r"\.index: a block's CRC32C does not match"),
        ("index truncated", ValueError, r"\.index: (not a TensorFlow checkpoint index|too short)"),
        ("index missing", FileNotFoundError, r"\.index"),
    ],
)
def test_a_damaged_checkpoint_is_named(
    tmp_path: Path, damage: str, error: type[Exception], match: str
) -> None:
    prefix = copy(tmp_path)
    what, how = damage.split()
    path = tmp_path / (INDEX if what == "index" else DATA)
    raw = bytearray(path.read_bytes())
    if how == "byte":
        raw[len(raw) // 3] ^= 0x40
        path.write_bytes(bytes(raw))
    elif how == "truncated":
        path.write_bytes(bytes(raw[: len(raw) - 20]))
    else:
        path.unlink()
    with pytest.raises(error, match=match):
        ckpt = TFCheckpoint(prefix)
        for name in ckpt.names():
            ckpt.tensor(name)


def test_an_unknown_name_is_named() -> None:
    with pytest.raises(KeyError, match="no tensor 'nothing'"):
        TFCheckpoint(PREFIX).tensor("nothing")


def test_any_damage_to_the_index_raises_a_clear_error_or_reads_right(tmp_path: Path) -> None:
    """Random single-byte changes anywhere in the index: each either fails with ValueError (or
    KeyError for a name it changed) or reads the tensors TensorFlow wrote; nothing else."""
    prefix = copy(tmp_path)
    index = tmp_path / INDEX
    good = (FIXTURE / INDEX).read_bytes()
    rng = random.Random(7)
    outcomes = {"refused": 0, "read": 0}
    for _ in range(300):
        raw = bytearray(good)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        index.write_bytes(bytes(raw))
        try:
            ckpt = TFCheckpoint(prefix)
            for name, want in EXPECTED["tensors"].items():
                got = ckpt.tensor(name)
                assert got.flatten().tolist() == want["values"], name
        except (ValueError, KeyError):
            outcomes["refused"] += 1
        else:
            outcomes["read"] += 1  # a byte nothing reads (the footer's padding)
    assert outcomes["refused"] > 250, outcomes


# -- psflow checkpoint inspect / export on a TensorFlow checkpoint's prefix -----------------


def _psflow(*argv: str) -> subprocess.CompletedProcess[str]:
    """``psflow ARGV`` as a process of its own, forked from the server that imported torch
    (:mod:`tests.multiproc.forked`): its exit code and output, 2 s of CPU sooner."""
    return run_forked(["-c", CLI_MAIN, *argv], timeout=120)


def test_the_cli_lists_a_tensorflow_checkpoint() -> None:
    proc = _psflow("checkpoint", "inspect", PREFIX)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"TensorFlow checkpoint: {PREFIX} (1 data file)"
    items = next(line.split() for line in lines if line.split()[:1] == ["items"])
    assert items == [
        "items",
        "float32",
        "[11,",
        "4]",
        "3",
        "partitions:",
        "rows",
        "0:4,",
        "4:8,",
        "8:11",
    ]
    assert {line.split()[0] for line in lines[2:]} == set(EXPECTED["tensors"])
    # TensorFlow's partitioners take an axis: a variable split along its columns is listed too.
    wide = next(line for line in lines if line.split()[:1] == ["wide"])
    assert wide.split()[4:] == ["2", "partitions", "along", "dim", "1:", "0:3,", "3:5"]


def test_the_cli_exports_a_tensorflow_checkpoint_with_its_tables_in_id_order(
    tmp_path: Path,
) -> None:
    out = tmp_path / "tf.safetensors"
    proc = _psflow("checkpoint", "export", PREFIX, str(out), "--table", "items=mod")
    assert proc.returncode == 0, proc.stderr
    assert "(in id order: items by mod)" in proc.stdout
    state = load_file(out)
    assert sorted(state) == sorted(EXPECTED["tensors"])
    want = EXPECTED["rows_in_id_order"]["items"]
    assert torch.equal(state["items"], torch.tensor(want["values"]))
    assert torch.equal(state["users"], TFCheckpoint(PREFIX).tensor("users"))  # saved order
    # What torch loads, as from_pretrained's rows: TensorFlow's lookups by id.
    emb = torch.nn.Embedding.from_pretrained(state["items"])
    assert torch.equal(emb(torch.tensor([2, 9])), torch.tensor(want["values"])[[2, 9]])
    bad = _psflow("checkpoint", "export", PREFIX, str(out), "--table", "itemz=mod")
    assert bad.returncode == 2 and "holds no tensor 'itemz'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_directory_gives_its_latest_checkpoint_as_tensorflow_finds_it(tmp_path: Path) -> None:
    prefix = copy(tmp_path)
    assert TFCheckpoint.latest(str(tmp_path)) is None  # no state file
    for command in (["inspect"], ["export", str(tmp_path / "out.safetensors")]):
        proc = _psflow("checkpoint", command[0], str(tmp_path), *command[1:])
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert (  # without it, the files' prefixes are named
            f"(TensorFlow checkpoint files, {EXPECTED['prefix']}, but no 'checkpoint' file naming "
            f"the latest: give a prefix, {prefix})"
        ) in proc.stderr
    state = tmp_path / "checkpoint"
    name = EXPECTED["prefix"]
    state.write_text(f'model_checkpoint_path: "{name}"\nall_model_checkpoint_paths: "{name}"\n')
    assert TFCheckpoint.latest(str(tmp_path)) == prefix
    # TensorFlow writes the absolute path it saved to; a directory copied elsewhere still works.
    state.write_text(f'model_checkpoint_path: "/elsewhere/gone/{name}"\n')
    assert TFCheckpoint.latest(str(tmp_path)) == prefix
    state.write_text(f'model_checkpoint_path: "{prefix}"\n')
    assert TFCheckpoint.latest(str(tmp_path)) == prefix
    proc = _psflow("checkpoint", "inspect", str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.startswith(f"TensorFlow checkpoint: {prefix} ")
    state.write_text("nothing useful\n")
    with pytest.raises(ValueError, match="no model_checkpoint_path"):
        TFCheckpoint.latest(str(tmp_path))


def test_a_tables_adagrad_slot_is_its_row_wise_state_in_id_order() -> None:
    ckpt = TFCheckpoint(PREFIX)
    state = ckpt.table_state("items", "Adagrad", "mod")
    assert list(state) == ["sum"]
    assert torch.equal(state["sum"], ckpt.embedding("items/Adagrad", "mod"))
    # Rows the three steps touched grew their accumulator; the rest kept TensorFlow's 0.1.
    touched = sorted(set(EXPECTED["step"]["item_ids"]))
    grown = (state["sum"] > 0.1 + 1e-6).all(dim=1).nonzero().flatten().tolist()
    assert grown == touched
    with pytest.raises(ValueError, match="holds no Ftrl slot"):
        ckpt.table_state("items", "Ftrl")
    with pytest.raises(ValueError, match="holds no Adam slot"):
        ckpt.table_state("items", "Adam")
    with pytest.raises(ValueError, match="not 'RMSProp'"):
        ckpt.table_state("items", "RMSProp")


# -- a crafted checkpoint: an index that claims more than its files hold --------------------


_varint, _field, _index_file = tf_index.varint, tf_index.field, tf_index.index_file


def test_slices_that_repeat_one_region_of_a_file_are_refused(tmp_path: Path) -> None:
    """A hostile index: a 1000 x 1000 float32 variable (4 MB) in 1000 one-row slices that all
    point at the same 4,000 bytes of a 4 KB data file. Refused before anything is allocated."""
    import google_crc32c

    row = bytes(4000)
    crc = google_crc32c.value(row)
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    shape = _field(2, _field(2, _field(1, 1000)) + _field(2, _field(1, 1000)))
    extents = [_field(1, _field(1, i) + _field(2, 1)) + _field(1, b"") for i in range(1000)]
    whole = _field(1, 1) + shape + b"".join(_field(7, e) for e in extents)
    piece = (
        _field(1, 1)
        + _field(2, _field(2, _field(1, 1)) + _field(2, _field(1, 1000)))
        + _field(4, 0)
        + _field(5, 4000)
        + b"\x35"
        + masked.to_bytes(4, "little")
    )
    entries = [(b"", _field(1, 1)), (b"t", whole)]
    entries += [(b"\x00t\x00\x01" + i.to_bytes(4, "big"), piece) for i in range(1000)]
    entries.sort()
    (tmp_path / "m.index").write_bytes(_index_file(entries))
    (tmp_path / "m.data-00000-of-00001").write_bytes(row)
    ckpt = TFCheckpoint(str(tmp_path / "m"))
    assert ckpt.names() == ["t"] and ckpt.shape("t") == (1000, 1000)
    with pytest.raises(ValueError, match="'t' claims more bytes than its data files hold"):
        ckpt.tensor("t")


# -- a dense variable's optimizer state ------------------------------------------------------

DENSE = Path(__file__).parent.parent / "fixtures" / "tf_dense_state"
DENSE_EXPECTED = json.loads((DENSE / "expected.json").read_text())


def _torch_optimizer(name: str, settings: dict[str, float], param: torch.Tensor) -> Any:
    """The torch optimizer that takes TensorFlow's ``name`` step with its ``settings``."""
    if name == "Adam":
        betas = (settings["beta1"], settings["beta2"])
        return torch.optim.Adam([param], lr=settings["lr"], betas=betas, eps=settings["epsilon"])
    if name == "Momentum":
        return torch.optim.SGD([param], lr=settings["lr"], momentum=settings["momentum"])
    return torch.optim.Adagrad(
        [param], lr=settings["lr"], initial_accumulator_value=settings["initial_accumulator_value"]
    )


DENSE_VARS = {n: o for n, o in DENSE_EXPECTED["optimizers"].items() if n != "emb"}
"""The fixture's dense variables and their optimizers (``emb`` is the table)."""


def _next_step(with_state: bool) -> dict[str, torch.Tensor]:
    """One torch step of the fixture's model from its checkpoint, each dense variable under
    the torch form of its TensorFlow optimizer, started from the checkpoint's slots (or fresh);
    the table's rows as they were saved."""
    ckpt = TFCheckpoint(str(DENSE / DENSE_EXPECTED["prefix"]))
    params = {n: torch.nn.Parameter(ckpt.tensor(n)) for n in DENSE_VARS}
    optimizers = []
    for name, (kind, settings) in DENSE_VARS.items():
        opt = _torch_optimizer(kind, settings, params[name])
        if with_state:
            state = ckpt.optimizer_state(name, kind)
            groups = opt.state_dict()["param_groups"]
            opt.load_state_dict({"state": {0: state}, "param_groups": groups})
        optimizers.append(opt)
    _dense_loss(
        ckpt, params["hidden/kernel"], params["hidden/bias"], params["out/kernel"]
    ).backward()
    for opt in optimizers:
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _dense_loss(
    ckpt: TFCheckpoint, kernel: torch.Tensor, bias: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The fixture's loss (``expected.json``'s ``loss``), the table's rows as saved."""
    x, y = torch.tensor(DENSE_EXPECTED["x"]), torch.tensor(DENSE_EXPECTED["y"])
    rows = ckpt.embedding("emb", "mod")[torch.tensor(DENSE_EXPECTED["ids"])]
    return ((torch.tanh(x @ kernel + bias + rows) @ out - y) ** 2).mean()


def test_dense_slots_give_torch_optimizers_tensorflows_next_step() -> None:
    """TensorFlow trained three variables for three steps under Adam, Momentum and Adagrad;
    torch's Adam, SGD(momentum) and Adagrad started from the slots ``optimizer_state`` reads
    take the step TensorFlow took next. Fresh ones take another (Adam's is 0.05 away)."""
    got = _next_step(with_state=True)
    fresh = _next_step(with_state=False)
    for name, (kind, _) in DENSE_VARS.items():
        want = torch.tensor(DENSE_EXPECTED["after_next_step"][name])
        # Adam: TensorFlow adds epsilon before the bias correction, torch after (2e-6 here).
        atol = 5e-6 if kind == "Adam" else 1e-6
        torch.testing.assert_close(got[name], want, rtol=0, atol=atol)
        assert (fresh[name] - want).abs().max() > 100 * atol, name


def test_a_tables_adam_slots_give_the_row_wise_adam_tensorflows_next_step() -> None:
    """The table trained by the same ``AdamOptimizer``: its moments in id order, every row's
    step the optimizer's 3. psflow's row-wise Adam from that state takes TensorFlow's next
    step for every row (rows no step touched have zero moments, and stay)."""
    from psflow.protocol import RowOptimizerSpec
    from psflow.sparse.optim import RowOptimizer

    ckpt = TFCheckpoint(str(DENSE / DENSE_EXPECTED["prefix"]))
    state = ckpt.table_state("emb", "Adam", "mod")
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
    assert state["step"].tolist() == [3] * 6 and state["step"].dtype == torch.int64
    assert torch.equal(state["exp_avg"], ckpt.embedding("emb/Adam", "mod"))
    untouched = sorted(set(range(6)) - set(DENSE_EXPECTED["ids"]))
    assert not state["exp_avg"][untouched].any()

    rows = torch.nn.Parameter(ckpt.embedding("emb", "mod"))
    x, y = torch.tensor(DENSE_EXPECTED["x"]), torch.tensor(DENSE_EXPECTED["y"])
    ids = torch.tensor(DENSE_EXPECTED["ids"])
    h = torch.tanh(x @ ckpt.tensor("hidden/kernel") + ckpt.tensor("hidden/bias") + rows[ids])
    ((h @ ckpt.tensor("out/kernel") - y) ** 2).mean().backward()
    assert rows.grad is not None
    touched = ids.unique()
    settings = DENSE_EXPECTED["optimizers"]["emb"][1]
    spec = RowOptimizerSpec.of(
        "Adam",
        lr=settings["lr"],
        betas=(settings["beta1"], settings["beta2"]),
        eps=settings["epsilon"],
    )
    values = rows.detach().clone()
    RowOptimizer(spec).apply(values, state, touched, rows.grad[touched])
    want = torch.tensor(DENSE_EXPECTED["after_next_step"]["emb"])
    torch.testing.assert_close(values, want, rtol=0, atol=1e-6)


def test_adams_steps_are_counted_from_its_beta_powers() -> None:
    ckpt = TFCheckpoint(str(DENSE / DENSE_EXPECTED["prefix"]))
    state = ckpt.optimizer_state("hidden/kernel", "Adam")
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
    assert state["step"].item() == 3 and state["step"].dim() == 0
    assert torch.equal(state["exp_avg_sq"], ckpt.tensor("hidden/kernel/Adam_1"))
    # Counted with the wrong beta1, the power is no power of it: named, not guessed.
    with pytest.raises(ValueError, match=r"beta1_power = .* is no power of beta 0\.8"):
        ckpt.optimizer_state("hidden/kernel", "Adam", beta1=0.8)
    assert ckpt.optimizer_state("out/kernel", "Adagrad")["step"].item() == 3  # global_step
    transposed = ckpt.optimizer_state("out/kernel", "Adagrad", transpose=True)["sum"]
    assert torch.equal(transposed, ckpt.tensor("out/kernel/Adagrad").T)


def test_adam_after_beta1s_power_ran_out_counts_from_beta2s() -> None:
    """1,000 Adam steps: ``beta1_power`` is 0 in float32, ``beta2_power`` 0.367. The steps
    come from the latter, and torch's Adam takes TensorFlow's 1,001st step."""
    long = DENSE_EXPECTED["long"]
    assert long["beta_powers"][0] == 0.0
    ckpt = TFCheckpoint(str(DENSE / long["prefix"]))
    assert "global_step" not in ckpt
    state = ckpt.optimizer_state("hidden/kernel", "Adam")
    assert state["step"].item() == long["steps"]
    kernel = torch.nn.Parameter(ckpt.tensor("hidden/kernel"))
    opt = torch.optim.Adam([kernel], lr=long["lr"], eps=1e-8)
    opt.load_state_dict({"state": {0: state}, "param_groups": opt.state_dict()["param_groups"]})
    _dense_loss(ckpt, kernel, ckpt.tensor("hidden/bias"), ckpt.tensor("out/kernel")).backward()
    opt.step()
    torch.testing.assert_close(
        kernel.detach(), torch.tensor(long["after_next_step"]), rtol=0, atol=1e-6
    )


def test_dense_state_that_cannot_be_read_is_named() -> None:
    ckpt = TFCheckpoint(str(DENSE / DENSE_EXPECTED["prefix"]))
    with pytest.raises(ValueError, match="not 'RMSProp'"):
        ckpt.optimizer_state("hidden/kernel", "RMSProp")
    with pytest.raises(ValueError, match=r"holds no Adagrad slot \['hidden/kernel/Adagrad'\]"):
        ckpt.optimizer_state("hidden/kernel", "Adagrad")
    with pytest.raises(ValueError, match="holds no Adam slot"):
        ckpt.optimizer_state("hidden/kernel", "Adam", slot_prefix="Adam_2")
    with pytest.raises(ValueError, match="not 2-D"):
        ckpt.optimizer_state("hidden/bias", "Momentum", transpose=True)
    with pytest.raises(ValueError, match=r"holds no \['b1', 'b2'\]"):
        ckpt.optimizer_state("hidden/kernel", "Adam", beta_powers=("b1", "b2"))


# -- hostile checkpoints (issue 36) ----------------------------------------------------------


def test_slices_that_overlap_and_leave_a_hole_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36, 1: a partitioned variable's second slice made equal to its first (``(0, 4)``),
    every CRC valid: the element count added up, and rows 4:8 came back as uninitialised
    memory. The slices are now placed by interval."""
    rows = [torch.arange(16, dtype=torch.float32).reshape(4, 4) + 100 * i for i in range(2)]
    raw = [r.numpy().tobytes() for r in rows]
    whole = tf_index.entry(1, [8, 4], slices=[[(0, 4), (0, -1)], [(0, 4), (0, -1)]])
    pieces = [
        tf_index.entry(1, [4, 4], offset=64 * i, size=64, crc=tf_index.masked_crc32c(raw[i]))
        for i in range(2)
    ]
    entries = [(b"", tf_index.field(1, 1)), (b"emb/Adagrad", whole)]
    entries += [(tf_index.slice_key("emb/Adagrad", i), pieces[i]) for i in range(2)]
    (tmp_path / "m.index").write_bytes(tf_index.index_file(sorted(entries)))
    (tmp_path / "m.data-00000-of-00001").write_bytes(b"".join(raw))
    ckpt = TFCheckpoint(str(tmp_path / "m"))
    with pytest.raises(ValueError, match=r"the slices of 'emb/Adagrad' overlap at \[0:4, 0:4\]"):
        ckpt.tensor("emb/Adagrad")
    from psflow.cli import main

    assert main(["checkpoint", "export", str(tmp_path / "m"), str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "overlap" in err and err.count("\n") == 1, err
    assert not (tmp_path / "o.safetensors").exists()


def test_a_keras_index_entry_the_object_graph_names_dropped_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36, 4: ``inspect`` raised KeyError when the index lacked a tensor its object
    graph named. Now the graph is refused with the key named, and the tensors go by key."""
    from psflow.train.tf_bundle import index_entries

    src = Path(__file__).parent.parent / "fixtures" / "tf_keras" / "keras3_adam"
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    index = tmp_path / "ckpt-1.index"
    entries = list(index_entries(index.read_bytes(), "x"))
    dropped = next(k for k, _ in entries if k.startswith(b"optimizer/_trainable_variables/0/"))
    index.write_bytes(tf_index.index_file([e for e in entries if e[0] != dropped]))
    prefix = str(tmp_path / "ckpt-1")
    with pytest.raises(ValueError, match=rf"lacks 1 tensor.*{dropped.decode()}"):
        TFCheckpoint(prefix).variables()
    from psflow.cli import main

    assert main(["checkpoint", "inspect", prefix]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks 1 tensor" in err, err


@pytest.mark.parametrize("which", ["index", "data"])
@pytest.mark.parametrize("what", ["fifo", "directory", "symlink"])
def test_special_files_of_a_tensorflow_checkpoint_are_refused_unopened(
    tmp_path: Path, which: str, what: str
) -> None:
    """Issue 36, 5: a FIFO in a checkpoint blocked its reader in ``open`` for ever."""
    import os
    import threading

    prefix = copy(tmp_path)
    path = tmp_path / (INDEX if which == "index" else DATA)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    if what == "fifo":
        os.mkfifo(path)
    elif what == "directory":
        path.mkdir()
    else:
        path.symlink_to(outside)
    kind = {"fifo": "a FIFO", "directory": "a directory", "symlink": "a symlink to .*, outside"}
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            with pytest.raises(ValueError, match=rf"{path.name}: {kind[what]}"):
                ckpt = TFCheckpoint(prefix)
                ckpt.tensor("scale")
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(20), "the reader blocked"
    if errors:
        raise errors[0]


def test_a_fifo_as_the_checkpoint_state_file_is_refused(tmp_path: Path) -> None:
    """``psflow checkpoint inspect DIR`` reads TensorFlow's ``checkpoint`` state file to find
    the latest prefix: a FIFO there blocked it in ``open``."""
    import os
    import threading

    from psflow.train.cli import _tf_prefix

    copy(tmp_path)
    os.mkfifo(tmp_path / "checkpoint")
    done = threading.Event()
    errors: list[BaseException] = []

    def find() -> None:
        try:
            _tf_prefix(str(tmp_path))
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=find, daemon=True).start()
    assert done.wait(20), "inspect blocked"
    assert isinstance(errors[0], ValueError)
    assert f"{tmp_path}/checkpoint: a FIFO where a file belongs" in str(errors[0])
