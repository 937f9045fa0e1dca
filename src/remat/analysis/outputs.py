"""Where a run's files go: paths checked before anything runs, and a run folder written aside and swapped in whole,
so an interrupted run leaves the previous folder as it was, never a mix of old and new files."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

# The files `remat explain` writes in its --out folder (with or without --pp), and the temporary names
# write_atomic and RunFolder use beside them.
RUN_FILE = re.compile(r"explain\.json|explain-pipeline\.json|timelines\.png|timeline-[^/]*\.json|\..*\.tmp")


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
    return None


def foreign_entries(folder: str | os.PathLike[str], own: Iterable[str] = ()) -> list[str]:
    """Names in ``folder`` that a run did not write (:data:`RUN_FILE`, or one of ``own``): replacing the folder
    would delete them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    keep = set(own)
    return sorted(p.name for p in folder.iterdir()
                  if p.name not in keep and not (p.is_file() and RUN_FILE.fullmatch(p.name)))


class RunFolder:
    """A run's output folder, written in a fresh sibling folder and swapped in by :meth:`commit`.

    Files outside the folder (``--html``, ``--snapshot``) get a temporary name beside their final one
    (:meth:`outside`) and are renamed into place by :meth:`commit` too, just before the folder swap. Until then,
    nothing at the final paths changes; :meth:`discard` (or leaving the ``with`` block by an exception) removes
    everything written. A kill between the two renames of the swap (microseconds) leaves the old folder as a
    hidden ``.NAME.old-*`` sibling.

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
        self.stage = Path(tempfile.mkdtemp(dir=self.target.parent, prefix=f".{self.target.name}.", suffix=".tmp"))
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
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
        os.close(fd)
        self._outside.append((Path(tmp), final))
        return Path(tmp)

    def commit(self) -> Path:
        """Rename the outside files into place, then swap the staged folder in for the target; returns it."""
        for tmp, final in self._outside:
            os.replace(tmp, final)
        self._outside = []
        if self.target.exists():
            old = Path(tempfile.mkdtemp(dir=self.target.parent, prefix=f".{self.target.name}.old-"))
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
