"""Refresh the option lists of docs/cli.md from the command line's own ``--help``.

    python docs/gen_cli.py           # rewrite every generated block of docs/cli.md
    python docs/gen_cli.py --check   # exit 1 (and say what) when a block is stale or missing

docs/cli.md has one section per ``vecinfer`` command and ``vecinfer bench`` benchmark, written by
hand (what it does, an example, what it prints and writes), each ending in a block between

    <!-- help: vecinfer NAME -->
    <!-- end help -->

that this script fills with ``vecinfer NAME --help`` at 100 columns. A command without such a
block is reported (write its section, then run this script); tests/test_cli_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent / "cli.md"
COLUMNS = 100
BLOCK = re.compile(r"(<!-- help: (?P<key>vecinfer[^>]*?) -->\n)(?P<body>.*?)(<!-- end help -->)", re.S)


def commands() -> list[str]:
    """Every registered ``vecinfer`` subcommand and every ``vecinfer bench`` benchmark, as the
    words after ``vecinfer`` (``"calibrate"``, ``"bench decode"``), in ``--help`` order, after
    ``""`` (``vecinfer --help`` itself)."""
    from vecinfer_compile.cli import build_parser
    from vecinfer_compile.commands.bench import SCRIPTS

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = [""]  # `vecinfer --help`: the list of commands
    for name in sub.choices:
        out.append(name)
        if name == "bench":
            out += [f"bench {b}" for b in SCRIPTS]
    return out


def help_text(command: str) -> str:
    """``vecinfer COMMAND --help`` as printed at :data:`COLUMNS` columns, trailing spaces dropped."""
    from vecinfer_compile.cli import main

    saved = {k: os.environ.get(k) for k in ("COLUMNS", "NO_COLOR", "PYTHON_COLORS")}
    os.environ.update({"COLUMNS": str(COLUMNS), "NO_COLOR": "1", "PYTHON_COLORS": "0"})
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            try:
                rc = main([*command.split(), "--help"])
            except SystemExit as exc:
                rc = exc.code
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if rc not in (0, None):
        raise RuntimeError(f"vecinfer {command} --help exited with {rc}")
    return "\n".join(line.rstrip() for line in buf.getvalue().strip("\n").splitlines())


def name(command: str) -> str:
    return f"vecinfer {command}".strip()


def render(command: str) -> str:
    return f"```text\n$ {name(command)} --help\n{help_text(command)}\n```\n"


def refresh(text: str) -> tuple[str, list[str]]:
    """``text`` with every help block rewritten, and the problems: commands without a block,
    blocks naming no command, blocks whose content changed."""
    wanted = commands()
    seen, problems = set(), []

    def sub(m: re.Match) -> str:
        key = m.group("key")[len("vecinfer ") :].strip()
        seen.add(key)
        if key not in wanted:
            problems.append(f"docs/cli.md has a help block for `{name(key)}`, which is not a command")
            return m.group(0)
        body = render(key)
        if body != m.group("body"):
            problems.append(f"the help block of `{name(key)}` is stale: run python docs/gen_cli.py")
        return m.group(1) + body + m.group(4)

    new = BLOCK.sub(sub, text)
    for key in wanted:
        if key not in seen:
            problems.append(
                f"`{name(key)}` has no section in docs/cli.md (no '<!-- help: {name(key)} -->' "
                f"block): write what it does, an example and what it prints, then run "
                f"python docs/gen_cli.py"
            )
    return new, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when docs/cli.md is out of date")
    args = p.parse_args(argv)
    text = DOC.read_text()
    new, problems = refresh(text)
    missing = [q for q in problems if "stale" not in q]
    if args.check:
        for q in problems:
            print(q, file=sys.stderr)
        return 1 if problems else 0
    if new != text:
        DOC.write_text(new)
        print(f"rewrote the help blocks of {DOC}")
    for q in missing:
        print(q, file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
