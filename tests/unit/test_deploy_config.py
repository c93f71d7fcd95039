"""psflow.deploy's job config: validation, the YAML job file, and precedence."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from psflow.deploy import JobConfig, load_job_file, parse_quantity, plan
from psflow.deploy.layout import check_target, compose_bytes, cpus, memory_mib

pytestmark = pytest.mark.unit

BASE: dict[str, Any] = {"name": "mnist", "image": "psflow:0.1.0", "script": "train.py"}


def job(**kw: Any) -> JobConfig:
    return JobConfig(**{**BASE, **kw})


def test_defaults() -> None:
    config = job()
    assert config.counts() == {"chief": 0, "ps": 1, "worker": 2, "evaluator": 0}
    assert config.port == 2222
    assert config.argv() == ["python", "train.py"]
    assert job(script=None, command=["psflow", "launch"]).argv() == ["psflow", "launch"]
    assert job(args=["--lr", "0.1"]).argv() == ["python", "train.py", "--lr", "0.1"]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"name": "Mnist"}, "name 'Mnist' is not a valid DNS-1035 label"),
        ({"name": "1mnist"}, "name '1mnist'"),
        ({"name": "mnist-"}, "name 'mnist-'"),
        ({"name": "a" * 55}, "task name 'a{55}-worker-1' has 64 characters, more than the 63"),
        ({"image": ""}, "image '' must be a non-empty image reference"),
        ({"image": "a b"}, "image 'a b'"),
        ({"ps": -1}, "ps must be an integer >= 0, got -1"),
        ({"workers": "2"}, "workers must be an integer >= 0, got '2'"),
        ({"workers": True}, "workers must be an integer"),
        ({"workers": 0}, "the job has no worker"),
        ({"evaluators": -2}, "evaluators must be an integer >= 0, got -2"),
        ({"port": 0}, "port must be in 1..65535|port must be an integer >= 1, got 0"),
        ({"port": 70000}, "port must be in 1..65535, got 70000"),
        ({"gpus": -1}, "gpus must be an integer >= 0, got -1"),
        ({"cpu": "lots"}, "cpu 'lots' is not a Kubernetes quantity"),
        ({"cpu": "0"}, "cpu '0' must be greater than zero"),
        ({"memory": "4GB"}, "memory '4GB' is not a Kubernetes quantity"),
        ({"memory": "512m"}, "did you mean 512Mi"),
        ({"logdir": "logs"}, "logdir 'logs' must be an absolute path"),
        ({"namespace": "ML"}, "namespace 'ML' is not a valid namespace"),
        ({"keys_secret": "Keys!"}, "keys_secret 'Keys!' is not a valid Secret name"),
        ({"logdir_claim": "_x"}, "logdir_claim '_x' is not a valid PersistentVolumeClaim name"),
        ({"script": None}, "nothing to run"),
        ({"command": ["python", "x.py"]}, "either a script .* or a command, not both"),
        ({"script": None, "command": []}, "must name a program first"),
        ({"args": "--lr 1"}, "args must be a list of strings"),
        ({"env": {"TF_CONFIG": "{}"}}, "env may not set TF_CONFIG"),
        ({"env": {"1X": "a"}}, "env name '1X' is not a valid"),
        ({"env": {"X": 1}}, "env X must be a string, got 1"),
        ({"tensorboard": "yes"}, "tensorboard must be true or false, got 'yes'"),
        ({"backoff_limit": -1}, "backoff_limit must be an integer >= 0"),
    ],
)
def test_bad_values_name_the_value(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        job(**kw)


def test_longest_name_that_fits() -> None:
    # The longest task name decides: 63 characters is the DNS label limit.
    job(name="a" * 54)  # a...a-worker-1
    with pytest.raises(ValueError, match=r"'a{54}-worker-10' has 64 characters"):
        job(name="a" * 54, workers=11)
    job(name="a" * 51, evaluators=1)  # a...a-evaluator-0
    with pytest.raises(ValueError, match="evaluator-0"):
        job(name="a" * 52, evaluators=1)
    with pytest.raises(ValueError, match=r"a{52}-tensorboard"):
        job(name="a" * 52, tensorboard=True, logdir_claim="logs")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        ("0.25", Decimal("0.25")),
        ("512Mi", Decimal(512 * 2**20)),
        ("1G", Decimal(10**9)),
        ("1e3", Decimal(1000)),
    ],
)
def test_quantities(text: str, value: Decimal) -> None:
    assert parse_quantity(text, what="x") == value


def test_resource_conversions() -> None:
    config = job(cpu="1500m", memory="1536Mi")
    assert cpus(config) == 1.5
    assert memory_mib(config) == 1536
    assert memory_mib(job(memory="1G")) == 954  # rounded up, never below the request
    assert compose_bytes("2Gi") == "2g"
    assert compose_bytes("1536Mi") == "1536m"
    assert compose_bytes("1000") == "1000b"
    # YAML reads `cpu: 2` as a number; it is kept as the quantity string.
    assert job(cpu=2).cpu == "2"


def test_job_file_and_flags_precedence(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: fromfile\nimage: img:1\nps: 3\nworkers: 4\nlogdir-claim: logs\n"
        "command: [psflow, launch]\nenv: {PSFLOW_TIMEOUT: '30'}\n"
    )
    config = JobConfig.merged(file=path, overrides={"workers": 5, "ps": None})
    assert (config.name, config.image, config.ps, config.workers) == ("fromfile", "img:1", 3, 5)
    assert config.logdir_claim == "logs"
    assert config.argv() == ["psflow", "launch"]
    assert config.env == {"PSFLOW_TIMEOUT": "30"}
    # A script given by flag replaces the file's command as a whole.
    config = JobConfig.merged(file=path, overrides={"script": "t.py", "args": ["-v"]})
    assert config.argv() == ["python", "t.py", "-v"]
    assert config.command is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: a\nimage: b\nworker: 3\n", "unknown option 'worker'; known options: name, image"),
        ("- a\n- b\n", "must hold a mapping"),
        ("name: [unclosed\n", "is not valid YAML"),
    ],
)
def test_bad_job_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_job_file(path)


def test_missing_job_file_and_required_fields(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read job file"):
        load_job_file(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match="no image: pass --image"):
        JobConfig.merged(overrides={"name": "a", "script": "t.py"})


@pytest.mark.parametrize(
    ("target", "kw", "message"),
    [
        ("nomad", {}, "unknown target 'nomad': expected one of kubernetes, tfjob"),
        ("kubernetes", {"keys_host_dir": "keys"}, "reads the CurveZMQ keys from a Secret"),
        ("tfjob", {"tensorboard": True}, "tensorboard needs a logdir shared by all pods"),
        ("compose", {"keys_secret": "k"}, "cannot mount the Kubernetes Secret 'k'"),
        ("marathon", {"keys_secret": "k"}, "cannot mount the Kubernetes Secret"),
        ("marathon", {"tensorboard": True}, "needs logdir_host_dir"),
        ("marathon", {"logdir_host_dir": "logs"}, "absolute logdir_host_dir, got 'logs'"),
        ("marathon", {"port": 65535}, "the last would be 65537"),
        ("kubernetes", {"evaluators": 1}, "an evaluator reads the checkpoints .* logdir_claim"),
        ("tfjob", {"evaluators": 1}, "the logdir must be shared: give logdir_claim"),
        ("marathon", {"evaluators": 1}, "the logdir must be shared: give logdir_host_dir"),
    ],
)
def test_target_specific_checks(target: str, kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_target(job(**kw), target)


def test_layout_names_and_ports() -> None:
    config = job(
        chief=True, ps=2, workers=1, evaluators=1, logdir_claim="logs", logdir_host_dir="/logs"
    )
    k8s = plan(config, "kubernetes")
    assert [t.name for t in k8s.tasks] == [
        "mnist-chief-0",
        "mnist-ps-0",
        "mnist-ps-1",
        "mnist-worker-0",
        "mnist-evaluator-0",
    ]
    assert [t.address for t in k8s.tasks][-1] is None  # nobody calls the evaluator
    assert k8s.cluster.evaluators == 1 and "evaluator" not in k8s.cluster.jobs
    marathon = plan(config, "marathon")
    assert [t.port for t in marathon.tasks[:4]] == [2222, 2223, 2224, 2225]
    assert marathon.tasks[1].host == "ps-0-mnist.marathon.mesos"
    tfjob = plan(config, "tfjob")
    assert tfjob.cluster.addresses("evaluator") == ("mnist-evaluator-0.default.svc:2222",)
    gpus = plan(job(gpus=2, chief=True), "kubernetes").tasks
    assert {t.job: t.gpus for t in gpus} == {"chief": 2, "ps": 0, "worker": 2}
