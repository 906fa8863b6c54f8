"""``vecinfer bench {decode,prefill,chunked-prefill,memory,generate,simulate,encode,append,ceiling,mask} [ARGS...]``: run a benchmark script of the
repository's ``benchmarks/`` folder (not part of the installed package) in this process.

Everything after the benchmark's name goes to the script: ``vecinfer bench memory --smoke``,
``vecinfer bench generate --cases 1x4096 --new-tokens 16``, ``vecinfer bench decode --help``.
The scripts are looked up in ``--benchmarks-dir``, else ``$VECINFER_BENCHMARKS_DIR``, else the
``benchmarks/`` folder next to the package (a source checkout, e.g. ``pip install -e .``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from unittest import mock

HELP = (
    "run a benchmark of the source checkout: decode, prefill, chunked-prefill, memory, generate, simulate, encode, "
    "append, ceiling, mask "
    "(GPU; --smoke on CPU)"
)

SCRIPTS: dict[str, tuple[str, str]] = {
    "decode": ("bench_decode_attention.py", "decode attention kernel vs FP16 SDPA (GPU)"),
    "memory": ("bench_memory.py", "KV bytes and peak memory vs HF dynamic/static caches (--smoke: CPU)"),
    "generate": (
        "bench_generate.py",
        "generate() decode tokens/s vs HF static compiled / dynamic eager (--smoke: CPU)",
    ),
    "prefill": ("bench_prefill_attention.py", "a prefill chunk's attention over codes vs FP16 flash (GPU)"),
    "chunked-prefill": ("bench_chunked_prefill.py", "generate()'s chunked prefill, compiled vs eager (--smoke: CPU)"),
    "simulate": ("bench_simulate_attention.py", "compiled simulate (prefill) attention vs SDPA (GPU)"),
    "encode": ("bench_encode.py", "encode / quantize kernels vs compiled PyTorch nearest centroid (GPU)"),
    "append": ("bench_append.py", "a decode step's cache append: nearest vs score-aware vs error-weighted codes (GPU)"),
    "ceiling": ("bench_gather_ceiling.py", "Triton code-read and centroid-gather floors of decode vs FP16 SDPA (GPU)"),
    "mask": (
        "bench_decode_mask.py",
        "host time of a decode step's attention mask: transformers' sdpa_mask vs ours (--smoke: CPU)",
    ),
}
ENV_DIR = "VECINFER_BENCHMARKS_DIR"


def register(subparsers) -> None:
    listing = "; ".join(f"{name}: {what}" for name, (_, what) in SCRIPTS.items())
    p = subparsers.add_parser(
        "bench",
        help=HELP,
        description=HELP + ". " + listing + ".",
        epilog="Arguments after the benchmark's name are the script's own: `vecinfer bench NAME --help`.",
    )
    p.add_argument(
        "--benchmarks-dir",
        metavar="DIR",
        default=None,
        help=f"folder holding the bench_*.py scripts (default: ${ENV_DIR}, else <checkout>/benchmarks)",
    )
    p.add_argument("benchmark", choices=list(SCRIPTS), help="which benchmark")
    p.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments for the script (e.g. --smoke, --cases 1x4096)",
    )
    p.set_defaults(func=run)


def benchmarks_dir(explicit: str | None = None) -> Path:
    """The folder of the benchmark scripts; FileNotFoundError (one line) when there is none."""
    if explicit or os.environ.get(ENV_DIR):
        folder = Path(explicit or os.environ[ENV_DIR]).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"benchmarks folder {folder} does not exist")
        return folder
    from .. import __file__ as package_init

    folder = Path(package_init).resolve().parents[1] / "benchmarks"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no benchmarks/ folder next to the installed package ({folder}): the benchmark scripts are "
            f"not shipped in the wheel; run from a source checkout (git clone, then pip install -e .) "
            f"or pass --benchmarks-dir DIR (or set {ENV_DIR})"
        )
    return folder


def load_script(name: str, folder: Path):
    """Import ``folder/<script of name>`` as a fresh module (benchmarks/ is not a package)."""
    script = folder / SCRIPTS[name][0]
    if not script.is_file():
        raise FileNotFoundError(f"benchmark script {script} is missing from {folder}")
    if str(folder) not in sys.path:  # the scripts import their sibling bench_common.py
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(f"vecinfer_bench_{name}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        raise ValueError(f"{script} has no main(argv) function")
    return module


@contextlib.contextmanager
def one_line_argument_errors(name: str):
    """A benchmark script's argparse errors as one line (no usage dump), like the other commands'."""
    from ..cli import UsageError

    def error(parser, message):
        raise UsageError(f"bench {name}: {message} (see vecinfer bench {name} --help)")

    with mock.patch.object(argparse.ArgumentParser, "error", error):
        yield


def run(args) -> int:
    from ..cli import UsageError

    folder = benchmarks_dir(args.benchmarks_dir)
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    saved_argv = sys.argv
    sys.argv = [f"vecinfer bench {args.benchmark}", *script_args]  # the script's usage/--help name
    try:
        module = load_script(args.benchmark, folder)
        with one_line_argument_errors(args.benchmark):
            module.main(script_args)
    except SystemExit as exc:  # argparse (--help, bad option) or "needs a CUDA GPU"
        if exc.code in (None, 0):
            return 0
        if isinstance(exc.code, int):
            return exc.code
        raise UsageError(f"bench {args.benchmark}: {exc.code}") from None
    finally:
        sys.argv = saved_argv
    return 0
