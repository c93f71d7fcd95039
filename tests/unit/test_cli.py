"""The ``psflow`` command and a script's ``psflow.resolve()``, as processes a user starts.

An ordinary mistake is one line on stderr and exit status 2; ``--debug`` or
``PSFLOW_LOG_LEVEL=DEBUG`` shows the traceback. ``psflow --help`` loads no torch or ZeroMQ.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import psflow
import psflow.cli
from psflow.data import serialize_example, write_records

pytestmark = pytest.mark.unit

HEAVY = ("torch", "zmq", "pyspark", "tensorboard")

SCRIPT = """
import psflow

ctx, argv = psflow.resolve()
print(ctx.task, argv)
"""


def run(
    *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def psflow_cmd(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run("-m", "psflow.cli", *argv, env=env)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], prefix: str, text: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"{prefix}: error: "), proc.stderr
    assert text in proc.stderr


def assert_traceback(proc: subprocess.CompletedProcess[str], exception: str) -> None:
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr
    assert exception in proc.stderr.splitlines()[-1]


@pytest.fixture
def parts(tmp_path: Path) -> Path:
    """A Spark-style output directory: two TFRecord parts and a ``_SUCCESS`` marker."""
    out = tmp_path / "out"
    out.mkdir()
    for part in range(2):
        records = [serialize_example({"id": [part * 10 + i]}) for i in range(3 + part)]
        write_records(out / f"part-{part}.tfrecord", records)
    (out / "_SUCCESS").write_text("")
    return out


# -- psflow data inspect ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["glob", "directory"])
def test_data_inspect_reads_a_glob_and_a_directory(
    parts: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = str(parts / "part-*.tfrecord") if how == "glob" else str(parts)
    assert psflow.cli.main(["data", "inspect", target, "-n", "5"]) == 0
    out = capsys.readouterr().out
    assert f"file: {target} (2 files)" in out
    assert "records: 7 " in out
    assert "id  fixed   int64" in out
    assert "record 3:\n  id: [10]" in out


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("missing.tfrecord", "no file matches '"),
        ("nothing-*.tfrecord", "no file matches '"),
        ("empty", "no data file in directory"),
    ],
)
def test_data_inspect_mistakes_are_one_line(
    tmp_path: Path, target: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty").mkdir()
    path = str(tmp_path / target)
    proc = psflow_cmd("data", "inspect", path)
    assert_one_line_error(proc, "psflow data inspect", message)
    assert f"{path}'" in proc.stderr
    # Each way of asking for the traceback lets the error out of main (the process prints it:
    # test_debug_shows_the_traceback), here in this process.
    with pytest.raises(FileNotFoundError, match=message):
        psflow.cli.main(["data", "inspect", path, "--debug"])
    with pytest.raises(FileNotFoundError, match=message):
        psflow.cli.main(["--debug", "data", "inspect", path])
    with pytest.raises(FileNotFoundError, match=message):  # between the group and the action
        psflow.cli.main(["data", "--debug", "inspect", path])
    monkeypatch.setenv("PSFLOW_LOG_LEVEL", "DEBUG")
    with pytest.raises(FileNotFoundError, match=message):
        psflow.cli.main(["data", "inspect", path])


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    path = str(tmp_path / "missing.tfrecord")
    assert_traceback(psflow_cmd("data", "inspect", path, "--debug"), "FileNotFoundError")
    debug_env = {"PSFLOW_LOG_LEVEL": "DEBUG"}
    assert_traceback(psflow_cmd("data", "inspect", path, env=debug_env), "FileNotFoundError")


def test_other_commands_mistakes_are_one_line(tmp_path: Path) -> None:
    assert_one_line_error(
        psflow_cmd("launch", str(tmp_path / "trian.py")),
        "psflow launch",
        "trian.py: no such training script",
    )
    assert_one_line_error(
        psflow_cmd("launch", str(tmp_path)), "psflow launch", "a directory, not a training script"
    )
    assert_one_line_error(
        psflow_cmd("checkpoint", "inspect", str(tmp_path)),
        "psflow checkpoint inspect",
        "no complete checkpoint",
    )
    assert_one_line_error(
        psflow_cmd("data", "convert", str(tmp_path / "t.csv"), str(tmp_path / "t.tfrecord")),
        "psflow data convert",
        "t.csv: No such file or directory",
    )
    assert_one_line_error(
        psflow_cmd("checkpoint", "inspect", "x", env={"PSFLOW_LOG_LEVEL": "loud"}),
        "psflow",
        "PSFLOW_LOG_LEVEL='LOUD' is not DEBUG, INFO, WARNING or ERROR",
    )


# -- a training script's psflow.resolve() ----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "tf_config", "message"),
    [
        (["--job_name", "wroker"], None, "unknown job 'wroker' (did you mean 'worker'?)"),
        (["--task_index", "5"], None, "task index 5 out of range: job 'worker' has 2 task(s)"),
        (
            [],
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}',
            "TF_CONFIG: task index 1 out of range",
        ),
        ([], '{"cluster": {"worker": ["a:1"]}', "TF_CONFIG is not valid JSON"),
    ],
)
def test_a_scripts_resolve_mistake_is_one_line(
    tmp_path: Path, argv: list[str], tf_config: str | None, message: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    if tf_config is None:
        argv = ["--ps_hosts", "a:1", "--worker_hosts", "b:1,c:1", "--job_name", "worker", *argv]
    env = {"TF_CONFIG": tf_config} if tf_config else {}
    assert_one_line_error(run(str(script), *argv, env=env), "train.py", message)
    debug = run(str(script), *argv, env={**env, "PSFLOW_LOG_LEVEL": "DEBUG"})
    assert_traceback(debug, "ValueError")
    assert message in debug.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (  # the flags' cluster has no ps: the misspelt flag is named
            ["--ps_host", "a:1", "--worker_hosts", "b:1", "--job_name", "ps"],
            "names job 'ps', which this cluster does not have (did you mean --ps_hosts, not "
            "--ps_host?)",
        ),
        (["--job_name", "worker"], "no cluster given"),  # a task named: never a cluster of one
        (["--worker_host=b:1", "--job_name", "worker"], "did you mean --worker_hosts"),
    ],
)
def test_a_misspelt_cluster_flag_is_named_and_never_runs_alone(
    argv: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        psflow.resolve_or_alone(argv, {})
    ctx, rest = psflow.resolve_or_alone(["--lr", "0.1", "--job", "x"], {})  # the script's own
    assert ctx.is_alone and rest == ["--lr", "0.1", "--job", "x"]


def test_launch_flags_say_which_value_is_wrong() -> None:
    for argv, message in (  # argparse's: its usage, then the one line
        (["--grace", "-5", "t.py"], "argument --grace: must be > 0 seconds, got -5"),
        (["--mode", "synch", "t.py"], "argument --mode: invalid choice: 'synch' (choose from "
                                      "'async', 'sync', 'allreduce')"),
        ([], "the following arguments are required: script"),  # the script's own: optional
    ):  # fmt: skip
        proc = psflow_cmd("launch", *argv)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == f"psflow launch: error: {message}"


def test_a_script_gets_its_own_flags(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    flags = ["--cluster", "{}", "--job", "ps", "--ps", "1", "--worker=2", "--task", "3"]
    proc = run(str(script), "--ps_hosts=a:1", "--worker_hosts", "b:1", "--job_name=ps", *flags)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ps:0 {flags}"


# -- a fast command line ---------------------------------------------------------------------


def test_building_the_parser_imports_nothing_heavy() -> None:
    code = (
        "import sys, psflow.cli\n"
        "psflow.cli.build_parser()\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    proc = run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "argv", [["--help"], ["data", "inspect", "--help"], ["render", "--help"], ["--version"]]
)
def test_help_and_version_import_nothing_heavy(argv: list[str]) -> None:
    proc = run("-X", "importtime", "-m", "psflow.cli", *argv)
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "psflow.cluster.launcher" in imported  # the parser was built
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_version() -> None:
    proc = psflow_cmd("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"psflow {psflow.__version__}\n"


def test_psflow_names_load_on_first_use() -> None:
    code = (
        "import sys, psflow\n"
        "before = 'torch' in sys.modules\n"
        "ctx = psflow.TaskSpec(job='ps')\n"
        "middle = 'torch' in sys.modules\n"
        "from psflow import DistributedOptimizer\n"
        "print(before, middle, 'torch' in sys.modules, psflow.data.TFRecordReader.__name__)\n"
    )
    proc = run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "True", "TFRecordReader"]
    assert sorted(psflow.__all__) == sorted([*psflow._EXPORTS, "__version__"])
    for name in psflow.__all__:
        assert getattr(psflow, name) is not None


def test_a_scripts_flags_that_abbreviate_psflows_reach_the_script() -> None:
    """``--p`` after the script was refused as an ambiguous abbreviation of --ps, --preload,
    ... (argparse looks at every argument before the script's remainder takes them)."""
    parser = psflow.cli.build_parser()
    args = parser.parse_args(["launch", "--ps", "1", "train.py", "--p", "1", "--n", "2"])
    assert (args.script, args.args, args.ps) == ("train.py", ["--p", "1", "--n", "2"], 1)
    args = parser.parse_args(["render", "compose", "--name", "a", "--image", "i", "t.py", "--p"])
    assert args.script_argv == ["t.py", "--p"]
