"""A job for the keys test: the worker trains one step, prints ``PROBE {json}`` (the ps's
address, its PSFLOW_KEYS_DIR) and finishes once the file ``GO`` (argv[1]) exists (60 s at most).

    psflow launch --workers 1 keys_probe.py GO
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import psflow

ctx, argv = psflow.resolve([])
if ctx.job == "ps":
    psflow.ParameterServer(ctx).join()
    sys.exit(0)
model = torch.nn.Linear(2, 1)
with psflow.DistributedOptimizer(model, ctx, lr=0.1) as opt:
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    probe = {"ps": ctx.cluster.addresses("ps")[0], "keys": os.environ.get("PSFLOW_KEYS_DIR")}
    print("PROBE " + json.dumps(probe), flush=True)
    go = Path(sys.argv[1])
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
