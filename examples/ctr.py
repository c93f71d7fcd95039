"""DLRM for click-through rate on the ps, its hashed embedding tables held by no worker.

    psflow data synth-ctr data/ctr --examples 5000000 --shards 8 && \
    psflow launch --ps 2 --workers 2 examples/ctr.py --data data/ctr --prefetch --logdir runs/ctr
    psflow launch --ps 2 --workers 2 --evaluator examples/ctr.py --data data/ctr --logdir runs/ctr \
        --save_checkpoint_steps 500
    python examples/ctr.py --data data/ctr --logdir runs/ctr   # alone: a cluster of one
    psflow launch --ps 2 --workers 2 --gpus-per-task 1 examples/ctr.py --data data/ctr \
        --prefetch --device cuda   # each worker on a GPU of its own (docs/cluster.md)

DLRM (facebookresearch/dlrm) beside Wide & Deep's first-order term (``--wide``, FTRL), its
tables ``psflow.nn.EmbeddingBag`` over hashed ids (value ``v`` of column ``c`` is row
``(c << 48) | v``), held on the ps only. Each worker reads its share of Criteo-layout TFRecords
(``psflow data synth-ctr`` or ``psflow data criteo``); the chief scores the test split into
TensorBoard (``eval/auc``, ``eval/loss``) and a ``RESULT`` line. Figures: docs/embeddings.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import psflow
import psflow.nn as pnn
from psflow.data.ctr import META_FILE, CTRBatch, auc, ctr_batches

from dlrm import DLRM  # examples/dlrm.py, beside this script (as nanoGPT keeps model.py)


def evaluate(model: nn.Module, files: str, device: torch.device | None = None) -> dict[str, float]:
    """AUC and log loss of ``model`` on ``files`` (every example, once), in eval mode: an id
    no table holds reads zeros, as in a served model."""
    scores, labels, training = [], [], model.training
    model.eval()
    with torch.no_grad():
        for batch in ctr_batches(files, batch_size=4096, num_epochs=1):
            on = batch.to(device)
            scores.append(model(on.dense, on.categorical).cpu())
            labels.append(batch.label)
    model.train(training)
    logits, y = torch.cat(scores), torch.cat(labels)
    loss = F.binary_cross_entropy_with_logits(logits, y).item()
    return {"auc": auc(logits.numpy(), y.numpy()), "loss": loss}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DLRM on Criteo-layout TFRecords (see the docstring)")
    add = p.add_argument
    add("--data", required=True, help="directory with train-* and test-* files")
    add("--train_steps", type=int, default=5000, help="global steps to train")
    add("--batch_size", type=int, default=1024, help="per worker")
    add("--dim", type=int, default=16, help="embedding and bottom-MLP output size")
    add("--bottom", default="64", help="bottom MLP sizes, comma-separated")
    add("--top", default="64", help="top MLP sizes, comma-separated")
    add("--optimizer", default="Adam", help="the dense layers' torch.optim class")
    add("--lr", type=float, default=1e-3)
    # A ps applies the dense optimizer at every worker's push: torch's fused form makes one pass
    # over the parameters and their state where the default loop makes six, for the last bits
    # (it rounds differently). Issue 35's 16-core profile: 48% of a shard's time was that loop.
    add("--fused", action=argparse.BooleanOptionalAction, default=True, help="... fused form")
    # RowWiseAdagrad (TorchRec's DLRM default): one accumulator a row where Adagrad keeps one an
    # element, the table's optimizer state a 16th of Adagrad's at --dim 16.
    add("--table_optimizer", choices=["Adagrad", "RowWiseAdagrad"], default="Adagrad")
    add("--table_lr", type=float, default=0.05, help="the table's row-wise optimizer's")
    add("--table_initial_accumulator", type=float, default=0.1, help="... and its accumulator")
    add("--min_count", type=int, default=5, help="admit an id at its n-th use")
    add("--wide", action=argparse.BooleanOptionalAction, default=True, help="first-order term")
    add("--wide_lr", type=float, default=0.1, help="the wide term's FTRL's")
    add("--wide_l1", type=float, default=0.0)
    add("--wide_l2", type=float, default=0.0)
    # Not TensorFlow's 0.1, sized for one example's gradient: a row's gradient is of the batch's
    # mean loss, and at 0.1 the accumulator would hold a rare id's weight near 0 for its whole
    # life; at 1e-5 each id's steps follow its own gradients (docs/embeddings.md).
    add("--wide_initial_accumulator", type=float, default=1e-5, help="... and its accumulator")
    add("--device", default="cpu", help="cuda: the dense layers and pulled rows on the GPU")
    add("--logdir", default=None, help="checkpoints and TensorBoard summaries")
    add("--save_checkpoint_steps", type=int, default=None, help="default: every 10 min")
    add("--export_dir", default=None, help="incremental exports for serving (needs ps)")
    add("--export_every", type=float, default=None, help="seconds between exports (300)")
    add("--seed", type=int, default=0)
    # A GPU's first steps load its kernels and libraries: a rate that counts them understates it.
    add("--warmup_steps", type=int, default=0, help="steps the printed rate leaves out")
    add("--prefetch", action="store_true", help="the next batch's rows ride each step")
    # The push's round trip hidden behind the next step's forward and backward (asynchronous
    # training: each gradient one step staler); the rows ride two batches ahead then.
    add("--overlap", action="store_true", help="each push's reply taken at the next step")
    add("--wire_dtype", choices=["float32", "bfloat16", "float16"], help="rows between worker/ps")
    args = p.parse_args(argv)
    if args.warmup_steps < 0:
        p.error(f"--warmup_steps must be >= 0, got {args.warmup_steps}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no CUDA device")
    return args


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx, argv = psflow.resolve_or_alone()  # no cluster given: a cluster of one, this process
    args = parse(argv)
    if ctx.job == "ps":
        # Saves go only under --logdir: the ps refuses to write its shard anywhere else.
        psflow.ParameterServer(ctx, checkpoint_dir=args.logdir).join()
        return

    torch.manual_seed(args.seed)
    table = pnn.RowOptimizerSpec.of(
        args.table_optimizer,
        lr=args.table_lr,
        initial_accumulator_value=args.table_initial_accumulator,
    )
    ftrl = {"lr": args.wide_lr, "l1": args.wide_l1, "l2": args.wide_l2}
    ftrl["initial_accumulator_value"] = args.wide_initial_accumulator
    wide = pnn.RowOptimizerSpec.of("Ftrl", **ftrl) if args.wide else None
    bottom, top = ([int(s) for s in f.split(",")] for f in (args.bottom, args.top))
    wire = getattr(torch, args.wire_dtype) if args.wire_dtype else None
    model = DLRM(args.dim, bottom, top, table, wide, args.min_count, wire)
    test = f"{args.data}/test-*"
    if ctx.is_evaluator:
        # Each checkpoint, hashed tables included, loaded here with no ps; ends after the last.
        psflow.Evaluator(model, lambda m: evaluate(m, test), args.logdir).run()
        return

    device = torch.device(args.device)
    model.to(device)

    def to_device(batch: CTRBatch) -> CTRBatch:  # to a GPU through pinned memory: no waiting
        return batch.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else batch

    batches = ctr_batches(
        f"{args.data}/train-*",
        batch_size=args.batch_size,
        shard_index=ctx.worker_index,
        num_shards=ctx.num_workers,
        shuffle_buffer=10 * args.batch_size,
        seed=args.seed + ctx.worker_index,
        num_epochs=None,
    )
    fused = {"fused": True} if args.fused else {}
    with psflow.TrainingSession(
        model,
        ctx,
        optimizer=psflow.OptimizerSpec.of(args.optimizer, lr=args.lr, **fused),
        overlap=args.overlap,
        checkpoint_dir=args.logdir,
        save_checkpoint_steps=args.save_checkpoint_steps,
        export_dir=args.export_dir,
        export_every=args.export_every,
        last_step=args.train_steps,
    ) as sess:
        start, steps, timed = time.perf_counter(), 0, 0  # timed: the steps the rate counts
        ahead = 2 if args.overlap else 1  # the push in flight brings the batch after next's rows
        coming = [to_device(next(batches)) for _ in range(ahead + 1)]
        while not sess.should_stop():
            batch = coming.pop(0)
            coming.append(to_device(next(batches)))
            sess.zero_grad()
            logits = model(batch.dense, batch.categorical)
            loss = F.binary_cross_entropy_with_logits(logits, batch.label)
            loss.backward()
            if args.prefetch:  # as stale as the dense parameters
                model.prefetch(coming[ahead - 1].categorical)
            sess.step(loss=loss, examples=len(batch.label))
            steps += 1
            timed += 1
            if steps == args.warmup_steps:  # the rate from here on
                start, timed = time.perf_counter(), 0
        rate = timed * args.batch_size / (time.perf_counter() - start)
        print(f"{timed} steps, {rate:,.0f} samples/s (this worker)", flush=True)
        if sess.is_chief:  # the one who evaluates, logs and prints the result
            sess.pull()  # the model as the job holds it now (the ps's, or this process's)
            scores = evaluate(model, test, device)
            for name, value in scores.items():
                sess.add_scalar(f"eval/{name}", value)  # TensorBoard, beside the training's
            meta = Path(args.data, META_FILE)
            result = {
                "global_step": sess.global_step,
                "test_auc": round(scores["auc"], 4),
                "test_loss": round(scores["loss"], 4),
                "best_auc": json.loads(meta.read_text()).get("best_auc") if meta.exists() else None,
                "samples_per_s_per_worker": round(rate),
            }
            print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
