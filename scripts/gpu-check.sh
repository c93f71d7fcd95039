#!/usr/bin/env bash
# The checks that need a GPU, as one command for a machine with one (the device tool's `run`,
# ../.library/device): the CUDA tests (towers, stages, pinned copies, workers on CUDA against 2
# ps), then examples/ctr.py with its 2 workers on the CPU, on CUDA, and on CUDA with plain copies
# (PSFLOW_PINNED=0), side by side on that machine, with the example's model and with DeepRec's
# DLRM shape (issue 35 item 6: CUDA workers at least 2x the CPU ones); then where a CUDA worker's time goes (benchmarks/job_profile.py, py-spy of worker:0
# in a 2 x 2 job of DeepRec's DLRM shape; GPU_PROFILE= skips it).
#
# There, python3 has a CUDA build of torch and most of psflow's dependencies, but not pyzmq or
# google-crc32c (nor, perhaps, cryptography 47 or later, which the sealed socket needs), and
# nothing can be fetched: they travel as wheels in .whl, fetched here once
# (git ignores .whl through .git/info/exclude):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d .whl pyzmq==27.3.0 \
#       google-crc32c==1.9.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
#
# and py-spy (add py-spy==0.4.3 with --platform manylinux1_x86_64), and the device run carries
# it: command `bash scripts/gpu-check.sh`, carry [".whl"]. About 7 minutes on an H100 with the
# defaults; CTR_STEPS and CTR_EXAMPLES make it shorter or longer (CTR_WARMUP: the steps each
# worker's printed rate leaves out, 100).
# Logs go to $OUT (the device tool brings them back), else /tmp/gpu-check. PYTHON names another
# interpreter (here: PYTHON=.venv/bin/python runs all but the CUDA parts, which fail or skip).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
steps="${CTR_STEPS:-600}"
# The rate leaves out each worker's first steps: a GPU's load its kernels and libraries.
warmup="${CTR_WARMUP:-100}"
examples="${CTR_EXAMPLES:-1000000}"

py="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi -L
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
# The C kernels for this Python (optional: without them the same updates run on torch's ops).
if ! "$py" setup.py -q build_ext --inplace >"$out/build.log" 2>&1; then
    # The tests that need the kernels would fail for it (tests/kernels.py): they skip instead.
    echo "C kernels not built: PSFLOW_KERNELS=0 (torch's ops); build.log's end:"
    tail -5 "$out/build.log"
    export PSFLOW_KERNELS=0
fi

echo "== CUDA tests =="
"$py" -m pytest -q -p no:cacheprovider -rs tests/unit/test_towers.py tests/unit/test_stages.py \
    tests/unit/test_staging.py tests/multiproc/test_gpu_worker.py \
    "tests/multiproc/test_tables.py::test_one_worker_matches_one_process_adagrad" \
    2>&1 | tee "$out/tests.log" | tail -15

"$py" -m psflow.cli data synth-ctr /tmp/ctr --examples "$examples" --shards 4 >/dev/null
# The example's own model (the issue's filing: CUDA 1.18x the CPU), then DeepRec's DLRM shape.
dlrm="--dim 16 --bottom 512,256,64 --top 512,256 --batch_size 512 --no-wide --min_count 0"
n=0
for shape in example dlrm; do
    echo "== examples/ctr.py, $shape: 2 ps, 2 workers, ${steps} steps =="
    model=()
    [ "$shape" = dlrm ] && read -ra model <<<"$dlrm"
    for run in cpu cuda cuda-plain cuda; do  # CUDA twice, around its plain copies: the noise
        pinned=1
        [ "$run" = cuda-plain ] && pinned=0
        n=$((n + 1))
        log="$out/ctr-$n-$shape-$run.log"
        gpus=()  # CUDA: the GPU dealt by the launcher (nvidia-smi's), the ps seeing none
        [ "$run" != cpu ] && gpus=(--gpus-per-task 0.5)
        PSFLOW_PINNED=$pinned "$py" -m psflow.cli launch --ps 2 --workers 2 "${gpus[@]}" \
            examples/ctr.py --data /tmp/ctr --train_steps "$steps" --device "${run%-plain}" \
            --prefetch --warmup_steps "$warmup" "${model[@]}" >"$log" 2>&1
        echo "$run (exit $?):"
        grep -E "samples/s|RESULT|GPUs|error" "$log" | tail -8
    done
done

[ -z "${GPU_PROFILE-1}" ] && exit 0
echo "== job_profile: 2 x 2, DLRM shape, CUDA workers =="
"$py" benchmarks/job_profile.py --ps 2 --workers 2 --data /tmp/ctr --warmup 12 --window 8 \
    --pyspy worker:0,ps:0 --extra="--device cuda" --out "$out" 2>&1 | tee "$out/profile.log"
