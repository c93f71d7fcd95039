"""GPUs for a local job's trainers: ``psflow launch --gpus-per-task``.

:func:`host_gpus` lists the GPUs this host lets a job use and :func:`gpu_sets` deals them out to
the chief and the workers, as Ray deals its GPUs to actors and Kubernetes' device plugin to pods:
each trainer sees only its own, through ``CUDA_VISIBLE_DEVICES`` (its ``cuda:0`` is the first of
them), and the ps and evaluator tasks see none. Without the flag no task's
``CUDA_VISIBLE_DEVICES`` is touched: every task sees every GPU, and a script's ``cuda`` is the
first one for all of them.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from psflow import env as envvars
from psflow.cluster.spec import TaskSpec


def check_per_task(per_task: float) -> None:
    """Raises ``ValueError`` unless ``per_task`` is ``0`` (no GPUs dealt), a whole number of
    GPUs, or a share of one below 1 (``0.5``: two trainers a GPU; Ray's rule too)."""
    if (
        not math.isfinite(per_task)
        or per_task < 0
        or (per_task > 1 and not float(per_task).is_integer())
    ):
        raise ValueError(
            f"--gpus-per-task takes a whole number of GPUs, or a share of one below 1 "
            f"(0.5: two trainers a GPU), got {per_task:g}"
        )


def host_gpus(environ: Mapping[str, str]) -> tuple[list[str], str]:
    """The GPUs this host lets a job use, and where that was read: the entries of
    ``CUDA_VISIBLE_DEVICES`` where it is set (indices, or UUIDs such as a MIG device's, kept
    as given), else one index a GPU that ``nvidia-smi -L`` on this process's ``PATH`` lists
    (none without it)."""
    given = envvars.entries(envvars.CUDA_VISIBLE_DEVICES, environ=environ)
    if given is not None:
        return given, f"CUDA_VISIBLE_DEVICES={','.join(given)}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no nvidia-smi on PATH"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi -L failed: {e}"
    if out.returncode != 0:
        return [], f"nvidia-smi -L exited with {out.returncode}"
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(count)], "nvidia-smi -L"


def gpu_sets(
    trainers: Sequence[TaskSpec], gpus: Sequence[str], per_task: float, where: str = ""
) -> dict[TaskSpec, list[str]]:
    """The GPUs each of ``trainers`` sees, dealt in their order (``ClusterSpec.trainers``: the
    chief, then the workers; as on Ray, and as ``psflow render --gpus`` gives them): ``per_task``
    of its own, or with a share below 1 one GPU for every ``1 / per_task`` of them, in turn.
    Empty for ``per_task == 0``.

    Example:
        >>> workers = [TaskSpec(job="worker", index=i) for i in range(3)]
        >>> {str(t): g for t, g in gpu_sets(workers, ["0", "1"], 0.5).items()}
        {'worker:0': ['0'], 'worker:1': ['0'], 'worker:2': ['1']}

    Raises:
        ValueError: for a ``per_task`` :func:`check_per_task` refuses, or when the host has too
            few GPUs (naming how many it has, and ``where`` that was read).
    """
    check_per_task(per_task)
    if not per_task:
        return {}
    if per_task >= 1:
        k = int(per_task)
        need = len(trainers) * k
        deal = [list(gpus[i * k : (i + 1) * k]) for i in range(len(trainers))]
    else:
        share = int(1 / per_task + 1e-9)  # trainers a GPU
        need = -(-len(trainers) // share)
        deal = [[gpus[i // share]] if i // share < len(gpus) else [] for i in range(len(trainers))]
    if need > len(gpus):
        raise ValueError(
            f"--gpus-per-task {per_task:g} for {len(trainers)} trainer(s) needs {need} GPU(s); "
            f"this host has {len(gpus)}{f' ({where})' if where else ''}"
        )
    return dict(zip(trainers, deal, strict=True))
