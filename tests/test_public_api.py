"""The public API as a user meets it: help() documents the lazily imported names too."""

from __future__ import annotations

import pydoc

import vecinfer_compile


def test_help_documents_lazy_exports():
    text = pydoc.plain(pydoc.render_doc(vecinfer_compile))
    for needle in ("class VecInferCache", "cache_kwargs(", "vecinfer_backend", "simulation("):
        assert needle in text, needle
    assert set(vecinfer_compile.__all__) <= set(dir(vecinfer_compile))
