"""A click-through-rate model on the ps: DLRM with hashed embedding tables no worker holds.

    psflow data synth-ctr data/ctr --examples 5000000 --shards 8 && \
    psflow launch --ps 2 --workers 2 examples/ctr.py --data data/ctr --prefetch --logdir runs/ctr

On that set (3.3 GB, about a minute to write; best achievable test AUC 0.78413) the job makes
one pass (the defaults: 5,000 steps of 1,024 examples, over 2 workers) and scores a test AUC of
0.779, within 0.01 of the best: 4 to 6 minutes on a shared, loaded 2-core machine; about 3 at
the 27,500 samples/s the same model did there when quiet (every run in
``benchmarks/results/embedding.md``, "examples/ctr.py: quality"). With an evaluator task:

    psflow launch --ps 2 --workers 2 --evaluator examples/ctr.py --data data/ctr --logdir runs/ctr \
        --save_checkpoint_steps 500

The model is DLRM's (facebookresearch/dlrm): the 13 dense features through a bottom MLP to a
vector of ``--dim``, each of the 26 categorical features through an embedding of the same
size, the pairwise dot products of those 27 vectors, and the bottom vector with them through
a top MLP to one logit, trained with binary cross-entropy. Beside it, Wide & Deep's
first-order term (``--wide``, on by default): one weight per id, summed into the logit,
trained with FTRL-Proximal as TensorFlow's linear models are. The embeddings are one
``psflow.nn.EmbeddingBag`` over hashed ids (``num_embeddings=None``): a feature's value ``v``
in column ``c`` is the row ``(c << 48) | v`` (Monolith's slot-and-feature id), so every column
shares one table, one lookup a step, any id is welcome, and a row is made on first use. The
table lives on the ps only, split ``mod`` over them, with row-wise Adagrad; the dense layers
train with ``--optimizer`` (Adam) on the ps.

It reads TFRecord files of the Criteo Kaggle layout through ``psflow.data`` (what
``psflow data synth-ctr`` writes; Criteo's own text, ``train.txt`` or the Terabyte set's
``day_N``, converted by ``psflow data criteo train.txt data/criteo``; or tensorflow/models'
``dense-feature-N``/``sparse-feature-N`` records, work unchanged), each
worker its share. At the end the chief scores the held-out split: AUC, and the best AUC
achievable on it when the set came from ``synth-ctr`` (its planted model's). With
``--evaluator`` an evaluator task scores every checkpoint on the held-out split (``eval/auc``,
``eval/loss`` in TensorBoard, under ``<logdir>/eval``) while the job trains. Without a cluster
(``python examples/ctr.py --data data/ctr``) the same script trains in one process. With
``--device cuda`` the workers' dense layers and the rows each step pulls are on the GPU, the
table on the ps, on the CPU (``scripts/gpu-check.sh`` runs it against ``--device cpu`` on a
machine with a GPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import psflow
import psflow.nn as pnn
from psflow.data.ctr import META_FILE, auc, ctr_batches
from psflow.protocol import RowOptimizerSpec
from psflow.train import TrainingSession

COLUMN_BITS = 48
"""A categorical value keeps its low 48 bits; the column goes above them."""


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(
        self,
        dim: int,
        bottom: list[int],
        top: list[int],
        table: RowOptimizerSpec,
        wide: RowOptimizerSpec | None = None,
        min_count: int = 0,
    ):
        super().__init__()
        self.bottom = mlp([13, *bottom, dim])
        # min_count: an id gets a row of its own only once seen that often (rarer ones keep
        # their small initial row): what keeps a model of click logs from learning noise.
        self.embedding = pnn.EmbeddingBag(
            None, dim, mode="sum", init_std=0.01, seed=1, optimizer=table, min_count=min_count
        )
        # The first-order ("wide") term of Wide & Deep and DeepFM: one weight per id, summed
        # into the logit, trained with FTRL-Proximal as TensorFlow's linear models are.
        self.wide = (
            pnn.EmbeddingBag(
                None, 1, mode="sum", init_std=0.0, seed=2, optimizer=wide, min_count=min_count
            )
            if wide is not None
            else None
        )
        pairs = 27 * 26 // 2
        self.top = nn.Sequential(mlp([dim + pairs, *top]), nn.Linear(top[-1], 1))
        self.register_buffer("columns", torch.arange(26, dtype=torch.int64) << COLUMN_BITS)
        rows, cols = torch.tril_indices(27, 27, offset=-1)
        self.register_buffer("lower", rows * 27 + cols)

    def table_ids(self, categorical: torch.Tensor) -> torch.Tensor:
        """The tables' ids of a batch's categorical features, ``[B, 26]``."""
        return (categorical & ((1 << COLUMN_BITS) - 1)) | self.columns

    def prefetch(self, categorical: torch.Tensor) -> None:
        """The tables' rows of a coming batch ride the next step (see ``--prefetch``)."""
        ids = self.table_ids(categorical)
        self.embedding.prefetch(ids)
        if self.wide is not None:
            self.wide.prefetch(ids)

    def forward(self, dense: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # [B, dim]
        ids = self.table_ids(categorical)
        e = self.embedding(ids.reshape(-1, 1)).view(len(dense), 26, -1)  # [B, 26, dim]
        t = torch.cat([x.unsqueeze(1), e], dim=1)  # [B, 27, dim]
        # The 351 pairs below the diagonal. index_select, not [:, lower]: the same values, and a
        # backward that adds along the row (index_add) instead of index_put's accumulation,
        # 1.4 ms less a step at batch 1,024 on one core.
        z = torch.bmm(t, t.transpose(1, 2)).flatten(1).index_select(1, self.lower)  # [B, 351]
        logit = self.top(torch.cat([x, z], dim=1))
        if self.wide is not None:
            logit = logit + self.wide(ids)
        return logit.squeeze(1)


def evaluate(
    model: nn.Module, files: str, batch_size: int, device: torch.device | None = None
) -> tuple[float, float]:
    """AUC and log loss of ``model`` on ``files`` (every example, once)."""
    scores, labels = [], []
    with torch.no_grad():
        for batch in ctr_batches(files, batch_size=batch_size, num_epochs=1):
            on = batch.to(device)
            scores.append(model(on.dense, on.categorical).cpu())
            labels.append(batch.label)
    logits, y = torch.cat(scores), torch.cat(labels)
    loss = F.binary_cross_entropy_with_logits(logits, y).item()
    return auc(logits.numpy(), y.numpy()), loss


class Alone:
    """What the training loop uses of a :class:`TrainingSession`, for a run in one process:
    the dense layers with a local ``torch.optim`` optimizer; the hashed table applies its
    row-wise Adagrad in backward (TorchRec's fused optimizer), as it does on the ps."""

    is_chief = True

    def __init__(self, model: nn.Module, optimizer: str, lr: float, last_step: int) -> None:
        self.opt = getattr(torch.optim, optimizer)(model.parameters(), lr=lr)
        self.global_step, self.last_step = 0, last_step

    def __enter__(self) -> Alone:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def should_stop(self) -> bool:
        return self.global_step >= self.last_step

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self, loss: torch.Tensor, examples: int | None = None) -> None:
        self.opt.step()
        self.global_step += 1


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx, argv = psflow.resolve_or_alone()
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="directory with train-* and test-* files")
    parser.add_argument("--train_steps", type=int, default=5000, help="global steps to train")
    parser.add_argument("--batch_size", type=int, default=1024, help="per worker")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--bottom", default="64", help="bottom MLP sizes, comma-separated")
    parser.add_argument("--top", default="64", help="top MLP sizes, comma-separated")
    parser.add_argument("--optimizer", default="Adam")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--table_lr", type=float, default=0.05, help="row-wise Adagrad's")
    parser.add_argument(
        "--table_initial_accumulator",
        type=float,
        default=0.1,
        help="row-wise Adagrad's initial_accumulator_value",
    )
    parser.add_argument("--min_count", type=int, default=5, help="admit an id at its n-th use")
    parser.add_argument(
        "--wide", action=argparse.BooleanOptionalAction, default=True, help="the first-order term"
    )
    parser.add_argument("--wide_lr", type=float, default=0.1, help="the wide term's FTRL's")
    parser.add_argument("--wide_l1", type=float, default=0.0)
    parser.add_argument("--wide_l2", type=float, default=0.0)
    parser.add_argument(
        "--wide_initial_accumulator",
        type=float,
        default=1e-5,
        help="the wide term's FTRL's initial_accumulator_value",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="the workers' device (cuda: the dense layers and the rows a step pulls are there; "
        "the table stays on the ps, on the CPU)",
    )
    parser.add_argument("--logdir", default=None, help="checkpoints and TensorBoard summaries")
    parser.add_argument("--save_checkpoint_steps", type=int, default=None, help="default: 10 min")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prefetch",
        action="store_true",
        help="the next batch's rows ride each step's round trip (one step stale, like the "
        "dense parameters; see psflow.nn.Embedding.prefetch)",
    )
    args = parser.parse_args(argv)

    if ctx is not None and ctx.job == "ps":
        # Saves go only under --logdir: the ps refuses to write its shard anywhere else.
        psflow.ParameterServer(ctx, checkpoint_dir=args.logdir).join()
        return
    torch.manual_seed(args.seed)
    table = RowOptimizerSpec.of(
        "Adagrad", lr=args.table_lr, initial_accumulator_value=args.table_initial_accumulator
    )
    wide = (
        # A row's gradient is of the batch's mean loss: about 1/batch_size of one example's. At
        # TensorFlow's initial accumulator (0.1, sized for one example's gradient) the
        # accumulator would outweigh a rare id's gradients for its whole life and hold its
        # weight near 0; at 1e-5 each id's steps follow its own gradients (test AUC 0.7720 ->
        # 0.7792 on the 5M synth-ctr set, benchmarks/results/embedding.md).
        RowOptimizerSpec.of(
            "Ftrl",
            lr=args.wide_lr,
            l1=args.wide_l1,
            l2=args.wide_l2,
            initial_accumulator_value=args.wide_initial_accumulator,
        )
        if args.wide
        else None
    )
    sizes = [int(s) for s in args.bottom.split(",")], [int(s) for s in args.top.split(",")]
    model = DLRM(args.dim, sizes[0], sizes[1], table, wide, args.min_count)
    test = os.path.join(args.data, "test-*")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch sees no CUDA device")
    if ctx is not None and ctx.is_evaluator:
        # Each checkpoint, hashed tables included, loaded here with no ps; ends after the last.
        def score(m: nn.Module) -> dict[str, float]:
            test_auc, test_loss = evaluate(m, test, 4096)
            return {"auc": test_auc, "loss": test_loss}

        psflow.Evaluator(model, score, args.logdir).run()
        return
    model.to(device)
    trainers = ctx.cluster.trainers if ctx else []
    index, workers = (trainers.index(ctx.task), len(trainers)) if ctx else (0, 1)
    train = os.path.join(args.data, "train-*")
    batches = ctr_batches(
        train,
        batch_size=args.batch_size,
        shard_index=index,
        num_shards=workers,
        shuffle_buffer=10 * args.batch_size,
        seed=args.seed + index,
        num_epochs=None,
    )
    session = (
        TrainingSession(
            model,
            ctx,
            optimizer=args.optimizer,
            lr=args.lr,
            checkpoint_dir=args.logdir,
            save_checkpoint_steps=args.save_checkpoint_steps,
            last_step=args.train_steps,
        )
        if ctx is not None
        else Alone(model, args.optimizer, args.lr, args.train_steps)
    )
    with session as sess:
        start, steps = time.perf_counter(), 0
        batch = next(batches).to(device)
        while not sess.should_stop():
            following = next(batches).to(device)
            sess.zero_grad()
            logits = model(batch.dense, batch.categorical)
            loss = F.binary_cross_entropy_with_logits(logits, batch.label)
            loss.backward()
            if args.prefetch:
                model.prefetch(following.categorical)
            sess.step(loss=loss, examples=len(batch.label))
            batch = following
            steps += 1
        seconds = time.perf_counter() - start
        rate = steps * args.batch_size / seconds
        print(f"{steps} steps, {rate:,.0f} samples/s (this worker)", flush=True)
        if sess.is_chief:
            if ctx is not None:
                sess.opt.pull()  # the dense layers as the ps hold them now
            test_auc, test_loss = evaluate(model, test, 4096, device)
            meta_path = os.path.join(args.data, META_FILE)
            best = None
            if os.path.exists(meta_path):
                with open(meta_path) as f:
                    best = json.load(f).get("best_auc")
            result = {
                "global_step": sess.global_step,
                "test_auc": round(test_auc, 4),
                "test_loss": round(test_loss, 4),
                "best_auc": best,
                "samples_per_s_per_worker": round(rate),
            }
            print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
