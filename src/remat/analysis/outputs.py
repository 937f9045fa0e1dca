"""Where a run's files go: paths checked before anything runs, and a run folder written aside and swapped in whole,
so an interrupted run leaves the previous folder as it was, never a mix of old and new files."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

from remat.parallel.launch import process_alive

# The files `remat explain` writes in its --out folder (with or without --pp), and the temporary names
# write_atomic and RunFolder use beside them.
RUN_FILE = re.compile(r"explain\.json|explain-pipeline\.json|timelines\.png|timeline-[^/]*\.json|\..*\.tmp")
# The files `remat measure` writes in its --timelines folder, and the temporary names beside them.
MEASURE_FILE = re.compile(r"measured-[^/]*-stage[0-9]+\.json|\..*\.tmp")

# NOTE [Staging names]
# What a run writes aside (RunFolder's staged folder, the old folder during the swap, a file outside the folder)
# is a hidden sibling named after its final name and its owner, ".<name>.<pid>@<host>.<random>.tmp" (the old
# folder: ".<name>.old-<pid>@<host>.<random>"), so that a later run can tell a dead run's leftovers (a SIGKILL or a
# SIGTERM runs no clean-up) from a live run's: remove_stale removes those whose process is gone on this host, and
# puts back an old folder whose swap was cut between its two renames.
_OWNED = r"(?P<old>old-)?(?P<pid>[0-9]+)@(?P<host>[A-Za-z0-9-]*)\.[A-Za-z0-9_]+(\.tmp)?"


def path_problem(path: str | os.PathLike[str], *, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written, as a file (or, with ``folder=True``, as a folder that is replaced whole);
    None when it can.

    Args:
        path: the file or folder a run will write.
        folder: True for a folder (:class:`RunFolder`), False for a file.

    Returns:
        A short reason (``'... is a file, not a folder'``, ``'cannot write in ... (permission denied)'``) or None.

    Example::

        >>> path_problem("/etc/passwd/report.html")
        '/etc/passwd is a file, not a folder'
    """
    path = Path(path)
    if path.exists():
        if folder and not path.is_dir():
            return "is a file, not a folder"
        if not folder and path.is_dir():
            return "is a folder: give a file name"
        if folder and not os.access(path, os.W_OK | os.X_OK):
            return "cannot replace this folder (permission denied)"
    ancestor = path.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a folder"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot write in {ancestor} (permission denied)"
    try:  # what os.access does not see: root on a read-only or virtual file system (/proc), a full disk's inodes
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=f".remat-probe.{owner()}.", suffix=".tmp")
    except OSError as err:
        return f"cannot write in {ancestor} ({(err.strerror or str(err)).lower()})"
    os.close(fd)
    os.unlink(probe)
    return None


def replace_problem(folder: str | os.PathLike[str], command: str, own: Iterable[str] = (),
                    pattern: re.Pattern[str] = RUN_FILE) -> str | None:
    """Why ``folder`` must not be replaced whole by ``command`` (``'remat explain'``): it is the current folder or
    holds it, or it holds files the command did not write (names ``pattern`` does not match, other than ``own``);
    None when it may.

    Example::

        >>> replace_problem(".", "remat explain")
        'is the current folder or holds it, and remat explain replaces the folder: give a new one'
    """
    if Path.cwd().resolve().is_relative_to(Path(folder).resolve()):
        return f"is the current folder or holds it, and {command} replaces the folder: give a new one"
    foreign = foreign_entries(folder, own, pattern)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        return (f"holds files {command} did not write ({shown}) and the folder is replaced whole: give a new or "
                "empty folder")
    return None


def foreign_entries(folder: str | os.PathLike[str], own: Iterable[str] = (),
                    pattern: re.Pattern[str] = RUN_FILE) -> list[str]:
    """Names in ``folder`` that a run did not write (``pattern``, default :data:`RUN_FILE`, or one of ``own``):
    replacing the folder would delete them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    keep = set(own)
    return sorted(p.name for p in folder.iterdir()
                  if p.name not in keep and not (p.is_file() and pattern.fullmatch(p.name)))


def owner() -> str:
    """``<pid>@<host>``: this process, as the names of what it writes aside record it (NOTE [Staging names])."""
    host = re.sub(r"[^A-Za-z0-9-]+", "-", socket.gethostname())[:40]
    return f"{os.getpid()}@{host}"


def remove_stale(final: str | os.PathLike[str]) -> list[Path]:
    """Remove what dead runs left beside ``final`` (a file or a folder) while writing it: their staged folders and
    temporary files; an old folder whose swap was cut between its two renames is put back when ``final`` is
    missing (it is the previous output), else removed. Only this host's runs whose process is gone; returns the
    paths removed or put back.

    Example::

        >>> remove_stale("remat-out")  # after a `remat explain --out remat-out` was killed mid-write
        [PosixPath('/home/me/.remat-out.4242@host.k3j2h1g0.tmp')]
    """
    final = Path(os.path.realpath(final))
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return []
    mine = owner().partition("@")[2]
    pattern = re.compile(rf"\.{re.escape(final.name)}\.{_OWNED}")
    done = []
    for path in entries:
        match = pattern.fullmatch(path.name)
        if not match or match["host"] != mine or process_alive(int(match["pid"])):
            continue
        if match["old"] and not final.exists() and not os.path.lexists(final):
            os.rename(path, final)
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        done.append(path)
    return done


class RunFolder:
    """A run's output folder, written in a fresh sibling folder and swapped in by :meth:`commit`.

    Files outside the folder (``--html``, ``--snapshot``) get a temporary name beside their final one
    (:meth:`outside`) and are renamed into place by :meth:`commit` too, just before the folder swap. Until then,
    nothing at the final paths changes; :meth:`discard` (or leaving the ``with`` block by an exception) removes
    everything written. A kill between the two renames of the swap (microseconds) leaves the old folder as a
    hidden ``.NAME.old-*`` sibling. Each name written aside records this process (NOTE [Staging names]): what a
    killed run left beside the target (or an outside file) is removed by the next :class:`RunFolder` of it
    (:func:`remove_stale`).

    Args:
        target: the folder to replace (created when missing).

    Example::

        >>> with RunFolder(Path("remat-out")) as run:
        ...     write_json(run.path("explain.json"), report)
        ...     run.commit()
    """

    def __init__(self, target: str | os.PathLike[str]):
        self.target = Path(os.path.realpath(target))
        self.target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(self.target)
        self.stage = Path(tempfile.mkdtemp(dir=self.target.parent, prefix=f".{self.target.name}.{owner()}.",
                                           suffix=".tmp"))
        os.chmod(self.stage, 0o777 & ~_umask())
        self._outside: list[tuple[Path, Path]] = []

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()

    def path(self, name: str) -> Path:
        """Where the file ``name`` of the folder is written until :meth:`commit`."""
        return self.stage / name

    def outside(self, final: str | os.PathLike[str]) -> Path:
        """A temporary path for ``final``, a file that :meth:`commit` renames into place; a ``final`` inside the
        target folder is written in the staged folder instead."""
        final = Path(os.path.realpath(final))
        if final.is_relative_to(self.target):
            return self.stage / final.relative_to(self.target)
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(final)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.{owner()}.", suffix=".tmp")
        os.close(fd)
        self._outside.append((Path(tmp), final))
        return Path(tmp)

    def commit(self) -> Path:
        """Rename the outside files into place, then swap the staged folder in for the target; returns it."""
        for tmp, final in self._outside:
            os.replace(tmp, final)
        self._outside = []
        if self.target.exists():
            old = Path(tempfile.mkdtemp(dir=self.target.parent, prefix=f".{self.target.name}.old-{owner()}."))
            os.rmdir(old)  # a free name: rename needs it not to exist
            os.rename(self.target, old)
            try:
                os.rename(self.stage, self.target)
            except BaseException:
                os.rename(old, self.target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.stage, self.target)
        return self.target

    def discard(self) -> None:
        """Remove whatever was written and not committed."""
        for tmp, _ in self._outside:
            tmp.unlink(missing_ok=True)
        self._outside = []
        if self.stage.exists():
            shutil.rmtree(self.stage, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
