"""README is a user guide and docs/results/ holds the numbers: the two set-up commands are the ones
CI runs, README stays short, every page (README, CONTRIBUTING, docs/ and its subfolders, examples/)
is free of work-log wording, every relative link of the docs resolves (file and #anchor), and every
results page is at most 20,000 characters and opens with its table of current numbers."""

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
    # CI may add options to a step (pytest's --durations), never change it
    assert all(any(line == step or line.startswith(step + " -") for line in ci) for step in TEST.split(" && ")), (
        ".ci/run no longer runs README's test command"
    )


def test_readme_is_a_short_guide():
    text = README.read_text()
    assert len(text) <= 15_000, f"README.md is {len(text)} characters; move details to docs/"
    for pattern, what in [
        (r"\bissues? \d+|#\d+\b", "an issue number"),
        (r"\bv[1-9]\b", "a kernel version name"),
        (r"another host|earlier session|later session", "work-log talk"),
    ]:
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


CONTRIBUTING = ROOT / "CONTRIBUTING.md"
DOCS = [README, *([CONTRIBUTING] if CONTRIBUTING.exists() else []), *sorted((ROOT / "docs").rglob("*.md"))]


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


# Work-log wording: what a page must not say, as (pattern, what it is, an example it must catch).
# Pages state measurements with their date, machine and command; who measured them, in which
# session or round, and how they compare to an earlier state of the code belong to git.
WORK_LOG = [
    (r"\bsessions?\b", "a work session", "measured in this session"),
    (
        r"\b(?:this|last|previous|earlier|later|next) (?:round|call|host|lease|tree|version)s?\b",
        "a measurement dated by another",
        "the previous tree's kernel",
    ),
    (
        r"\b(?:first|second|third|accuracy|kernel-speed|decode-speed|window) round\b",
        "a round of work",
        "the kernel-speed round's target",
    ),
    (r"\ba later\b", "a later ...", "fixed in a later call"),
    (r"\b(?:measured|found|shown) (?:earlier|previously)\b", "a measurement dated by another", "as measured earlier"),
    (
        r"\bearlier (?:calls?|sessions?|runs?|tables?|measurements?|sections?|versions?|forms?|kernels?)\b",
        "a measurement dated by another",
        "an earlier call gave 1.2x",
    ),
    (r"\bnow\b", "'now' (was X, is now Y)", "the kernel now takes 12 warps"),
    (r"\bpreviously\b", "'previously'", "previously 3.2x"),
    (r"\bdone\b", "'done'", "Done: see the next section"),
    (r"\bnot yet\b", "'not yet'", "not yet run on a GPU"),
    (r"\bissues? #?\d+", "an issue number", "issue 14's targets"),
    (r"(?<![\w/.-])#\d+(?![\w-])", "an issue number", "see #30"),
    (r"\bthe issue\b", "a reference to an issue", "as the issue asks"),
    (
        r"\banother host\b|\bother hosts\b|\b(?:was|were) lent\b|\bdevice (?:time|budget)\b|\btime box\b",
        "who measured where, and with what budget",
        "no H200 was lent",
    ),
    (r"\bthrowaway\b|\.carry\b", "scratch work", "a throwaway probe in .carry"),
    (r"\b(?:I|we) (?:have|had|did|measured|found|tried|designed|ran|saw)\b", "first person", "we measured it twice"),
    (r"\btoday'?s?\b", "'today'", "today's tree"),
    (r"\b(?:new|old) (?:tree|kernel|code)\b", "a state of the code named by its age", "the new kernel"),
    (r"(?-i:\bv[1-9]\b)", "a kernel version name (lower case: DeepSeek-V2 is a model)", "kernel v8"),
]
# Headings that date a measurement only relative to others ("a later session", "second round").
RELATIVE_HEADING = (
    r"\b(?:later|earlier|previous|latest|newest|today|now|again|new|old)\b"
    r"|\b(?:first|second|third|next|last) (?:round|session|call)\b"
)
HELP_BLOCK = re.compile(r"<!-- help: .*? -->.*?<!-- end help -->", re.S)  # docs/cli.md: pasted --help


def work_log_findings(text: str, markdown: bool = True) -> list[str]:
    """Each work-log phrase in ``text`` (pasted ``--help`` blocks left out: their wording is the
    code's), as 'what: the phrase', and in markdown each heading dated only relative to others."""
    text = HELP_BLOCK.sub("", text)
    found = [f"{what}: {m.group(0)!r}" for pattern, what, _ in WORK_LOG for m in re.finditer(pattern, text, re.I)]
    headings = re.findall(r"^#{1,6} (.*)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M) if markdown else []
    for heading in headings:
        m = re.search(RELATIVE_HEADING, heading, re.I)
        if m:
            found.append(f"a heading dated only relative to others: {heading!r}")
    return found


SCREENED = [*DOCS, *sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file() and p.suffix in (".md", ".py"))]


@pytest.mark.parametrize("page", SCREENED, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_work_log_wording(page):
    found = work_log_findings(page.read_text(), markdown=page.suffix == ".md")
    assert not found, (
        f"{page.relative_to(ROOT)} has work-log wording (say what was measured, when, where):\n" + "\n".join(found)
    )


def test_the_work_log_screen_can_fail():
    """Every pattern catches its own example, a planted phrase and a relatively dated heading are
    caught in a page, and plain measured prose passes."""
    for pattern, what, example in WORK_LOG:
        assert re.search(pattern, example, re.I), f"the pattern for {what} misses its example {example!r}"
        assert work_log_findings(f"Intro.\n\nSome text; {example}.\n"), example
    planted = "# Decode\n\n## Current numbers\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\nAs we measured earlier, it is 2x.\n"
    assert work_log_findings(planted)
    assert work_log_findings("# Page\n\n### The kernel, measured again (H200)\n\ntext\n")
    clean = (
        "# Decode\n\n## Current numbers\n\n| claim | GPU | value | date | command |\n|---|---|---|---|---|\n"
        "| 2 bits, B=8/T=128k | H200 | 4.79x | 2026-12-06 | [1] |\n\nSee pytorch/pytorch#169232 and "
        "[the study](../studies/x.md#2-bits-and-more).\n"
    )
    assert work_log_findings(clean) == []
    assert opens_with_table(clean) and not opens_with_table(planted.replace("| a | b |", "Text first.\n\n| a | b |"))


def opens_with_table(text: str) -> bool:
    """After the page's title and its '## Current numbers' heading, the first thing is a table."""
    lines = [line for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines() if line.strip()]
    return (
        len(lines) >= 3 and lines[0].startswith("# ") and lines[1] == "## Current numbers" and lines[2].startswith("|")
    )


RESULTS_PAGE_LIMIT = 20_000


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "results").glob("*.md")), ids=lambda p: p.name)
def test_results_page_is_short_and_opens_with_its_table(page):
    text = page.read_text()
    assert len(text) <= RESULTS_PAGE_LIMIT, (
        f"{page.name} is {len(text):,} characters (at most "
        f"{RESULTS_PAGE_LIMIT:,}): keep the latest row of each claim "
        f"and move diagnoses to docs/studies/"
    )
    assert opens_with_table(text), f"{page.name} must open with '## Current numbers' and its table"
