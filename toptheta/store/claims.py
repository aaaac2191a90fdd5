"""Claims: at most one job computes a given run, baseline or thresholds file at a time.

A claim is an exclusive lock on ``<dir>/<name>.lock``, held while a job computes the thing. A job that
finds the claim taken waits for it (saying who it waits for), then finds the finished result and reuses
it, so parallel jobs of a sweep (Hydra's joblib or submitit launcher, several shells, several nodes)
never compute the same thing twice. Both lock kinds come from the ``filelock`` package:

- ``flock`` (``filelock.FileLock``): the kernel drops the lock when its holder dies, however it dies.
- ``soft`` (``filelock.SoftFileLease``): a marker file that its holder's heartbeat thread refreshes every
  lease/3 seconds; a waiter takes the claim over once it has seen the marker unchanged for a whole lease,
  so a crashed job, on any host, blocks the others for about one lease (default 60 s) and never forever.
  For file systems without a working ``flock`` (some NFS, Lustre and GPFS mounts).

``TOPTHETA_LOCK=auto|flock|soft`` picks the kind (``auto``, the default: probe ``flock`` once per
directory, soft where it fails). Set ``soft`` on clusters whose ``flock`` is node-local (Lustre's
``localflock``): the probe cannot tell that it does not reach other nodes. ``TOPTHETA_LOCK_LEASE``
sets the soft lease in seconds; every job sharing the directory must use the same value.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import filelock

log = logging.getLogger(__name__)

LOCK_ENV = "TOPTHETA_LOCK"
LEASE_ENV = "TOPTHETA_LOCK_LEASE"
LOCK_KINDS = ("auto", "flock", "soft")
DEFAULT_LEASE_SECONDS = 60.0


def lock_kind(directory: str | os.PathLike[str]) -> str:
    """``flock`` or ``soft`` for locks in ``directory``, from $TOPTHETA_LOCK (``auto`` probes)."""
    kind = os.environ.get(LOCK_ENV, "auto") or "auto"
    if kind not in LOCK_KINDS:
        raise ValueError(f"{LOCK_ENV}={kind!r}; valid: {', '.join(LOCK_KINDS)} (auto probes flock, soft works anywhere)")
    if kind == "auto":
        return "flock" if _flock_works(str(Path(directory).resolve())) else "soft"
    return kind


@functools.cache
def _flock_works(directory: str) -> bool:
    """Whether flock works on a file in ``directory`` (ENOLCK, ENOSYS, EOPNOTSUPP: it does not)."""
    try:
        import fcntl  # POSIX only: optional
    except ImportError:  # not a POSIX system
        return False
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / ".flock-probe", "a", encoding="utf-8") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return True  # another job holds the probe right now: flock works
            log.info("flock is not supported in %s (%s): using soft file leases", directory, err)
            return False
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    return True


def lease_seconds() -> float:
    value = os.environ.get(LEASE_ENV) or DEFAULT_LEASE_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{LEASE_ENV}={value!r}: give a positive number of seconds, e.g. {LEASE_ENV}=60")
    return seconds


def make_lock(path: str | os.PathLike[str]) -> filelock.BaseFileLock:
    """An exclusive inter-process lock on ``path`` of the kind lock_kind chooses for its directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if lock_kind(path.parent) == "flock":
        return filelock.FileLock(str(path))
    return filelock.SoftFileLease(str(path), lease_duration=lease_seconds())


@contextlib.contextmanager
def claim(path: str | os.PathLike[str], what: str, *, wait: bool = True) -> Iterator[bool]:
    """Hold the claim on ``path`` inside the block; yields True once held.

    Taken by another job: with ``wait`` (the default) log it and block until the holder finishes, crashes
    or (soft locks) lets its lease lapse; without ``wait`` yield False at once and hold nothing. Either way
    the caller should look for the finished result first thing inside the block.
    """
    lock = make_lock(path)
    try:
        lock.acquire(blocking=False)
    except filelock.Timeout:
        if not wait:
            log.info("%s: claimed by another job (%s); skipping it here", what, path)
            yield False
            return
        log.info("%s: another job is computing it (claim %s); waiting for it to finish", what, path)
        lock.acquire()
    try:
        yield True
    finally:
        lock.release()
