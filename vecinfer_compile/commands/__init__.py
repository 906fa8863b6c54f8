"""Subcommands of the ``vecinfer`` command line: one module per subcommand, each with
``register(subparsers)``; :data:`vecinfer_compile.cli.COMMANDS` lists them. Shared argument
helpers live here."""

from __future__ import annotations

import argparse
import json
import sys


def add_model_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--model", required=required, metavar="DIR",
                   help="Hugging Face model directory" + ("" if required else " (default: the embedded tiny model)"))
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights/activations dtype (default float32)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")


def add_window_args(p: argparse.ArgumentParser, windows: int, window_len: int) -> None:
    p.add_argument("--windows", type=int, default=windows, metavar="N",
                   help=f"number of non-overlapping windows scored (default {windows})")
    p.add_argument("--window-len", type=int, default=window_len, metavar="L",
                   help=f"tokens per window (default {window_len})")


def add_calib_args(p: argparse.ArgumentParser, max_tokens: int = 32768) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"calibration tokens at most (default {max_tokens})")
    p.add_argument("--seq-len", type=int, default=1024, metavar="L",
                   help="calibration sequence length (default 1024); calibrate at the longest context you will "
                        "run: positions past it are quantized worse")
    p.add_argument("--iters", type=int, default=20, help="k-means iterations (default 20)")
    p.add_argument("--seed", type=int, default=0, help="k-means seed (default 0)")


def add_progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def bits_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"bits must be positive, got {text}")
    return value


def layer_bits_arg(text: str) -> list[float]:
    """``"2,2,1,2,1,4"`` -> ``[2.0, 2.0, 1.0, 2.0, 1.0, 4.0]``."""
    return [bits_arg(part) for part in text.split(",")]


def print_json(obj) -> None:
    """Exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=False) + "\n")
    sys.stdout.flush()


def positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
