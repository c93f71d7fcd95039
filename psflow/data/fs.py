"""Paths: local files and any fsspec URL, with glob patterns.

Local paths go through the builtin ``open`` (fastest, no fsspec layer); anything with a
``scheme://`` goes through fsspec, so ``s3://``, ``gs://``, ``hdfs://`` and ``memory://`` work when
the matching fsspec backend is installed.
"""

from __future__ import annotations

import glob as globlib
import os
from collections.abc import Iterable
from typing import IO, Any

import fsspec

_GLOB_CHARS = frozenset("*?[")


def is_url(path: str) -> bool:
    """True for ``scheme://...`` paths (``file://`` included), which go through fsspec."""
    return "://" in path


def _has_glob(path: str) -> bool:
    return any(c in _GLOB_CHARS for c in path)


def expand_paths(patterns: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str]:
    """Expands files, directories and glob patterns into a sorted, de-duplicated list of files.

    A directory stands for every file directly inside it whose name does not start with ``_`` or
    ``.`` (Spark and Hadoop write ``_SUCCESS`` and ``.crc`` files beside the data).

    Raises:
        FileNotFoundError: a pattern or path that matches no file, named in the message.
    """
    if isinstance(patterns, str | os.PathLike):
        patterns = [patterns]
    out: list[str] = []
    for pattern in (os.fspath(p) for p in patterns):
        found = _expand_one(pattern)
        if not found:
            if not is_url(pattern) and os.path.isdir(pattern):
                raise FileNotFoundError(
                    f"no data file in directory {pattern!r} (names starting with _ or . are "
                    "skipped)"
                )
            raise FileNotFoundError(f"no file matches {pattern!r}")
        out.extend(found)
    return sorted(dict.fromkeys(out))


def _data_file(name: str) -> bool:
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return not base.startswith(("_", "."))


def _expand_one(pattern: str) -> list[str]:
    if not is_url(pattern):
        if _has_glob(pattern):
            return sorted(p for p in globlib.glob(pattern) if os.path.isfile(p))
        if os.path.isdir(pattern):
            return sorted(
                os.path.join(pattern, n)
                for n in os.listdir(pattern)
                if _data_file(n) and os.path.isfile(os.path.join(pattern, n))
            )
        return [pattern] if os.path.isfile(pattern) else []
    fs, _, _ = fsspec.get_fs_token_paths(pattern)
    if _has_glob(pattern):
        paths = [p for p in fs.glob(pattern) if fs.isfile(p)]
    elif fs.isdir(pattern):
        paths = [p for p in fs.ls(pattern, detail=False) if _data_file(p) and fs.isfile(p)]
    else:
        paths = [pattern] if fs.exists(pattern) else []
    return sorted(p if is_url(p) else fs.unstrip_protocol(p) for p in paths)


def open_read(path: str) -> IO[bytes]:
    """Opens ``path`` for binary reading; unbuffered for local files (the reader buffers)."""
    if is_url(path):
        return fsspec.open(path, "rb").open()  # type: ignore[no-any-return]
    return open(path, "rb", buffering=0)


def open_write(path: str) -> IO[bytes]:
    """Opens ``path`` for binary writing, creating parent directories of local paths."""
    if is_url(path):
        fs, _, (p,) = fsspec.get_fs_token_paths(path)
        parent = p.rsplit("/", 1)[0]
        if parent and parent != p:
            fs.makedirs(parent, exist_ok=True)
        return fsspec.open(path, "wb").open()  # type: ignore[no-any-return]
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    return open(path, "wb")


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def join(directory: str, name: str) -> str:
    """Joins a directory (local or URL) and a file name."""
    if is_url(directory):
        return directory.rstrip("/") + "/" + name
    return os.path.join(directory, name)


def file_system(path: str) -> Any:
    """The fsspec filesystem for ``path`` (local paths get fsspec's local filesystem)."""
    return fsspec.get_fs_token_paths(path)[0]
