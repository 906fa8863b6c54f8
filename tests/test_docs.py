"""README is a user guide and docs/results/ holds the numbers: the two set-up commands are the ones
CI runs, README stays short and free of work-log talk, every relative link of the docs resolves
(file and #anchor), and every results page opens with its current numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TRY = "pip install torch==2.13.0 && pip install -e . && vecinfer demo"
TEST = 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest -q'


def test_readme_set_up_commands_are_the_ones_ci_runs():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert TRY + "\n" in blocks and TEST + "\n" in blocks
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert all(step in ci for step in TEST.split(" && ")), ".ci/run no longer runs README's test command"


def test_readme_is_a_short_guide():
    text = README.read_text()
    assert len(text) <= 15_000, f"README.md is {len(text)} characters; move details to docs/"
    for pattern, what in [(r"\bissues? \d+|#\d+\b", "an issue number"),
                          (r"\bv[1-9]\b", "a kernel version name"),
                          (r"another host|earlier session|later session", "work-log talk")]:
        found = re.search(pattern, text)
        assert not found, f"README.md has {what}: {found.group(0)!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.*)$", text, re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        yield slug if n == 0 else f"{slug}-{n}"


DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in set(_anchors(file)):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"


def test_results_pages_open_with_current_numbers():
    pages = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert pages
    for page in pages:
        sections = re.findall(r"^## (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
        assert sections and sections[0] == "Current numbers", f"{page.name} must open with '## Current numbers'"
