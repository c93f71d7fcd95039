"""TensorFlow 2 checkpoints of Keras models (``tests/fixtures/make_tf_keras.py``): variables
read by their Keras names, and the optimizer slots their object graph links to them (Keras 3,
``tf_keras``, ``tf_keras.optimizers.legacy``), carried over to torch's optimizers and psflow's
row-wise ones so that they take the step Keras took next."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from psflow.train.tf_checkpoint import TFCheckpoint
from psflow.train.tf_objects import GRAPH_KEY, ObjectGraph
from tests.multiproc.support import CLI_MAIN, run_forked

KERAS = Path(__file__).parent.parent / "fixtures" / "tf_keras"
EXPECTED = json.loads((KERAS / "expected.json").read_text())
CASES = EXPECTED["cases"]

DENSE_KINDS = {"Adam": "Adam", "Adagrad": "Adagrad", "SGD": "Momentum"}
"""Keras's optimizer -> the name ``optimizer_state`` takes for it."""


def _ckpt(case: str) -> TFCheckpoint:
    return TFCheckpoint(str(KERAS / CASES[case]["prefix"]))


def _is_kernel(name: str) -> bool:
    return name.endswith("kernel")


def _torch_optimizer(case: str, param: torch.Tensor) -> torch.optim.Optimizer:
    """The torch optimizer that takes Keras's step for ``case``'s settings."""
    kind, s = CASES[case]["optimizer"], CASES[case]["settings"]
    lr = s["learning_rate"]
    if kind == "Adam":
        betas = (s["beta_1"], s["beta_2"])
        # Keras adds epsilon to sqrt(v) before the bias correction, torch after: at step t,
        # torch's eps is Keras's over sqrt(1 - beta2 ** t) (here the 4th step).
        eps = s["epsilon"] / math.sqrt(1 - s["beta_2"] ** 4)
        return torch.optim.Adam([param], lr=lr, betas=betas, eps=eps)
    if kind == "Adagrad":
        start = s["initial_accumulator_value"]
        return torch.optim.Adagrad([param], lr=lr, initial_accumulator_value=start, eps=0.0)
    nesterov = bool(s.get("nesterov", False))
    return torch.optim.SGD([param], lr=lr, momentum=s["momentum"], nesterov=nesterov)


def _torch_step(case: str, name: str, state: dict[str, Any] | None) -> torch.Tensor:
    """Variable ``name`` (Keras's layout) after one torch step with Keras's gradient, from
    the checkpoint's value and (unless ``None``) ``state``."""
    ckpt, var = _ckpt(case), CASES[case]["variables"][name]
    value = ckpt.tensor(name)
    grad = torch.tensor(var["grad"])
    if _is_kernel(name):  # a Keras kernel is [in, out]: the Linear weight is its transpose
        value, grad = value.T.contiguous(), grad.T.contiguous()
    param = torch.nn.Parameter(value)
    opt = _torch_optimizer(case, param)
    if state is not None:
        groups = opt.state_dict()["param_groups"]
        opt.load_state_dict({"state": {0: state}, "param_groups": groups})
    param.grad = grad
    opt.step()
    out = param.detach()
    return out.T if _is_kernel(name) else out


DENSE_CASES = [c for c in CASES if CASES[c]["optimizer"] in DENSE_KINDS]


@pytest.mark.parametrize("case", DENSE_CASES)
def test_keras_slots_give_torch_optimizers_keras_next_step(case: str) -> None:
    """Every variable of the model (the table, the kernel transposed, the bias): torch's
    Adam, Adagrad or SGD(momentum), started from what ``optimizer_state`` reads, take the
    step Keras took next; fresh ones take another."""
    kind = DENSE_KINDS[CASES[case]["optimizer"]]
    ckpt = _ckpt(case)
    for name, var in CASES[case]["variables"].items():
        assert torch.equal(ckpt.tensor(name), torch.tensor(var["before"])), name
        state = ckpt.optimizer_state(name, kind, transpose=_is_kernel(name))
        want = torch.tensor(var["after"])
        got = _torch_step(case, name, state)
        rows = torch.arange(len(want))
        if case == "legacy_sgd" and name.endswith("embeddings"):
            # OptimizerV2's SGD moves a table lazily: a row the step did not touch keeps its
            # momentum and stays (3 and 5 had momentum), where torch's dense SGD moves it.
            rows = torch.tensor(CASES[case]["touched"])
            assert (got[[3, 5]] - want[[3, 5]]).abs().max() > 1e-3
        torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=1e-6, msg=f"{case} {name}")
        fresh = _torch_step(case, name, None)
        assert (fresh - want).abs().max() > 1e-5, f"{case} {name}"


def test_steps_are_the_optimizers_iterations() -> None:
    cases = ("keras3_adam", "tf_keras_adam", "legacy_adam", "v1_adam", "keras3_adagrad")
    for case in (*cases, "pss_adagrad", "pss_legacy_adam"):
        kind = DENSE_KINDS[CASES[case]["optimizer"]]
        state = _ckpt(case)
        for name in CASES[case]["variables"]:
            step = state.optimizer_state(name, kind)["step"]
            assert step.item() == 3 and step.dim() == 0, (case, name)


def test_kerass_momentum_becomes_torchs_buffer() -> None:
    """Keras keeps ``m = momentum * m - lr * g``; torch's buffer is ``-m / lr``. A rate the
    checkpoint did not save (a schedule) is asked for; a given one wins."""
    ckpt = _ckpt("keras3_sgd")
    key = ckpt.variables()["model/head/bias"]
    graph = ckpt._object_graph()
    assert graph is not None
    slots = graph.slots(key)
    assert slots is not None and sorted(slots.keys) == ["momentum"]
    m = ckpt.tensor(slots.keys["momentum"])
    buffer = ckpt.optimizer_state("model/head/bias", "Momentum")["momentum_buffer"]
    torch.testing.assert_close(buffer, m / -0.1)
    halved = ckpt.optimizer_state("model/head/bias", "Momentum", lr=0.2)["momentum_buffer"]
    torch.testing.assert_close(halved, m / -0.2)


def test_a_rate_the_checkpoint_lacks_is_asked_for(tmp_path: Path) -> None:
    """The learning rate's node gone from the graph (as for a schedule): Keras's momentum
    cannot be turned into torch's without one, and the error says what to give."""
    ckpt = _ckpt("keras3_sgd")
    graph = ckpt._object_graph()
    assert graph is not None
    for node in graph.nodes:
        node.children = [(n, i) for n, i in node.children if n != "_learning_rate"]
    with pytest.raises(ValueError, match=r"saved no learning rate .* give lr="):
        ckpt.optimizer_state("model/head/bias", "Momentum")
    assert "momentum_buffer" in ckpt.optimizer_state("model/head/bias", "Momentum", lr=0.1)


TABLE_CASES = {
    "keras3_adagrad": ("Adagrad", {"eps": 0.0}),
    "keras3_ftrl": ("Ftrl", {}),
    "keras3_adam": ("Adam", {}),
    "tf_keras_adam": ("Adam", {}),
    "legacy_adam": ("Adam", {}),
    "legacy_adagrad": ("Adagrad", {"eps": 0.0}),
    "v1_adam": ("Adam", {}),
    "pss_adagrad": ("Adagrad", {"eps": 0.0}),
    "pss_legacy_adam": ("Adam", {}),
}


@pytest.mark.parametrize("case", sorted(TABLE_CASES))
def test_a_keras_tables_slots_give_the_row_wise_optimizer_kerass_next_step(case: str) -> None:
    """The table's slots as ``table_state`` reads them: psflow's row-wise optimizer takes
    Keras's next step for every row the step touched. (Keras's Adam also moves the rows a
    step does not touch, by their decaying moments; the row-wise lazy Adam leaves them.)"""
    from psflow.protocol import RowOptimizerSpec
    from psflow.sparse.optim import RowOptimizer

    kind, extra = TABLE_CASES[case]
    s, var = CASES[case]["settings"], CASES[case]["variables"]
    name = next(n for n in var if n.endswith("embeddings"))
    ckpt = _ckpt(case)
    state = ckpt.table_state(name, kind, CASES[case].get("partition", "mod"))
    rows = len(var[name]["before"])
    if kind == "Adam":
        # psflow's row-wise Adam adds eps before the bias correction, as Keras does.
        spec = RowOptimizerSpec.of(
            "Adam", lr=s["learning_rate"], betas=(s["beta_1"], s["beta_2"]), eps=s["epsilon"]
        )
        assert state["step"].tolist() == [3] * rows
    elif kind == "Adagrad":
        spec = RowOptimizerSpec.of("Adagrad", lr=s["learning_rate"], **extra)
    else:
        spec = RowOptimizerSpec.of(
            "Ftrl",
            lr=s["learning_rate"],
            lr_power=s["learning_rate_power"],
            initial_accumulator_value=s["initial_accumulator_value"],
        )
    touched = torch.tensor(CASES[case]["touched"])
    values = ckpt.tensor(name).clone()
    RowOptimizer(spec).apply(values, state, touched, torch.tensor(var[name]["grad"])[touched])
    want = torch.tensor(var[name]["after"])
    atol = 1e-6
    torch.testing.assert_close(values[touched], want[touched], rtol=0, atol=atol)
    fresh_state = RowOptimizer(spec).new_state(rows, 3, values.dtype)
    fresh = ckpt.tensor(name).clone()
    RowOptimizer(spec).apply(fresh, fresh_state, touched, torch.tensor(var[name]["grad"])[touched])
    assert (fresh[touched] - want[touched]).abs().max() > 100 * atol


def test_variables_by_their_keras_names() -> None:
    """Keras 3 saves the model's variables under the optimizer's list
    (``optimizer/_trainable_variables/0/...``), ``tf_keras`` under the model's layers: both by
    their own names too. Keys stay readable; a name no variable has is a ``KeyError``."""
    k3 = _ckpt("keras3_adam")
    key = k3.variables()["model/items/embeddings"]
    assert key == "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"
    assert "model/items/embeddings" in k3 and key in k3 and "items/embeddings" not in k3
    assert torch.equal(k3.tensor("model/items/embeddings"), k3.tensor(key))
    assert k3.shape("model/head/kernel") == (6, 2)
    tk = _ckpt("tf_keras_adam")
    assert tk.variables()["head/kernel"].startswith("model/layer_with_weights-1/")
    assert tk.dtype("head/bias") == torch.float32
    with pytest.raises(KeyError, match="holds no tensor 'head/weights'"):
        tk.tensor("head/weights")
    # A TensorFlow 1.x checkpoint has no object graph: its keys are the names.
    v1 = TFCheckpoint(
        str(Path(__file__).parent.parent / "fixtures" / "tf_dense_state" / "model.ckpt-3")
    )
    assert v1.variables() == {}


def test_a_slot_of_another_optimizer_is_named() -> None:
    """Asking Adam's state of a variable Adagrad trained names the slots there are."""
    ckpt = _ckpt("keras3_adagrad")
    with pytest.raises(ValueError, match=r"keeps slots \['accumulator'\] .* Adam keeps m"):
        ckpt.optimizer_state("model/head/bias", "Adam")
    with pytest.raises(ValueError, match="holds no Adagrad slot"):
        ckpt.optimizer_state("save_counter", "Adagrad")


def test_a_corrupt_object_graph_is_named(tmp_path: Path) -> None:
    """One byte of the graph's string flipped: its CRC32C fails, named; the tensors still
    read by key."""
    case = CASES["keras3_adam"]
    src = KERAS / case["prefix"]
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(f"{src}{suffix}", tmp_path / f"ckpt{suffix}")
    ckpt = TFCheckpoint(str(tmp_path / "ckpt"))
    entry = ckpt._entries[GRAPH_KEY]
    data = tmp_path / "ckpt.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[entry.offset + entry.size - 3] ^= 0x40
    data.write_bytes(bytes(raw))
    ckpt = TFCheckpoint(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="CRC32C of '_CHECKPOINTABLE_OBJECT_GRAPH' does not"):
        ckpt.tensor("model/head/bias")
    key = "optimizer/_trainable_variables/2/.ATTRIBUTES/VARIABLE_VALUE"
    assert ckpt.tensor(key).shape == (2,)
    proc = _psflow("checkpoint", "inspect", str(tmp_path / "ckpt"))  # lists them, and says why
    assert proc.returncode == 0, proc.stderr
    assert "the CRC32C of '_CHECKPOINTABLE_OBJECT_GRAPH' does not match" in proc.stderr
    assert any(line.split()[:1] == [key] for line in proc.stdout.splitlines())


def test_an_object_graph_that_points_outside_itself_is_refused() -> None:
    child = b"\x08\x05\x12\x01a"  # ObjectReference(node_id=5, local_name="a")
    node = b"\x0a" + bytes([len(child)]) + child
    graph = b"\x0a" + bytes([len(node)]) + node
    with pytest.raises(ValueError, match="refers to a node outside its 1"):
        ObjectGraph(graph)
    with pytest.raises(ValueError, match="runs past"):
        ObjectGraph(graph[:-2])


def _psflow(*argv: str) -> subprocess.CompletedProcess[str]:
    """``psflow ARGV`` as a process of its own, forked from the server that imported torch
    (:mod:`tests.multiproc.forked`): its exit code and output, 2 s of CPU sooner."""
    return run_forked(["-c", CLI_MAIN, *argv], timeout=120)


def test_the_cli_lists_and_exports_a_keras_checkpoint_by_its_variables_names(
    tmp_path: Path,
) -> None:
    directory = KERAS / "keras3_adam"  # the directory: its `checkpoint` file names ckpt-1
    proc = _psflow("checkpoint", "inspect", str(directory))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1] == "variables (name, then the key it is saved under):"
    kernel = next(line.split() for line in lines if line.split()[:1] == ["model/head/kernel"])
    assert kernel == [
        "model/head/kernel",
        "float32",
        "[6,",
        "2]",
        "optimizer/_trainable_variables/1/.ATTRIBUTES/VARIABLE_VALUE",
    ]
    assert lines[-2:] == ["other tensors:", f"  {GRAPH_KEY}  string   []"]

    out = tmp_path / "keras.safetensors"
    proc = _psflow("checkpoint", "export", str(directory), str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"string tensors not exported: {GRAPH_KEY}" in proc.stdout
    state = load_file(out)
    variables = CASES["keras3_adam"]["variables"]
    for name, var in variables.items():
        assert torch.equal(state[name], torch.tensor(var["before"])), name
    assert "adam/model_head_kernel_momentum" in state and "adam/iteration" in state


@pytest.mark.parametrize("case", ["keras3_adam", "tf_keras_sgd", "legacy_adagrad"])
def test_any_damage_to_an_object_graph_raises_a_clear_error_or_parses(case: str) -> None:
    """Random single-bit changes to a graph's bytes (past its CRC32C, as a file crafted to
    pass it would be): parsing and looking up every variable's slots either works or raises
    ValueError; nothing else."""
    good = _ckpt(case)._strings(GRAPH_KEY)[0]
    rng = random.Random(3)
    outcomes = {"refused": 0, "parsed": 0}
    for _ in range(300):
        raw = bytearray(good)
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        try:
            graph = ObjectGraph(bytes(raw))
            for keys in graph.variables().values():
                for key in keys:
                    graph.slots(key)
        except ValueError:
            outcomes["refused"] += 1
        else:
            outcomes["parsed"] += 1
    assert outcomes["refused"] > 30 and outcomes["parsed"] > 30, outcomes


def test_parameter_server_strategys_sharded_variables_by_their_paths() -> None:
    """``ParameterServerStrategy`` saves each ``ShardedVariable`` whole, in slices (one per
    ps), with no name of its own ("ShardedVariable"): it is taken by its path, its rows in
    id order with ``"div"`` (each shard holds contiguous rows). A ``tf_keras`` optimizer's
    slots carry no usable name either: they are matched by shape, one to one, or refused."""
    ckpt = _ckpt("pss_adagrad")
    assert ckpt.num_shards == 3  # the chief's and each ps's data file
    path = "model/layer_with_weights-0/embeddings"
    assert ckpt.variables()[path] == path + "/.ATTRIBUTES/VARIABLE_VALUE"
    assert "ShardedVariable" not in ckpt.variables()
    assert ckpt.partitions(path) == [(0, 6), (6, 5)]
    assert torch.equal(ckpt.embedding(path, "div"), ckpt.tensor(path))
    graph = ckpt._object_graph()
    assert graph is not None
    key = ckpt.variables()[path]
    slots = graph.slots(key, ckpt.shape)
    assert slots is not None and list(slots.keys) == ["accumulator"]
    assert graph.slots(key) is None  # without shapes, nothing links them
    with pytest.raises(ValueError, match=r"holds 3 slots of shape \[2\] for 3 unnamed"):
        graph.slots(key, lambda _: (2,))


def test_a_saved_models_variables_are_a_checkpoint() -> None:
    """``model.save(directory)`` (a SavedModel) keeps the model and its optimizer in
    ``variables/variables``: read as any TensorFlow 2 checkpoint (the dense test above runs on
    it too), and ``psflow checkpoint inspect`` takes the SavedModel's directory."""
    case = CASES["savedmodel_adagrad"]
    assert case["prefix"] == "savedmodel_adagrad/variables/variables"
    ckpt = _ckpt("savedmodel_adagrad")
    assert (
        ckpt.variables()["head/kernel"] == "layer_with_weights-1/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    )
    proc = _psflow("checkpoint", "inspect", str(KERAS / "savedmodel_adagrad"))
    assert proc.returncode == 0, proc.stderr
    prefix = KERAS / "savedmodel_adagrad" / "variables" / "variables"
    assert proc.stdout.splitlines()[0] == f"TensorFlow checkpoint: {prefix} (1 data file)"
    assert any(line.split()[:1] == ["head/kernel"] for line in proc.stdout.splitlines())


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _message(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _variable_node(name: str, key: str) -> bytes:
    """A ``TrackableObject`` that saved one variable (``SerializedTensor``)."""
    tensor = _message(1, b"VARIABLE_VALUE") + _message(2, name.encode()) + _message(3, key.encode())
    return _message(1, _message(2, tensor))


def test_a_name_two_variables_share_is_refused_by_name_and_read_by_key() -> None:
    """Two models in one checkpoint can each have a ``dense/kernel``: asked by that name, the
    error lists both keys; each key still reads."""
    ckpt = _ckpt("keras3_adam")
    first, second = (ckpt.variables()[n] for n in ("model/head/kernel", "model/head/bias"))
    graph = ObjectGraph(
        _variable_node("dense/kernel", first) + _variable_node("dense/kernel", second)
    )
    assert graph.variables() == {"dense/kernel": [first, second]}
    ckpt._graph = graph
    assert "dense/kernel" not in ckpt.variables()
    with pytest.raises(KeyError, match="2 variables are named 'dense/kernel'"):
        ckpt.tensor("dense/kernel")
    assert ckpt.tensor(first).shape == (6, 2) and ckpt.tensor(second).shape == (2,)


def test_a_tensorflow_hash_tables_rows_go_to_a_hashed_table_by_id() -> None:
    """A ``MutableHashTable`` of rows saved by ``tf.train.Checkpoint``: its keys and values
    (in the table's own order) given to a hashed table by id; each id looks up its row."""
    from psflow.nn import Embedding

    saved = EXPECTED["hash_table"]
    ckpt = TFCheckpoint(str(KERAS / saved["prefix"]))
    keys, values = ckpt.hash_table("users")
    assert torch.equal(keys, ckpt.tensor("users/.ATTRIBUTES/table-keys"))
    assert torch.equal(values, ckpt.tensor("users/.ATTRIBUTES/table-values"))
    assert sorted(keys.tolist()) == sorted(saved["keys"])
    with pytest.raises(KeyError, match=r"no hash table 'items' \(looked for items-keys and"):
        ckpt.hash_table("items")
    v1_keys, v1_values = TFCheckpoint(str(KERAS / saved["v1_prefix"])).hash_table("users")
    assert torch.equal(v1_keys, keys) and torch.equal(v1_values, values)  # users-keys, -values
    emb = Embedding(None, 3, optimizer="Adagrad")
    emb.load_rows(keys, values)
    got = emb(torch.tensor(saved["keys"])).detach()
    assert torch.equal(got, torch.tensor(saved["rows"]))
