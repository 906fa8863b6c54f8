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
import time

_bar = contextvars.ContextVar("vecinfer_heartbeat_bar", default=None)
_LAST_BEAT = "_vecinfer_last_beat"  # when a beat last redrew a bar


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
        # A redraw at most every mininterval, and not through update(0): that would move tqdm's own
        # bookkeeping (the time and count of its last print), so that a bar iterated over counted
        # past its total and timed a layer from the last beat (an ETA off by the beats per layer).
        now = getattr(bar, "_time", time.time)()
        if now - max(getattr(bar, _LAST_BEAT, 0.0), bar.last_print_t) >= bar.mininterval:
            setattr(bar, _LAST_BEAT, now)
            bar.refresh()
