"""``psflow launch --gpus-per-task``: the host's GPUs read, and dealt out to the trainers."""

from __future__ import annotations

import doctest
import os
import stat
from pathlib import Path

import pytest

import psflow.cli
from psflow.cluster import gpus as gpus_module
from psflow.cluster.gpus import check_per_task, gpu_sets, host_gpus
from psflow.cluster.ports import local_cluster
from psflow.cluster.spec import TaskSpec

pytestmark = pytest.mark.unit

CHIEF = TaskSpec(job="chief", index=0)


def workers(n: int) -> list[TaskSpec]:
    return [TaskSpec(job="worker", index=i) for i in range(n)]


def test_each_trainer_gets_gpus_of_its_own_the_chief_first() -> None:
    tasks = local_cluster(1, 2, chief=True, evaluators=1).trainers
    got = gpu_sets(tasks, ["0", "1", "2", "3", "4", "5"], 2)
    assert got == {CHIEF: ["0", "1"], workers(1)[0]: ["2", "3"], workers(2)[1]: ["4", "5"]}
    assert gpu_sets(tasks, ["GPU-a", "GPU-b", "GPU-c"], 1) == {
        CHIEF: ["GPU-a"],
        workers(1)[0]: ["GPU-b"],
        workers(2)[1]: ["GPU-c"],
    }


@pytest.mark.parametrize(
    ("share", "each"),
    [
        (0.5, ["0", "0", "1", "1", "2"]),
        (0.34, ["0"] * 2 + ["1"] * 2 + ["2"]),
        (1 / 3, ["0"] * 3 + ["1"] * 2),
    ],
)
def test_a_share_of_a_gpu_puts_that_many_trainers_on_each(share: float, each: list[str]) -> None:
    got = gpu_sets(workers(5), ["0", "1", "2"], share)
    assert [got[t] for t in workers(5)] == [[g] for g in each]


def test_no_gpus_asked_deals_none() -> None:
    assert gpu_sets(workers(3), [], 0) == {}


@pytest.mark.parametrize(
    ("per_task", "found", "match"),
    [
        (
            1,
            ["0", "1"],
            r"--gpus-per-task 1 for 3 trainer\(s\) needs 3 GPU\(s\); this host has 2 \(here\)",
        ),
        (0.5, ["0"], r"needs 2 GPU\(s\); this host has 1"),
        (1.5, ["0", "1", "2", "3", "4"], "a whole number of GPUs, or a share of one below 1"),
        (-1, ["0"], "a whole number"),
        (float("nan"), ["0"], "a whole number"),
        (float("inf"), ["0"], "a whole number"),
    ],
)
def test_too_few_gpus_or_a_count_no_one_can_have_are_refused(
    per_task: float, found: list[str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        gpu_sets(workers(3), found, per_task, "here")


def test_check_per_task_takes_whole_numbers_and_shares() -> None:
    for ok in (0, 0.25, 0.5, 1, 2, 8.0):
        check_per_task(ok)


def test_the_hosts_gpus_are_cuda_visible_devices_where_set() -> None:
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "3, 5,GPU-9f"}) == (
        ["3", "5", "GPU-9f"],
        "CUDA_VISIBLE_DEVICES=3,5,GPU-9f",
    )
    assert host_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ([], "CUDA_VISIBLE_DEVICES=")


def _fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """A real ``nvidia-smi`` first on ``PATH``: a script with ``body``."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")


def test_else_they_are_the_gpus_nvidia_smi_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = (
        "GPU 0: NVIDIA H200 (UUID: GPU-1)\\n  MIG 1g.18gb Device 0: (UUID: MIG-2)\\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-3)"
    )
    _fake_smi(tmp_path, monkeypatch, f'printf "{listing}\\n"')
    assert host_gpus({}) == (["0", "1"], "nvidia-smi -L")
    _fake_smi(tmp_path, monkeypatch, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    assert host_gpus({}) == ([], "nvidia-smi -L exited with 9")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert host_gpus({}) == ([], "no nvidia-smi on PATH")


def test_the_flag_is_zero_unless_given_and_reaches_both_backends(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    parse = psflow.cli.build_parser().parse_args
    assert parse(["launch", str(script)]).gpus_per_task == 0
    assert parse(["launch", "--gpus-per-task", "0.5", str(script)]).gpus_per_task == 0.5
    assert (
        parse(["launch", "--backend", "ray", "--gpus-per-task", "1", str(script)]).gpus_per_task
        == 1
    )


def test_the_docstring_example_runs() -> None:
    assert doctest.testmod(gpus_module).failed == 0
