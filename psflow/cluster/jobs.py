"""The job files of ``psflow launch``: how ``psflow top`` finds a job running on this machine.

The launcher writes ``<pid>.json`` (the job's tasks, their addresses and where each serves its
metrics) into :func:`jobs_dir` when the job starts and removes it when the launcher exits; a
file whose launcher is gone (killed outright) is ignored and removed by the next reader.
The directory is the user's own (``$XDG_RUNTIME_DIR/psflow/jobs``, else
``/tmp/psflow-<uid>/jobs``), mode 0700: no other user reads or plants a job there.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from psflow import env as envvars
from psflow.cluster.shmfiles import pid_alive


@dataclass(kw_only=True)
class JobFile:
    """One running ``psflow launch`` job."""

    pid: int
    """The launcher's process id."""
    script: str
    """The training script its tasks run."""
    started: float = field(default_factory=time.time)
    """Unix time the job started."""
    cluster: dict[str, list[str]] = field(default_factory=dict)
    """The cluster spec: job name to task addresses."""
    metrics: dict[str, str] = field(default_factory=dict)
    """Task (``ps:0``) to the ``host:port`` where it serves its metrics."""

    @classmethod
    def from_json(cls, data: Any, source: str) -> JobFile:
        """Raises ``ValueError`` naming ``source`` when ``data`` is not a job file's."""
        try:
            job = cls(
                pid=int(data["pid"]),
                script=str(data["script"]),
                started=float(data["started"]),
                cluster={str(k): [str(a) for a in v] for k, v in data["cluster"].items()},
                metrics={str(k): str(v) for k, v in data["metrics"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source} is not a psflow job file: {e!r}") from None
        return job


def jobs_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The user's job directory (not created); ``environ``: where ``XDG_RUNTIME_DIR`` is read
    (default this process's environment)."""
    runtime = envvars.text(envvars.XDG_RUNTIME_DIR, environ=environ)
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "psflow" / "jobs"
    return Path(tempfile.gettempdir()) / f"psflow-{os.getuid()}" / "jobs"


def _own_dir(path: Path) -> Path:
    """Creates ``path`` (mode 0700) and checks that it, and its parent, are this user's own."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for p in (path.parent, path):
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(f"{p} is not a directory of this user: refusing to use it")
        if st.st_mode & 0o077:
            os.chmod(p, 0o700)
    return path


def write_job(job: JobFile, directory: Path | None = None) -> Path:
    """Writes ``job``'s file (atomically); returns its path, for :func:`remove_job`."""
    d = _own_dir(directory or jobs_dir())
    path = d / f"{job.pid}.json"
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".job-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(job), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def remove_job(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def running_jobs(directory: Path | None = None) -> list[JobFile]:
    """The jobs whose launcher still runs, the most recent first (stale files are removed)."""
    d = directory or jobs_dir()
    if not d.is_dir():
        return []
    jobs = []
    for path in d.glob("*.json"):
        try:
            job = JobFile.from_json(json.loads(path.read_text()), str(path))
        except (OSError, ValueError):
            continue  # half written by someone else, or not ours: not a job we can show
        if pid_alive(job.pid):
            jobs.append(job)
        else:
            remove_job(path)
    return sorted(jobs, key=lambda j: j.started, reverse=True)
