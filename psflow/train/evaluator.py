"""``Evaluator``: TensorFlow's ``evaluator`` task, which scores every checkpoint of a job.

It reads the checkpoint directory the chief writes, with no ps and no connection to any task:
each new complete checkpoint (its manifest is written last, atomically) is loaded into the
model, the user's evaluation function runs, and its numbers go to TensorBoard as ``eval/<name>``
under ``<logdir>/eval`` at the checkpoint's global step (a run of its own beside the chief's
training scalars). It stops after the checkpoint the chief marks final
(:attr:`~psflow.train.manifest.Manifest.final`, saved when training ends).

Every checkpoint is scored once: ``<logdir>/eval/evaluated.jsonl`` records each one scored (or
skipped), after its scalars are flushed, so an evaluator that restarts goes on after the last
one it recorded. A checkpoint removed (``max_to_keep``) before it could be read is skipped with
a log line: the evaluator fell behind the chief.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from psflow import env as envvars
from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.ps.checkpoint import CKPT_DIR_RE, join, url_to_fs
from psflow.sparse import Rows, make_rows
from psflow.train.checkpoint import fixed_tables, load_checkpoint
from psflow.train.checkpoint_buffers import model_buffers
from psflow.train.manifest import MANIFEST, CheckpointDir, CheckpointInfo, Manifest
from psflow.worker.placement import dense_parameters
from psflow.worker.tables import tables_of

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from psflow.nn import TableModule

log = logging.getLogger(__name__)

EVAL_SUBDIR = "eval"
"""Where the evaluator's event files go, under the logdir (TensorBoard shows it as a run)."""
RECORD = "evaluated.jsonl"
"""The checkpoints scored (or skipped) so far, one JSON object a line, in ``<logdir>/eval``."""

EvalFn = Callable[[nn.Module], Mapping[str, Any]]
"""The user's evaluation: the model, loaded with a checkpoint, to ``{name: number}``."""


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """One checkpoint the evaluator dealt with."""

    checkpoint: str
    """Its name, ``ckpt-<step>`` (the chief's step when it asked for the save)."""
    global_step: int
    """The global step its manifest gives (the ps's, at the snapshot); the name's step when
    it was skipped."""
    final: bool
    """Whether the chief marked it the job's last."""
    metrics: dict[str, float] | None
    """What the evaluation function returned; ``None``: skipped (removed before it was read)."""


class Evaluator:
    """Scores each checkpoint of a job as the chief writes it, until the final one.

    The script's evaluator branch (``psflow launch --evaluator 1`` starts one task with
    ``TF_CONFIG``'s ``task.type == "evaluator"``: :attr:`TaskContext.is_evaluator
    <psflow.cluster.TaskContext.is_evaluator>`).

    The model is the one the workers train, built the same way. Dense parameters are copied in,
    and the buffers the chief's model had at the save (a BatchNorm's running statistics);
    a fixed-size :mod:`psflow.nn` table loads into its local ``weight``; a hashed table gets its
    saved rows, kept on this process (an id the checkpoint does not hold reads as its initial
    row, as from the ps), so the whole table must fit this process's memory. The evaluation
    function runs with ``model.eval()`` and ``torch.no_grad()``.

    Args:
        model: the model to load each checkpoint into.
        eval_fn: ``eval_fn(model) -> {name: number}``; each number is written as
            ``eval/<name>``.
        checkpoint_dir: the job's checkpoint directory (a path or fsspec URL; default
            ``PSFLOW_LOGDIR``).
        logdir: a local directory whose ``eval`` subdirectory receives the event files and
            the record of scored checkpoints (default ``checkpoint_dir``, when it is local).
        timeout: seconds to wait for a new checkpoint before giving up with an error (the
            job died before its final checkpoint); each new checkpoint starts the wait again.
        poll_interval: seconds between looks at the checkpoint directory.

    Example:
        >>> # if ctx.is_evaluator:
        >>> #     psflow.Evaluator(model, lambda m: {"loss": heldout_loss(m)}, "runs/x").run()
    """

    def __init__(
        self,
        model: nn.Module,
        eval_fn: EvalFn,
        checkpoint_dir: str | None = None,
        *,
        logdir: str | None = None,
        timeout: float = 3600.0,
        poll_interval: float = 1.0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable, got {eval_fn!r}")
        if timeout <= 0 or poll_interval <= 0:
            raise ValueError(
                f"timeout and poll_interval must be > 0 seconds, got {timeout}, {poll_interval}"
            )
        checkpoint_dir = checkpoint_dir or envvars.text(envvars.PSFLOW_LOGDIR)
        if checkpoint_dir is None:
            raise ValueError(
                f"the evaluator needs the job's checkpoint_dir (or {envvars.PSFLOW_LOGDIR})"
            )
        self.dir = CheckpointDir(checkpoint_dir)
        if logdir is None:
            fs, path = url_to_fs(self.dir.url)
            if "file" not in _protocols(fs):
                raise ValueError(
                    f"checkpoint_dir {checkpoint_dir!r} is not a local directory: give logdir, "
                    "a local one for the evaluator's TensorBoard files"
                )
            logdir = path
        self.model = model
        self.eval_fn = eval_fn
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.eval_dir = os.path.join(logdir, EVAL_SUBDIR)
        self.record_path = os.path.join(self.eval_dir, RECORD)
        self.done: dict[str, EvalResult] = self._read_record()
        """Every checkpoint scored or skipped, by name (this run's and earlier runs')."""
        self._writer: SummaryWriter | None = None

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> list[EvalResult]:
        """Scores every checkpoint not yet scored, waiting for new ones, until the final one.

        Returns:
            What this call scored or skipped, oldest first.

        Raises:
            TimeoutError: no new checkpoint came within ``timeout`` seconds and none is final.
        """
        results: list[EvalResult] = []
        self.done = self._read_record()
        log.info(
            "evaluator: scoring the checkpoints in %s into %s (%d scored before)",
            self.dir.url,
            self.eval_dir,
            len(self.done),
        )
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                pending = self.pending()
                if len(pending) > 1:
                    log.info(
                        "evaluator: %d checkpoints to score, up to %s: behind the chief",
                        len(pending),
                        pending[-1].name,
                    )
                for info in pending:
                    results.append(self.evaluate(info))
                if pending:
                    deadline = time.monotonic() + self.timeout
                if self.finished():
                    return results
                if time.monotonic() > deadline:
                    newest = self._newest_done()
                    raise TimeoutError(
                        f"evaluator: no new checkpoint in {self.dir.url} for {self.timeout:g} s "
                        f"and none marked final (the newest scored: "
                        f"{newest.checkpoint if newest else 'none'}): the job stopped before "
                        "the chief saved its final checkpoint, or it is still far from it"
                    )
                time.sleep(self.poll_interval)
        finally:
            self.close()

    def pending(self) -> list[CheckpointInfo]:
        """The complete checkpoints newer than every one scored so far, oldest first."""
        newest = self._newest_done()
        after = -1 if newest is None else _name_step(newest.checkpoint)
        return [c for c in self.dir.checkpoints() if c.complete and c.step > after]

    def finished(self) -> bool:
        """Whether the newest checkpoint scored is the job's final one (the chief may mark a
        checkpoint final after it was scored: the manifest is read again)."""
        newest = self._newest_done()
        if newest is None:
            return False
        if newest.final:
            log.info(
                "evaluator: %s (global step %d) is the job's final checkpoint: done",
                newest.checkpoint,
                newest.global_step,
            )
            return True
        if newest.metrics is None:
            return False
        try:
            final = self.dir.manifest(newest.checkpoint).final
        except ValueError:  # removed: a newer one exists
            return False
        if final:
            marked = replace(newest, final=True)
            self._record(marked)
            return self.finished()
        return False

    def evaluate(self, info: CheckpointInfo) -> EvalResult:
        """Loads ``info``'s checkpoint, runs the evaluation function, writes its scalars and
        records it; a checkpoint removed before it could be read is recorded as skipped."""
        start = time.perf_counter()
        manifest = self._load_unless_removed(info.name)
        if manifest is None:
            log.warning(
                "evaluator: %s was removed (max_to_keep) before it could be read: skipped; "
                "the evaluator is slower than the chief's checkpoints",
                info.name,
            )
            result = EvalResult(
                checkpoint=info.name, global_step=info.step, final=False, metrics=None
            )
            self._record(result)
            return result
        self.model.eval()
        with torch.no_grad():
            raw = self.eval_fn(self.model)
        metrics = _numbers(raw, self.eval_fn)
        writer = self.writer
        step = manifest.global_step
        for name, value in metrics.items():
            writer.add_scalar(f"{EVAL_SUBDIR}/{name}", value, step)
        writer.flush()  # before the record: a crash in between scores it again, never loses it
        result = EvalResult(
            checkpoint=info.name, global_step=step, final=manifest.final, metrics=metrics
        )
        self._record(result)
        log.info(
            "evaluator: %s (global step %d%s): %s (%.1f s)",
            info.name,
            step,
            ", final" if manifest.final else "",
            " ".join(f"{k}={v:.6g}" for k, v in metrics.items()),
            time.perf_counter() - start,
        )
        return result

    # -- loading ----------------------------------------------------------------------------

    def _load_unless_removed(self, name: str) -> Manifest | None:
        """:meth:`load`, or ``None`` when the checkpoint was removed before it could be read
        (its manifest is gone). A failure while the manifest is still there is tried once
        more after ``poll_interval`` (a removal may be under way), then raised."""
        try:
            return self.load(name)
        except (ValueError, FileNotFoundError):
            if not self._has_manifest(name):
                return None
        time.sleep(self.poll_interval)
        try:
            return self.load(name)
        except (ValueError, FileNotFoundError):
            if not self._has_manifest(name):
                return None
            raise  # there, yet unreadable: not a removal

    def _has_manifest(self, name: str) -> bool:
        return bool(self.dir.fs.exists(join(self.dir.path, name, MANIFEST)))

    def load(self, name: str) -> Manifest:
        """Loads checkpoint ``name`` into the model; returns its manifest.

        Raises:
            ValueError: when the checkpoint is incomplete or does not match the model.
        """
        ckpt = load_checkpoint(self.dir.url, name)
        assert ckpt is not None  # a name was given
        params = dense_parameters(self.model)
        ckpt.check_model({n: p.detach() for n, p in params.items()})
        ckpt.check_buffers(model_buffers(self.model))
        modules = tables_of(self.model)
        saved_tables = set(ckpt.manifest.tables)
        if set(modules) != saved_tables:
            raise ValueError(
                f"{name}: the model's embedding tables {sorted(modules)} are not the "
                f"checkpoint's {sorted(saved_tables)}"
            )
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(ckpt.params[n])
            ckpt.load_buffers(self.model)  # a BatchNorm's statistics, as the chief had them
            if modules:
                saved = ckpt.tables  # read and checked by load_checkpoint
                weights = fixed_tables(self.dir.url, ckpt)
                for table, module in modules.items():
                    spec = TableSpec.from_wire(ckpt.manifest.tables[table]["spec"])
                    mine = (module.num_embeddings, module.embedding_dim)
                    if mine != (spec.num_embeddings, spec.embedding_dim):
                        raise ValueError(
                            f"{name}: table {table!r} is {spec.num_embeddings} x "
                            f"{spec.embedding_dim} (None: hashed), the model's is "
                            f"{mine[0]} x {mine[1]}"
                        )
                    if spec.num_embeddings is not None and not module.attached:
                        module.weight.copy_(weights[f"{table}.weight"])
                    else:
                        module.attach(_SavedRows(_rows(table, spec, saved.get(table, []))))
        return ckpt.manifest

    # -- output -----------------------------------------------------------------------------

    @property
    def writer(self) -> SummaryWriter:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.eval_dir)
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _newest_done(self) -> EvalResult | None:
        return max(self.done.values(), key=lambda r: _name_step(r.checkpoint), default=None)

    def _record(self, result: EvalResult) -> None:
        os.makedirs(self.eval_dir, exist_ok=True)
        with open(self.record_path, "a") as f:
            f.write(json.dumps(asdict(result), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[result.checkpoint] = result

    def _read_record(self) -> dict[str, EvalResult]:
        try:
            with open(self.record_path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return {}
        done: dict[str, EvalResult] = {}
        for number, line in enumerate(lines, 1):
            try:
                result = EvalResult(**json.loads(line))
                if not isinstance(result.checkpoint, str) or not isinstance(
                    result.global_step, int
                ):
                    raise TypeError("checkpoint and global_step must be a name and a step")
                _name_step(result.checkpoint)
            except (ValueError, TypeError) as e:
                if number == len(lines):  # cut short by a crash while it was written
                    log.warning("%s: ignoring its torn last line: %s", self.record_path, e)
                    continue
                raise ValueError(f"{self.record_path}:{number}: not a record line: {e}") from None
            done[result.checkpoint] = result
        return done


def _name_step(name: str) -> int:
    m = CKPT_DIR_RE.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a checkpoint name (ckpt-<step>)")
    return int(m.group(1))


class _SavedRows:
    """The rows of a table as a checkpoint holds them, for a module's forward pass (a
    :class:`~psflow.nn.RowSource` that never updates)."""

    def __init__(self, rows: Rows) -> None:
        self.store = rows

    def rows(self, table: TableModule, ids: torch.Tensor) -> torch.Tensor:
        # Eval mode (the evaluator's): an id the checkpoint holds no row of reads zeros.
        return self.store.lookup(ids.cpu(), absent_zeros=not table.training).to(ids.device)


def _rows(table: str, spec: TableSpec, parts: list[dict[str, torch.Tensor]]) -> Rows:
    """One local shard holding every saved row of ``table`` (values only: the evaluator never
    updates them, so the row optimizer is plain SGD, which keeps no state)."""
    rows = make_rows(replace(spec, name=table, optimizer=RowOptimizerSpec.of("SGD")), 0, 1)
    for part in parts:
        if "ids" not in part or "values" not in part:
            raise ValueError(f"table {table!r}: a shard file lacks its ids or values")
        rows.load(part["ids"], part["values"], {})
    return rows


def _numbers(raw: Any, eval_fn: EvalFn) -> dict[str, float]:
    """The evaluation function's result as ``{name: float}``, or a ``TypeError`` naming it."""
    what = getattr(eval_fn, "__qualname__", repr(eval_fn))
    if not isinstance(raw, Mapping) or not raw:
        raise TypeError(f"eval_fn {what} must return a non-empty {{name: number}}, got {raw!r}")
    out = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"eval_fn {what} returned a metric named {name!r}: use a string")
        try:
            number = float(value.item() if isinstance(value, torch.Tensor) else value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"eval_fn {what} returned {name}={value!r}, which is not a number"
            ) from None
        if not math.isfinite(number):
            log.warning("evaluator: %s is %s", name, number)
        out[name] = number
    return out


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
