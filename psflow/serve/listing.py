"""The exports in an export directory: the complete ones (:func:`list_exports`), the damaged
ones (:func:`damaged_exports`), and the chain of a base and its deltas that makes one
(:func:`chain`). A damaged export blocks only a chain that needs it; otherwise it is logged,
once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import fsspec

from psflow.serve.manifest import (
    EXPORT_RE,
    MANIFEST,
    Export,
    ExportError,
    _join,
    export_dir_name,
    read_export,
)

log = logging.getLogger("psflow.serve.delta")  # the loader's lines, by the name they always had
_logged: set[str] = set()
"""The damaged exports already logged (each once)."""


def _scan(export_dir: str) -> tuple[dict[int, Export], dict[int, ExportError]]:
    """The exports in ``export_dir`` that have a manifest: those read, and why each other one
    could not be (by its n)."""
    fs, path = fsspec.core.url_to_fs(export_dir)
    if not fs.exists(path):
        return {}, {}
    good: dict[int, Export] = {}
    bad: dict[int, ExportError] = {}
    for entry in fs.ls(path, detail=False):
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        match = EXPORT_RE.match(name)
        if match and fs.exists(f"{str(entry).rstrip('/')}/{MANIFEST}"):
            seq = int(match.group(1))
            try:
                good[seq] = read_export(_join(export_dir, name))
            except ExportError as e:
                bad[seq] = e
    return dict(sorted(good.items())), dict(sorted(bad.items()))


def _log_damaged(bad: Mapping[int, ExportError]) -> None:
    for error in bad.values():
        text = str(error)
        if text not in _logged:
            if len(_logged) > 10_000:
                _logged.clear()
            _logged.add(text)
            log.warning("export skipped: %s", text)


def list_exports(export_dir: str) -> list[Export]:
    """The complete exports in ``export_dir`` (those with a manifest), oldest first. One whose
    manifest cannot be read is left out, and logged (once)."""
    good, bad = _scan(export_dir)
    _log_damaged(bad)
    return list(good.values())


def damaged_exports(export_dir: str) -> dict[int, ExportError]:
    """The exports in ``export_dir`` whose manifest is there but cannot be read, by their n:
    why each cannot."""
    return _scan(export_dir)[1]


def chain(export_dir: str, upto: int | None = None) -> list[Export]:
    """The newest complete export (or export ``upto``) and its predecessors back to its base,
    in the order they apply. A damaged export that is not one of them is skipped (and logged
    once); one that is is refused.

    Raises:
        ExportError: when there is no export, or one of the chain is missing or damaged.
    """
    exports, bad = _scan(export_dir)
    if not exports and not bad:
        raise ExportError(f"{export_dir}: no complete export")
    seq = max([*exports, *bad]) if upto is None else upto
    out: list[Export] = []
    seen: set[int] = set()
    while True:
        export = exports.get(seq)
        after = f", which {out[-1].name} follows," if out else ""
        if seq in bad:
            raise ExportError(f"{export_dir}: {export_dir_name(seq)}{after} is damaged: {bad[seq]}")
        if export is None:
            raise ExportError(f"{export_dir}: {export_dir_name(seq)}{after} is missing")
        if seq in seen:  # read_export refuses since >= seq: never, unless a manifest changed
            raise ExportError(f"{export_dir}: {export.name} follows itself: a cycle")
        seen.add(seq)
        out.append(export)
        if export.since is None:
            _log_damaged(bad)  # none of them is needed
            return out[::-1]
        seq = export.since
