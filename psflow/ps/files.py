"""Where checkpoint files go: a local path or an fsspec URL, written atomically.

Shared by the ps (its shard files, :mod:`psflow.ps.checkpoint`) and :mod:`psflow.train` (the
manifest and the ``latest`` pointer).
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Callable, Iterable

import fsspec
from fsspec.core import split_protocol
from fsspec.implementations.local import LocalFileSystem


def url_to_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the path within it for a local path or an fsspec URL."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/") if len(path) > 1 else path


def join(path: str, *names: str) -> str:
    return "/".join([path.rstrip("/"), *names])


def atomic_write(
    fs: fsspec.AbstractFileSystem,
    path: str,
    data: bytes | Iterable[bytes | memoryview],
    *,
    before_commit: Callable[[], None] | None = None,
) -> None:
    """Writes ``data`` (bytes, or pieces written one after the other) to ``path`` so that a
    reader sees either the old file or the whole new one.

    Locally: a temporary name in the same directory, fsync, rename, fsync of the directory.
    Elsewhere: the filesystem's own write then move (object stores replace whole objects).
    """
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    if isinstance(fs, LocalFileSystem):
        parent = os.path.dirname(path) or "."
        os.makedirs(parent, exist_ok=True)
        with open(tmp, "wb") as f:
            for chunk in [data] if isinstance(data, bytes) else data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if before_commit is not None:
            before_commit()
        os.replace(tmp, path)
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        parent = path.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        if isinstance(data, bytes):
            fs.pipe_file(tmp, data)
        else:
            with fs.open(tmp, "wb") as f:
                for chunk in data:
                    f.write(chunk)
        if before_commit is not None:
            before_commit()
        fs.mv(tmp, path)


def normal_url(url: str) -> tuple[str, str] | None:
    """``(scheme, absolute normalised path)`` of a local path or fsspec URL; ``None`` when a
    component is ``..`` (refused, not resolved)."""
    scheme, path = split_protocol(url)
    if ".." in path.split("/"):
        return None
    if scheme in (None, "file", "local"):
        return "file", os.path.abspath(path)
    return scheme, posixpath.normpath("/" + path.lstrip("/"))
