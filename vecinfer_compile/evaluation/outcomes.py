"""How one path of the architecture sweep ended: ``works``, ``refused`` or ``crashed``, and why.

``refused``: a ValueError, TypeError or NotImplementedError that a ``raise`` statement of this
package raised (a clear error naming what is not supported), under any wrappers (Dynamo wraps a
backend's errors). ``crashed``: anything else, kept as type, one-line message and the place it was
raised (with the innermost frame of this package above it, if any); a sweep check that found
wrong numbers raises :class:`CheckFailed`, a path past its time limit :class:`PathTimeout`.
``skipped`` is for architectures, not paths (:mod:`.architectures`).
"""

from __future__ import annotations

import contextlib
import dis
import signal
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

WORKS, REFUSED, CRASHED, SKIPPED = "works", "refused", "crashed", "skipped"
STATUSES = (WORKS, REFUSED, CRASHED, SKIPPED)
_REFUSALS = (ValueError, TypeError, NotImplementedError)
_PACKAGE = Path(__file__).resolve().parents[1]
_SWEEP = tuple(str(Path(__file__).resolve().parent / f) for f in ("architectures.py", "outcomes.py"))


@dataclass
class Outcome:
    """One path of one architecture: a status of :data:`STATUSES` and, unless it works, why."""

    status: str
    reason: str = ""


class CheckFailed(AssertionError):
    """A path ran but gave the wrong result (a crash of its own kind: the numbers are wrong)."""


def one_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message on one line (whitespace collapsed), at most ``limit`` characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _deepest(exc: BaseException) -> BaseException:
    """The original exception under Dynamo's and transformers' wrappers (``__cause__`` chain)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None:
            break
        exc = inner
    return exc


def _short_path(filename: str) -> str:
    path = Path(filename)
    for anchor in ("site-packages", "dist-packages"):
        if anchor in path.parts:
            return "/".join(path.parts[path.parts.index(anchor) + 1 :])
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(_PACKAGE.parent))
    return path.name


def _in_package(frame: traceback.FrameSummary) -> bool:
    return Path(frame.filename).resolve().is_relative_to(_PACKAGE)


def where(exc: BaseException) -> str:
    """``file:line`` where ``exc`` was raised, and the innermost frame of this package above it
    (the sweep's own frames skipped: a time limit expires in its handler, not where the time went)."""
    frames = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if f.filename not in _SWEEP] or frames
    if not frames:
        return ""
    last = frames[-1]
    text = f"{_short_path(last.filename)}:{last.lineno}"
    ours = [f for f in frames if _in_package(f)]
    if ours and ours[-1] is not last:
        text += f" (from {_short_path(ours[-1].filename)}:{ours[-1].lineno})"
    return text


def raised_by_package(exc: BaseException) -> bool:
    """Whether a ``raise`` statement of this package raised ``exc`` (the instruction its innermost
    frame stopped at, not the source text, which may have changed since)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return (
        Path(code.co_filename).resolve().is_relative_to(_PACKAGE)
        and dis.opname[code.co_code[tb.tb_lasti]] == "RAISE_VARARGS"
    )


def outcome_of(exc: BaseException) -> Outcome:
    """refused for a ValueError/TypeError/NotImplementedError that a ``raise`` statement of this
    package raised; crashed with type, message and place for anything else."""
    origin = _deepest(exc)
    if isinstance(origin, CheckFailed):  # the sweep's own check: where it failed says nothing
        return Outcome(CRASHED, f"CheckFailed: {one_line(origin)}")
    if isinstance(origin, _REFUSALS) and raised_by_package(origin):
        return Outcome(REFUSED, one_line(origin))
    at = where(origin)
    return Outcome(CRASHED, f"{type(origin).__name__}: {one_line(origin)}" + (f" at {at}" if at else ""))


class PathTimeout(TimeoutError):
    """A path ran longer than the sweep's limit (``time_limit``)."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`PathTimeout` in the block after ``seconds`` (SIGALRM: the main thread of a
    POSIX process; elsewhere, or with None, no limit)."""
    usable = seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def expire(signum, frame):
        raise PathTimeout(f"took longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_step(step, seconds: float | None = None) -> Outcome:
    """Run ``step()`` within ``seconds``: works, or the :func:`outcome_of` what it raised."""
    try:
        with time_limit(seconds):
            step()
    except Exception as exc:  # every failure is recorded: the sweep goes on
        return outcome_of(exc)
    return Outcome(WORKS)
