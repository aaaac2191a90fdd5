"""Atomic file writes: a temporary sibling, then ``os.replace``, so a reader never sees half a file.

The temporary file gets the permissions a plain ``open(path, "w")`` would (0666 minus the umask), not
``mkstemp``'s private 0600: results, figures and thresholds are shared with teammates on cluster file systems.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable


def _read_umask() -> int:
    umask = os.umask(0)  # the only portable way to read it: set and restore, once, at import
    os.umask(umask)
    return umask


_UMASK = _read_umask()


def default_mode(directory: bool = False) -> int:
    """The mode ``open``/``mkdir`` would give a new file or directory under the process umask (read at import:
    changing the umask on every write would race with other threads creating files)."""
    return (0o777 if directory else 0o666) & ~_UMASK


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], None], *, fsync: bool = False) -> Path:
    """Write ``path`` through ``write(tmp_path)`` (which creates or fills the temporary file), then rename.

    ``fsync``: flush the temporary file to disk before the rename and the directory entry after it, for files
    written by a callback that cannot fsync itself (e.g. safetensors' ``save_file``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, default_mode())
        if fsync:
            _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        with contextlib.suppress(OSError):  # directories cannot be opened for fsync everywhere (Windows)
            _fsync(path.parent)
    return path


def _fsync(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, fsync: bool = False) -> Path:
    """Write ``text`` (UTF-8, newlines as given) atomically; ``fsync`` flushes it to disk before the rename."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())

    return atomic_write(path, write)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False) -> Path:
    """Write ``data`` atomically; ``fsync`` flushes it to disk before the rename."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())

    return atomic_write(path, write)
