"""A task that records its pid, says it started, and sleeps; with IGNORE_SIGTERM=1 it ignores
SIGTERM (as a task stuck in a long save would not stop in time).

    psflow launch --ps 1 --workers 2 stubborn.py OUT_DIR
"""

import json
import os
import signal
import sys
import time

out = sys.argv[1]
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
if os.environ.get("IGNORE_SIGTERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(out, f"{name}.pid"), "w") as f:
    f.write(str(os.getpid()))
print(f"started {name}", flush=True)
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    time.sleep(1)
