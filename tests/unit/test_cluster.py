"""Cluster spec: flags, TF_CONFIG, files, and every kind of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psflow.cluster import ClusterSpec, TaskSpec, resolve

pytestmark = pytest.mark.unit

PS = "localhost:2222"
W0, W1 = "localhost:2223", "localhost:2224"


def test_from_flags_and_back_to_tf_config() -> None:
    ctx, rest = resolve(
        [
            "--ps_hosts",
            PS,
            "--worker_hosts",
            f"{W0},{W1}",
            "--job_name",
            "worker",
            "--task_index",
            "1",
            "--lr",
            "0.1",
        ],
        environ={},
    )
    assert rest == ["--lr", "0.1"]
    assert ctx.task == TaskSpec(job="worker", index=1)
    assert ctx.cluster.addresses("worker") == (W0, W1)
    assert not ctx.is_chief
    back = json.loads(ctx.cluster.to_tf_config(ctx.task))
    assert back == {
        "cluster": {"ps": [PS], "worker": [W0, W1]},
        "task": {"type": "worker", "index": 1},
    }
    again, task = ClusterSpec.from_tf_config(json.dumps(back))
    assert again == ctx.cluster and task == ctx.task


def test_chief_flag_makes_a_separate_chief() -> None:
    ctx, _ = resolve(
        [
            "--chief_host",
            "localhost:2000",
            "--ps_hosts",
            PS,
            "--worker_hosts",
            W0,
            "--job_name",
            "chief",
            "--task_index",
            "0",
        ],
        environ={},
    )
    assert ctx.is_chief
    assert ctx.cluster.trainers == [TaskSpec(job="chief"), TaskSpec(job="worker", index=0)]


def test_worker_zero_is_chief_without_a_chief_job() -> None:
    spec = ClusterSpec(jobs={"ps": [PS], "worker": [W0, W1]})
    assert spec.chief == TaskSpec(job="worker", index=0)


def test_tf_config_as_kubeflow_writes_it_with_master_alias() -> None:
    tf_config = {
        "cluster": {
            "master": ["job-master-0:2222"],
            "ps": ["job-ps-0:2222"],
            "worker": ["job-worker-0:2222", "job-worker-1:2222"],
        },
        "task": {"type": "master", "index": 0},
        "environment": "cloud",
    }
    ctx, _ = resolve([], environ={"TF_CONFIG": json.dumps(tf_config)})
    assert ctx.task == TaskSpec(job="chief", index=0)
    assert ctx.is_chief
    assert ctx.cluster.addresses("chief") == ("job-master-0:2222",)


def test_evaluator_outside_cluster() -> None:
    tf_config = {
        "cluster": {"chief": ["c:1"], "worker": ["w:1"]},
        "task": {"type": "evaluator", "index": 0},
    }
    spec, task = ClusterSpec.from_tf_config(json.dumps(tf_config))
    assert task.job == "evaluator"
    assert spec.num_tasks("evaluator") == 1
    assert TaskSpec(job="evaluator") in spec.tasks()


def test_flags_override_tf_config() -> None:
    tf_config = {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}
    ctx, _ = resolve(
        ["--ps_hosts", PS, "--worker_hosts", W0, "--job_name", "ps"],
        environ={"TF_CONFIG": json.dumps(tf_config)},
    )
    assert ctx.cluster.addresses("worker") == (W0,)
    assert ctx.task == TaskSpec(job="ps", index=0)


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_cluster_file(tmp_path: Path, suffix: str) -> None:
    data = {"cluster": {"ps": [PS], "worker": [W0]}, "task": {"type": "ps", "index": 0}}
    path = tmp_path / f"cluster.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps(data))
    else:
        path.write_text(
            f"cluster:\n  ps: [{PS}]\n  worker:\n    - {W0}\ntask: {{type: ps, index: 0}}\n"
        )
    ctx, _ = resolve(["--cluster_file", str(path)], environ={})
    assert ctx.task == TaskSpec(job="ps", index=0)
    assert ctx.cluster.addresses("ps") == (PS,)


def test_cluster_file_without_task_needs_job_name(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"ps: [{PS}]\nworker: [{W0}]\n")
    with pytest.raises(ValueError, match="no task"):
        resolve(["--cluster_file", str(path)], environ={})
    ctx, _ = resolve(["--cluster_file", str(path), "--job_name", "worker"], environ={})
    assert ctx.is_chief


@pytest.mark.parametrize(
    ("jobs", "message"),
    [
        ({"ps": [PS], "trainer": [W0]}, "unknown job 'trainer'"),
        ({"ps": [PS], "worker": [W0, W0]}, "duplicate address 'localhost:2223'"),
        ({"ps": [W0], "worker": [W0]}, "duplicate address"),
        ({"ps": ["localhost"], "worker": [W0]}, "malformed address 'localhost'"),
        ({"ps": ["localhost:99999"], "worker": [W0]}, "port 99999"),
        ({"ps": ["local host:1"], "worker": [W0]}, "malformed address"),
        ({"ps": [PS]}, "no worker"),
        ({"ps": [], "worker": [W0]}, "job 'ps' has no hosts"),
        ({"ps": PS, "worker": [W0]}, "must list its addresses"),
        ({"chief": ["a:1", "b:1"], "worker": [W0]}, "exactly one task"),
        ({"chief": ["a:1"], "master": ["b:1"], "worker": [W0]}, "given twice"),
    ],
)
def test_bad_cluster(jobs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterSpec(jobs=jobs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--ps_hosts", PS, "--worker_hosts", W0, "--job_name", "worker", "--task_index", "1"],
            "task index 1 out of range: job 'worker' has 1 task",
        ),
        (["--ps_hosts", PS, "--worker_hosts", W0, "--job_name", "boss"], "unknown job 'boss'"),
        (["--ps_hosts", "", "--worker_hosts", W0, "--job_name", "ps"], "job 'ps' has no hosts"),
        (["--worker_hosts", W0, "--job_name", "ps"], "does not have"),
        (
            ["--ps_hosts", PS, "--worker_hosts", W0, "--job_name", "worker", "--task_index", "-1"],
            "must be an integer >= 0",
        ),
        ([], "no cluster given"),
        (["--ps_hosts", PS, "--worker_hosts", W0], "no task"),
    ],
)
def test_bad_flags(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(argv, environ={})


@pytest.mark.parametrize(
    ("tf_config", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"task": {"type": "worker", "index": 0}}', "no 'cluster'"),
        ('{"cluster": {"worker": ["a:1"]}}', "no 'task'"),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "x"}}',
            "not an integer",
        ),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}',
            "out of range",
        ),
        # int() would have taken them: 0.9 as task 0, true as task 1, an Arabic-Indic digit.
        (
            '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0.9}}',
            "task index 0.9 is not an integer",
        ),
        (
            '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": true}}',
            "task index True is not an integer",
        ),
        (
            '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": "\\u0661"}}',
            "is not an integer",
        ),
        (
            '{"cluster": {"worker": ["a:\\u0663"]}, "task": {"type": "worker", "index": 0}}',
            "malformed address",
        ),
    ],
)
def test_bad_tf_config(tf_config: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve([], environ={"TF_CONFIG": tf_config})


def test_bad_cluster_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read cluster file"):
        ClusterSpec.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ps: [a:1\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        ClusterSpec.from_file(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        ClusterSpec.from_file(scalar)


SCRIPT_FLAGS = ["--cluster", '{"a": 1}', "--job", "ps", "--ps", "1", "--worker", "2", "--task", "3"]


@pytest.mark.parametrize(
    "script_flags",
    [
        SCRIPT_FLAGS,
        ['--cluster={"a": 1}', "--job=ps", "--ps=1", "--worker=2", "--task=3"],
        ["--job_name_suffix", "x", "--task_index_base=4", "--cluster_files", "f"],
    ],
)
def test_the_scripts_own_flags_come_back_untouched(script_flags: list[str]) -> None:
    # argparse's prefix matching once took --cluster for --cluster_file and --job for --job_name.
    argv = ["--ps_hosts", PS, "--worker_hosts", W0, "--job_name", "worker", *script_flags]
    ctx, rest = resolve(argv, environ={})
    assert rest == script_flags
    assert ctx.task == TaskSpec(job="worker", index=0)
    assert ctx.cluster.addresses("ps") == (PS,)


def test_the_cluster_flags_in_both_forms(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"ps: [{PS}]\nworker: [{W0}, {W1}]\n")
    spaced, rest = resolve(
        ["--cluster_file", str(path), "--job_name", "worker", "--task_index", "1", "--lr", "3"],
        environ={},
    )
    joined, rest2 = resolve(
        [f"--cluster_file={path}", "--job_name=worker", "--task_index=1", "--lr=3"], environ={}
    )
    assert spaced == joined
    assert spaced.task == TaskSpec(job="worker", index=1)
    assert (rest, rest2) == (["--lr", "3"], ["--lr=3"])
    chief = "localhost:2225"
    hosts, _ = resolve(
        [
            f"--ps_hosts={PS}",
            f"--worker_hosts={W0},{W1}",
            f"--chief_host={chief}",
            "--job_name=chief",
        ],
        environ={},
    )
    assert hosts.is_chief and hosts.cluster.addresses("worker") == (W0, W1)


@pytest.mark.parametrize(
    ("argv", "tf_config", "message"),
    [
        (["--job_name", "wroker"], None, "unknown job 'wroker' (did you mean 'worker'?)"),
        (["--task_index", "7"], None, "task index 7 out of range: job 'worker' has 2 task(s)"),
        (["--task_index", "x"], None, "argument --task_index: invalid int value: 'x'"),
        (
            [],
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}',
            "TF_CONFIG: task index 3 out of range: job 'worker' has 1 task(s)",
        ),
        (
            [],
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "wroker"}}',
            "TF_CONFIG: unknown job 'wroker' (did you mean 'worker'?)",
        ),
    ],
)
def test_a_mistake_names_its_source(argv: list[str], tf_config: str | None, message: str) -> None:
    if tf_config is None:
        argv = ["--ps_hosts", PS, "--worker_hosts", f"{W0},{W1}", "--job_name", "worker", *argv]
    environ = {} if tf_config is None else {"TF_CONFIG": tf_config}
    with pytest.raises(ValueError) as e:
        resolve(argv, environ=environ)
    assert message in str(e.value)


def test_two_sources_that_disagree_are_both_named() -> None:
    # A TF_CONFIG left in the shell, and this run's --job_name.
    tf_config = '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}'
    with pytest.raises(
        ValueError, match="the cluster comes from TF_CONFIG, the task from the flags"
    ):
        resolve(["--job_name", "ps"], environ={"TF_CONFIG": tf_config})


def test_exit_on_error_prints_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--ps_hosts", PS, "--worker_hosts", W0, "--job_name", "wroker"]
    with pytest.raises(SystemExit) as e:
        resolve(argv, environ={}, exit_on_error=True)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: unknown job 'wroker'" in err
    with pytest.raises(ValueError, match="unknown job"):
        resolve(argv, environ={"PSFLOW_LOG_LEVEL": "debug"}, exit_on_error=True)


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """No outgoing connection can take a chosen port before its task binds it: the kernel gives
    those ports from ``ip_local_port_range``, and free_ports chooses below it."""
    import socket

    from psflow.cluster.ports import _listening_ports, free_ports

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(p < low and p in _listening_ports() for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free


def test_threads_per_task_shares_the_cores_out() -> None:
    import os

    from psflow.env import threads_per_task

    cores = len(os.sched_getaffinity(0))
    assert threads_per_task(1) == str(cores)
    assert threads_per_task(cores) == "1"
    assert threads_per_task(cores * 10) == "1"  # at least one
    assert threads_per_task(0) == str(cores)
