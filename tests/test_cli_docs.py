"""docs/cli.md covers every `vecinfer` command and `vecinfer bench` benchmark, and the option lists
it shows are the commands' current `--help` (pasted by docs/gen_cli.py)."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOC = REPO_ROOT / "docs" / "cli.md"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_cli", REPO_ROOT / "docs" / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def registered() -> list[str]:
    """Every subcommand the parser knows (not only cli.COMMANDS: whatever registers one) and every
    benchmark of `vecinfer bench`."""
    from vecinfer_compile.cli import build_parser
    from vecinfer_compile.commands.bench import SCRIPTS

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "bench" in sub.choices and len(sub.choices) >= 9
    return list(sub.choices) + [f"bench {b}" for b in SCRIPTS]


def test_every_command_has_a_section():
    text = DOC.read_text()
    headings = set(re.findall(r"^#{2,3} `vecinfer ([a-z0-9 -]+)`\s*$", text, re.M))
    missing = [c for c in registered() if c not in headings]
    assert not missing, (
        f"docs/cli.md has no section for: {', '.join('vecinfer ' + c for c in missing)}. "
        f"Add '## `vecinfer NAME`' (or '### `vecinfer bench NAME`') with what it does, an "
        f"example on the shipped data and what it prints and writes, a "
        f"'<!-- help: vecinfer NAME -->' / '<!-- end help -->' pair, then run "
        f"python docs/gen_cli.py"
    )
    stale = [h for h in headings if h not in registered()]
    assert not stale, f"docs/cli.md documents commands that do not exist: {stale}"
    # the README points at docs/cli.md for each command
    assert "docs/cli.md" in (REPO_ROOT / "README.md").read_text()


def test_help_blocks_are_current(gen):
    assert gen.commands()[1:] == registered()  # the generator sees every command the test does
    _, problems = gen.refresh(DOC.read_text())
    assert not problems, "\n".join(problems)
