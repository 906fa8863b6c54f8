"""Shared helpers of the benchmark scripts (not a package: the scripts load this file by path).

- :func:`llama_config`: Llama-3.1-8B attention/MLP geometry (hidden 4096, 32 layers, 32 query
  heads, 8 KV heads, head_dim 128, intermediate 14336, vocab 128256), Llama-3.1-70B's (hidden
  8192, 80 layers, 64 query heads, 8 KV heads, intermediate 28672), either with fewer layers, or,
  with ``smoke=True``, a tiny Llama that runs on a laptop CPU in seconds.
- :func:`build_model`: a random-weight model built directly on the target device (no CPU
  round trip, no checkpoint), SDPA attention, eval mode.
- :func:`save_random_model` / :func:`load_tp_model`: that model written once as a bf16 checkpoint,
  and loaded from it with transformers' tensor parallelism (``tp_plan="auto"``, under torchrun).
- :func:`random_codebooks` (re-exported from :mod:`vecinfer_compile.testing`): random codebooks for a config —
  fine for speed and memory, meaningless for accuracy.
- :func:`bench_setup`: device / dtype / defaults for the normal run and for ``--smoke``.
- :func:`graph_time_ms`: median ms per call of calls captured in one CUDA graph (the attention
  benchmarks' timer), over :func:`copies_for` input copies that defeat the L2.
- small formatting and CUDA-memory helpers, and :func:`trellis_states` (an option's check).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
if (REPO_ROOT / "vecinfer_compile").is_dir():  # a checkout times its own package, even beside an installed one
    sys.path.insert(0, str(REPO_ROOT))

from vecinfer_compile.testing import random_codebooks  # noqa: F401, E402  (C.random_codebooks in the scripts)

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072 + 4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA_70B = dict(
    LLAMA_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
)
GEOMETRIES = {"8b": ("Llama-3.1-8B", LLAMA_8B), "70b": ("Llama-3.1-70B", LLAMA_70B)}
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@dataclass(frozen=True)
class Setup:
    """Where and how a benchmark runs."""

    smoke: bool
    device: torch.device
    dtype: torch.dtype
    config: LlamaConfig

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def label(self) -> str:
        where = torch.cuda.get_device_name(self.device) if self.cuda else "CPU"
        geo = "tiny Llama (smoke)" if self.smoke else geometry_label(self.config)
        return f"{geo}, {str(self.dtype).removeprefix('torch.')}, {where}"


def llama_config(smoke: bool = False, geometry: str = "8b", layers: int | None = None) -> LlamaConfig:
    """The config of ``geometry`` (a key of :data:`GEOMETRIES`; the tiny one if ``smoke``), with
    ``layers`` decoder layers when given."""
    shape = dict(TINY if smoke else GEOMETRIES[geometry][1])
    if layers:
        shape["num_hidden_layers"] = layers
    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    return config


def geometry_label(config) -> str:
    """``"Llama-3.1-70B geometry, 8 layers"``: the :data:`GEOMETRIES` entry ``config`` has (the
    layer count said when it is not the model's own), else its sizes."""
    for name, shape in GEOMETRIES.values():
        if all(getattr(config, k) == shape[k] for k in SHAPE_KEYS if k != "num_hidden_layers"):
            layers = config.num_hidden_layers
            return f"{name} geometry" + ("" if layers == shape["num_hidden_layers"] else f", {layers} layers")
    return f"Llama, {config.num_hidden_layers} layers, hidden {config.hidden_size}"


def bench_setup(smoke: bool, device: str | None = None, geometry: str = "8b", layers: int | None = None) -> Setup:
    """``smoke``: tiny config (``layers`` of them if given), float32, CPU. Otherwise ``geometry``
    (8B by default) in bf16 on CUDA (a clear SystemExit when there is no GPU: these numbers mean
    nothing on a CPU)."""
    if smoke:
        torch.set_num_threads(1)  # tiny tensors: threads only add contention (and CI boxes are shared)
        return Setup(True, torch.device(device or "cpu"), torch.float32, llama_config(True, layers=layers))
    if not torch.cuda.is_available() and (device is None or device.startswith("cuda")):
        raise SystemExit("this benchmark needs a CUDA GPU (use --smoke for a tiny CPU run)")
    dev = torch.device(device or "cuda")
    if dev.type == "cuda" and dev.index is None:  # "cuda" != "cuda:0" in device checks
        dev = torch.device("cuda", torch.cuda.current_device())
    return Setup(False, dev, torch.bfloat16, llama_config(False, geometry, layers))


def build_model(setup: Setup):
    """Random-weight causal LM allocated and initialised on ``setup.device`` (for the 8B
    geometry this is quick: ``normal_`` runs on the GPU)."""
    t0 = time.perf_counter()
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(setup.config, dtype=setup.dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = setup.config.pad_token_id
    sync(setup.device)
    model._bench_build_s = time.perf_counter() - t0
    return model


def save_random_model(setup: Setup, folder: str) -> str:
    """Write :func:`build_model` of ``setup`` to ``folder`` as a bf16 checkpoint (``save_pretrained``:
    config, generation config, safetensors shards), unless ``folder`` already holds a model of the
    same geometry (then it is reused; another geometry is a SystemExit). The write goes to
    ``folder.partial`` first, so a killed run never leaves a half checkpoint under ``folder``.
    Returns what was done, for the log."""
    path = Path(folder)
    if (path / "config.json").is_file():
        saved = LlamaConfig.from_pretrained(path)
        differ = [k for k in SHAPE_KEYS if getattr(saved, k) != getattr(setup.config, k)]
        if differ:
            raise SystemExit(
                f"{path} holds another geometry ({', '.join(differ)} differ): pick another folder or delete it"
            )
        return f"reusing the random-weight model in {path}"
    if path.exists():
        raise SystemExit(f"{path} exists but holds no model (no config.json): pick another folder")
    t0 = time.perf_counter()
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = build_model(setup)
    model.to(torch.bfloat16).save_pretrained(partial)
    del model
    free_memory(setup.device)
    os.replace(partial, path)
    took = time.perf_counter() - t0
    return f"wrote the random-weight model ({geometry_label(setup.config)}, bf16) to {path} in {took:.1f} s"


def load_tp_model(setup: Setup, folder: str):
    """``folder`` (from :func:`save_random_model`) loaded with ``tp_plan="auto"`` in ``setup.dtype``,
    SDPA attention, eval mode: run under ``torchrun --nproc-per-node N``; each rank holds its shard
    of every layer (attention split by heads). With N > 1 ``from_pretrained`` starts the process
    group (NCCL on CUDA, gloo on the CPU) and binds rank ``LOCAL_RANK`` to its GPU. With N = 1
    (TP=1) transformers sets up no TP and would load on the CPU, so the model goes to
    ``setup.device`` (no process group)."""
    place = {} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {"device_map": setup.device}
    t0 = time.perf_counter()
    from vecinfer_compile.hf.tensor_parallel import tp_load_kwargs

    model = AutoModelForCausalLM.from_pretrained(
        folder, **tp_load_kwargs("auto"), attn_implementation="sdpa", dtype=setup.dtype, **place
    )
    model.eval().requires_grad_(False)
    sync(model.device)
    model._bench_build_s = time.perf_counter() - t0
    return model


# -- parsing --------------------------------------------------------------------------------------
def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``"1x32768,16x32768"`` -> ``[(1, 32768), (16, 32768)]`` (batch x context length)."""
    cases = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            b, t = item.split("x")
            cases.append((int(b), int(t)))
        except ValueError:
            raise SystemExit(f"bad case {item!r}: write BxT, e.g. 1x32768") from None
    return cases


# -- memory and timing ----------------------------------------------------------------------------
def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def allocated(device) -> int | None:
    return torch.cuda.memory_allocated(device) if torch.device(device).type == "cuda" else None


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def gib(n: int | float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def human_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def short_error(exc: BaseException) -> str:
    """One table-safe line for an exception (OOM messages are long)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text.replace("|", "/")
    return f"{type(exc).__name__}: {text[:120]}"


L2_DEFEAT_BYTES = 256 * 2**20  # input copies that together exceed the H200's 60 MB L2 several times
MAX_COPIES = 128
REPLAYS = 15


def graph_time_ms(calls: list) -> float:
    """Median ms per call of ``calls`` (one per input copy) captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up: compiles, autotunes, allocates outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # where it warmed up, as CUDA-graph runners capture
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def copies_for(bytes_per_copy: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(L2_DEFEAT_BYTES / max(bytes_per_copy, 1))))


def write_json(path: str, rows: list[dict]) -> None:
    """Write ``rows`` atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, path)


def trellis_states(text: str) -> int:
    """argparse type of a trellis size: a power of two of at least 2 states (0: none)."""
    n = int(text)
    if n != 0 and (n < 2 or n & (n - 1)):
        raise argparse.ArgumentTypeError(f"{n} states: a trellis has a power of two of at least 2 states (or 0)")
    return n
