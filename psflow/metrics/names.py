"""Every metric psflow exports, named and defined once: its kind, help text and labels.

``psflow top`` and the launcher's progress line read the metrics back by these names.
"""

from __future__ import annotations

from typing import Any

PATH = "/metrics"
"""Where a task serves its metrics."""

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_SLOW_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)

# The names, each spelled once (psflow top and the launcher read them back).
STEPS = "psflow_worker_steps_total"
EXAMPLES = "psflow_worker_examples_total"
LOSS = "psflow_worker_loss"
GLOBAL_STEP = "psflow_worker_global_step"
LAST_STEP = "psflow_worker_last_step"
SENT_BYTES = "psflow_worker_sent_bytes_total"
RECEIVED_BYTES = "psflow_worker_received_bytes_total"
REQUEST_SECONDS = "psflow_worker_request_seconds"
SYNC_WAIT = "psflow_worker_sync_wait_seconds"
STALENESS = "psflow_worker_gradient_staleness_steps"
CHECKPOINT_SECONDS = "psflow_checkpoint_save_seconds"
CHECKPOINT_STEP = "psflow_checkpoint_last_step"
CHECKPOINT_TIME = "psflow_checkpoint_last_timestamp_seconds"
PS_REQUESTS = "psflow_ps_requests_total"
PS_APPLY = "psflow_ps_apply_seconds"
PS_WAITING = "psflow_ps_requests_waiting"
PS_STEP = "psflow_ps_global_step"
PS_BYTES = "psflow_ps_variables_bytes"
PS_DROPPED = "psflow_ps_dropped_stale_gradients_total"
PS_ROWS_PULLED = "psflow_ps_rows_pulled_total"
PS_ROWS_PUSHED = "psflow_ps_rows_pushed_total"
PS_ROWS = "psflow_ps_table_rows"
PS_EVICTED = "psflow_ps_table_evicted_rows_total"
PS_EXPIRED = "psflow_ps_table_expired_rows_total"
PS_CKPT_PAUSE = "psflow_ps_checkpoint_pause_seconds"
PS_CKPT_WRITE = "psflow_ps_checkpoint_write_seconds"
PS_EXPORT_PAUSE = "psflow_ps_export_pause_seconds"
PS_EXPORT_WRITE = "psflow_ps_export_write_seconds"
PS_EXPORT_FAILED = "psflow_ps_exports_failed_total"
INFO = "psflow_task_info"
CPU = "process_cpu_seconds_total"
MEMORY = "process_resident_memory_bytes"


_COUNTER, _GAUGE, _HISTOGRAM = "counter", "gauge", "histogram"

_DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...], dict[str, Any]]] = {
    STEPS: (_COUNTER, "Training steps this worker has taken", (), {}),
    EXAMPLES: (_COUNTER, "Examples this worker has trained on (as passed to step)", (), {}),
    LOSS: (_GAUGE, "Loss of this worker's last step", (), {}),
    GLOBAL_STEP: (_GAUGE, "Global step after this worker's last step", (), {}),
    LAST_STEP: (_GAUGE, "Global step at which the training stops (when the session knows)", (), {}),
    SENT_BYTES: (_COUNTER, "Bytes of tensors sent to a ps shard", ("shard",), {}),
    RECEIVED_BYTES: (_COUNTER, "Bytes of tensors received from a ps shard", ("shard",), {}),
    REQUEST_SECONDS: (
        _HISTOGRAM,
        "Round trip of requests to the ps shards, sent together, until all answered",
        ("shard",),
        {"buckets": _LATENCY_BUCKETS},
    ),
    SYNC_WAIT: (
        _HISTOGRAM,
        "Time a synchronous step waited for its step to complete on ps:0",
        (),
        {"buckets": _SLOW_BUCKETS},
    ),
    STALENESS: (
        _HISTOGRAM,
        "Updates of other workers applied between this worker's pull and its push",
        (),
        {"buckets": _STALENESS_BUCKETS},
    ),
    CHECKPOINT_SECONDS: (
        _HISTOGRAM,
        "Time a checkpoint took, from the save request to the last shard written",
        (),
        {"buckets": _SLOW_BUCKETS},
    ),
    CHECKPOINT_STEP: (_GAUGE, "Global step of the last checkpoint written", (), {}),
    CHECKPOINT_TIME: (_GAUGE, "Unix time the last checkpoint was written", (), {}),
    PS_REQUESTS: (_COUNTER, "Requests served by the shard", ("shard", "op"), {}),
    PS_APPLY: (
        _HISTOGRAM,
        "Time the shard spent applying one update",
        ("shard",),
        {"buckets": _LATENCY_BUCKETS},
    ),
    PS_WAITING: (_GAUGE, "Requests received and not answered yet", ("shard",), {}),
    PS_STEP: (_GAUGE, "The shard's step (ps:0's is the global step)", ("shard",), {}),
    PS_BYTES: (_GAUGE, "Bytes of the shard's dense variables", ("shard",), {}),
    PS_DROPPED: (
        _COUNTER,
        "Synchronous gradients dropped as stale (computed against an older step)",
        ("shard",),
        {},
    ),
    PS_ROWS_PULLED: (_COUNTER, "Embedding rows looked up", ("shard", "table"), {}),
    PS_ROWS_PUSHED: (_COUNTER, "Embedding rows updated", ("shard", "table"), {}),
    PS_CKPT_PAUSE: (
        _HISTOGRAM,
        "Time a checkpoint snapshot paused serving",
        ("shard",),
        {"buckets": _LATENCY_BUCKETS},
    ),
    PS_CKPT_WRITE: (
        _HISTOGRAM,
        "Time writing a checkpoint shard took (in the background)",
        ("shard",),
        {"buckets": _SLOW_BUCKETS},
    ),
    PS_EXPORT_PAUSE: (
        _HISTOGRAM,
        "Time an export's snapshot paused serving",
        ("shard",),
        {"buckets": _LATENCY_BUCKETS},
    ),
    PS_EXPORT_WRITE: (
        _HISTOGRAM,
        "Time writing the shard's file of an export took (in the background)",
        ("shard",),
        {"buckets": _SLOW_BUCKETS},
    ),
    PS_EXPORT_FAILED: (
        _COUNTER,
        "Exports whose file this shard did not write (refused for disk space, write errors)",
        ("shard",),
        {},
    ),
    INFO: (_GAUGE, "Always 1: the task and its job, as labels", ("job",), {}),
}
