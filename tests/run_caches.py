"""Compile caches of one test run, so that no run reads what an interrupted one left behind.

Inductor keeps compiled kernels (``.so``), Triton kernels and its precompiled headers (``.h.gch``,
about 150 MB each, under the system temp dir even when ``TORCHINDUCTOR_CACHE_DIR`` is set) in
directories every run shares, and it takes a file's existence as a finished build. A run killed
mid-write leaves a truncated file there, and every later run that compiles the same code fails on
it ("cannot read PCH file", a C++ compile error) until someone deletes the cache by hand.

So a run of the suite (``tests/conftest.py`` calls :func:`isolate` before torch loads) compiles
into a directory of its own, removed at the end; directories of runs that were killed are removed
by the next run (a run holds a lock on its directory while it lives, so a live run's directory,
even another user's, is never touched). Tests that start Python subprocesses pass them the same
environment. Set ``TORCHINDUCTOR_CACHE_DIR`` yourself to keep a warm cache across runs: then nothing
here applies.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "vecinfer-tests-"
LOCK = "lock"


def _try_lock(path: Path, create: bool = False) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock, or None if another process holds it
    (or the file is gone). The lock goes with the process: the kernel releases it when the process
    ends, however it ends."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def prune(parent: Path) -> list[Path]:
    """Remove the directories under ``parent`` of runs that ended without cleaning up (killed,
    interrupted); returns them."""
    removed = []
    for root in parent.glob(PREFIX + "*"):
        fd = _try_lock(root / LOCK)
        if fd is None:  # a live run, or one still creating its directory
            continue
        try:
            shutil.rmtree(root, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(root)
    return removed


class RunCaches:
    """One run's cache directory: ``root`` (locked by this process while ``lock_fd`` is open)."""

    def __init__(self, root: Path, lock_fd: int):
        self.root, self.lock_fd = root, lock_fd

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        os.close(self.lock_fd)


def isolate(environ=os.environ, parent: Path | None = None) -> RunCaches | None:
    """Point this process's compile caches (and its children's, through ``environ``) at a fresh
    directory under ``parent`` (the system temp dir), after pruning killed runs' directories there.
    None, changing nothing, when ``TORCHINDUCTOR_CACHE_DIR`` is already set. Sets
    ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR`` (unless set) and ``TMPDIR`` (Inductor puts
    precompiled headers under the temp dir, whatever its cache dir); pytest's ``tmp_path`` stays in
    the system temp dir (``PYTEST_DEBUG_TEMPROOT``)."""
    if environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    parent = Path(parent or tempfile.gettempdir())
    prune(parent)
    root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    fd = _try_lock(root / (LOCK + ".new"), create=True)
    assert fd is not None, root
    os.rename(root / (LOCK + ".new"), root / LOCK)  # the lock file appears only once locked
    environ.setdefault("PYTEST_DEBUG_TEMPROOT", str(parent))
    environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    environ["TMPDIR"] = str(root)
    if environ is os.environ:
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again (pytest's capture has asked already)
    return RunCaches(root, fd)
