"""Learning-rate schedules: the spec's validation, and the learning rate as a function of the
global step, equal to torch's own scheduler stepped as many times."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from psflow.protocol import OptimizerSpec, ScheduleSpec
from psflow.protocol.specs import SCHEDULES
from psflow.ps.checkpoint import ShardCheckpointer
from psflow.ps.shard_file import read_shard
from psflow.ps.store import MAX_SCHEDULE_CATCH_UP, ShardStore
from psflow.train.checkpoint import load_checkpoint
from psflow.train.manifest import CheckpointDir, Manifest, VariableEntry

pytestmark = pytest.mark.unit

# One of each class a spec may name, with arguments that make its learning rate move within
# the steps tested (and past the points where the piecewise ones stop moving).
CASES: list[tuple[str, dict[str, Any], OptimizerSpec]] = [
    ("StepLR", {"step_size": 7, "gamma": 0.1}, OptimizerSpec(kwargs={"lr": 0.3})),
    ("MultiStepLR", {"milestones": [5, 5, 40, 90], "gamma": 0.3}, OptimizerSpec()),
    ("ConstantLR", {"factor": 0.3, "total_iters": 11}, OptimizerSpec()),
    ("LinearLR", {"start_factor": 0.1, "total_iters": 30}, OptimizerSpec()),
    ("PolynomialLR", {"total_iters": 50, "power": 2.0}, OptimizerSpec()),
    ("ExponentialLR", {"gamma": 0.97}, OptimizerSpec(kwargs={"lr": 0.7})),
    ("CosineAnnealingLR", {"T_max": 25, "eta_min": 0.001}, OptimizerSpec()),
    ("CosineAnnealingWarmRestarts", {"T_0": 10, "T_mult": 2}, OptimizerSpec()),
    (
        "CyclicLR",
        {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 9, "mode": "triangular2"},
        OptimizerSpec(kwargs={"lr": 0.01, "momentum": 0.9}),
    ),
    (
        "OneCycleLR",
        {"max_lr": 0.5, "total_steps": 150},
        OptimizerSpec(name="Adam", kwargs={"lr": 0.01}),
    ),
    (  # a warmup, then a cosine decay
        "SequentialLR",
        {
            "schedulers": [
                ("LinearLR", {"start_factor": 0.01, "total_iters": 20}),
                ("CosineAnnealingLR", {"T_max": 100}),
            ],
            "milestones": [20],
        },
        OptimizerSpec(),
    ),
    (  # TensorFlow's piecewise_constant(step, [40, 90], [0.1, 0.05, 0.01])
        "ChainedScheduler",
        {
            "schedulers": [
                ("MultiStepLR", {"milestones": [41], "gamma": 0.5}),
                ("MultiStepLR", {"milestones": [91], "gamma": 0.2}),
            ]
        },
        OptimizerSpec(kwargs={"lr": 0.1}),
    ),
]
STEPS = 150


def test_every_schedule_the_spec_accepts_is_tested() -> None:
    assert sorted(name for name, _, _ in CASES) == sorted(SCHEDULES)


def _torch_scheduler(
    opt: torch.optim.Optimizer, name: str, kwargs: dict[str, Any]
) -> torch.optim.lr_scheduler.LRScheduler:
    cls = getattr(torch.optim.lr_scheduler, name)
    if name == "SequentialLR":
        subs = [_torch_scheduler(opt, n, k) for n, k in kwargs["schedulers"]]
        return cls(opt, schedulers=subs, milestones=kwargs["milestones"])  # type: ignore[no-any-return]
    if name == "ChainedScheduler":
        subs = [_torch_scheduler(opt, n, k) for n, k in kwargs["schedulers"]]
        return cls(subs, optimizer=opt)  # type: ignore[no-any-return]
    return cls(opt, **kwargs)  # type: ignore[no-any-return]


def _torch_lrs(name: str, kwargs: dict[str, Any], opt_spec: OptimizerSpec) -> list[tuple]:
    """Torch's own scheduler, stepped once a step: (lr, momentum or betas) at steps 0..STEPS."""
    opt = opt_spec.build([torch.zeros(1, requires_grad=True)])
    sched = _torch_scheduler(opt, name, kwargs)
    out = [_group(opt)]
    for _ in range(STEPS):
        opt.step()  # no gradient: changes nothing, but the order torch expects
        sched.step()
        out.append(_group(opt))
    return out


def _group(opt: torch.optim.Optimizer) -> tuple:
    g = opt.param_groups[0]
    return (g["lr"], g.get("momentum"), tuple(g["betas"]) if "betas" in g else None)


@pytest.mark.parametrize(("name", "kwargs", "opt_spec"), CASES, ids=[c[0] for c in CASES])
def test_the_learning_rate_at_each_step_is_torchs_stepped_as_many_times(
    name: str, kwargs: dict[str, Any], opt_spec: OptimizerSpec
) -> None:
    expected = _torch_lrs(name, kwargs, opt_spec)
    spec = ScheduleSpec(name=name, kwargs=kwargs)
    # Once a step (the synchronous ps, shard 0).
    opt = opt_spec.build([torch.zeros(1)])
    schedule = spec.build(opt)
    for step in range(STEPS + 1):
        schedule.advance(step)
        assert schedule.step == step
        assert _group(opt) == expected[step], step
    # By jumps, and asked again for steps already passed (a shard told of the global step by
    # its workers' pushes, which arrive out of order).
    rng = random.Random(0)
    opt = opt_spec.build([torch.zeros(1)])
    schedule = spec.build(opt)
    at = 0
    while at < STEPS:
        at = min(STEPS, at + rng.choice([1, 2, 3, 5, 8, 13]))
        schedule.advance(at)
        assert _group(opt) == expected[at], at
        schedule.advance(at - rng.randint(0, 3))  # the past: it stays
        assert _group(opt) == expected[at] and schedule.step == at
    # From nothing straight to step n (a restore at n): a pure function of n.
    for n in (0, 1, 6, 7, 8, 49, 50, 51, 99, STEPS):
        opt = opt_spec.build([torch.zeros(1)])
        spec.build(opt).advance(n)
        assert _group(opt) == expected[n], n


def test_one_cycle_keeps_its_last_learning_rate_past_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opt = torch.optim.Adam([torch.zeros(1)], lr=0.01)
    schedule = ScheduleSpec(name="OneCycleLR", kwargs={"max_lr": 0.5, "total_steps": 20}).build(opt)
    schedule.advance(20)
    last = schedule.lr
    schedule.advance(35)  # asynchronous workers push past the end the script meant
    assert schedule.lr == last and schedule.step == 35 and schedule.ended_at == 20
    assert "ended at step 20" in caplog.text


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("ExponentialLR", "SequentialLR")])
def test_no_warning_from_torch_about_the_order_of_steps(case: tuple) -> None:
    """The ps steps its optimizer its own way (not through torch's wrapper): no warning."""
    name, kwargs, opt_spec = case
    opt = opt_spec.build([torch.zeros(1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ScheduleSpec(name=name, kwargs=kwargs).build(opt).advance(STEPS)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("LambdaLR", {}, "LambdaLR' takes a Python function"),
        ("MultiplicativeLR", {}, "takes a Python function"),
        ("ReduceLROnPlateau", {}, "steps on a metric"),
        ("SequentialLR", {"schedulers": "StepLR", "milestones": []}, "non-empty list"),
        ("SequentialLR", {"schedulers": [("LambdaLR", {})], "milestones": []}, "function"),
        ("SequentialLR", {"schedulers": [("ExponentialLR", {"gamma": 0.5})]}, "'milestones'"),
        ("ChainedScheduler", {"schedulers": [("StepLR", {"step_sise": 3})]}, "'step_sise'"),
        ("LRScheduler", {}, "unknown lr_schedule 'LRScheduler'"),
        ("StepLr", {}, r"unknown lr_schedule 'StepLr'.*StepLR"),
        ("ExponentialLR", {}, "missing a required argument: 'gamma'"),
        ("StepLR", {"step_size": 10, "gama": 0.5}, "unexpected keyword argument 'gama'"),
        ("StepLR", {"step_size": 10, "last_epoch": 5}, "do not give 'last_epoch'"),
        ("StepLR", {"step_size": 10, "optimizer": "SGD"}, "do not give 'optimizer'"),
        ("StepLR", {"step_size": 0}, "step_size must be >= 1"),
        ("StepLR", {"step_size": 2.5}, "step_size must be an integer"),
        ("MultiStepLR", {"milestones": [10, 2.5]}, "milestones must be a list of integers"),
        ("CyclicLR", {"base_lr": 0.1, "max_lr": 1, "scale_fn": print}, "not a plain value"),
    ],
)
def test_specs_that_cannot_run_on_the_ps_are_refused_with_what_to_do(
    name: str, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ScheduleSpec(name=name, kwargs=kwargs)


def test_the_forms_a_script_may_give() -> None:
    spec = ScheduleSpec(name="StepLR", kwargs={"step_size": 1000, "gamma": 0.5})
    assert ScheduleSpec.of(("StepLR", {"step_size": 1000, "gamma": 0.5})) == spec
    assert ScheduleSpec.of(spec) is spec
    assert ScheduleSpec.of(None) is None
    with pytest.raises(ValueError, match="missing a required argument"):
        ScheduleSpec.of("StepLR")
    with pytest.raises(ValueError, match=r"a \(name, \{arguments\}\) pair"):
        ScheduleSpec.of(("StepLR", 1000, 0.5))  # type: ignore[arg-type]
    assert ScheduleSpec.from_wire(spec.to_wire()) == spec
    tupled = ScheduleSpec(name="MultiStepLR", kwargs={"milestones": (3, 9)})
    assert tupled.to_wire() == {"name": "MultiStepLR", "kwargs": {"milestones": [3, 9]}}
    assert spec.describe() == "StepLR(step_size=1000, gamma=0.5)"
    with pytest.raises(ValueError, match="must be a map"):
        ScheduleSpec.from_wire(["StepLR"])


def test_a_schedule_the_optimizer_cannot_follow_is_named_on_the_worker() -> None:
    cyclic = ScheduleSpec(name="CyclicLR", kwargs={"base_lr": 0.01, "max_lr": 0.1})
    cyclic.check(OptimizerSpec(name="SGD", kwargs={"lr": 0.01, "momentum": 0.9}))
    with pytest.raises(ValueError, match=r"CyclicLR.*Adagrad.*momentum"):
        cyclic.check(OptimizerSpec(name="Adagrad", kwargs={"lr": 0.01}))


def test_the_optimizers_learning_rate_for_summaries() -> None:
    assert OptimizerSpec(name="SGD", kwargs={"lr": 0.25}).lr == 0.25
    assert OptimizerSpec(name="Adam", kwargs={}).lr == 0.001  # torch's default


# -- on a ps shard (psflow.ps.store): the updates, a restore, the global step of the pushes --

STEP_LR = ScheduleSpec(name="StepLR", kwargs={"step_size": 3, "gamma": 0.1})


def _reference(
    w0: torch.Tensor, opt_kwargs: dict[str, Any], grads: list[torch.Tensor | None]
) -> tuple[torch.Tensor, list[float]]:
    """torch.optim.SGD and StepLR in one process, the way a training loop steps them."""
    ref = w0.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], **opt_kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, **STEP_LR.kwargs)
    lrs = []
    for g in grads:
        lrs.append(opt.param_groups[0]["lr"])
        ref.grad = None if g is None else g.clone()
        opt.step()
        sched.step()
    return ref.detach(), lrs


@pytest.mark.parametrize("opt_kwargs", [{"lr": 0.5}, {"lr": 0.5, "momentum": 0.9}])
def test_a_shard_applies_the_schedule_by_its_step_bit_for_bit(opt_kwargs: dict[str, Any]) -> None:
    torch.manual_seed(0)
    w0 = torch.randn(4)
    grads = [torch.randn(4) for _ in range(10)]
    store = ShardStore()
    store.initialize([("w", w0)], OptimizerSpec(kwargs=opt_kwargs), schedule=STEP_LR)
    applied = []
    for g in grads:
        applied.append(store.learning_rate())
        store.apply([("w", g)])
    expected, lrs = _reference(w0, opt_kwargs, grads)
    assert applied == lrs and lrs[0] != lrs[-1]
    assert torch.equal(store.variables["w"], expected)
    # Restored at step 4 (a checkpoint): the learning rate of step 4, not of step 0.
    restored = ShardStore()
    restored.initialize([("w", w0)], OptimizerSpec(kwargs=opt_kwargs), step=4, schedule=STEP_LR)
    assert restored.learning_rate() == lrs[4]
    # Without a schedule the store does nothing of the kind.
    plain = ShardStore()
    plain.initialize([("w", w0)], OptimizerSpec(kwargs=opt_kwargs))
    assert plain.schedule is None and plain.learning_rate() is None


def test_a_shard_that_pushes_pass_by_follows_the_global_step_they_carry() -> None:
    """Asynchronous training, shard 1: pushes that leave it out (its variables had no
    gradient) do not hold its schedule back; the global step the next push carries does."""
    torch.manual_seed(1)
    w0 = torch.randn(4)
    grads: list[torch.Tensor | None] = [
        None if step in (1, 2, 3, 6) else torch.randn(4) for step in range(9)
    ]
    shard1 = ShardStore()
    shard1.initialize([("w", w0)], OptimizerSpec(kwargs={"lr": 0.5}), schedule=STEP_LR)
    for global_step, g in enumerate(grads):
        if g is not None:
            shard1.apply([("w", g)], global_step=global_step)
    expected, _ = _reference(w0, {"lr": 0.5}, grads)
    assert torch.equal(shard1.variables["w"], expected)
    assert shard1.step == 5  # its own count: 5 pushes reached it
    # A push from a worker that saw an older step leaves the schedule where it is.
    lr = shard1.learning_rate()
    shard1.apply([("w", torch.zeros(4))], global_step=2)
    assert shard1.learning_rate() == lr
    # No push moves the schedule by more than MAX_SCHEDULE_CATCH_UP steps (a worker's word).
    assert shard1.schedule is not None
    before = shard1.schedule.step
    shard1.apply([("w", torch.zeros(4))], global_step=1 << 60)
    assert shard1.schedule.step == before + MAX_SCHEDULE_CATCH_UP
    with pytest.raises(ValueError, match="'step' must be a global step"):
        shard1.apply([("w", torch.zeros(4))], global_step="7")


def test_a_shard_file_and_the_manifest_name_the_schedule(tmp_path: Path) -> None:
    store = ShardStore()
    store.initialize([("w", torch.zeros(2))], OptimizerSpec(kwargs={"lr": 0.5}), schedule=STEP_LR)
    for _ in range(7):
        store.apply([("w", torch.ones(2))])
    url = f"{tmp_path}/ckpt-7"
    saver = ShardCheckpointer(store, shard=0, num_shards=1)
    reply = saver.save({"dir": url})
    saver.wait(10)
    assert reply["lr_schedule"] == STEP_LR.to_wire()
    shard = read_shard(f"{url}/shard-0-of-1.safetensors")
    assert shard.step == 7 and shard.lr_schedule == STEP_LR.to_wire()
    assert shard.param_groups[0]["lr"] == pytest.approx(0.5 * 0.1 * 0.1)  # the lr at step 7
    manifest = Manifest(
        global_step=7,
        num_shards=1,
        optimizer=OptimizerSpec(kwargs={"lr": 0.5}).to_wire(),
        lr_schedule=reply["lr_schedule"],
        variables=[
            VariableEntry(
                var="w",
                param="w",
                shard=0,
                file="shard-0-of-1.safetensors",
                shape=[2],
                dtype="float32",
            )
        ],
    )
    CheckpointDir(str(tmp_path)).publish("ckpt-7", manifest)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt is not None and ckpt.lr_schedule == STEP_LR
    # A manifest written before schedules existed reads as "no schedule".
    old = json.loads(manifest.to_json())
    del old["lr_schedule"]
    assert Manifest.from_json(json.dumps(old)).lr_schedule is None


def test_a_composite_travels_as_data_and_reads_back_equal() -> None:
    spec = ScheduleSpec.of(CASES[-2][:2])  # type: ignore[arg-type]
    assert spec is not None
    wired = json.loads(json.dumps(spec.to_wire()))  # as in a manifest
    assert wired["kwargs"]["schedulers"][0] == {
        "name": "LinearLR",
        "kwargs": {"start_factor": 0.01, "total_iters": 20},
    }
    assert ScheduleSpec.from_wire(wired) == spec
    assert spec.describe() == (
        "SequentialLR(schedulers=[LinearLR(start_factor=0.01, total_iters=20), "
        "CosineAnnealingLR(T_max=100)], milestones=[20])"
    )


def test_piecewise_constant_as_tensorflow_defines_it() -> None:
    """TensorFlow's piecewise_constant(step, [40, 90], [0.1, 0.05, 0.01]): 0.1 up to step 40
    included, 0.05 up to 90, then 0.01 (docs/training.md spells it with MultiStepLR pieces)."""
    name, kwargs, opt_spec = CASES[-1]
    opt = opt_spec.build([torch.zeros(1)])
    schedule = ScheduleSpec(name=name, kwargs=kwargs).build(opt)
    for step in range(STEPS):
        schedule.advance(step)
        want = 0.1 if step <= 40 else 0.05 if step <= 90 else 0.01
        assert schedule.lr == pytest.approx(want, rel=1e-12), step


def test_tables_that_take_the_jobs_optimizer_follow_its_schedule() -> None:
    """A table that names no optimizer (``scheduled``) updates its rows with the schedule's
    learning rate at each step, as the dense variables; one with its own optimizer keeps its
    own rate."""
    from psflow.protocol import RowOptimizerSpec, TableSpec
    from psflow.sparse import make_rows

    torch.manual_seed(2)
    sgd = RowOptimizerSpec.of("SGD", lr=0.5)
    specs = {
        name: TableSpec(
            name=name,
            embedding_dim=4,
            num_embeddings=3,
            dtype="float64",
            optimizer=sgd,
            scheduled=scheduled,
        )
        for name, scheduled in (("follows", True), ("own", False))
    }
    tables = {name: make_rows(spec, 0, 1) for name, spec in specs.items()}
    start = {name: t.values.clone() for name, t in tables.items()}
    store = ShardStore()
    store.initialize(
        [("w", torch.zeros(4, dtype=torch.float64))],
        OptimizerSpec(kwargs={"lr": 0.5}),
        schedule=STEP_LR,
        tables=tables,
    )
    grads = [torch.randn(4, dtype=torch.float64) for _ in range(10)]
    for g in grads:
        one = g.unsqueeze(0)
        store.apply(
            [("w", g)], rows={"follows": (torch.tensor([1]), one), "own": (torch.tensor([1]), one)}
        )
    # The scheduled row moved exactly as the dense variable (plain SGD, the same gradients).
    moved = tables["follows"].values[1] - start["follows"][1]
    assert torch.allclose(moved, store.variables["w"], rtol=0, atol=1e-12)
    expected, lrs = _reference(torch.zeros(4, dtype=torch.float64), {"lr": 0.5}, grads)
    assert torch.allclose(moved, expected, rtol=0, atol=1e-12) and lrs[0] != lrs[-1]
    # The other at a constant 0.5.
    constant = -0.5 * torch.stack(grads).sum(0)
    assert torch.allclose(tables["own"].values[1] - start["own"][1], constant, rtol=0, atol=1e-12)
    # Rows the pushes did not touch did not move.
    assert torch.equal(tables["follows"].values[0], start["follows"][0])
