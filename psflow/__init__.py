"""psflow: parameter-server training for PyTorch.

The public API, by layer:

- cluster: :class:`ClusterSpec`, :class:`TaskSpec`, :class:`TaskContext`, :func:`resolve`
"""

from psflow.cluster import ClusterSpec, TaskContext, TaskSpec, resolve

__version__ = "0.1.0"

__all__ = ["ClusterSpec", "TaskContext", "TaskSpec", "__version__", "resolve"]
