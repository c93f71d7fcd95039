"""Trains on numbered records so that what reached the optimizer can be counted.

Record ``i`` (a ``tf.train.Example`` with ``id = i``) adds exactly 1 to row ``i`` of a table:
rows start at 0, the loss is minus their sum, row-wise SGD at learning rate 1. After the job a
row holds how many times its record was trained: 1 each if exactly once, 2 for a record trained
twice, 0 for one skipped. The reader's position goes with each step (``input=``), and faults
come from tests/faults.py's schedule::

    python tests/faults.py --once D --kill-at ps:1@40 SCRIPT --records 2000 --logdir L \
        --brokers 127.0.0.1:9092 --topic counted      # a Kafka topic
    ... SCRIPT --records 2000 --logdir L --files 'DIR/part-*.tfrecord'   # or TFRecord files

A worker ends once its reader is past its share of the ``--records`` records, all there before
the job starts: for Kafka, each of its partitions at ``records / partitions``; for files, each
file of its share read whole.
"""

from __future__ import annotations

import argparse
import glob
from typing import Any

import torch

import psflow
from psflow.data import FixedLenFeature

SPEC = {"id": FixedLenFeature(dtype="int64")}


class Counter(torch.nn.Module):
    def __init__(self, records: int) -> None:
        super().__init__()
        self.rows = psflow.nn.Embedding(records, 1, init_std=0.0)
        self.bias = torch.nn.Parameter(torch.zeros(1))  # a dense part, pushed every step

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return -self.rows(ids).sum() + 0.0 * self.bias.sum()


def reader_of(args: argparse.Namespace, ctx: psflow.TaskContext) -> Any:
    if args.files is not None:
        from psflow.data.stream import FileStreamConfig, FileStreamReader

        return FileStreamReader(
            FileStreamConfig(
                pattern=args.files,
                worker_index=ctx.worker_index,
                num_workers=ctx.num_workers,
                poll_interval_s=0.05,
            )
        )
    from psflow.data.kafka import KafkaConfig, KafkaReader

    return KafkaReader(
        KafkaConfig(
            brokers=args.brokers,
            topic=args.topic,
            worker_index=ctx.worker_index,
            num_workers=ctx.num_workers,
            max_wait_s=60,
        )
    )


def finished(args: argparse.Namespace, ctx: psflow.TaskContext, state: dict[str, Any]) -> bool:
    if args.files is not None:  # every file of this worker's share read whole
        from psflow.data.stream import owner

        mine = {f for f in glob.glob(args.files) if owner(f, ctx.num_workers) == ctx.worker_index}
        return mine <= set(state["done"])
    return all(off >= args.records // args.partitions for off in state["offsets"].values())


def main() -> None:
    ctx, argv = psflow.resolve()
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, required=True)
    p.add_argument("--logdir", required=True)
    p.add_argument("--brokers")
    p.add_argument("--topic")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--files")
    p.add_argument("--batch_size", type=int, default=16)
    args = p.parse_args(argv)
    if ctx.job == "ps":
        psflow.ParameterServer(ctx, checkpoint_dir=args.logdir).join()
        return
    model = Counter(args.records)
    reader = reader_of(args, ctx)
    with psflow.TrainingSession(
        model, ctx, optimizer="SGD", lr=1.0, checkpoint_dir=args.logdir,
        save_checkpoint_steps=10, input=reader,
    ) as sess:  # fmt: skip
        trained = 0
        while not finished(args, ctx, reader.state()):
            batch = reader.read_examples(args.batch_size, SPEC, timeout_s=1.0)
            if batch is None:
                continue
            ids = torch.as_tensor(batch["id"])
            sess.zero_grad()
            model(ids).backward()
            sess.step(examples=len(ids))
            trained += len(ids)
        print(f"{ctx.task} trained {trained} records to step {sess.global_step}", flush=True)
    reader.close()


if __name__ == "__main__":
    main()
