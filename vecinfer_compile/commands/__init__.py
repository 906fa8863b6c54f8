"""Subcommands of the ``vecinfer`` command line: one module per subcommand, each with
``register(subparsers)``; :data:`vecinfer_compile.cli.COMMANDS` lists them. Shared argument
helpers live here and in :mod:`.arguments` (the checks that need no model).

A subcommand's ``run(args)`` makes its remaining checks that need no model before it imports
torch or loads anything, so that every argument error costs well under a second."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .arguments import codebook_file, count, device_arg, model_dir, output_dir, text_file


def add_model_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument(
        "--model",
        required=required,
        metavar="DIR",
        type=model_dir,
        help="Hugging Face model directory" + ("" if required else " (default: the embedded tiny model)"),
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights/activations dtype (default float32)",
    )
    p.add_argument(
        "--device", default="auto", type=device_arg, help="cpu, cuda, cuda:1, ... (default: cuda if available)"
    )


def add_window_args(p: argparse.ArgumentParser, windows: int, window_len: int) -> None:
    p.add_argument(
        "--windows",
        type=count(1),
        default=windows,
        metavar="N",
        help=f"number of non-overlapping windows scored (default {windows})",
    )
    p.add_argument(
        "--window-len",
        type=count(2),
        default=window_len,
        metavar="L",
        help=f"tokens per window (default {window_len}; at most the model's max_position_embeddings)",
    )


def add_calib_args(p: argparse.ArgumentParser, max_tokens: int = 32768) -> None:
    p.add_argument(
        "--max-tokens",
        type=count(1),
        default=max_tokens,
        metavar="N",
        help=f"calibration tokens at most (default {max_tokens})",
    )
    p.add_argument(
        "--seq-len",
        type=count(2),
        default=1024,
        metavar="L",
        help="calibration sequence length (default 1024); calibrate at the longest context you will "
        "run: positions past it are quantized worse",
    )
    p.add_argument("--iters", type=count(1), default=20, metavar="N", help="k-means iterations (default 20)")
    p.add_argument("--seed", type=count(0), default=0, metavar="S", help="k-means seed (default 0)")


def add_codebook_source_args(p: argparse.ArgumentParser, codebooks_help: str, calib_help: str, save_help: str) -> None:
    """``--codebooks FILE`` or ``--calib-text FILE`` (one of them at most), and ``--save-codebooks DIR``."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--codebooks", metavar="FILE", type=codebook_file, help=codebooks_help)
    src.add_argument("--calib-text", metavar="FILE", type=text_file("calibration text"), help=calib_help)
    p.add_argument("--save-codebooks", metavar="DIR", default=None, type=output_dir, help=save_help)


def add_cache_backend_arg(p: argparse.ArgumentParser) -> None:
    """``--backend eager|compile``: how the cache's decode step runs."""
    p.add_argument(
        "--backend",
        choices=["eager", "compile"],
        default="eager",
        help="the cache's decode step: eager (default), or compiled with vecinfer_backend "
        "(the fused kernel over codes)",
    )


def add_progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def print_json(obj) -> None:
    """Exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=False) + "\n")
    sys.stdout.flush()


def save_and_print_json(args: argparse.Namespace, result: dict) -> bool:
    """Writes ``result`` as indented JSON to ``args.out`` when given (making its folder), prints it
    with :func:`print_json` when ``args.json``; returns ``args.json`` (False: the caller prints its
    text report)."""
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print_json(result)
    return args.json
