"""``psflow render``'s arguments (what it does is in ``psflow/deploy/cli.py``, imported when it runs)."""

from __future__ import annotations

import argparse

from psflow.cli.common import command, runs
from psflow.deploy.layout import TARGETS


def add_render(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
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
    p.set_defaults(func=runs("psflow.deploy.cli", "render"))
