"""Real ps and worker processes on 127.0.0.1: convergence, partitioning, clean exit."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

import psflow
from psflow.transport import TransportConfig
from psflow.transport.shm import SHM_DIR
from psflow.worker.client import ShardedClient
from psflow.worker.optimizer import flushing

from .support import ROOT, in_area, lanes, launch_cmd, local_cluster, start_ps, stop, worker_ctx


def test_linear_regression_example_converges_and_every_task_exits() -> None:
    # Twice the example's learning rate (0.001) for half its 10,000 steps: the same lr x steps,
    # so the same end values (W's error shrinks as exp(-2/3 lr t)), in half the time.
    example = ROOT / "examples" / "linear_regression.py"
    proc = subprocess.run(
        launch_cmd(example, "--train_steps", "5000", "--lr", "0.002", preload=True),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"\[worker:0\] W=(\S+) b=(\S+)", last)
    assert m, last
    assert abs(float(m.group(1)) - 2.0) < 0.05 and abs(float(m.group(2)) - 0.3) < 0.05
    assert "job finished: 3 tasks exited 0" in proc.stderr
    assert "[ps:0]" in proc.stderr and "every worker has finished" in proc.stderr


class Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(9, 4))  # 144 bytes: partitioned below
        self.bias = torch.nn.Parameter(torch.zeros(4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx] + self.bias


def test_two_shards_with_a_partitioned_tensor() -> None:
    cluster = local_cluster(2, 1)
    ps = [start_ps(cluster, i) for i in range(2)]
    try:
        torch.manual_seed(0)
        model = Wide()
        initial = model.table.detach().clone()
        with psflow.DistributedOptimizer(
            model, worker_ctx(cluster), lr=0.05, partition_bytes=64
        ) as opt:
            parts = [p for p in opt.pieces if p.param == "table"]
            assert [p.rows for p in parts] == [(0, 5), (5, 9)]
            assert {p.shard for p in parts} == {0, 1}
            assert torch.equal(model.table, initial)  # pulled back whole, unchanged
            target = torch.arange(36.0).reshape(9, 4) / 10
            for step in range(200):
                idx = torch.arange(9)
                loss = ((model(idx) - target) ** 2).sum() / 2
                opt.zero_grad()
                loss.backward()
                assert opt.step() == step + 1
            assert loss.item() < 0.01
            # What each shard holds is exactly its rows of the model's tensor.
            probe = ShardedClient(worker_ctx(cluster), TransportConfig(timeout=10))
            try:
                held = {name: t for _, (_, ts) in probe.pull().items() for name, t in ts}
            finally:
                probe.close()
            assert sorted(held) == ["bias", "table/part_0", "table/part_1"]
            assert torch.equal(
                torch.cat([held["table/part_0"], held["table/part_1"]]), model.table.detach()
            )
        for p in ps:
            code, err = stop(p)
            assert code == 0, err
            assert "every worker has finished" in err
    finally:
        for p in ps:
            stop(p, timeout=1)


def test_async_workers_share_one_global_step() -> None:
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    try:
        m0, m1 = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        o0 = psflow.DistributedOptimizer(m0, worker_ctx(cluster, 0), lr=0.1)
        o1 = psflow.DistributedOptimizer(m1, worker_ctx(cluster, 1), lr=0.1)
        assert torch.equal(m0.weight, m1.weight)  # worker 1 starts from the chief's values
        steps = []
        for _ in range(10):
            for m, o in ((m0, o0), (m1, o1)):
                o.zero_grad()
                m(torch.ones(1, 2)).sum().backward()
                steps.append(o.step())
        assert steps == list(range(1, 21))
        o0.close()
        assert ps.poll() is None  # worker 1 still running: the ps keeps serving
        assert flushing()  # o1 still holds this thread's subnormal mode
        o1.close()
        assert not flushing()  # the last to close gives the thread its mode back
        code, err = stop(ps)
        assert code == 0, err
    finally:
        stop(ps, timeout=1)


def test_worker_gives_up_waiting_for_the_chief() -> None:
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    try:
        probe = ShardedClient(worker_ctx(cluster, 1), TransportConfig(timeout=30))
        try:
            probe.wait_ready(60, initialized=False)  # the ps is up; only the chief is missing
        finally:
            probe.close()
        with pytest.raises(TimeoutError, match=r"worker:0 \(the chief\) did not initialise ps:0"):
            psflow.DistributedOptimizer(
                torch.nn.Linear(1, 1), worker_ctx(cluster, 1), ready_timeout=1.0
            )
    finally:
        ps.kill()
        stop(ps)


def test_mismatched_model_is_refused_with_the_variable_named() -> None:
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    try:
        with (
            psflow.DistributedOptimizer(torch.nn.Linear(2, 1), worker_ctx(cluster, 0)),
            pytest.raises(ValueError, match="the model has"),
        ):
            psflow.DistributedOptimizer(torch.nn.Linear(3, 1), worker_ctx(cluster, 1))
    finally:
        ps.kill()
        stop(ps)


def _train_wide_linear(env: dict[str, str]) -> tuple[torch.Tensor, dict[str, object]]:
    """Five steps of a 512 KB layer against a real ps; the weights and the client's lanes."""
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster, env=env)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 512)
        x = torch.randn(8, 256)
        with psflow.DistributedOptimizer(model, worker_ctx(cluster), lr=0.1) as opt:
            for _ in range(5):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            held = lanes(opt)
            if held:  # the parameters live where the ps writes them: a pull copies nothing
                assert in_area(model.weight, held["ps:0"].reply)
                assert in_area(model.bias, held["ps:0"].reply)  # 2 KB: small ones too
        code, err = stop(ps)
        assert code == 0, err
        return model.weight.detach().clone(), held
    finally:
        stop(ps, timeout=1)


def test_large_tensors_go_through_shared_memory_with_the_socket_result() -> None:
    through_lane, lanes = _train_wide_linear({})
    assert list(lanes) == ["ps:0"]
    lane = lanes["ps:0"]
    assert lane.request_bytes >= 512 * 257 * 4 and lane.reply_bytes >= 512 * 257 * 4
    assert not (Path(SHM_DIR) / lane.name).exists()  # unlinked once the ps mapped it
    # A ps that refuses lanes: the worker falls back to the socket, same arithmetic.
    through_socket, lanes = _train_wide_linear({"PSFLOW_SHM": "0"})
    assert lanes == {}
    assert torch.equal(through_lane, through_socket)


def test_the_ps_lets_go_of_a_finished_workers_lane() -> None:
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    try:
        maps = Path(f"/proc/{ps.pid}/maps")
        models = [torch.nn.Linear(256, 512) for _ in range(2)]
        opts = [
            psflow.DistributedOptimizer(m, worker_ctx(cluster, i), lr=0.1)
            for i, m in enumerate(models)
        ]
        for model, opt in zip(models, opts, strict=True):
            model(torch.ones(1, 256)).sum().backward()
            opt.step()
        names = [lanes(opt)["ps:0"].name for opt in opts]
        assert all(name in maps.read_text() for name in names)
        opts[1].close()  # worker:1 finishes: the ps unmaps its lane
        deadline = time.monotonic() + 10
        while names[1] in maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert names[1] not in maps.read_text() and names[0] in maps.read_text()
        opts[0].close()
        code, err = stop(ps)
        assert code == 0, err
    finally:
        stop(ps, timeout=1)
