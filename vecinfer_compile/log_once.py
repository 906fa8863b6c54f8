"""One log line per reason for the whole process: a kernel fallback or a slower path taken at every
step is worth saying once, not at every step."""

from __future__ import annotations

import logging

_said: set[tuple[str, str]] = set()


def log_once(logger: logging.Logger, level: int, key: str, message: str, *args) -> None:
    """``logger.log(level, message, *args)`` the first time ``(logger, key)`` is seen."""
    if (logger.name, key) not in _said:
        _said.add((logger.name, key))
        logger.log(level, message, *args)


def forget() -> None:
    """Say everything again (tests that count the lines)."""
    _said.clear()
