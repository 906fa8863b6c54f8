"""Checks of the Python API's arguments, as strict as the command line's
(:mod:`vecinfer_compile.commands.arguments`): here a tokenizer that turns text into no tokens.
Each raises a TypeError or ValueError naming the argument and the fix before any work starts."""

from __future__ import annotations


def check_tokenizer(tokenizer, text: str, where: str = "calibrate") -> None:
    """TypeError for a missing tokenizer; ValueError for one that turns ``text`` (its first 2,000
    characters) into no tokens, or only its unknown token: a tokenizer without its vocabulary files
    (AutoTokenizer builds such an empty one from a folder that lacks them), which would calibrate
    on nothing."""
    if tokenizer is None or not callable(tokenizer):
        got = "None" if tokenizer is None else f"a {type(tokenizer).__name__}"
        raise TypeError(f"{where} needs the model's tokenizer, got {got}: pass "
                        "transformers.AutoTokenizer.from_pretrained(MODEL_DIR), the folder holding its "
                        "tokenizer.json (or tokenizer.model / vocab.json)")
    sample = text[:2000]
    if not sample.strip():
        return
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    unknown = getattr(tokenizer, "unk_token_id", None)
    if not ids or (unknown is not None and len(sample) > 20 and all(i == unknown for i in ids)):
        source = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise ValueError(f"the tokenizer of {source} turns {len(sample):,} characters of text into "
                         f"{'no tokens' if not ids else 'only its unknown token'}: it has no vocabulary (its "
                         "tokenizer.json / tokenizer.model / vocab.json missing): copy the model's tokenizer "
                         "files into its folder")
