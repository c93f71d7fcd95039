"""psflow's own log lines in a task, shown without the script configuring logging.

TensorFlow printed its INFO lines (waiting for ..., restored, saved) whatever the script did;
Python's logging drops a library's INFO lines until someone configures it. :func:`configure`
(called by :func:`~psflow.cluster.resolve`) sets the level of the ``psflow`` logger from
``PSFLOW_LOG_LEVEL`` (INFO by default) and gives it one handler on stderr, which prints a
record only when no other handler on the record's way up would: once the script calls
``logging.basicConfig`` (before or after), its handler prints psflow's lines and this one
stays silent, so no line shows twice. The root logger is never touched.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import TextIO

from psflow import env as envvars

LOGGER = "psflow"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Prints psflow's records on stderr while no other handler would print them."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.setFormatter(logging.Formatter(FORMAT))

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        # Whatever stderr is at each line, as logging's own last resort does.
        return sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        if not self._handled_elsewhere(record):
            super().emit(record)

    def _handled_elsewhere(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            for handler in logger.handlers:
                if handler is not self and record.levelno >= handler.level:
                    return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False


def configure(environ: Mapping[str, str] | None = None) -> None:
    """Sets the ``psflow`` logger's level and gives it its fallback handler (once).

    The level comes from ``PSFLOW_LOG_LEVEL`` when set; otherwise INFO, unless the script set
    the ``psflow`` logger's level itself.

    Raises:
        ValueError: when ``PSFLOW_LOG_LEVEL`` names no level.
    """
    value = envvars.text(envvars.PSFLOW_LOG_LEVEL, environ=environ)
    logger = logging.getLogger(LOGGER)
    if value is not None:
        name = value.strip().upper()
        if name not in LEVELS:
            raise ValueError(
                f"{envvars.PSFLOW_LOG_LEVEL}={value!r} is not a level: use one of "
                f"{', '.join(LEVELS)}"
            )
        logger.setLevel(name)
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not any(isinstance(h, FallbackHandler) for h in logger.handlers):
        logger.addHandler(FallbackHandler())
