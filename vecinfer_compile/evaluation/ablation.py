"""Run several (method, bits) rows of perplexity on one model and format them as a table.

Shared by ``vecinfer demo`` and ``vecinfer ablation`` (and usable from Python). Each VQ row is
calibrated once (or loaded from a codebook cache directory), then evaluated with the simulated
quantize->dequantize attention (eager) or the compile backend.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..methods import VQ_METHODS, normalize_bits
from .kv_bytes import kv_bytes
from .perplexity import perplexity

log = logging.getLogger(__name__)

LABELS = {
    # method "fp16" is the model unquantized, in the dtype it runs in (float32 on the CPU by
    # default); its KV bytes are counted at 16 bits, what a serving cache would hold
    "fp16": "full precision",
    "vecinfer": "VecInfer",
    "kivi": "KIVI",
    "vq": "VQ (plain)",
    "smooth": "VQ + smoothing",
    "hadamard": "VQ + Hadamard",
    "qaware": "query-aware + Hadamard, centred, refined centroids, error-weighted codes",
    "qaware-nearest": "query-aware + Hadamard, centred, refined centroids, nearest codes",
    "qaware-scoreaware": "query-aware + Hadamard, centred, refined centroids, score-aware keys",
    "qaware-norefine": "query-aware + Hadamard, centred, k-means centroids",
    "qaware-nocenter": "query-aware + Hadamard, uncentred",
    "qaware-nohadamard": "query-aware, uncentred",
    "qaware-sqrt": "query-aware S^1/2 + Hadamard, uncentred",
    "vecinfer-center": "VecInfer, centred keys",
    "prerope": "pre-RoPE keys (VecInfer, centred), values predicted from them",
    "prerope-keys": "pre-RoPE keys (VecInfer, centred)",
}

DEMO_ROWS: list[tuple[str, float]] = [
    ("fp16", 16),
    ("vecinfer", 4),
    ("vecinfer", 2),
    ("vecinfer", 1.5),
    ("kivi", 2),
]

ABLATION_ROWS: list[tuple[str, float]] = [
    ("fp16", 16),
    ("vecinfer", 4),
    ("vecinfer", 3),
    ("vecinfer", 2),
    ("vecinfer", 1.5),
    ("vecinfer", 1),
    ("kivi", 4),
    ("kivi", 2),
    ("vq", 2),
    ("vq", 1.5),
    ("smooth", 2),
    ("smooth", 1.5),
    ("hadamard", 2),
    ("hadamard", 1.5),
    ("qaware", 2),
    ("qaware", 1.5),
    ("qaware-nearest", 2),
    ("qaware-scoreaware", 2),
    ("qaware-norefine", 2),
    ("qaware-nocenter", 2),
    ("qaware-nohadamard", 2),
    ("qaware-sqrt", 2),
    ("vecinfer-center", 2),
]


def codebook_filename(method: str, bits: float, prefix: str = "") -> str:
    return f"{prefix}{method}-{bits:g}bit.safetensors"


def get_codebooks(
    model,
    tokenizer,
    method: str,
    bits: float,
    *,
    codebooks_path: str | Path | None = None,
    calib_text: str | None = None,
    cache_dir: str | Path | None = None,
    search_dirs: tuple = (),
    max_tokens: int = 32768,
    seq_len: int = 1024,
    iters: int = 20,
    seed: int = 0,
    progress: bool = True,
):
    """Codebooks for a VQ method: from ``codebooks_path``, else from the first of
    ``search_dirs`` / ``cache_dir`` holding :func:`codebook_filename`, else calibrated on
    ``calib_text`` (and saved to ``cache_dir`` if given). Loaded files are checked against the
    model, bits and method (errors) and the model's weights (a warning). ``None`` for fp16/kivi."""
    if method not in VQ_METHODS:
        if codebooks_path is not None:
            raise ValueError(f"--codebooks is only for VQ methods ({', '.join(VQ_METHODS)}), not {method!r}")
        return None
    from ..calibration import calibrate, recipe_mismatch
    from ..codebooks import load_codebooks

    path = Path(codebooks_path) if codebooks_path is not None else None
    if path is None:
        dirs = [Path(d) for d in (*search_dirs, cache_dir) if d is not None]
        path = next(
            (d / codebook_filename(method, bits) for d in dirs if (d / codebook_filename(method, bits)).is_file()), None
        )
    if path is not None:
        cb = load_codebooks(path)
        try:
            cb.check_model(model.config, bits=bits, method=method)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        stale = None if codebooks_path is not None else recipe_mismatch(cb, method)
        if stale is None:
            cb.check_weights(model)  # calibrated on another model of this shape: a warning
            return cb
        if calib_text is None:
            raise ValueError(
                f"{path} is a cached {method!r} file, but {stale}: delete it to recalibrate "
                f"(with calibration text), or pass it as --codebooks to use it as it is"
            )
        log.warning("%s: %s; calibrating %s %g-bit again", path, stale, method, bits)
    if calib_text is None:
        raise ValueError(
            f"method {method!r} needs codebooks: pass --codebooks FILE (from `vecinfer calibrate`) "
            f"or --calib-text FILE to calibrate now"
        )
    check_calibration_length(tokenizer, calib_text, seq_len, max_tokens)
    cb = calibrate(
        model,
        tokenizer,
        calib_text,
        bits=bits,
        method=method,
        max_tokens=max_tokens,
        seq_len=seq_len,
        iters=iters,
        seed=seed,
        progress=progress,
    )
    if cache_dir is not None:  # a stale cached file (above) is replaced
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        cb.save(Path(cache_dir) / codebook_filename(method, bits), overwrite=True)
    return cb


def check_calibration_length(tokenizer, calib_text: str, seq_len: int, max_tokens: int) -> None:
    """ValueError unless ``calib_text`` fills one calibration sequence (or ``max_tokens``, if
    fewer), as ``vecinfer calibrate`` requires: a few tokens would fit codebooks to almost nothing,
    silently."""
    from ..models import tokenize

    needed = min(seq_len, max_tokens)
    tokens = tokenize(tokenizer, calib_text[: needed * 64]).numel()  # a token is far fewer than 64 characters
    if tokens < needed:
        raise ValueError(
            f"the calibration text holds {tokens} tokens, fewer than one calibration sequence ({needed}: "
            "the smaller of --seq-len and --max-tokens): give a longer --calib-text, or lower --seq-len"
        )


@contextlib.contextmanager
def applied(model, method: str, bits: float, *, codebooks=None, residual: int = 0, backend: str = "eager"):
    """Yield a callable model that runs ``method``: eager simulation (quantize->dequantize
    inside attention) or ``torch.compile`` with the vecinfer backend. Eager simulation is
    switched off again on exit."""
    if backend not in ("eager", "compile"):
        raise ValueError(f"unknown backend {backend!r}; choose eager or compile")
    if backend == "compile":
        if method == "fp16":  # the compiled full-precision baseline: plain Inductor
            if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
                model.set_attn_implementation("sdpa")
            yield torch.compile(model)
            return
        if method not in VQ_METHODS:
            raise ValueError(f"--backend compile runs fp16 and the VQ methods, not {method!r}: use --backend eager")
        from ..backend import vecinfer_backend

        configured = vecinfer_backend.configure(codebooks=codebooks, bits=bits, method=method, residual=residual)
        yield torch.compile(model, backend=configured)
        return
    if method == "fp16":
        if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":
            model.set_attn_implementation("sdpa")
        yield model
        return
    from ..simulate import disable_simulation, enable_simulation

    enable_simulation(model, method, bits=bits, codebooks=codebooks, residual=residual)
    try:
        yield model
    finally:
        disable_simulation(model)


@dataclass
class Row:
    method: str
    label: str
    bits: float
    nominal_bits: float
    physical_bits_per_element: float
    kv_bytes_per_token: float
    fixed_bytes: int
    ppl: float
    nll: float
    tokens: int
    ppl_ratio: float | None = None
    seconds: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def evaluate_row(
    model,
    tokenizer,
    token_ids,
    method: str,
    bits: float,
    *,
    codebooks=None,
    windows: int,
    window_len: int,
    residual: int = 0,
    backend: str = "eager",
    progress: bool = True,
) -> Row:
    acc = kv_bytes(
        method,
        None if method == "fp16" else bits,
        model.config,
        residual=residual,
        layer_bits=getattr(codebooks, "layer_bits", None),  # a per-layer allocation's own presets
        weighted_codes=getattr(codebooks, "weighted_codes", None),
    )
    t0 = time.perf_counter()
    with applied(model, method, bits, codebooks=codebooks, residual=residual, backend=backend) as m:
        res = perplexity(m, token_ids, windows=windows, window_len=window_len, progress=progress)
    return Row(
        method=method,
        label=LABELS[method],
        bits=bits,
        nominal_bits=acc.nominal_bits,
        physical_bits_per_element=acc.physical_bits_per_element,
        kv_bytes_per_token=acc.bytes_per_token,
        fixed_bytes=acc.fixed_bytes,
        ppl=res.ppl,
        nll=res.nll,
        tokens=res.tokens,
        seconds={"eval": round(time.perf_counter() - t0, 3)},
    )


def run_rows(
    model,
    tokenizer,
    token_ids,
    rows,
    *,
    calib_text: str | None,
    windows: int,
    window_len: int,
    cache_dir: str | Path | None = None,
    search_dirs: tuple = (),
    max_tokens: int = 32768,
    seq_len: int = 1024,
    iters: int = 20,
    seed: int = 0,
    residual: int = 0,
    backend: str = "eager",
    progress: bool = True,
) -> list[Row]:
    """Evaluate each ``(method, bits)`` of ``rows``; ``ppl_ratio`` is relative to the fp16 row
    (evaluated first if present)."""
    rows = [(m, normalize_bits(m, b)) for m, b in rows]
    if any(m in VQ_METHODS for m, _ in rows) and calib_text is None and cache_dir is None and not search_dirs:
        raise ValueError("VQ rows need calibration text (--calib-text) or a codebook cache (--out-codebooks)")
    out: list[Row] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(rows, desc="rows", unit="row")
    for method, bits in rows:
        if bar is not None:
            bar.set_postfix_str(f"{method} {bits:g}")
        t0 = time.perf_counter()
        cb = get_codebooks(
            model,
            tokenizer,
            method,
            bits,
            calib_text=calib_text,
            cache_dir=cache_dir,
            search_dirs=search_dirs,
            max_tokens=max_tokens,
            seq_len=seq_len,
            iters=iters,
            seed=seed,
            progress=progress,
        )
        t_cal = time.perf_counter() - t0
        row = evaluate_row(
            model,
            tokenizer,
            token_ids,
            method,
            bits,
            codebooks=cb,
            windows=windows,
            window_len=window_len,
            residual=residual,
            backend=backend,
            progress=progress,
        )
        if cb is not None:
            row.seconds["calibrate"] = round(t_cal, 3)
        out.append(row)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    base = next((r.ppl for r in out if r.method == "fp16"), None)
    for r in out:
        r.ppl_ratio = None if base is None else r.ppl / base
    return out


def _fmt_bytes(n: float) -> str:
    return f"{n:,.0f}" if n >= 100 else f"{n:g}"


def format_table(rows: list[Row]) -> str:
    """A markdown table of the rows."""
    head = (
        "| method | nominal bits | physical bits/elem | KV bytes/token | fixed bytes | ppl | ppl / full precision |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        ratio = "—" if r.ppl_ratio is None else f"{r.ppl_ratio:.3f}"
        bits = "16" if r.method == "fp16" else f"{r.nominal_bits:g}"
        lines.append(
            f"| {r.label} | {bits} | {r.physical_bits_per_element:g} | {_fmt_bytes(r.kv_bytes_per_token)} "
            f"| {_fmt_bytes(r.fixed_bytes)} | {r.ppl:.3f} | {ratio} |"
        )
    return "\n".join(lines)
