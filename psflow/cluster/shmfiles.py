"""The files a task makes in ``/dev/shm``, named for the process that made them.

A shared-memory lane (:mod:`psflow.transport.shm`) is three files, named
``psflow-<pid>-<pidns>-<random>`` (``.q`` and ``.r`` for its FIFOs): the process that made it
and its pid namespace. They live only until the server has mapped them, but a process killed
in that moment (SIGKILL, or a default SIGTERM) cannot remove them. Because the name says whose
they are, removing them later is safe: the launcher removes a task's once the task has exited
(:func:`remove_files_of`), and every process removes those of dead processes of its own pid
namespace before it makes its first lane (:func:`remove_stale`). A file whose process still
lives, or that belongs to another pid namespace (a container sharing ``/dev/shm``) or another
user, is never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "psflow-"
NAME = re.compile(r"psflow-(\d+)-(\d+)-[0-9a-f]{32}\Z")
"""A lane's name: the maker's pid, its pid namespace, 16 random bytes."""
_FILE = re.compile(r"(psflow-(\d+)-(\d+)-[0-9a-f]{32})(\.q|\.r)?\Z")


def pid_namespace() -> int:
    """This process's pid namespace (its inode; 0 where ``/proc`` does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_name() -> str:
    """A fresh lane name for this process."""
    return f"{PREFIX}{os.getpid()}-{pid_namespace()}-{secrets.token_hex(16)}"


def owner(name: str) -> tuple[int, int] | None:
    """The pid and pid namespace a lane file's name gives (``None``: not a lane file)."""
    m = _FILE.match(name)
    return (int(m.group(2)), int(m.group(3))) if m else None


def files_of(pid: int, directory: str = SHM_DIR) -> list[str]:
    """The lane files (paths) of process ``pid`` of this pid namespace."""
    ns = pid_namespace()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(
        os.path.join(directory, n) for n in names if n.startswith(PREFIX) and owner(n) == (pid, ns)
    )


def remove_files_of(pid: int, directory: str = SHM_DIR) -> list[str]:
    """Removes the lane files of process ``pid`` (which has exited); returns their paths."""
    return [path for path in files_of(pid, directory) if _remove_own(path)]


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Removes the lane files of this pid namespace's processes that no longer run."""
    ns = pid_namespace()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for n in sorted(names):
        who = owner(n) if n.startswith(PREFIX) else None
        if who is None or who[1] != ns or pid_alive(who[0]):
            continue
        path = os.path.join(directory, n)
        if _remove_own(path):
            removed.append(path)
    if removed:
        log.info("removed %d shared-memory files left by dead processes", len(removed))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True


def _remove_own(path: str) -> bool:
    """Unlinks ``path`` if it is a file or FIFO of this user (never following a link)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if st.st_uid != os.getuid() or not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        return True
    return False
