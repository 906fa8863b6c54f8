"""Checks of the Python API's arguments, as strict as the command line's
(:mod:`vecinfer_compile.commands.arguments`): a count below its minimum, a missing or empty
tokenizer, a codebook file given by its path. Each raises a TypeError or ValueError naming the
argument and the fix before any work starts."""

from __future__ import annotations

import os
from pathlib import Path


def check_count(name: str, value, minimum: int) -> int:
    """``value`` as a whole number of at least ``minimum`` (the keyword ``name`` in the message)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    value = value.__index__()
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_model(model, where: str) -> None:
    """TypeError unless ``model`` is a loaded model (a torch module with a Hugging Face config)."""
    if not (hasattr(model, "config") and hasattr(model, "parameters")):
        got = f"the path {model!r}" if isinstance(model, (str, os.PathLike)) else f"a {type(model).__name__}"
        raise TypeError(
            f"{where} needs a loaded model, got {got}: pass "
            "transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR)"
        )


def check_calibrate(model, tokenizer, texts, **counts: tuple[int, int]) -> None:
    """The arguments of :func:`~vecinfer_compile.calibrate` that need no work: the model, the
    tokenizer on the text, and ``counts`` (``name=(value, minimum)``)."""
    check_model(model, "calibrate")
    for name, (value, minimum) in counts.items():
        check_count(name, value, minimum)
    items = check_texts(texts)
    check_tokenizer(tokenizer, next(t for t in items if t.strip()))


def check_texts(texts) -> list[str]:
    """Calibration text: a string, or a list of strings, with more than white space in it."""
    items = [texts] if isinstance(texts, str) else texts
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) for t in items):
        raise TypeError(
            f"texts must be a string or a list of strings, got {type(texts).__name__}: read the "
            "file first, e.g. Path(FILE).read_text()"
        )
    if not any(t.strip() for t in items):
        raise ValueError("the calibration text is empty: give at least a few thousand tokens of text")
    return list(items)


def check_tokenizer(tokenizer, text: str, where: str = "calibrate") -> None:
    """TypeError for a missing tokenizer; ValueError for one that turns ``text`` (its first 2,000
    characters) into no tokens, or only its unknown token: a tokenizer without its vocabulary files
    (AutoTokenizer builds such an empty one from a folder that lacks them), which would calibrate
    on nothing."""
    if tokenizer is None or not callable(tokenizer):
        got = "None" if tokenizer is None else f"a {type(tokenizer).__name__}"
        raise TypeError(
            f"{where} needs the model's tokenizer, got {got}: pass "
            "transformers.AutoTokenizer.from_pretrained(MODEL_DIR), the folder holding its "
            "tokenizer.json (or tokenizer.model / vocab.json)"
        )
    sample = text[:2000]
    if not sample.strip():
        return
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    unknown = getattr(tokenizer, "unk_token_id", None)
    if not ids or (unknown is not None and len(sample) > 20 and all(i == unknown for i in ids)):
        source = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise ValueError(
            f"the tokenizer of {source} turns {len(sample):,} characters of text into "
            f"{'no tokens' if not ids else 'only its unknown token'}: it has no vocabulary (its "
            "tokenizer.json / tokenizer.model / vocab.json missing): copy the model's tokenizer "
            "files into its folder"
        )


def codebooks_arg(codebooks):
    """Codebooks given as a path (str or os.PathLike) are loaded with
    :func:`~vecinfer_compile.codebooks.load_codebooks`; other values are returned as they are."""
    if isinstance(codebooks, (str, os.PathLike)):
        from .codebooks import load_codebooks

        return load_codebooks(Path(codebooks))
    return codebooks


def check_codebooks_type(codebooks) -> None:
    """TypeError unless ``codebooks`` is None or a VecInferCodebooks."""
    from .codebooks import VecInferCodebooks

    if codebooks is not None and not isinstance(codebooks, VecInferCodebooks):
        raise TypeError(
            f"codebooks must be a path, a VecInferCodebooks (load_codebooks(path) or calibrate(...)) or "
            f"None, got {type(codebooks).__name__}"
        )
