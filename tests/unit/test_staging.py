"""Staging: a worker's copies between the host and its GPU, through pinned memory."""

from __future__ import annotations

import pytest
import torch

from psflow.worker.config import OptimizerConfig
from psflow.worker.staging import Staging

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU = torch.device("cpu")


@pytest.mark.parametrize("pinned", [True, False])
def test_on_the_cpu_nothing_is_copied(pinned: bool) -> None:
    staging = Staging(pinned=pinned)
    t = torch.arange(6.0).reshape(2, 3)
    assert staging.to_device(t, CPU) is t
    assert staging.to_host(t) is t
    dst = torch.zeros(2, 3)
    staging.copy_into(dst, t)
    assert torch.equal(dst, t)
    staging.wait()  # nothing under way: returns at once
    assert not staging.crosses(CPU)


def test_pinned_needs_cuda() -> None:
    assert Staging(pinned=True).pinned == torch.cuda.is_available()
    assert not Staging(pinned=False).pinned


def test_the_setting_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PSFLOW_PINNED", raising=False)
    assert OptimizerConfig().pinned is True
    monkeypatch.setenv("PSFLOW_PINNED", "0")
    assert OptimizerConfig().pinned is False
    assert OptimizerConfig.of(pinned=True).pinned is True  # a keyword beats the environment
    with pytest.raises(TypeError, match="pinned must be a bool"):
        OptimizerConfig(pinned="yes")  # type: ignore[arg-type]


@CUDA
@pytest.mark.parametrize("pinned", [True, False])
def test_copies_to_and_from_a_gpu_keep_every_value(pinned: bool) -> None:
    staging = Staging(pinned=pinned)
    gpu = torch.device("cuda", 0)
    assert staging.crosses(gpu) is pinned
    g = torch.Generator().manual_seed(0)
    host = torch.randn(1000, 16, generator=g)
    want = host.clone()
    on = staging.to_device(host, gpu)
    host.fill_(7.0)  # the device reads a copy: the host's memory may change at once
    assert on.device == gpu
    torch.testing.assert_close(on.cpu(), want, rtol=0, atol=0)
    dst = torch.zeros(1000, 16, device=gpu)
    staging.copy_into(dst, want)
    torch.testing.assert_close(dst.cpu(), want, rtol=0, atol=0)
    grads = [torch.randn(n, 16, device=gpu) * 3 for n in (1, 500, 4096)]
    back = [staging.to_host(x) for x in grads]
    staging.wait()
    for b, x in zip(back, grads, strict=True):
        assert b.device.type == "cpu" and b.is_pinned() is pinned
        torch.testing.assert_close(b, x.cpu(), rtol=0, atol=0)


@CUDA
def test_a_copy_to_the_host_is_there_after_the_wait_behind_the_kernels_before_it() -> None:
    """The gradient of a long backward: the copy is queued behind the kernels that make it,
    and the wait returns only when it holds their result."""
    staging = Staging(pinned=True)
    x = torch.randn(2048, 2048, device="cuda")
    y = x
    for _ in range(20):
        y = torch.tanh(y @ x) * 0.01
    want = y.clone()
    back = staging.to_host(y)
    staging.wait()
    torch.testing.assert_close(back, want.cpu(), rtol=0, atol=0)
