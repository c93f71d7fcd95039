"""Deployment: Jinja2 templates for Kubernetes, Kubeflow TFJob and Trainer v2, Volcano,
docker-compose and Marathon.

- ``config.py``: :class:`JobConfig`, the job description (defaults < YAML job file < flags),
  :func:`load_job_file`; ``quantity.py``: :func:`parse_quantity`.
- ``settings.py``: checks of the cluster settings (limits, node selectors, tolerations, queue,
  pull secrets, gang and quota, image reference); ``targets.py``: what each target can express.
- ``layout.py``: :func:`plan` and :class:`Plan`/:class:`Task`/:class:`Group`: names, addresses
  and ``TF_CONFIG`` per task (and per pod template, for Trainer v2 and Volcano) for one target;
  :data:`TARGETS`.
- ``render.py``: :func:`render` and :class:`Rendered`: the templates in ``templates/`` (or a
  ``template_dir`` that overrides them) applied to a plan.
- ``cli.py``: ``psflow render``.

Example:
    >>> from psflow.deploy import JobConfig, render
    >>> job = JobConfig(name="mnist", image="psflow:0.1.0", ps=1, workers=2, script="train.py")
    >>> print(render(job, "compose").text.splitlines()[0])
    name: 'mnist'
"""

from psflow.deploy.config import JobConfig, load_job_file
from psflow.deploy.layout import TARGETS, Group, Plan, Task, plan
from psflow.deploy.quantity import parse_quantity
from psflow.deploy.render import Rendered, render

__all__ = [
    "TARGETS",
    "Group",
    "JobConfig",
    "Plan",
    "Rendered",
    "Task",
    "load_job_file",
    "parse_quantity",
    "plan",
    "render",
]
