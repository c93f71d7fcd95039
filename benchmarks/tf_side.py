"""TensorFlow's side of the comparisons: needs only tensorflow (it runs in its own venv)."""

from __future__ import annotations

import json
import os
from typing import Any


def start_tf_task() -> tuple[Any, Any, int, dict[str, Any]]:
    """This task's ``tf.distribute.Server``, from ``TF_CONFIG``, in graph mode.

    A ps task serves here forever: TensorFlow's ps tasks never exit (tensorflow#25858), so the
    benchmark kills them. A worker gets ``(cluster, server, index, config)``.
    """
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    config = json.loads(os.environ["TF_CONFIG"])
    cluster = tf.train.ClusterSpec(config["cluster"])
    job, index = config["task"]["type"], config["task"]["index"]
    server = tf.distribute.Server(cluster, job_name=job, task_index=index)
    if job == "ps":
        server.join()
    return cluster, server, index, config
