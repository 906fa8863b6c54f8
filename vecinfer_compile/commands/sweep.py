"""``vecinfer sweep``: every causal-LM architecture of the installed transformers, tiny and random,
through the compiled, simulate and cache paths; a markdown table of what works."""

from __future__ import annotations

import difflib
import shlex
import time
from datetime import date

from . import add_progress_arg
from .arguments import new_file, real

HELP = "tiny random model of every transformers causal-LM architecture through compile, simulate and cache"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep",
        help=HELP,
        description=HELP + ". Each architecture gets one row: works, refused (a clear error of this "
        "package, its reason in the note), crashed (any other exception or a failed check: type, "
        "message and where) or skipped (its tiny model cannot be built or run in transformers). "
        "CPU, float32; every architecture takes a few seconds (compiling dominates).",
    )
    p.add_argument(
        "--only",
        metavar="NAME,...",
        default=None,
        help="these architectures only (model types of transformers' causal-LM mapping, "
        "e.g. llama,qwen2,mistral); default: all of them",
    )
    p.add_argument(
        "--timeout",
        type=real(0, above=True),
        default=None,
        metavar="S",
        help="seconds one path of one architecture may take before it counts as crashed (default 300)",
    )
    p.add_argument(
        "--out",
        metavar="PATH.md",
        default=None,
        type=new_file,
        help="also write the markdown document (command, versions, date, counts, table) here (a new file)",
    )
    add_progress_arg(p)
    p.set_defaults(func=run)


def _names(only: str | None) -> list[str] | None:
    from ..evaluation.architectures import causal_lm_names

    if only is None:
        return None
    known = causal_lm_names()
    names = [n.strip() for n in only.split(",") if n.strip()]
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"--only: {name!r} is not an architecture of transformers' causal-LM mapping{hint}")
    if not names:
        raise ValueError("--only needs at least one architecture name")
    return names


def versions() -> str:
    import torch
    import transformers

    return f"transformers {transformers.__version__}, torch {torch.__version__}"


def run(args) -> int:
    from pathlib import Path

    from ..evaluation.architecture_table import counts_line, document, table
    from ..evaluation.architectures import TIMEOUT, sweep

    names = _names(args.only)
    timeout = TIMEOUT if args.timeout is None else args.timeout
    t0 = time.perf_counter()
    results = sweep(names, timeout=timeout, progress=args.progress)
    seconds = time.perf_counter() - t0
    print(table(results))
    print(f"\n{counts_line(results)}; {versions()}; {seconds:.0f} s")
    if args.out:
        command = (
            "vecinfer sweep"
            + (f" --only {shlex.quote(args.only)}" if args.only else "")
            + f" --out {shlex.quote(args.out)}"
        )
        text = document(results, command=command, versions=versions(), date=date.today().isoformat(), seconds=seconds)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0
