#!/usr/bin/env bash
# Issue 35's many-core measurement, as one command for a machine with more cores than this one
# (the device tool's `run`, ../.library/device): benchmarks/scaling.py at JOBS, then
# benchmarks/job_profile.py on the largest job (each task's cores, py-spy stacks of a ps and a
# worker). AGAINST gives scaling.py's --against (example arguments for an A/B run of each job,
# alternating: AGAINST=--no-fused); AGAINST_TREE gives another checkout (a worktree of the code
# before a change, carried with the tree: AGAINST_TREE=.ab/start) for that second run, its C
# kernels built here too; AGAINST_ENV gives that run's environment (K=V,...: AGAINST_ENV=
# PSFLOW_FLUSH_DENORMALS=0); NATIVE_AB=1 first measures a CTR shard's serving CPU with the
# native request path on and off (embedding.py --native_requests 1,0); PROFILE= skips the profile;
# ROW_THREADS=2,4 first measures a shard's rows on that many threads (benchmarks/row_threads.py,
# then the sparse workload with PSFLOW_PS_THREADS 1 and N, both paths each); SHARD_LOAD=12 first
# runs that many hollow CTR workers against 4 shards on one core of their own
# (benchmarks/shard_load.py, both paths: a shard's serving CPU a request where it is saturated,
# and a worker's CPU a step outside its model); SOCKET_PROFILE=1 profiles the job through the
# socket too (its stacks in $OUT/socket).
#
# It needs pyzmq, google-crc32c, cryptography (for the sealed socket: without it every byte
# through the socket stays inside CurveZMQ) and py-spy as wheels in .whl (see
# scripts/gpu-check.sh for the download; add py-spy==0.4.3 with --platform manylinux1_x86_64),
# carried: command
# `bash scripts/scale-check.sh`, carry [".whl"]. Logs and stacks go to $OUT, else
# /tmp/scale-check. About 6 minutes on 16 cores with the defaults.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/scale-check}"
mkdir -p "$out"
jobs="${JOBS:-1x1,2x4,4x8,4x12}"
profile="${PROFILE-4x12}"
py="${PYTHON:-python3}"
have='import zmq, google_crc32c; from psflow.transport import seal; assert seal.available()'
if compgen -G ".whl/*.whl" >/dev/null && ! PYTHONPATH="$PWD" "$py" -c "$have" 2>/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PATH="/tmp/site/bin:$PATH"
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
lscpu | grep -E "^Model name|^CPU\(s\)|^Thread|^NUMA node\(s\)" | tee "$out/machine.log"
"$py" -c "import torch; print('torch', torch.__version__, 'threads', torch.get_num_threads())"
"$py" setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || {
    echo "C kernels not built: every figure below is torch's ops'; build.log's end:"
    tail -5 "$out/build.log"
}
"$py" -m psflow.cli data synth-ctr /tmp/ctr --examples "${EXAMPLES:-500000}" \
    --test-examples 1000 >/dev/null || exit 1

if [ -n "${ROW_THREADS:-}" ]; then  # e.g. ROW_THREADS=2,4: a shard's rows on N threads
    for n in ${ROW_THREADS//,/ }; do
        echo "== row_threads: 1 against $n threads (kernels alone) =="
        "$py" benchmarks/row_threads.py --threads "$n" 2>&1 | tee "$out/row_threads-$n.log"
        # The sparse workload, PSFLOW_PS_THREADS 1 and n alternating, both paths (about 3
        # minutes on 16 cores; the full preset's 7 variants took over 4 a count).
        echo "== sparse shard, PSFLOW_PS_THREADS 1 against $n =="
        # Each run's line says the rows a shard's core serves and each op's microseconds.
        "$py" benchmarks/embedding.py --workload sparse --paths shm,socket \
            --ps_threads "1,$n" 2>&1 | tee "$out/sparse-t$n.log" | grep -v Warning
    done
fi

if [ -n "${SHARD_LOAD:-}" ]; then  # e.g. SHARD_LOAD=12: hollow workers against 4 shards on a core
    for path in "" --socket; do
        echo "== shard_load: 4 shards, $SHARD_LOAD hollow workers ${path:-(shared memory)} =="
        "$py" benchmarks/shard_load.py --data /tmp/ctr --workers "$SHARD_LOAD" $path 2>&1 |
            tee "$out/shard_load${path:+-socket}.log" | grep -v Warning
    done
fi

if [ -n "${NATIVE_AB:-}" ]; then  # NATIVE_AB=1: a CTR shard's serving, native against Python
    echo "== ctr shard: PSFLOW_NATIVE_REQUESTS 1 against 0 =="
    # Each run's line says a shard's serving CPU a step and the share of pushes served natively.
    "$py" benchmarks/embedding.py --workload ctr --preset example --data /tmp/ctr \
        --paths shm,socket --native_requests 1,0 2>&1 | tee "$out/ctr-native.log" |
        grep -v Warning
fi

echo "== scaling: $jobs =="
against=()
[ -n "${AGAINST:-}" ] && against=("--against=$AGAINST")
[ -n "${AGAINST_ENV:-}" ] && against+=("--against_env=$AGAINST_ENV")
if [ -n "${AGAINST_TREE:-}" ]; then
    (cd "$AGAINST_TREE" && "$py" setup.py -q build_ext --inplace >"$out/build-against.log" 2>&1) ||
        echo "C kernels of $AGAINST_TREE not built"
    against+=("--against_tree=$AGAINST_TREE")
fi
"$py" benchmarks/scaling.py --data /tmp/ctr --jobs "$jobs" "${against[@]}" 2>&1 |
    tee "$out/scaling.log"
[ -z "$profile" ] && exit 0

echo "== job_profile: $profile, shared memory =="
"$py" benchmarks/job_profile.py --ps "${profile%x*}" --workers "${profile#*x}" --data /tmp/ctr \
    --warmup "${WARMUP:-12}" --window "${WINDOW:-8}" --pyspy ps:0,worker:0 --out "$out" 2>&1 | tee "$out/profile.log"
if [ -n "${SOCKET_PROFILE:-}" ]; then  # SOCKET_PROFILE=1: the same through the socket
    echo "== job_profile: $profile, socket =="
    mkdir -p "$out/socket"
    "$py" benchmarks/job_profile.py --ps "${profile%x*}" --workers "${profile#*x}" --data /tmp/ctr \
        --warmup "${WARMUP:-12}" --window "${WINDOW:-8}" --pyspy ps:0,worker:0 --socket \
        --out "$out/socket" 2>&1 | tee "$out/profile-socket.log"
fi
