"""The ``vecinfer`` command line (also ``python -m vecinfer_compile``).

Each subcommand lives in its own module of :mod:`vecinfer_compile.commands` with a
``register(subparsers)`` function that adds its parser and sets ``func`` (``args -> int``).
To add a subcommand, write the module and append its name to :data:`COMMANDS`.

Errors a user can fix (missing files, unknown methods, bad bits, codebooks for another model)
print one line to stderr and exit with code 2; set ``VECINFER_DEBUG=1`` for the traceback.
Arguments are checked before torch is imported (:mod:`vecinfer_compile.commands.arguments`), and
an output path is checked before any work, so a bad one costs a fraction of a second and writes
nothing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

# Modules of vecinfer_compile.commands, in the order `vecinfer --help` lists them.
COMMANDS: list[str] = [
    "demo",
    "calibrate",
    "eval_ppl",
    "ablation",
    "needle",
    "inspect",
    "gsm8k",
    "match",
    "sweep",
    "bench",
]

EXIT_USAGE = 2


class UsageError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors that main() turns into exit code 2 (no usage dump)."""

    def error(self, message):  # noqa: D401 - argparse API
        raise UsageError(f"{self.prog}: {message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(
        prog="vecinfer",
        description="VecInfer low-bit vector-quantized KV cache: demo, calibration and evaluation.",
    )
    parser.add_argument("--version", action="version", version=f"vecinfer_compile {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.commands.{name}").register(subparsers)
    return parser


def log_friendly_progress() -> None:
    """Progress bars for a log file rather than a terminal: every bar on one line (nested bars
    move the cursor with escape codes otherwise) and redrawn at most every 10 s. Set through
    tqdm's ``TQDM_*`` defaults, before tqdm is imported; a value the user set wins."""
    os.environ.setdefault("TQDM_POSITION", "0")
    os.environ.setdefault("TQDM_MININTERVAL", "10")


def check_kernel_env() -> None:
    """A bad ``$VECINFER_KERNEL`` refused before anything loads (a ValueError); the old name's
    FutureWarning printed as one line."""
    from .kernel_env import env_kernel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        env_kernel()
    for w in caught:
        print(f"vecinfer: warning: {w.message}", file=sys.stderr)


def check_device(args) -> None:
    """A GPU asked for on a machine without it: refused before anything else is imported."""
    if getattr(args, "device", "auto") not in ("auto", "cpu"):
        from .models import resolve_device

        resolve_device(args.device)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 user error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = os.environ.get("VECINFER_DEBUG", "") not in ("", "0")
    if not sys.stderr.isatty():
        log_friendly_progress()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        check_kernel_env()
        check_device(args)
        return int(args.func(args) or 0)
    except (UsageError, OSError, ValueError, ImportError) as exc:
        if debug:
            raise
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"vecinfer: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("vecinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
