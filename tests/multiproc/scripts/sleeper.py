"""A task that records its pid, prints its OMP_WAIT_POLICY and OMP_NUM_THREADS, then sleeps; worker:1 exits with code 3 when FAIL_WORKER1 is set."""

import json
import os
import sys
import time

out = sys.argv[1]
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
with open(os.path.join(out, f"{name}.pid"), "w") as f:
    f.write(str(os.getpid()))
omp = f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
print(f"started {name} {omp} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
if name == "worker:1" and os.environ.get("FAIL_WORKER1"):
    time.sleep(0.5)
    sys.exit(3)
time.sleep(60)
