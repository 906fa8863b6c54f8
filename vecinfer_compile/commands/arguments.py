"""Argument types and checks of the command line that need neither torch nor a model.

Each type below is an ``argparse`` ``type=``: it returns the value (paths stay the text given) or
raises :class:`argparse.ArgumentTypeError`, which argparse prefixes with the option's name. So a
bad number, a missing input or an output that would overwrite a file is refused while the
arguments are parsed, in a fraction of a second, before anything is loaded or written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import tempfile
from pathlib import Path

from ..methods import METHODS, VQ_METHODS, normalize_bits
from ..safetensors_file import DamagedFile, TruncatedFile, describe_nonfinite, nonfinite_tensors, read_header

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def count(minimum: int):
    """An integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def power_of_two(text: str) -> int:
    """A power of two from 2 to 65536 (a state count)."""
    value = count(2)(text)
    if value & (value - 1) or value > 1 << 16:
        raise argparse.ArgumentTypeError(f"must be a power of two from 2 to 65536, got {value}")
    return value


def real(minimum: float, *, above: bool = False):
    """A finite number of at least ``minimum`` (``above``: greater than it)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            bound = "greater than" if above else "at least"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound} {minimum:g}, got {text}")
        return value

    return parse


def bits_arg(text: str) -> float:
    """A bit-width: a positive number (whether a method has it is checked with the method)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"bits must be positive, got {text}")
    return value


def layer_bits_arg(text: str) -> list[float]:
    """``"2,2,1,2,1,4"`` -> ``[2.0, 2.0, 1.0, 2.0, 1.0, 4.0]``."""
    return [bits_arg(part) for part in text.split(",")]


def number_list(kind, what: str, low: float, high: float = math.inf):
    """Comma-separated numbers of ``kind`` (int or float), each in ``[low, high]``."""

    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
        bad = [v for v in values if not low <= v <= high]
        if bad:
            bound = f"at least {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{what} must be {bound}, got {bad[0]:g}")
        return values

    return parse


def device_arg(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (whether that GPU exists is checked on loading)."""
    if not DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"unknown device {text!r}: use cpu, cuda, cuda:N or auto (cuda when available)"
        )
    return text


def _path(text: str) -> Path:
    """``text`` as a path; an empty one is an error (``Path("")`` would be the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return Path(text)


def _existing(text: str, what: str, *, folder: bool) -> Path:
    """``text`` as a path to an existing folder (or file); ArgumentTypeError naming what it is instead."""
    path = _path(text)
    if not (path.is_dir() if folder else path.is_file()):
        state = (
            "does not exist"
            if not path.exists()
            else "is not a directory"
            if folder
            else "is a directory, not a file"
            if path.is_dir()
            else "is not a regular file"
        )
        raise argparse.ArgumentTypeError(f"{what} {text} {state}")
    return path


# The files a Hugging Face tokenizer reads its vocabulary from (any one suffices), and the
# suffixes of weight files (safetensors, PyTorch, TensorFlow, Flax; sharded or not).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "spiece.model")
TOKENIZER_SUFFIXES = (".model", ".tiktoken")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")


def model_dir(text: str) -> str:
    """A Hugging Face model directory: a folder holding a config.json that is JSON, tokenizer files
    (without them AutoTokenizer may build an empty tokenizer, which turns every text into 0
    tokens) and weights."""
    path = _existing(text, "model directory", folder=True)
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"model directory {text} has no config.json: not a Hugging Face model directory"
        )
    try:
        json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"{path / 'config.json'} is not valid JSON ({exc}): copy the model's config.json again"
        ) from None
    names = [p.name for p in path.iterdir()]
    if not any(n in TOKENIZER_FILES or n.endswith(TOKENIZER_SUFFIXES) or n.startswith("vocab.") for n in names):
        raise argparse.ArgumentTypeError(
            f"model directory {text} has no tokenizer (no tokenizer.json, "
            "tokenizer.model or vocab.json): copy the model's tokenizer files into it"
        )
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in names):
        raise argparse.ArgumentTypeError(
            f"model directory {text} has no weights (no *.safetensors or "
            "pytorch_model*.bin): copy the model's weight files into it"
        )
    return text


def input_file(what: str):
    """An existing, readable, non-empty file."""

    def parse(text: str) -> str:
        path = _existing(text, what, folder=False)
        if not os.access(path, os.R_OK):
            raise argparse.ArgumentTypeError(f"{what} {text} is not readable")
        if path.stat().st_size == 0:
            raise argparse.ArgumentTypeError(f"{what} {text} is empty")
        return text

    return parse


def text_file(what: str):
    """An existing UTF-8 text file with more than white space in it."""
    exists = input_file(what)

    def parse(text: str) -> str:
        data = Path(exists(text)).read_bytes()
        try:
            content = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise argparse.ArgumentTypeError(
                f"{what} {text} is not UTF-8 (byte {exc.start}: 0x{data[exc.start]:02x}); convert it, e.g. "
                f"`iconv -f latin1 -t utf-8 FILE > FILE.utf8.txt`"
            ) from None
        if not content.strip():
            raise argparse.ArgumentTypeError(f"{what} {text} holds only white space")
        return text

    return parse


def input_dir(what: str):
    """An existing directory."""

    def parse(text: str) -> str:
        _existing(text, what, folder=True)
        return text

    return parse


def _check_writable_parent(path: Path, text: str) -> None:
    """The nearest existing folder above ``path`` must be a writable directory (the rest is created)."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot create {text}: {parent} is not writable")


def new_file(text: str) -> str:
    """An output file that does not exist yet (nothing is overwritten) in a folder that can be created."""
    path = _path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file path, e.g. {path / 'out'}")
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} exists: give a new path, or delete it first")
    _check_writable_parent(path, text)
    return text


def new_file_in_folder(text: str) -> str:
    """:func:`new_file` in a folder that exists already: a codebook file, written after a long fit
    (a mistyped folder used to be created silently once the fit was done)."""
    new_file(text)
    parent = _path(text).parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: its folder {parent} does not exist: create it first (mkdir -p {parent})"
        )
    try:  # a file written there for real: os.access says yes to root on a read-only file system
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: cannot create a file in {parent} ({exc.strerror or exc})"
        ) from None
    return text


def output_dir(text: str) -> str:
    """An output folder: an existing directory, or one that can be created."""
    path = _path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory: give a folder")
    if not path.exists():
        _check_writable_parent(path, text)
    elif not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {text} is not writable")
    return text


def codebook_file(text: str) -> str:
    """A file written by ``vecinfer calibrate``: its header read and every tensor checked finite
    without torch (a file holding NaN or inf used to load, then fail in the model's forward)."""
    path = input_file("codebook file")(text)
    codebook_header(path)
    bad = nonfinite_tensors(path)
    if bad:
        raise argparse.ArgumentTypeError(describe_nonfinite(path, bad))
    return text


def codebook_header(path: str) -> dict:
    """The ``vecinfer`` metadata of a codebook file (method, bits, ...), read from its safetensors
    header; ArgumentTypeError when the file is not one, or is truncated."""
    try:
        header, _ = read_header(path)
    except TruncatedFile as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except DamagedFile:
        header = {}
    try:
        meta = json.loads(header["__metadata__"]["vecinfer"])
        meta["bits"] = float(meta["bits"])
        if not isinstance(meta["method"], str):
            raise TypeError("method is not a name")
        return meta
    except (ValueError, KeyError, TypeError):
        raise argparse.ArgumentTypeError(
            f"codebook file {path} is not a codebook file of `vecinfer calibrate` (no vecinfer safetensors header)"
        ) from None


def method_with_codebooks(method: str | None, codebooks: str | None, default: str | None = None) -> str:
    """``--method``, else the method the codebook file records, else ``default``. ValueError when
    neither says, or when both say and disagree."""
    recorded = None if codebooks is None else codebook_header(codebooks).get("method")
    if method is not None and recorded is not None and method != recorded:
        raise ValueError(
            f"--method {method} disagrees with {codebooks}, calibrated for {recorded}: drop "
            f"--method (the file's method is used) or pass the codebooks of {method}"
        )
    chosen = method or recorded or default
    if chosen is None:
        raise ValueError(f"give --method (one of: {', '.join(METHODS)}), or --codebooks FILE whose method is used")
    return chosen


def bits_with_codebooks(method: str, bits: float | None, codebooks: str | None) -> float:
    """``--bits``, else the codebook file's bits for a VQ method, else the method's default;
    checked against the method's presets."""
    if codebooks is not None and method in VQ_METHODS:
        recorded = codebook_header(codebooks)["bits"]
        if bits is not None and float(bits) != recorded:
            raise ValueError(
                f"{codebooks}: these codebooks are for {recorded:g} bits, not {bits:g}: drop --bits (the "
                f"file's bits are used) or calibrate at {bits:g} bits"
            )
        bits = recorded
    return normalize_bits(method, bits)


def check_vq_sources(methods, codebooks: str | None, calib_text: str | None, cache_dir: str | None = None) -> None:
    """A VQ method needs codebooks (a file, a calibration text or a folder of saved ones); the
    other methods take none."""
    needs = [m for m in methods if m in VQ_METHODS]
    if codebooks is not None and len(needs) > 1:
        raise ValueError(f"--codebooks is one file for one method; {needs} need --calib-text instead")
    if needs and codebooks is None and calib_text is None and cache_dir is None:
        raise ValueError(
            f"method {needs[0]!r} needs codebooks: pass --codebooks FILE (from `vecinfer "
            "calibrate`) or --calib-text FILE to calibrate now"
        )
    if not needs and (codebooks is not None or calib_text is not None):
        raise ValueError(f"method {methods[0]!r} takes no codebooks; drop --codebooks/--calib-text")


def check_quantizes(residual: int, reach: int, what: str, fix: str | None = None) -> None:
    """ValueError when a full-precision window of ``residual`` tokens covers every key ``what``
    reads (``reach``: the farthest a query reads back, -1 when no query reads codes): nothing would
    be quantized, so the run would measure full precision under the method's name."""
    if residual <= reach:
        return
    fix = fix or f"use --residual at most {reach}"
    raise ValueError(
        f"nothing would be quantized: the full-precision window (--residual {residual}) covers "
        f"every key {what} reads; {fix}"
    )


def model_config(model_dir: str | Path | None) -> dict:
    """The settings of the language model in ``model_dir``'s config.json (its ``text_config`` for a
    multimodal model), read as JSON without torch; {} when there is no such file or it cannot be
    read (the checks below then wait for the loaded model)."""
    if model_dir is None:
        return {}
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    if isinstance(text, dict):
        return {**config, **text}
    if any(isinstance(v, dict) and "num_hidden_layers" in v for v in config.values()):
        return {}  # the language model in a sub-config of another name: left to the loaded model
    return config


def _config_int(config: dict, *names: str) -> int | None:
    """The first of ``names`` that ``config`` gives as a whole number, else None."""
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _position_limit(model) -> int | None:
    """``max_position_embeddings`` of a loaded model's (text) config, or of the config.json of a
    model directory (None: not stated)."""
    if model is None or isinstance(model, (str, Path)):
        return _config_int(model_config(model), "max_position_embeddings", "n_positions")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


def check_positions(model, tokens: int, what: str) -> None:
    """ValueError when ``tokens`` positions pass the model's ``max_position_embeddings``: such a
    run would score positions the model was never trained on (and take long to tell). ``model``: a
    loaded model, or its directory (its config.json is read, so that the run is refused before the
    model loads; nothing happens when it states no limit)."""
    limit = _position_limit(model)
    if limit is not None and tokens > limit:
        raise ValueError(
            f"{what} needs {tokens} positions, past the model's max_position_embeddings ({limit}): use at most {limit}"
        )


def check_layer_count(model_dir: str | Path | None, layer_bits: list | None) -> None:
    """ValueError when ``--layer-bits`` gives another count of presets than the model in
    ``model_dir`` has layers (``num_hidden_layers`` of its config.json), before it loads."""
    layers = _config_int(model_config(model_dir), "num_hidden_layers", "n_layer")
    if layer_bits is not None and layers is not None and len(layer_bits) != layers:
        raise ValueError(
            f"--layer-bits gives {len(layer_bits)} presets, but the model in {model_dir} has {layers} "
            f"layers (num_hidden_layers in its config.json): give one preset per layer"
        )


def check_codebooks_layers(codebooks: str | None, model_dir: str | Path | None) -> None:
    """ValueError when the codebook file was calibrated for a model of another number of layers
    than the one in ``model_dir`` (read from both files' headers, before the model loads; the rest
    of the geometry is checked against the loaded model)."""
    if codebooks is None:
        return
    layers = _config_int(model_config(model_dir), "num_hidden_layers", "n_layer")
    geometry = codebook_header(codebooks).get("geometry")
    theirs = geometry.get("num_layers") if isinstance(geometry, dict) else None
    if layers is not None and isinstance(theirs, int) and theirs != layers:
        raise ValueError(
            f"{codebooks}: these codebooks were calibrated for another model (num_layers: codebooks "
            f"{theirs} vs model {layers}, {model_dir}): run `vecinfer calibrate` on this model"
        )
