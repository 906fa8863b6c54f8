"""Writing a file whole or not at all, and never over another one by accident.

:func:`write_new` writes through a temporary file in the target's folder and moves it in at the
end, only if the target is still new (or when the caller asks to overwrite): two runs writing one
path at once no longer both report success while the later silently replaces the first, an
interrupted write leaves no half file under the target's name, and a folder that does not exist is
refused before any work rather than created after it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def check_new_path(path: str | Path, *, overwrite: bool = False) -> Path:
    """``path`` as a Path, checked: not a folder, in a folder that exists, and new unless
    ``overwrite``. FileExistsError, FileNotFoundError, NotADirectoryError or IsADirectoryError
    naming the path and the fix."""
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory: give a file path, e.g. {path / 'codebooks.safetensors'}")
    if not parent.exists():
        raise FileNotFoundError(
            f"cannot write {path}: its folder {parent} does not exist: create it first (mkdir -p {parent})"
        )
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a directory")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists: give a new path, or pass overwrite=True to replace it")
    return path


def write_new(path: str | Path, write: Callable[[Path], object], *, overwrite: bool = False) -> Path:
    """Write ``path`` by calling ``write(temporary)``, a path in the same folder, then move the
    result in: only while ``path`` is still new (atomically, by a hard link), or in its place
    with ``overwrite``. The temporary file is removed whatever happens. Returns ``path``."""
    path = check_new_path(path, overwrite=overwrite)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot write {path}: cannot create a file in {path.parent} ({exc.strerror or exc})"
        ) from None
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        if overwrite:
            os.replace(tmp, path)
        else:
            _move_if_new(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _move_if_new(tmp: Path, path: Path) -> None:
    """Move ``tmp`` to ``path`` unless something else created ``path`` meanwhile."""
    try:
        os.link(tmp, path)  # fails, atomically, if path exists
    except FileExistsError:
        raise FileExistsError(
            f"{path} was created by something else while this was being written (another run "
            "with the same output?): it is kept as it is and nothing was written; give a new "
            "path"
        ) from None
    except OSError:  # a file system without hard links: check, then rename (a race window remains)
        if path.exists():
            raise FileExistsError(
                f"{path} was created by something else while this was being written: it is "
                "kept as it is and nothing was written; give a new path"
            ) from None
        os.rename(tmp, path)
