"""The public API as a user meets it: help() documents the lazily imported names too."""

from __future__ import annotations

import pydoc

import vecinfer_compile


def test_help_documents_lazy_exports():
    text = pydoc.plain(pydoc.render_doc(vecinfer_compile))
    for needle in ("class VecInferCache", "cache_kwargs(", "vecinfer_backend", "simulation("):
        assert needle in text, needle
    assert set(vecinfer_compile.__all__) <= set(dir(vecinfer_compile))


def test_every_file_the_package_reads_is_in_its_package_data():
    """A non-editable install copies only the globs of pyproject's package-data besides the modules:
    a kernel header or data file they miss would be absent there (editable installs and this
    checkout would not notice)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    root = repo / "vecinfer_compile"
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["vecinfer_compile"]
    files = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert any(f.startswith("ops/cuda/") for f in files)
    missed = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missed, f"add globs for {missed} to [tool.setuptools.package-data] in pyproject.toml"
