# The psflow image: every task of a job runs it; TF_CONFIG (or the classic flags) picks the role.
#
#   docker build -t psflow:0.1.0 .
#   docker run --rm psflow:0.1.0 psflow render compose --name demo --image psflow:0.1.0 train.py
#
# A job image adds its script on top:  FROM psflow:0.1.0 / COPY train.py .
# The manifests from `psflow render` set only the arguments (`python SCRIPT ARGS`), so this
# ENTRYPOINT stays in front of them everywhere.
FROM python:3.11-slim

# tini as PID 1 forwards SIGTERM to Python (which, as PID 1, would ignore it) and reaps zombies,
# so `kubectl delete` and `docker compose down` stop a task at once, not after the grace period.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# OMP_WAIT_POLICY, PSFLOW_LOG_LEVEL: as psflow.env.TASK_DEFAULTS (idle OpenMP threads leave the
# core to ZeroMQ; psflow's INFO lines show without the script configuring logging).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    OMP_WAIT_POLICY=PASSIVE \
    PSFLOW_LOG_LEVEL=INFO \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU wheels unless told otherwise, e.g. --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

WORKDIR /opt/psflow
# The runtime pins of `bash scripts/run.sh`, which the test command installs too (its file
# includes them), so the image runs what was tested, without the test tools. Own layer: code
# changes do not reinstall torch.
COPY requirements/run.txt requirements/run.txt
RUN pip install --extra-index-url "$TORCH_INDEX" -r requirements/run.txt
# Data and checkpoints on object storage (psflow[s3], psflow[gcs]: s3://, gs:// through fsspec),
# at the pins the tests use. HDFS: fsspec's needs Hadoop's libhdfs,
# which no Python registry package carries.
RUN pip install "s3fs==2026.9.0" "gcsfs==2026.10.1"
COPY pyproject.toml setup.py README.md ./
COPY psflow ./psflow
# gcc only for the build: setup.py compiles the ps's row kernels (psflow/sparse/_kernels.c) and
# the data layer's hash and Example parser (psflow/data/_native.c), and the image keeps the
# compiled modules, not the compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-deps . \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
    && python -c "import psflow, torch, zmq; from psflow.sparse import _kernels; from psflow.data import _native"

# A fixed non-root uid/gid: the Kubernetes manifests set fsGroup 1000 so the keys Secret and
# the logdir volume are readable and writable by it.
RUN groupadd --gid 1000 psflow \
    && useradd --uid 1000 --gid 1000 --create-home psflow \
    && mkdir -p /logs /workspace \
    && chown psflow:psflow /logs /workspace
USER 1000:1000
WORKDIR /workspace
ENV PSFLOW_LOGDIR=/logs

EXPOSE 2222 6006
ENTRYPOINT ["tini", "--"]
CMD ["psflow", "--help"]
