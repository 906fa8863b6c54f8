"""Heartbeats from long inner loops (k-means iterations, centroid refinement) to the progress bar
of the step that runs them, so that a long per-layer fit shows it is alive between layers.

The step opens :func:`reporting` with its tqdm bar; inner loops call :func:`beat` with what they
are doing. A beat only sets the bar's postfix and lets tqdm redraw when its ``mininterval`` has
passed, so it costs nothing measurable and never floods a log. Outside :func:`reporting` a beat
does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars

_bar = contextvars.ContextVar("vecinfer_heartbeat_bar", default=None)


@contextlib.contextmanager
def reporting(bar):
    """Within the block, :func:`beat` shows on ``bar`` (a tqdm bar; a disabled one shows nothing)."""
    token = _bar.set(bar)
    try:
        yield bar
    finally:
        _bar.reset(token)


def beat(what: str) -> None:
    """Say ``what`` the current inner loop is doing on the reporting bar, if any."""
    bar = _bar.get()
    if bar is not None and not bar.disable:
        bar.set_postfix_str(what, refresh=False)
        bar.update(0)  # redraws only once tqdm's mininterval has passed
