"""Where a local job's tasks serve their metrics: the ports ``psflow launch`` picks for them,
the job file ``psflow top`` reads while the job runs, and the progress line below the output."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from psflow import metrics
from psflow.cluster import jobs
from psflow.cluster.launch_start import TaskStarting
from psflow.cluster.ports import free_ports
from psflow.cluster.progress import ProgressLine


class JobMetrics(TaskStarting):
    """The tasks' metrics, the job file and the progress line, for
    :class:`~psflow.cluster.launcher.Launcher` (a mixin: the launcher holds the state below)."""

    _job_file: Path | None
    _live: ProgressLine | None

    def _metrics_ports(self) -> dict[str, str]:
        if not self.config.metrics:
            return {}
        tasks = [str(t) for t in self.cluster.tasks()]
        # An evaluator has no address of its own (it is outside the cluster).
        taken = {a.rsplit(":", 1)[1] for addrs in self.cluster.jobs.values() for a in addrs}
        # Chosen after the tasks' own ports were let go: one of those may come back.
        ports = [p for p in free_ports(2 * len(tasks), self.config.host) if str(p) not in taken]
        return {t: f"{self.config.host}:{p}" for t, p in zip(tasks, ports, strict=False)}

    def _announce_metrics(self) -> None:
        """Says where the tasks serve their metrics; writes the job file ``psflow top`` reads."""
        if not self.metrics_at:
            return
        where = ", ".join(f"{t} {a}" for t, a in self.metrics_at.items())
        self._say(f"metrics at http://<address>{metrics.PATH}: {where}")
        job = jobs.JobFile(
            pid=os.getpid(),
            script=self.config.script,
            cluster={j: list(a) for j, a in self.cluster.jobs.items()},
            metrics=self.metrics_at,
        )
        try:
            self._job_file = jobs.write_job(job)
        except OSError as e:
            self._say(f"cannot write the job file for psflow top: {e}")

    def _forget_job(self) -> None:
        if self._job_file is not None:
            jobs.remove_job(self._job_file)
            self._job_file = None

    def _start_progress(self) -> None:
        show = self.config.progress
        if show is None:
            show = sys.stdout.isatty()
        if not show or not self.metrics_at:
            return
        by_name = {str(t): t for t in self.cluster.tasks()}

        def alive(task: str) -> bool:
            proc = self.procs.get(by_name[task])
            return proc is not None and proc.poll() is None

        self._live = ProgressLine(self.metrics_at, alive)
        self._live.start()

    def _stop_progress(self) -> None:
        if self._live is None:
            return
        self._live.stop()
        self._live = None
