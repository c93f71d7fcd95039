"""``psflow render`` on the command line: in-process through psflow.cli.main, and as a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

import psflow.cli
from psflow.cluster import ClusterSpec

pytestmark = pytest.mark.unit

PSFLOW = Path(sys.executable).with_name("psflow")


@pytest.fixture
def main() -> Callable[[list[str]], int]:
    return psflow.cli.main


BASE = ["--name", "mnist", "--image", "psflow:0.1.0"]


def test_render_kubernetes_to_stdout(
    main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["render", "kubernetes", *BASE, "--ps", "2", "--workers", "1", "--chief",
               "--evaluator", "1", "--port", "2345", "--gpus", "1", "--cpu", "2",
               "--memory", "8Gi", "--namespace", "ml", "--keys-secret", "keys",
               "--logdir-claim", "logs", "--tensorboard", "--env", "PSFLOW_TIMEOUT=60",
               "train.py", "--lr", "0.1", "--port", "9"])  # fmt: skip
    assert rc == 0
    objects = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    jobs = [d for d in objects if d["kind"] == "Job"]
    assert [d["metadata"]["name"] for d in jobs] == [
        "mnist-chief-0", "mnist-ps-0", "mnist-ps-1", "mnist-worker-0", "mnist-evaluator-0"
    ]  # fmt: skip
    container = jobs[0]["spec"]["template"]["spec"]["containers"][0]
    # Options after the script are the script's, even one psflow render also has (--port).
    assert container["args"] == ["python", "train.py", "--lr", "0.1", "--port", "9"]
    env = {e["name"]: e["value"] for e in container["env"]}
    spec, _ = ClusterSpec.from_tf_config(env["TF_CONFIG"])
    assert spec.addresses("ps") == ("mnist-ps-0:2345", "mnist-ps-1:2345")
    assert env["PSFLOW_TIMEOUT"] == "60"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert any(d["kind"] == "Deployment" for d in objects)


def test_job_file_then_flags(
    main: Callable[[list[str]], int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "name: fromfile\nimage: img:2\nps: 2\nworkers: 3\nscript: train.py\n"
        "args: [--epochs, '5']\nlogdir_host_dir: /data/logs\n"
    )
    assert main(["render", "marathon", "--job-file", str(job_file), "--workers", "1"]) == 0
    group = json.loads(capsys.readouterr().out)
    assert group["id"] == "/fromfile"
    assert [a["id"] for a in group["apps"]] == ["ps-0", "ps-1", "worker-0"]
    assert group["apps"][0]["args"] == ["python", "train.py", "--epochs", "5"]
    assert group["apps"][0]["container"]["docker"]["image"] == "img:2"


def test_compose_host_directories_are_made_absolute_where_they_were_given(
    main: Callable[[list[str]], int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Compose would take a relative bind source from the compose file's own directory (deploy/),
    # not from where the user typed it: a flag's is the current directory's, a job file's its own.
    (tmp_path / "jobs").mkdir()
    job_file = tmp_path / "jobs" / "job.yaml"
    job_file.write_text("name: a\nimage: i\nkeys_host_dir: ./keys\nlogdir_host_dir: /abs/logs\n")
    monkeypatch.chdir(tmp_path)
    argv = ["render", "compose", "--job-file", str(job_file), "--data-host-dir", "data", "t.py"]
    assert main(argv) == 0
    ps = yaml.safe_load(capsys.readouterr().out)["services"]["a-ps-0"]
    sources = {v["target"]: v["source"] for v in ps["volumes"]}
    assert sources["/etc/psflow/keys"] == str(tmp_path / "jobs" / "keys")
    assert sources["/data"] == str(tmp_path / "data")
    assert sources["/logs"] == "/abs/logs"
    # Marathon's agents are other hosts: a relative directory there is still refused.
    job_file.write_text("name: a\nimage: i\nkeys_host_dir: ./keys\n")
    assert main(["render", "marathon", "--job-file", str(job_file), "t.py"]) == 2
    assert "marathon needs an absolute keys_host_dir, got './keys'" in capsys.readouterr().err


def test_output_dir_and_command(
    main: Callable[[list[str]], int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "deploy"
    rc = main(["render", "compose", *BASE, "--command", "psflow launch --ps 1 'a b.py'",
               "-o", str(out)])  # fmt: skip
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert str(out / "compose.yaml") in captured.err
    doc = yaml.safe_load((out / "compose.yaml").read_text())
    assert doc["services"]["mnist-worker-0"]["command"] == [
        "psflow", "launch", "--ps", "1", "a b.py"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["render", "kubernetes", *BASE], "nothing to run: give the training script"),
        (["render", "kubernetes", "--image", "i", "t.py"], "no name: pass --name"),
        (["render", "kubernetes", *BASE, "--workers", "0", "t.py"], "the job has no worker"),
        (["render", "kubernetes", "--name", "My_Job", "--image", "i", "t.py"], "'My_Job'"),
        (["render", "kubernetes", *BASE, "--port", "0", "t.py"], "port must be"),
        (["render", "kubernetes", *BASE, "--memory", "1gb", "t.py"], "memory '1gb'"),
        (["render", "compose", *BASE, "--keys-secret", "k", "t.py"], "keys_host_dir"),
        (["render", "tfjob", *BASE, "--tensorboard", "t.py"], "give logdir_claim"),
        (["render", "compose", *BASE, "--env", "NOEQUALS", "t.py"], "KEY=VALUE"),
        (["render", "compose", *BASE, "--command", "x", "t.py"], "either a SCRIPT or --command"),
        (["render", "compose", *BASE, "--job-file", "/nonexistent.yaml"], "cannot read job file"),
    ],
)
def test_bad_input_is_a_clean_error(
    main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("psflow render: error: ")
    assert message in err
    assert "Traceback" not in err


def test_unknown_target_is_an_argparse_error(main: Callable[[list[str]], int]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["render", "nomad", *BASE, "t.py"])
    assert e.value.code == 2


@pytest.mark.skipif(not PSFLOW.exists(), reason="the psflow console script is not installed")
def test_psflow_render_as_a_process(tmp_path: Path) -> None:
    env = dict(os.environ)
    out = subprocess.run(
        [str(PSFLOW), "render", "tfjob", *BASE, "--chief", "--namespace", "ml", "train.py"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (tfjob,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert tfjob["kind"] == "TFJob"
    assert set(tfjob["spec"]["tfReplicaSpecs"]) == {"Chief", "PS", "Worker"}
    bad = subprocess.run(
        [str(PSFLOW), "render", "kubernetes", *BASE, "--cpu", "fast", "train.py"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "psflow render: error: cpu 'fast' is not a Kubernetes quantity" in bad.stderr
