"""A worker that attaches a shared-memory lane when the test says so, to be killed mid-attach.

    psflow launch --ps 1 --workers 1 lane_attach.py OUT_DIR

Every task writes its pid to ``OUT_DIR/<task>.pid``. The worker waits for the ps to answer
(over the socket), prints ``ready``, waits for ``OUT_DIR/go`` to exist, then makes one more
request: the first one that goes through a lane, so it makes the lane's files and asks the ps
to attach them.
"""

import os
import sys
import time

import psflow
from psflow.transport import TransportConfig
from psflow.worker import ShardedClient

out = sys.argv[1]
ctx, _ = psflow.resolve([])
with open(os.path.join(out, f"{ctx.task}.pid"), "w") as f:
    f.write(str(os.getpid()))
if ctx.job == "ps":
    psflow.ParameterServer(ctx).join()
else:
    client = ShardedClient(ctx, TransportConfig.from_env())
    client.wait_ready(60, initialized=False)
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "go")):
        if time.monotonic() > deadline:
            sys.exit("no go within 60 s")
        time.sleep(0.01)
    client.status()
    print("attached", flush=True)
