"""dense_optimizer: a ps's dense update, per form of the torch.optim class, on one thread.

    .venv/bin/python benchmarks/dense_optimizer.py [--preset smoke|full]

One shard's share of ``examples/ctr.py``'s MLPs in DeepRec's shape (bottom 13-512-256-64-16,
top 367-512-256, the output layer; every other tensor, as round-robin placement over 2 ps
gives them): microseconds a step of Adam, AdamW, Adagrad and SGD with momentum in torch's
per-tensor loop (its default on CPU), its ``foreach`` form and its ``fused`` form, and whether
each ends with the same bits as the loop; the forms' runs alternate in blocks. The ps takes ``foreach`` where it is the same bits
and faster (``psflow.ps.store.FOREACH_SAME_BITS``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

PRESETS = {"full": {"rounds": 15, "steps": 20}, "smoke": {"rounds": 2, "steps": 2}}
FORMS = {"per_tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "Adam": {"lr": 1e-3},
    "AdamW": {"lr": 1e-3, "weight_decay": 0.01},
    "Adagrad": {"lr": 0.05},
    "SGD": {"lr": 0.1, "momentum": 0.9},
}


def shard_params() -> list[torch.Tensor]:
    torch.manual_seed(0)
    layers = []
    for sizes in ([13, 512, 256, 64, 16], [16 + 351, 512, 256], [256, 1]):
        layers += [nn.Linear(a, b) for a, b in itertools.pairwise(sizes)]
    return [p.detach().requires_grad_(True) for p in nn.ModuleList(layers).parameters()][::2]


def compare(name: str, p: dict[str, int]) -> dict[str, Any]:
    """Each form's median microseconds a step over ``rounds`` blocks of ``steps``, the forms'
    blocks alternating (a noisy machine slows all of them alike), and whether each form ends
    with the per-tensor loop's bits."""
    gen = torch.Generator().manual_seed(1)
    shapes = [q.shape for q in shard_params()]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(8)]
    params = {form: shard_params() for form in FORMS}
    opts = {
        form: getattr(torch.optim, name)(params[form], **OPTIMIZERS[name], **extra)
        for form, extra in FORMS.items()
    }
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for r in range(p["rounds"] + 1):  # the first round warms up
        for form, opt in opts.items():
            start = time.perf_counter()
            for i in range(p["steps"]):
                for q, g in zip(params[form], grads[i % len(grads)], strict=True):
                    q.grad = g
                opt.step()
            if r:
                times[form].append((time.perf_counter() - start) / p["steps"])
    out: dict[str, Any] = {}
    for form in FORMS:
        same = all(
            torch.equal(a, b) for a, b in zip(params["per_tensor"], params[form], strict=True)
        )
        out[f"{name}_{form}_us"] = round(statistics.median(times[form]) * 1e6, 1)
        out[f"{name}_{form}_same_bits"] = same
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    args = parser.parse_args()
    p = PRESETS[args.preset]
    torch.set_num_threads(1)
    result: dict[str, Any] = {"benchmark": "dense_optimizer", "preset": args.preset}
    for name in OPTIMIZERS:
        figures = compare(name, p)
        result.update(figures)
        print(
            f"{name:8s} "
            + ", ".join(
                f"{form} {figures[f'{name}_{form}_us']:,.0f} us"
                + ("" if figures[f"{name}_{form}_same_bits"] else " (other bits)")
                for form in FORMS
            )
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import machine

    result["machine"] = machine()
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
