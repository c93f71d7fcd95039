"""TFRecord data and checkpoints on ``s3://``, against a real S3-compatible server.

moto's standalone server (``moto_server``, from PyPI) runs as its own process on 127.0.0.1 for
the module; psflow reaches it through s3fs (``psflow[s3]``) with nothing but the standard AWS
variables (``AWS_ENDPOINT_URL`` among them) in the environment, as a job on a cluster would
reach its bucket. Records written by psflow are read back by psflow and by ``psflow data
inspect``; a ps SIGKILLed while it writes a checkpoint's shard (``tests/faults.py
--slow-save``) leaves the previous checkpoint whole, and it restores.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from psflow.cluster.ports import free_ports
from psflow.data import TFRecordWriter, expand_paths, read_records, serialize_example
from psflow.train import CheckpointDir, TrainingSession, load_checkpoint
from psflow.transport import TransportConfig

from .support import local_cluster, start_ps, stop, worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

MOTO = str(Path(sys.executable).with_name("moto_server"))


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """A bucket on a moto server of this module; yields its ``s3://`` URL."""
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [MOTO, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)  # this process and every task it starts
        try:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "moto_server did not start"
                    time.sleep(0.05)
            import fsspec

            fs = fsspec.filesystem("s3", skip_instance_cache=True)
            fs.mkdir("psflow-test")
            yield "s3://psflow-test"
        finally:
            proc.terminate()
            stop(proc)  # type: ignore[arg-type]


def test_tfrecords_on_s3(s3: str) -> None:
    records = [serialize_example({"label": i % 2, "x": [i / 10, 1.0]}) for i in range(100)]
    for shard in range(2):
        with TFRecordWriter(f"{s3}/data/train-{shard}.tfrecord.gz", compression="GZIP") as w:
            w.write_all(records[shard::2])
    files = expand_paths(f"{s3}/data/train-*.tfrecord.gz")
    assert files == [f"{s3}/data/train-0.tfrecord.gz", f"{s3}/data/train-1.tfrecord.gz"]
    got = [r for f in files for r in read_records(f)]
    assert sorted(got) == sorted(records)
    out = subprocess.run(
        [sys.executable, "-m", "psflow.cli", "data", "inspect", f"{s3}/data/train-*.tfrecord.gz"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(2 files)" in out.stdout and "records: 100 " in out.stdout, out.stdout
    assert "label  fixed   int64" in out.stdout, out.stdout


def _train(sess: TrainingSession, model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        sess.zero_grad()
        model(torch.ones(1, 16)).pow(2).sum().backward()
        sess.step()


def _session(model: torch.nn.Module, cluster: object, url: str) -> TrainingSession:
    return TrainingSession(
        model,
        worker_ctx(cluster),  # type: ignore[arg-type]
        optimizer="Adam",
        lr=0.01,
        checkpoint_dir=url,
        save_checkpoint_secs=3600,
        log_step_count_steps=None,
        transport=TransportConfig(timeout=10),
        end_timeout=1,
    )


def test_a_checkpoint_save_killed_midway_on_s3_leaves_the_previous_whole(s3: str) -> None:
    import fsspec

    url = f"{s3}/ckpt"
    fs = fsspec.filesystem("s3")
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    try:
        torch.manual_seed(1)
        model = torch.nn.Linear(16, 16)
        sess = _session(model, cluster, url)
        _train(sess, model, 4)
        assert sess.save() == f"{url}/ckpt-4"
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        sess.close()
        code, err = stop(ps)
        assert code == 0, err
    finally:
        stop(ps, timeout=1)
    # A new job resumes from it; its ps is killed while it writes the next checkpoint's shard.
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster, faults=["--slow-save", "30"])  # the kill lands in this window
    try:
        model = torch.nn.Linear(16, 16)
        sess = _session(model, cluster, url)
        assert sess.restored_from == "ckpt-4"
        _train(sess, model, 2)
        assert sess.checkpointer is not None
        sess.checkpointer.save(sess.global_step, wait=False)
        tmp = _wait_for_tmp(fs, url, "ckpt-6")
        ps.kill()
        stop(ps)
        with pytest.raises(RuntimeError, match="saving a checkpoint failed: ps:0"):
            sess.checkpointer.wait()
        sess.close(RuntimeError("ps died"))
    finally:
        stop(ps, timeout=1)
    fs.invalidate_cache()
    assert not fs.exists(tmp.split(".tmp-")[0])  # the shard never took its name
    d = CheckpointDir(url)
    assert d.latest() == "ckpt-4"
    ckpt = load_checkpoint(url)
    assert ckpt is not None and ckpt.name == "ckpt-4" and ckpt.manifest.global_step == 4
    for name, value in saved.items():
        assert torch.equal(ckpt.params[name], value), name


def _wait_for_tmp(fs: object, url: str, name: str) -> str:
    """The path of the shard file the ps is writing under its temporary name, once it is
    there (the ps then waits --slow-save seconds before its rename)."""
    deadline = time.monotonic() + 30
    prefix = url.removeprefix("s3://") + "/" + name
    while time.monotonic() < deadline:
        fs.invalidate_cache()  # type: ignore[attr-defined]
        found = [p for p in fs.find(prefix) if ".tmp-" in p]  # type: ignore[attr-defined]
        if found:
            return str(found[0])
        time.sleep(0.05)
    raise AssertionError(f"no temporary shard file under {prefix} within 30 s")
