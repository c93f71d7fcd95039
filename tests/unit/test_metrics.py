"""psflow.metrics: the names follow Prometheus' conventions, each task has its own registry,
metrics are off without PSFLOW_METRICS_PORT, and what a task serves over HTTP reads back.

Also the pieces of ``psflow top`` that need no job: the job files and the rates of a view.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from psflow import metrics
from psflow.cluster import jobs
from psflow.cluster.watch import JobView, progress_line, summary_text, top_table

pytestmark = pytest.mark.unit

_NAME_RE = re.compile(r"^psflow_[a-z]+(_[a-z]+)*$")


def test_every_metric_is_named_by_prometheus_conventions() -> None:
    for name, (kind, doc, labels, _) in metrics._DEFINITIONS.items():
        assert _NAME_RE.match(name), name
        assert doc and doc[0].isupper(), name
        assert set(labels) <= {"shard", "op", "table", "job"}, name
        assert kind in (metrics._COUNTER, metrics._GAUGE, metrics._HISTOGRAM), name
        if kind == metrics._COUNTER:
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
        if kind == metrics._HISTOGRAM:
            assert name.endswith(("_seconds", "_steps")), name
    # The names read back (psflow top, the tests) are the ones defined.
    spelled = {v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str)}
    assert set(metrics._DEFINITIONS) <= spelled


def test_each_task_has_its_own_registry_with_bound_children() -> None:
    a = metrics.TaskMetrics("worker:0", enabled=True)
    b = metrics.TaskMetrics("worker:1", enabled=True)
    wa, wb = a.worker(2), b.worker(2)
    wa.steps.inc(3)
    wa.sent[1].inc(100)
    wb.steps.inc()
    pa = metrics.parse(generate_latest(a.registry).decode())
    pb = metrics.parse(generate_latest(b.registry).decode())
    assert pa.total(metrics.STEPS) == 3 and pb.total(metrics.STEPS) == 1
    assert pa.by(metrics.SENT_BYTES, "shard") == {"0": 0.0, "1": 100.0}
    assert pa.values[metrics.STEPS][0][0] == {"task": "worker:0"}
    assert pa.total(metrics.INFO, job="worker") == 1
    assert (pa.total(metrics.MEMORY) or 0) > 0  # the process collector
    assert a.worker(2) is wa  # bound once


def test_ps_gauges_are_read_when_scraped() -> None:
    m = metrics.TaskMetrics("ps:1", enabled=True)
    ps = m.ps(1)
    state = {"step": 5, "waiting": 2, "rows": 7}
    ps.watch(
        step=lambda: state["step"],
        nbytes=lambda: 4096,
        waiting=lambda: state["waiting"],
        tables=lambda: {"emb": {"rows": state["rows"], "evicted": 3}},
    )
    ps.requests("push").inc()
    ps.rows_pulled("emb").inc(10)
    state["step"] = 9
    got = metrics.parse(generate_latest(m.registry).decode())
    assert got.total(metrics.PS_STEP, shard="1") == 9
    assert got.total(metrics.PS_WAITING) == 2
    assert got.total(metrics.PS_BYTES) == 4096
    assert got.total(metrics.PS_ROWS, table="emb") == 7
    assert got.total(metrics.PS_EVICTED, table="emb") == 3
    assert got.total(metrics.PS_REQUESTS, op="push") == 1
    assert got.total(metrics.PS_ROWS_PULLED, table="emb") == 10


def test_off_means_no_op_children_and_an_empty_registry() -> None:
    m = metrics.TaskMetrics("worker:0", enabled=False)
    w = m.worker(1)
    w.steps.inc()
    w.request_seconds[0].observe(0.1)
    m.ps(0).watch(step=lambda: 1, nbytes=lambda: 1, waiting=lambda: 0, tables=dict)
    assert generate_latest(m.registry) == b""
    assert w.steps is w.request_seconds[0] is metrics._NOOP


def test_children_expose_what_prometheus_clients_own_would() -> None:
    """The lock-free children against prometheus-client's Counter, Gauge and Histogram fed
    the same numbers: the same samples, bucket by bucket (bounds included: "less or equal")."""
    ours = metrics.TaskMetrics("worker:0", enabled=True)
    theirs = CollectorRegistry()
    bounds = metrics._DEFINITIONS[metrics.REQUEST_SECONDS][3]["buckets"]
    ref_hist = Histogram(
        metrics.REQUEST_SECONDS, "h", ("task", "shard"), registry=theirs, buckets=bounds
    ).labels(task="worker:0", shard="1")
    ref_count = Counter(
        metrics.SENT_BYTES[: -len("_total")], "c", ("task", "shard"), registry=theirs
    )
    ref_gauge = Gauge(metrics.LOSS, "g", ("task",), registry=theirs).labels(task="worker:0")
    w = ours.worker(2)
    rng = random.Random(7)
    values = [rng.choice(bounds) for _ in range(50)] + [rng.uniform(0, 40) for _ in range(200)]
    for v in values:
        w.request_seconds[1].observe(v)
        ref_hist.observe(v)
        w.sent[1].inc(v)
        ref_count.labels(task="worker:0", shard="1").inc(v)
    w.loss.set(0.25)
    ref_gauge.set(0.25)
    got = metrics.parse(generate_latest(ours.registry).decode())
    want = metrics.parse(generate_latest(theirs).decode())
    for name in (
        metrics.REQUEST_SECONDS + "_bucket",
        metrics.REQUEST_SECONDS + "_count",
        metrics.REQUEST_SECONDS + "_sum",
        metrics.SENT_BYTES,
        metrics.LOSS,
    ):
        mine = sorted((sorted(labels.items()), v) for labels, v in got.values[name])
        ref = sorted((sorted(labels.items()), v) for labels, v in want.values[name])
        mine = [m for m in mine if ("shard", "0") not in m[0]]  # ours has shard 0 too
        assert [m[0] for m in mine] == [r[0] for r in ref], name
        assert [m[1] for m in mine] == pytest.approx([r[1] for r in ref]), name


def test_a_child_takes_exactly_its_labels() -> None:
    m = metrics.TaskMetrics("ps:0", enabled=True)
    assert m.child(metrics.PS_REQUESTS, shard="0", op="push") is m.child(
        metrics.PS_REQUESTS, op="push", shard="0"
    )
    with pytest.raises(ValueError, match="psflow_ps_requests_total takes the labels"):
        m.child(metrics.PS_REQUESTS, shard="0")


@pytest.mark.parametrize(
    ("value", "port"), [(None, None), ("", None), ("0", 0), ("9090", 9090), (" 80 ", 80)]
)
def test_metrics_port(value: str | None, port: int | None) -> None:
    environ = {} if value is None else {"PSFLOW_METRICS_PORT": value}
    assert metrics.metrics_port(environ) == port


@pytest.mark.parametrize("value", ["x", "-1", "65536", "90.5"])
def test_bad_metrics_port_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=f"PSFLOW_METRICS_PORT must be a port.*{re.escape(value)}"):
        metrics.metrics_port({"PSFLOW_METRICS_PORT": value})


def test_served_on_the_tasks_own_address_and_read_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_tasks", {})
    monkeypatch.setattr(metrics, "_served", {})
    monkeypatch.setenv("PSFLOW_METRICS_PORT", "0")
    monkeypatch.delenv("PSFLOW_METRICS_HOST", raising=False)
    m = metrics.for_task("worker:3", "127.0.0.1")
    assert metrics.for_task("worker:3", "127.0.0.1") is m
    m.worker(1).examples.inc(32)
    where = metrics.served_at("worker:3")
    assert where is not None and where.startswith("127.0.0.1:")
    got = metrics.scrape(where)
    assert got.total(metrics.EXAMPLES, task="worker:3") == 32
    # A second task in the same process records, unserved.
    other = metrics.for_task("ps:0", "127.0.0.1")
    assert other.enabled and metrics.served_at("ps:0") is None


def test_a_port_taken_leaves_the_task_training(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(metrics, "_tasks", {})
    monkeypatch.setattr(metrics, "_served", {})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("PSFLOW_METRICS_PORT", str(taken.getsockname()[1]))
        m = metrics.for_task("worker:0", "127.0.0.1")
    assert m.enabled and metrics.served_at("worker:0") is None
    assert "cannot serve metrics on 127.0.0.1" in caplog.text


def test_scrape_of_nothing_is_an_oserror() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        metrics.scrape(f"127.0.0.1:{port}", timeout=2)


# -- job files ---------------------------------------------------------------------------------


def test_job_files_round_trip_and_stale_ones_go(tmp_path: Path) -> None:
    d = tmp_path / "psflow" / "jobs"
    job = jobs.JobFile(
        pid=os.getpid(), script="t.py", cluster={"ps": ["h:1"]}, metrics={"ps:0": "h:2"}
    )
    path = jobs.write_job(job, d)
    assert path == d / f"{os.getpid()}.json"
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    assert jobs.running_jobs(d) == [job]
    dead = subprocess_pid_that_exited()
    (d / f"{dead}.json").write_text(json.dumps({**json.loads(path.read_text()), "pid": dead}))
    (d / "junk.json").write_text("{not json")
    assert jobs.running_jobs(d) == [job]
    assert not (d / f"{dead}.json").exists()  # its launcher is gone
    jobs.remove_job(path)
    assert jobs.running_jobs(d) == []


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


def test_jobs_dir_prefers_the_runtime_dir(tmp_path: Path) -> None:
    assert jobs.jobs_dir({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "psflow" / "jobs"
    assert jobs.jobs_dir({}).name == "jobs"
    assert f"psflow-{os.getuid()}" in str(jobs.jobs_dir({}))


def test_a_bad_job_file_names_itself() -> None:
    with pytest.raises(ValueError, match=r"x\.json is not a psflow job file"):
        jobs.JobFile.from_json({"pid": "nope"}, "x.json")


# -- the view ----------------------------------------------------------------------------------


class _Exposition(BaseHTTPRequestHandler):
    pages: dict[int, bytes] = {}

    def do_GET(self) -> None:
        body = self.pages[self.server.server_address[1]]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_view_rates_between_two_scrapes(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = metrics.TaskMetrics("worker:0", enabled=True)
    ps = metrics.TaskMetrics("ps:0", enabled=True)
    w = worker.worker(1)
    w.last_step.set(100)
    p = ps.ps(0)
    step = {"v": 10}
    p.watch(step=lambda: step["v"], nbytes=lambda: 8, waiting=lambda: 1, tables=dict)
    servers = {}
    for task in ("worker:0", "ps:0"):
        srv = HTTPServer(("127.0.0.1", 0), _Exposition)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers[task] = srv
    targets = {t: f"127.0.0.1:{s.server_address[1]}" for t, s in servers.items()}

    def publish() -> None:
        for task, m in (("worker:0", worker), ("ps:0", ps)):
            _Exposition.pages[servers[task].server_address[1]] = generate_latest(m.registry)

    clock = {"t": 1000.0}
    monkeypatch.setattr("psflow.cluster.watch.time.monotonic", lambda: clock["t"])
    view = JobView(targets)
    try:
        publish()
        view.poll()
        w.steps.inc(20)
        w.global_step.set(30)
        w.loss.set(0.25)
        w.sent[0].inc(2000)
        w.received[0].inc(2000)
        w.staleness.observe(1)
        w.staleness.observe(3)
        step["v"] = 30
        clock["t"] += 2.0
        publish()
        rows, summary = view.poll()
    finally:
        view.close()
        for s in servers.values():
            s.shutdown()
    by = {r.task: r for r in rows}
    assert by["worker:0"].step_rate == pytest.approx(10.0)
    assert by["worker:0"].bytes_rate == pytest.approx(2000.0)
    assert by["worker:0"].staleness == pytest.approx(2.0)
    assert by["ps:0"].bytes_rate == pytest.approx(2000.0)  # what the workers moved to shard 0
    assert by["ps:0"].waiting == 1
    assert summary.global_step == 30 and summary.last_step == 100
    assert summary.rate == pytest.approx(10.0)
    assert summary.eta == pytest.approx(7.0)
    assert summary.loss == 0.25 and (summary.up, summary.total) == (2, 2)
    assert (
        summary_text(summary) == "step 30/100 · 10.0 steps/s · loss 0.25 · ETA 0:07 · tasks up 2/2"
    )
    assert [r.task for r in rows] == ["worker:0", "ps:0"]
    progress_line(summary)
    top_table(rows, summary, "job")


def test_view_shows_a_task_that_does_not_answer() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    view = JobView({"worker:0": f"127.0.0.1:{port}"}, alive=lambda t: False, timeout=1)
    try:
        rows, summary = view.poll()
    finally:
        view.close()
    assert not rows[0].up and rows[0].error
    assert (summary.up, summary.total) == (0, 1)


# -- the launcher's choice ---------------------------------------------------------------------


def test_launch_shows_its_progress_line_only_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from psflow.cluster.launcher import LaunchConfig, Launcher

    script = tmp_path / "train.py"
    script.write_text("")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stdout, progress, shown in (
        (io.StringIO(), None, False),  # a pipe or a file: plain prefixed lines
        (Terminal(), None, True),
        (Terminal(), False, False),
        (io.StringIO(), True, True),
    ):
        monkeypatch.setattr("sys.stdout", stdout)
        launcher = Launcher(LaunchConfig(script=str(script), progress=progress))
        assert set(launcher.metrics_at) == {"ps:0", "worker:0", "worker:1"}
        launcher._start_progress()
        try:
            assert (launcher._live is not None) is shown
            if shown:
                print("[worker:0] a line")  # goes above the live line, as it is
        finally:
            launcher._stop_progress()
        assert launcher._live is None
        assert sys.stdout is stdout
        if shown:
            assert "[worker:0] a line" in stdout.getvalue()
    no_metrics = Launcher(LaunchConfig(script=str(script), metrics=False, progress=True))
    assert no_metrics.metrics_at == {}
    no_metrics._start_progress()
    assert no_metrics._live is None  # nothing to read the progress from


# -- psflow top's targets ----------------------------------------------------------------------


def _top_args(**kw: Any) -> Any:
    import argparse

    return argparse.Namespace(**{"pid": None, "cluster_file": None, "metrics_port": None, **kw})


def test_top_finds_the_one_launch_job_or_says_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from psflow.cluster.top import targets_of

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="no psflow launch job runs on this machine"):
        targets_of(_top_args())
    d = jobs.jobs_dir()
    mine = jobs.JobFile(pid=os.getpid(), script="a.py", metrics={"ps:0": "127.0.0.1:9"})
    jobs.write_job(mine, d)
    assert targets_of(_top_args()) == ({"ps:0": "127.0.0.1:9"}, f"a.py (pid {os.getpid()})")
    other = jobs.JobFile(pid=os.getppid(), script="b.py", metrics={"ps:0": "127.0.0.1:8"})
    jobs.write_job(other, d)
    with pytest.raises(ValueError, match=r"2 psflow launch jobs run here; pick one: --pid"):
        targets_of(_top_args())
    assert targets_of(_top_args(pid=os.getppid()))[0] == {"ps:0": "127.0.0.1:8"}
    with pytest.raises(ValueError, match="no psflow launch job of pid 1 "):
        targets_of(_top_args(pid=1))


def test_top_reads_a_cluster_file_with_one_metrics_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from psflow.cluster.top import targets_of

    monkeypatch.delenv("PSFLOW_METRICS_PORT", raising=False)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("cluster:\n  ps: ['ps0:2222']\n  worker: ['w0:2222', '[::1]:2222']\n")
    with pytest.raises(ValueError, match="give --metrics-port"):
        targets_of(_top_args(cluster_file=str(cluster)))
    targets, title = targets_of(_top_args(cluster_file=str(cluster), metrics_port=9090))
    assert targets == {"ps:0": "ps0:9090", "worker:0": "w0:9090", "worker:1": "[::1]:9090"}
    assert title == str(cluster)
