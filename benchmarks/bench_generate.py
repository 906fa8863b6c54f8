"""End-to-end decode tokens/s with ``model.generate()``: VecInferCache compiled vs a strong
full-precision baseline vs HF static cache compiled vs HF dynamic cache eager, side by side, on a
random-weight Llama-3.1-8B-geometry model.

Methods (greedy, ``min_new_tokens = max_new_tokens = N``, random input ids, no padding):

- ``ours``: ``VecInferCache(model, random 2-bit codebooks, R=128)`` as the generate() cache and
  ``compile_config=CompileConfig(backend=vecinfer_backend.configure(codebooks=...), fullgraph=True)``
  (HF's default mode ``reduce-overhead``: CUDA graphs);
- ``fp16``: the strong full-precision baseline (``fp16_valid_cache.py``): a static cache stored
  position-major whose decode attention reads only the valid length with torch's varlen
  flash-attention kernel (``seqused_k``, split over the SMs at ``Tq = 1``), compiled with HF's
  default compile config (CUDA graphs); what a serving engine's decode step does;
- ``static``: HF ``StaticCache`` (what ``cache_implementation="static"`` builds, passed explicitly
  so it is reused across runs) with HF's default compile config (Inductor, reduce-overhead);
- ``dynamic``: HF ``DynamicCache``, eager (the paper's baseline).

For each (B, T) and method: one warm-up ``generate`` with a short prompt and the same cache size
(compiles the decode step and records CUDA graphs; not timed), then ``generate`` with N new
tokens on the full T-token prompt, timed step by step: a stopping criterion records a CUDA event
when each token is out (and, after a device sync, a host timestamp; HF synchronizes once per step
anyway). The headline is **device-timed steps**::

    tok/s = B / (mean time between consecutive tokens' CUDA events)        (host stamps on the CPU)

and next to it the **time to first token** (``prefill s``: the request's start to its first token,
the prefill, chunked or not, included). Two cross-checks, labelled: ``in-run tok/s`` from the host
timestamps, and ``tok/s by subtraction`` = ``B x (N - 1) / (time(N new tokens) - time(1 new
token))``, which divides a few decode steps by the difference of two prefills and is noise when a
prefill is long (at B=1/T=128k it reads far below the device-timed rate); ``--in-run-only`` skips
its 1-token run. Each row is printed as soon as it is measured; a method that fails (e.g. out of
memory) gets its error in its row and the run goes on.

    python benchmarks/bench_generate.py [--cases 1x32768,1x131072,16x32768] [--new-tokens 32]
        [--methods ours,static,dynamic]
    python benchmarks/bench_generate.py --smoke   # tiny config on the CPU, compiled too

``--profile K`` adds, per (case, method), one more ``generate`` of K new tokens under
``torch.profiler`` (the prefill and first step excluded): the kernels by device time per decode
step, their sum ("GPU busy") next to the wall time per step, so host overhead shows as the gap;
then one more such ``generate`` under ``cProfile``: the host time per step by who spends it (the
compiled forward call, which holds the CUDA-graph replay and its checks; transformers' generate
loop around it; vecinfer_compile's own Python).
With ``--prefill-chunk`` the same run's last prefill chunk (the one over the longest context) is
profiled too, and every row keeps the chunked prefill's own time (``prefill_chunks_s``; the table's
prefill column shows it, starred, under ``--in-run-only``).

``--stop-check deferred`` runs every method's ``generate`` under
``vecinfer_compile.defer_stop_check()``: transformers' loop then reads its stop flag one step
late, so the host queues step n+1 while the GPU runs step n instead of idling the GPU for its
per-step Python (docs/studies/decode-step-time.md); the device-timed steps show it, the in-run host stamps are not taken
(the timer syncs at the first token only). transformers defers only when a cache handed back to
the caller can undo a step: ours and fp16 can; HF's ``StaticCache`` only where transformers marks
its layers croppable (5.25 does, 5.17 does not: it then runs with the sync). Compare both in one call:

    python benchmarks/bench_generate.py --isolate --in-run-only --cases 1x131072 --methods ours,fp16 \
        --prefill-chunk 4096 --stop-check deferred

``--isolate`` measures every (case, method) in a fresh child process: otherwise a method runs
after another in one process and can inherit its memory (CUDA-graph pools, cached blocks); at
B=16, T=32k on an H200 both baselines ran out of memory that way, right after ours.

``--prefill-chunk N`` runs every method's prompt through the model in eager chunks of N tokens
before ``generate`` (``ours=128,fp16=1024``: per method): at B=16, T=32k HF's static cache cannot
prefill in one eager forward on an H200, and at the largest batches no method can (ours' chunks
read the older tokens from codes, by the rule of ``vecinfer_compile.ops.split_attention.chunk``, so its
prompt numerics change; the timed decode step does not). ``--until-error`` skips a method at
larger batch sizes of a length once it failed at a smaller one, so a list of batch sizes finds the
largest that fits; ``--in-run-only`` skips the 1-token run there (its prefill is most of a large
batch's time):

    python benchmarks/bench_generate.py --isolate --until-error --in-run-only --prefill-chunk 1024 \
        --methods ours,fp16 --cases 16x32768,24x32768,32x32768,64x32768,128x32768 --new-tokens 8

``--synthetic-prefill N`` replaces the prefill of ours and fp16 by a stand-in, for the largest
batches, whose real prefill takes minutes (ours at 32 rows of 32k: about 3): the first N tokens
go through the model (allocating the cache), then every layer is set to hold the prompt's T - 1
tokens, the older ones with random content (random codes for ours: random centroid gathers, as a
real cache has; normal noise for fp16). The timed decode step does the same work as after a real
prefill (its cost does not depend on the cached values); peak memory then counts the cache and
the decode step, not a prefill's activations. Rows say ``synthetic_prefill``:

    python benchmarks/bench_generate.py --isolate --until-error --in-run-only --synthetic-prefill 1024 \
        --methods ours --cases 128x32768,192x32768,256x32768 --new-tokens 8

``--job P --job-batch fp16=28,ours=200`` serves P prompts of the ``--cases`` length with every
method at its own batch (the largest that fits, found as above), a real prefill: one round per
method is measured (TTFT, device-timed steps, peak memory), and the job table gives ``ceil(P / B)``
rounds of ``TTFT + (N - 1) x step`` for N = 256, 2,048 and 8,192 new tokens, labelled as arithmetic
from the measured rates, with ours' job throughput over each baseline's:

    python benchmarks/bench_generate.py --isolate --in-run-only --job 224 --job-batch fp16=28,ours=200 \
        --cases 1x32768 --prefill-chunk ours=128,fp16=1024 --new-tokens 64

``--prefill-rows G`` prefills G rows at a time (``cache.filling_rows``: the rows' slice of the
batch's own buffers) and then decodes the whole batch, as a serving engine prefills few and
decodes many: the prefill's activations are sized for G rows, so ours can prefill its largest
batch in long chunks (a 128-token chunk re-reads the coded prefix 32x as often as a 4096-token one).
Per method, the same for both here:

    python benchmarks/bench_generate.py --isolate --in-run-only --job 224 --job-batch fp16=28,ours=224 \
        --cases 1x32768 --prefill-chunk 4096 --prefill-rows 4 --new-tokens 64

``--geometry 70b --layers 8`` picks Llama-3.1-70B's geometry with 8 decoder layers (the default
is the 8B geometry, all 32 layers).

Tensor parallelism (transformers' ``tp_plan="auto"``): the model must come from a checkpoint,
so write the random-weight model once, then run the same measurement under torchrun, where
every rank loads it sharded by heads (``N = 1`` is TP=1, the same code path):

    python benchmarks/bench_generate.py --save-model DIR [--geometry 70b --layers 8]
    torchrun --nproc-per-node N benchmarks/bench_generate.py --tp-model DIR --methods ours,fp16 \
        --cases 1x131072 --new-tokens 16 --json OUT.json

Every rank runs the same prefill and timed decode on the same random ids; rank 0 prints and
writes the rows, each with ``tp`` (the TP size), ``kv_bytes_per_rank`` (each rank's
``cache.kv_bytes()``, one GPU each) and ``kv_bytes_total`` (``tensor_parallel.total_kv_bytes``:
an all-reduce). ``fp16`` works under TP as it is: its buffers take the rank's KV heads from the
first key states.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import bench_common as C  # a sibling: benchmarks/ is on sys.path (script dir, or `vecinfer bench`)
import torch
from fp16_valid_cache import ValidLengthCache, ValidLengthLayer, restore_attention, use_valid_length_attention
from transformers import CompileConfig, DynamicCache, StaticCache, StoppingCriteria, StoppingCriteriaList

from vecinfer_compile.codebooks import model_geometry  # noqa: E402
from vecinfer_compile.codecs.trellis.code import random_code as random_trellis_codec  # noqa: E402
from vecinfer_compile.hf.compat import (
    cache_kwargs,  # noqa: E402  (bench_common puts the checkout on sys.path)
    forward_cache_kwargs,  # noqa: E402
)
from vecinfer_compile.hf.deferred_stop import defer_stop_check  # noqa: E402
from vecinfer_compile.hf.tensor_parallel import local_kv_heads, model_shard, total_kv_bytes  # noqa: E402
from vecinfer_compile.quant.score_aware import check_parallel_weight  # noqa: E402

METHODS = ("ours", "fp16", "static", "dynamic")
LABELS = {
    "ours": "ours (VecInferCache, compiled)",
    "fp16": "full precision, valid-length flash, compiled",
    "static": "HF static, compiled",
    "dynamic": "HF dynamic, eager",
}


class StepTimer(StoppingCriteria):
    """Never stops. Each time a token is produced it records a CUDA event on the current stream
    (on CUDA) and, after a device sync, a host timestamp; ``t0`` is the host time the request
    started (before any chunked prefill), for the time to first token. ``sync_every_step=False``
    (the deferred stop check) syncs at the first token only, so the host can run ahead: the
    events still time every step, the host stamps then only the first token."""

    def __init__(self, device, sync_every_step: bool = True):
        self.device, self.stamps, self.events, self.t0 = device, [], [], None
        self.sync_every_step = sync_every_step

    def __call__(self, input_ids, scores, **kwargs):
        if torch.device(self.device).type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        if self.sync_every_step or not self.stamps:
            C.sync(self.device)
            self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step_ms(self) -> list[float]:
        """Milliseconds between consecutive tokens: CUDA-event (device) time on CUDA, host
        timestamps elsewhere."""
        if self.events:
            return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:])]


class Runner:
    """One method at one (B, T): its cache (reused, reset before every generate) and compile config.
    ``prefill_chunk``: the prompt goes through the model in eager chunks of this many tokens
    before ``generate`` (0: ``generate`` prefills the whole prompt at once). For ours a chunk
    appended to a non-empty VecInferCache reads the older tokens from codes, so the prompt's
    numerics differ from a one-shot prefill; the decode step that is timed is the same.
    ``prefill_rows``: the prompt is prefilled that many rows at a time (``cache.filling_rows``), in
    chunks of ``prefill_chunk`` (0: all but the last token at once), before ``generate`` decodes
    the whole batch: a serving engine's small-batch prefill, large-batch decode."""

    def __init__(
        self,
        method,
        model,
        setup,
        codebooks,
        batch,
        max_cache_len,
        residual,
        prefill_chunk: int = 0,
        synthetic_prefill: int = 0,
        prefill_rows: int = 0,
        stop_check: str = "sync",
    ):
        self.method, self.model, self.setup = method, model, setup
        self.stop_check = stop_check
        self.prefill_chunk, self.synthetic_prefill = prefill_chunk, synthetic_prefill
        self.prefill_rows = prefill_rows if 0 < prefill_rows < batch else 0
        if self.prefill_rows and (synthetic_prefill or method not in ("ours", "fp16")):
            raise ValueError("--prefill-rows fills the caches of ours and fp16 only, and not with --synthetic-prefill")
        self.prefill_s = None  # the last generate()'s chunked (or synthetic) prefill, seconds
        self.chunk_profiler = None  # when set, the next chunked prefill records its last chunk in it
        if synthetic_prefill and method not in ("ours", "fp16"):
            raise ValueError(f"--synthetic-prefill fills the caches of ours and fp16 only, not {method}")
        self.cache, self.compile_config, self.previous_attention = None, None, None
        if method == "ours":
            from vecinfer_compile.backend import vecinfer_backend
            from vecinfer_compile.cache import VecInferCache

            self.cache = VecInferCache(
                model, codebooks, batch_size=batch, max_cache_len=max_cache_len, residual=residual
            )
            self.compile_config = CompileConfig(backend=vecinfer_backend.configure(codebooks=codebooks), fullgraph=True)
        elif method == "fp16":
            self.cache = ValidLengthCache(model.config, max_cache_len)
            self.compile_config = CompileConfig(fullgraph=True)
            self.previous_attention = use_valid_length_attention(model)
            if self.prefill_rows:  # row views need the buffers before the first update
                g = model_geometry(model.config)
                _, heads = local_kv_heads(model_shard(model), g["num_kv_heads"])  # this rank's, under TP
                self.cache.allocate(batch, heads, g["head_dim"], model.dtype, model.device)
        elif method == "static":
            self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
            self.compile_config = CompileConfig()  # HF's default: inductor, reduce-overhead
        elif method != "dynamic":
            raise ValueError(f"unknown method {method!r}: pick from {', '.join(METHODS)}")
        if self.compile_config is not None and not setup.cuda:
            self.compile_config._compile_all_devices = True  # let generate() compile decode on CPU

    def close(self) -> None:
        """Give the model back its own attention implementation."""
        if self.previous_attention is not None:
            restore_attention(self.model, self.previous_attention)
            self.previous_attention = None

    def generate(self, ids: torch.Tensor, new_tokens: int, extra_criteria=()) -> tuple[float, StepTimer, torch.Tensor]:
        if self.cache is None:
            cache = DynamicCache(config=self.model.config)
        else:
            cache = self.cache
            cache.reset()
        deferred = self.stop_check == "deferred"
        on_cuda = torch.device(self.setup.device).type == "cuda"  # transformers defers on CUDA only (events)
        timer = StepTimer(self.setup.device, sync_every_step=not (deferred and on_cuda))
        kwargs = {} if self.compile_config is None else {"compile_config": self.compile_config}
        C.sync(self.setup.device)
        t0 = timer.t0 = time.perf_counter()
        self.prefill_s = None
        if self.synthetic_prefill and ids.shape[1] > self.synthetic_prefill + 1:
            synthetic_prefill(
                self.model, ids, cache, self.synthetic_prefill, self.prefill_chunk or self.synthetic_prefill
            )
            C.sync(self.setup.device)
            self.prefill_s = time.perf_counter() - t0
        elif self.prefill_rows:
            prefill_by_rows(self.model, ids, cache, self.prefill_rows, self.prefill_chunk, self.chunk_profiler)
            C.sync(self.setup.device)
            self.prefill_s = time.perf_counter() - t0
        elif self.prefill_chunk and ids.shape[1] > self.prefill_chunk:
            prefill_in_chunks(self.model, ids, cache, self.prefill_chunk, self.chunk_profiler)
            C.sync(self.setup.device)
            self.prefill_s = time.perf_counter() - t0
        with warnings.catch_warnings(), defer_stop_check() if deferred else contextlib.nullcontext():
            warnings.simplefilter("ignore")
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **cache_kwargs(cache),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.setup.config.pad_token_id,
                stopping_criteria=StoppingCriteriaList([timer, *extra_criteria]),
                **kwargs,
            )
        C.sync(self.setup.device)
        elapsed = time.perf_counter() - t0
        if out.shape[1] != ids.shape[1] + new_tokens:
            raise RuntimeError(f"generated {out.shape[1] - ids.shape[1]} tokens, expected {new_tokens}")
        return elapsed, timer, out


@torch.no_grad()
def prefill_in_chunks(model, ids: torch.Tensor, cache, chunk: int, last_chunk_profiler=None) -> None:
    """All but the last of ``ids: [B, T]`` through ``model`` eagerly into ``cache``, ``chunk``
    tokens per forward (one logit row each); ``generate`` then finds ``T - 1`` cached tokens and
    prefills the last one. What HF's static cache needs at B=16/T=32k on one H200 (its one-shot
    eager prefill runs out of memory), and every method at the largest batches.
    ``last_chunk_profiler``: a ``torch.profiler.profile`` that records the last chunk (the one
    over the longest context)."""
    length = ids.shape[1]
    starts = list(range(0, length - 1, chunk))
    for start in starts:
        end = min(start + chunk, length - 1)
        position = torch.arange(start, end, device=ids.device)
        record = last_chunk_profiler is not None and start == starts[-1]
        if record:
            last_chunk_profiler.start()
        model(
            input_ids=ids[:, start:end],
            attention_mask=torch.ones_like(ids[:, :end]),
            **forward_cache_kwargs(model, cache),
            use_cache=True,
            position_ids=position[None].expand(ids.shape[0], -1),
            cache_position=position,
            logits_to_keep=1,
        )
        if record:
            C.sync(ids.device)
            last_chunk_profiler.stop()


@torch.no_grad()
def prefill_by_rows(model, ids: torch.Tensor, cache, rows: int, chunk: int, last_chunk_profiler=None) -> None:
    """All but the last of ``ids: [B, T]`` into ``cache``, ``rows`` rows at a time
    (``cache.filling_rows``: each group's forwards are ``rows`` wide), each group in chunks of
    ``chunk`` tokens (0: one forward). ``last_chunk_profiler`` records the last group's last chunk."""
    batch, length = ids.shape
    for start in range(0, batch, rows):
        stop = min(start + rows, batch)
        with cache.filling_rows(start, stop) as part:
            prefill_in_chunks(
                model, ids[start:stop], part, chunk or length, last_chunk_profiler if stop == batch else None
            )


@torch.no_grad()
def synthetic_prefill(model, ids: torch.Tensor, cache, real: int, chunk: int) -> None:
    """The stand-in for a prefill of all but the last of ``ids: [B, T]`` (``--synthetic-prefill``):
    ``real`` tokens through the model in chunks of ``chunk``, then every layer holds ``T - 1``
    tokens: ours' code slots random bytes (valid codes in both storage formats) with the window
    as the real tokens left it; fp16's slots past the real ones normal noise."""
    from vecinfer_compile.cache import VecInferLayer

    held = ids.shape[1] - 1
    prefill_in_chunks(model, ids[:, : real + 1], cache, chunk)
    for layer in cache.layers:
        if isinstance(layer, VecInferLayer):
            layer.storage.k_codes.random_(0, 256)
            layer.storage.v_codes.random_(0, 256)
            layer.storage.n_coded.fill_(held - int(layer.storage.n_window))
        elif isinstance(layer, ValidLengthLayer):
            layer.k_store[:, real:held].normal_()
            layer.v_store[:, real:held].normal_()
            layer.length.fill_(held)
        else:
            raise TypeError(f"--synthetic-prefill cannot fill a {type(layer).__name__}")


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["stats"].get(k, 0) for k in ("unique_graphs",))


def reset_compiled(model) -> None:
    """Forget compiled code (and CUDA graphs) between methods and cases: every (method, B, T)
    compiles afresh, and the recompile limit is never reached."""
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    torch._dynamo.reset()
    C.free_memory(next(model.parameters()).device)


class ProfileWindow(StoppingCriteria):
    """Never stops; starts ``prof`` once ``skip`` tokens exist and stops it ``steps`` tokens later,
    so only whole decode steps are recorded (not the prefill)."""

    def __init__(self, prof, skip: int, steps: int):
        self.prof, self.skip, self.steps, self.seen = prof, skip, steps, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.seen += 1
        if self.seen == self.skip:
            self.prof.start()
        elif self.seen == self.skip + self.steps:
            self.prof.stop()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HostProfile:
    """``cProfile`` with the ``start``/``stop`` of a ``torch.profiler`` run (for :class:`ProfileWindow`)."""

    def __init__(self):
        import cProfile

        self.prof = cProfile.Profile()

    def start(self):
        self.prof.enable()

    def stop(self):
        self.prof.disable()


# Host time of a decode step by who spends it: (label, file fragment, function name) whose cumulative
# time is reported (name None: the outermost function of that file, whatever torch version names it);
# "vecinfer_compile" sums the own time of every function in the package's files.
HOST_PARTS = (
    ("compiled forward (guards, CUDA-graph replay and its checks)", "torch/_dynamo/eval_frame.py", None),
    (
        "transformers: prepare_inputs_for_generation",
        "transformers/generation/utils.py",
        "prepare_inputs_for_generation",
    ),
    (
        "transformers: create_masks_for_generate (in the above)",
        "transformers/masking_utils.py",
        "create_masks_for_generate",
    ),
    ("transformers: logits processors", "transformers/generation/logits_process.py", "__call__"),
    (
        "transformers: stopping criteria (the bench's step timer waits for the GPU in one)",
        "transformers/generation/stopping_criteria.py",
        "__call__",
    ),
    (
        "transformers: _update_model_kwargs_for_generation",
        "transformers/generation/utils.py",
        "_update_model_kwargs_for_generation",
    ),
)


def host_table(host: HostProfile, per: int) -> dict:
    """Milliseconds per step of the :data:`HOST_PARTS`, of vecinfer_compile's own functions and of
    everything profiled, from a finished :class:`HostProfile`."""
    import pstats

    stats = pstats.Stats(host.prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)

    def cum(fragment, name):
        times = [v[3] for (f, _, n), v in stats.items() if name in (None, n) and fragment in f.replace("\\", "/")]
        return max(times, default=0.0) if name is None else sum(times)

    out = {label: 1e3 * cum(f, n) / per for label, f, n in HOST_PARTS}
    out["vecinfer_compile's own Python"] = (
        1e3 * sum(v[2] for (f, _, _), v in stats.items() if "vecinfer_compile" in f) / per
    )
    out["everything the host ran in those steps"] = 1e3 * sum(v[2] for v in stats.values()) / per
    return out


def kernel_table(prof, per: int, top: int = 15) -> tuple[float, list[dict], float]:
    """``(busy_us, kernels, launches)`` of a finished ``torch.profiler`` run, divided by ``per``
    (steps or chunks): the device time summed over kernels, the ``top`` kernels by device time,
    the number of kernel launches."""
    from torch.autograd import DeviceType

    per_kernel = []
    for ev in prof.key_averages():
        if ev.device_type != DeviceType.CUDA:
            continue
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0)
        per_kernel.append((t / per, ev.count / per, ev.key))
    per_kernel.sort(reverse=True)
    kernels = [{"us": round(t, 2), "calls": round(n, 2), "name": k[:110]} for t, n, k in per_kernel[:top]]
    return sum(t for t, _, _ in per_kernel), kernels, round(sum(n for _, n, _ in per_kernel), 1)


def _profiler(runner):
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.setup.cuda else []))


def profile_decode(runner, ids, steps: int) -> dict:
    """Kernels of ``steps`` decode steps of one ``generate`` (after the prefill and one more
    step): device time per step by kernel, their sum, and the wall time per step of the same
    run (with the profiler on). With ``--prefill-chunk``, the same run's last prefill chunk too
    (``"prefill_chunk"``: the same fields for that one forward)."""
    prof, chunk_prof = _profiler(runner), None
    if runner.prefill_chunk and not runner.synthetic_prefill:
        runner.chunk_profiler = chunk_prof = _profiler(runner)
    skip = 2
    try:
        _, timer, _ = runner.generate(ids, skip + steps + 1, extra_criteria=[ProfileWindow(prof, skip, steps)])
        stamps = timer.stamps
    finally:
        runner.chunk_profiler = None
    busy, kernels, launches = kernel_table(prof, steps)
    wall = [b - a for a, b in zip(stamps[skip - 1 : skip - 1 + steps], stamps[skip : skip + steps])]
    out = {"busy_us": busy, "wall_us": 1e6 * sum(wall) / max(len(wall), 1), "kernels": kernels, "n_kernels": launches}
    if chunk_prof is not None and chunk_prof.profiler is not None:
        busy, kernels, launches = kernel_table(chunk_prof, 1)
        out["prefill_chunk"] = {"busy_us": busy, "kernels": kernels, "n_kernels": launches}
    host = HostProfile()
    runner.generate(ids, skip + steps + 1, extra_criteria=[ProfileWindow(host, skip, steps)])
    out["host_ms"] = host_table(host, steps)
    return out


def print_profile(row: dict) -> None:
    p = row["profile"]
    print(
        f"# profile {row['B']}x{row['T']} {LABELS[row['method']]}: GPU busy {p['busy_us'] / 1e3:.2f} ms/step over "
        f"{p['n_kernels']:.0f} kernel launches; wall {p['wall_us'] / 1e3:.2f} ms/step (profiler on)"
    )
    for k in p["kernels"]:
        print(f"#   {k['us']:9.1f} us  {k['calls']:6.1f}x  {k['name']}")
    if "host_ms" in p:
        print(f"# host time per step, {row['B']}x{row['T']} {LABELS[row['method']]} (cProfile on, one more run):")
        for label, ms in p["host_ms"].items():
            print(f"#   {ms:7.3f} ms  {label}")
    chunk = p.get("prefill_chunk")
    if chunk:
        print(
            f"# profile {row['B']}x{row['T']} {LABELS[row['method']]}, the last prefill chunk of "
            f"{row.get('prefill_chunk')} tokens: GPU busy {chunk['busy_us'] / 1e3:.2f} ms over "
            f"{chunk['n_kernels']:.0f} kernel launches"
        )
        for k in chunk["kernels"]:
            print(f"#   {k['us']:9.1f} us  {k['calls']:6.1f}x  {k['name']}")


def kv_bytes_per_rank(cache) -> list[int]:
    """``cache.kv_bytes()`` of every rank, by rank (an all-gather: every rank must call it); one
    entry without torch.distributed."""
    local = cache.kv_bytes()
    if not torch.distributed.is_initialized():
        return [local]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, local)
    return out


def run_method(
    method,
    model,
    setup,
    codebooks,
    batch,
    length,
    new_tokens,
    residual,
    warmup_len,
    profile_steps: int = 0,
    prefill_chunk: int = 0,
    in_run_only: bool = False,
    synthetic: int = 0,
    prefill_rows: int = 0,
    stop_check: str = "sync",
) -> dict:
    dev = setup.device
    row = {"B": batch, "T": length, "method": method, "new_tokens": new_tokens, "stop_check": stop_check}
    if prefill_chunk:
        row["prefill_chunk"] = prefill_chunk
    if synthetic:
        row["synthetic_prefill"] = synthetic
    if 0 < prefill_rows < batch:
        row["prefill_rows"] = prefill_rows
    if in_run_only:
        row["in_run_only"] = True
    reset_compiled(model)
    vocab = setup.config.vocab_size
    gen = torch.Generator(device=dev).manual_seed(length * 131 + batch)
    ids = torch.randint(3, vocab, (batch, length), device=dev, generator=gen)
    cache_len = length + max(new_tokens, profile_steps + 3)  # the profiled run makes steps + 3 tokens
    runner = Runner(
        method, model, setup, codebooks, batch, cache_len, residual, prefill_chunk, synthetic, prefill_rows, stop_check
    )
    try:
        graphs_before = _compiled_graphs()
        t0 = time.perf_counter()
        runner.generate(ids[:, : min(warmup_len, length)], new_tokens)  # compile + CUDA graphs
        row["warmup_s"] = time.perf_counter() - t0
        row["warmup_compiles"] = _compiled_graphs() - graphs_before
        graphs_before = _compiled_graphs()
        C.reset_peak(dev)
        t_n, timer, _ = runner.generate(ids, new_tokens)
        row["peak_bytes"] = C.peak(dev)
        row["time_n_s"], row["subtraction_tok_s"] = t_n, None
        if runner.prefill_s is not None:
            row["prefill_chunks_s"] = runner.prefill_s
        if timer.stamps:  # the first token ends the prefill (chunked or not) and generate()'s first step
            row["ttft_s"] = timer.stamps[0] - timer.t0
        steps = timer.step_ms()
        if steps:  # the headline: device-timed decode steps (CUDA events; host stamps on the CPU)
            row["step_ms"] = sum(steps) / len(steps)
            row["step_ms_median"] = sorted(steps)[len(steps) // 2]
            row["tok_s"] = batch * 1e3 / row["step_ms"]
            row["step_timing"] = "cuda events" if timer.events else "host"
        if len(timer.stamps) >= 2:  # cross-check: host timestamps after a sync per step (not when deferred)
            row["in_run_tok_s"] = batch * (len(timer.stamps) - 1) / (timer.stamps[-1] - timer.stamps[0])
        if not in_run_only:  # cross-check: the t(N) - t(1) subtraction (two prefills' noise in it)
            t_1, _, _ = runner.generate(ids, 1)
            row["time_1_s"] = t_1
            row["subtraction_tok_s"] = batch * (new_tokens - 1) / (t_n - t_1) if t_n > t_1 else float("nan")
        # Dynamo graphs compiled during the timed runs (should be 0: the warm-up compiled them)
        row["timed_compiles"] = _compiled_graphs() - graphs_before
        row["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        if hasattr(runner.cache, "kv_bytes"):  # ours and fp16; collectives under TP
            row["kv_bytes_per_rank"] = kv_bytes_per_rank(runner.cache)
            row["kv_bytes_total"] = total_kv_bytes(runner.cache)
        if profile_steps:
            row["profile"] = profile_decode(runner, ids, profile_steps)
    finally:
        runner.close()
    del runner, ids
    return row


def _num(x, fmt="{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


HEADER = (
    "| B | T | method | tok/s (device-timed steps) | ms/step | prefill s (TTFT) | in-run tok/s (host) "
    "| tok/s by subtraction | warm-up s | peak |"
)
TP_HEADER = " KV/GPU | KV total | TP |"  # appended under tensor parallelism


def _prefill_cell(row: dict) -> str:
    """The time to first token (the prompt's prefill, chunked or not, and generate()'s first step);
    ``*`` when a chunked or synthetic prefill was part of it."""
    if row.get("ttft_s") is None:
        return "n/a"
    return f"{row['ttft_s']:.2f}" + ("*" if row.get("prefill_chunks_s") is not None else "")


def format_row(row: dict) -> str:
    head = f"| {row['B']} | {row['T']} | {LABELS[row['method']]} |"
    tp = (
        ""
        if "tp" not in row
        else (
            f" {C.human_bytes(row.get('kv_bytes_per_rank', [None])[0])} | "
            f"{C.human_bytes(row.get('kv_bytes_total'))} | {row['tp']} |"
        )
    )
    if "error" in row:
        return f"{head} error: {row['error']} | | | | | | |{tp}"
    note = ""
    if row.get("timed_compiles"):
        note = f" (WARNING: {row['timed_compiles']} graph(s) compiled during the timed runs)"
    return (
        f"{head} {_num(row.get('tok_s'))} | {_num(row.get('step_ms'), '{:.2f}')} | {_prefill_cell(row)} | "
        f"{_num(row.get('in_run_tok_s'))} | {_num(row.get('subtraction_tok_s'))} | {row['warmup_s']:.1f} | "
        f"{C.gib(row.get('peak_bytes'))}{note} |{tp}"
    )


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    x, y = (a or {}).get(key), (b or {}).get(key)
    if x is None or y is None or not (x == x and y == y and y > 0):  # missing or nan
        return "n/a"
    return f"{x / y:.2f}x"


def summary(rows: list[dict]) -> list[str]:
    """Per case: each method's headline tok/s and time to first token, and ours against each
    baseline (tok/s: ours / baseline, higher is better; TTFT: baseline / ours, higher is better)."""
    others = [m for m in METHODS if m != "ours"]
    lines = [
        "| B | T | "
        + " | ".join(f"{m} tok/s" for m in METHODS)
        + " | "
        + " | ".join(f"ours/{m} tok/s" for m in others)
        + " | "
        + " | ".join(f"{m} TTFT s" for m in METHODS)
        + " | "
        + " | ".join(f"TTFT {m}/ours" for m in others)
        + " |",
        "|---|---|" + "---|" * (2 * len(METHODS) + 2 * len(others)),
    ]
    cases = list(dict.fromkeys((r["B"], r["T"]) for r in rows))
    for b, t in cases:
        by = {r["method"]: r for r in rows if (r["B"], r["T"]) == (b, t) and "error" not in r}
        cells = [_num(by[m].get("tok_s")) if m in by else "error/skipped" for m in METHODS]
        cells += [_ratio(by.get("ours"), by.get(m), "tok_s") for m in others]
        cells += [_num(by[m].get("ttft_s"), "{:.2f}") if m in by else "-" for m in METHODS]
        cells += [_ratio(by.get(m), by.get("ours"), "ttft_s") for m in others]
        lines.append(f"| {b} | {t} | {' | '.join(cells)} |")
    return lines


JOB_TOKENS = (256, 2048, 8192)  # new tokens per prompt the job table extrapolates to (arithmetic)


def job_table(rows: list[dict], prompts: int) -> list[str]:
    """``--job P``: P prompts served by each method at its own batch B, in ceil(P / B) rounds of a
    real prefill then N decode steps. Measured per round: the time to first token and the
    device-timed step; the job's time for N new tokens is their arithmetic,
    ``rounds * (TTFT + (N - 1) * step)`` (the step measured at the prompt's length: longer
    generations grow each step's context, which this does not count)."""
    done = [r for r in rows if "error" not in r and r.get("ttft_s") and r.get("step_ms")]
    lines = [
        f"# job: {prompts} prompts; measured per round: TTFT and device-timed step at N = "
        f"{', '.join(sorted({str(r['new_tokens']) for r in done}) or ['-'])} new tokens; job times for other N are "
        "arithmetic from those rates: rounds * (TTFT + (N - 1) * step)",
        "| method | B | T | rounds | TTFT s (per round) | ms/step | peak - weights - KV | "
        + " | ".join(f"job s, N={n} | tok/s, N={n}" for n in JOB_TOKENS)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|---|" * len(JOB_TOKENS),
    ]
    rates = {}
    for r in done:
        rounds = -(-prompts // r["B"])
        cells = []
        for n in JOB_TOKENS:
            seconds = rounds * (r["ttft_s"] + (n - 1) * r["step_ms"] / 1e3)
            rates[(r["method"], n)] = prompts * n / seconds
            cells += [f"{seconds:.0f}", f"{prompts * n / seconds:.0f}"]
        extra = None
        if r.get("peak_bytes") is not None and r.get("kv_bytes_total") is not None:
            extra = r["peak_bytes"] - r["weights_bytes"] - r["kv_bytes_total"]
        lines.append(
            f"| {LABELS[r['method']]} | {r['B']} | {r['T']} | {rounds} | {r['ttft_s']:.1f} | "
            f"{r['step_ms']:.2f} | {C.gib(extra)} | {' | '.join(cells)} |"
        )
    for m in METHODS:
        if m != "ours" and ("ours", JOB_TOKENS[0]) in rates and (m, JOB_TOKENS[0]) in rates:
            lines.append(
                f"# job throughput ours / {m}: "
                + ", ".join(f"N={n} {rates[('ours', n)] / rates[(m, n)]:.2f}x" for n in JOB_TOKENS)
            )
    return lines


def per_method(text: str, methods: list[str], what: str) -> dict[str, int]:
    """``"1024"`` (every method) or ``"ours=128,fp16=1024"`` -> {method: int} (0 for methods not named)."""
    text = str(text).strip()
    if "=" not in text:
        return {m: int(text or 0) for m in methods}
    out = dict.fromkeys(methods, 0)
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in METHODS:
            raise SystemExit(f"{what}: unknown method {name.strip()!r} in {text!r}")
        out[name.strip()] = int(value)
    return out


def with_identity_metrics(codebooks) -> None:
    """Give every layer identity error metrics ``[H_kv, D, D]``: the weighted encode runs its full
    descent (its cost does not depend on the metric's values)."""
    h, d = codebooks.geometry["num_kv_heads"], codebooks.geometry["head_dim"]
    for i in codebooks.attention_layers():
        layer = codebooks.layer(i)
        layer.key_metric = torch.eye(d).expand(h, d, d).contiguous()
        layer.value_metric = layer.key_metric.clone()


def with_trellis_codecs(codebooks, states: int) -> None:
    """Code every layer's keys and values by random trellis codecs of ``states`` states at the
    layer's bits (:func:`vecinfer_compile.codecs.trellis.code.random_code`: the codec's cost, not its
    quality)."""
    h, d = codebooks.geometry["num_kv_heads"], codebooks.geometry["head_dim"]
    gen = torch.Generator().manual_seed(0)
    for i in codebooks.attention_layers():
        layer, bits = codebooks.layer(i), codebooks.bits if codebooks.layer_bits is None else codebooks.layer_bits[i]
        layer.keys, layer.values = (random_trellis_codec(gen, h, d, bits, states.bit_length() - 1) for _ in range(2))


def passthrough_args(args, new_tokens: int, residual: int, warmup_len: int) -> list[str]:
    """The options a child process of ``--isolate`` needs to measure the same thing."""
    out = [
        "--new-tokens",
        str(new_tokens),
        "--bits",
        str(args.bits),
        "--residual",
        str(residual),
        "--warmup-len",
        str(warmup_len),
        "--profile",
        str(args.profile),
        "--geometry",
        args.geometry,
        "--prefill-chunk",
        str(args.prefill_chunk),
        "--synthetic-prefill",
        str(args.synthetic_prefill),
        "--prefill-rows",
        str(args.prefill_rows),
        "--stop-check",
        args.stop_check,
        "--key-parallel-weight",
        str(args.key_parallel_weight),
    ]
    if args.weighted_codes:
        out.append("--weighted-codes")
    if args.trellis_states:
        out += ["--trellis-states", str(args.trellis_states)]
    if args.in_run_only:
        out.append("--in-run-only")
    if args.layers:
        out += ["--layers", str(args.layers)]
    if args.smoke:
        out.append("--smoke")
    if args.device:
        out += ["--device", args.device]
    return out


def run_isolated(extra: list[str], batch: int, length: int, method: str) -> dict:
    """One (case, method) measured by a child process of this script; its row, or its error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--cases",
            f"{batch}x{length}",
            "--methods",
            method,
            "--json",
            str(out),
            *extra,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rows = json.loads(out.read_text()) if out.exists() else []
    if rows:
        return rows[0]
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()] or [f"exit code {proc.returncode}"]
    return {"B": batch, "T": length, "method": method, "error": f"child process: {lines[-1][:120].replace('|', '/')}"}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--cases", default=None, help="BxT list (default 1x32768,1x131072,16x32768; smoke 2x24)")
    ap.add_argument("--new-tokens", type=int, default=None, help="N new tokens per timed run (default 32; smoke 3)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--bits", type=float, default=2.0)
    ap.add_argument(
        "--key-parallel-weight",
        type=float,
        default=1.0,
        metavar="W",
        help="ours: how the cache encodes keys (1: nearest centroid; above: score-aware codes, whose "
        "decode-step append adds the CUDA encoder's launch)",
    )
    ap.add_argument(
        "--weighted-codes",
        action="store_true",
        help="ours: error-weighted codes (identity metrics: the encode's cost, not its quality), whose "
        "decode-step append adds the CUDA encoder's launch",
    )
    ap.add_argument(
        "--trellis-states",
        type=C.trellis_states,
        default=0,
        metavar="S",
        help="ours: keys and values coded by random trellis codecs of S states (a power of two; "
        "0: the codebooks' codes)",
    )
    ap.add_argument("--residual", type=int, default=None, help="VecInferCache window R (default 128; smoke 8)")
    ap.add_argument(
        "--warmup-len", type=int, default=None, help="prompt length of the untimed warm-up run (default 256; smoke 8)"
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="K",
        help="also profile K decode steps per (case, method) and print the kernels by device time",
    )
    ap.add_argument(
        "--prefill-chunk",
        default="0",
        metavar="N",
        help="every method prefills in eager chunks of N tokens before generate() (default 0: "
        "at once); or per method, e.g. ours=128,fp16=1024",
    )
    ap.add_argument(
        "--prefill-rows",
        default="0",
        metavar="G",
        help="ours and fp16: prefill G rows at a time (chunked by --prefill-chunk), then decode the "
        "whole batch; or per method, e.g. ours=8,fp16=8 (default 0: every row at once)",
    )
    ap.add_argument(
        "--synthetic-prefill",
        type=int,
        default=0,
        metavar="N",
        help="ours and fp16: N real prompt tokens, then the cache set to hold the rest with random "
        "content (for the largest batches; the decode step's work is the same)",
    )
    ap.add_argument(
        "--until-error",
        action="store_true",
        help="once a method fails at some batch size (out of memory), skip it at the larger batch "
        "sizes of the same length: with --cases 16x32768,32x32768,... the largest batch that fits",
    )
    ap.add_argument(
        "--in-run-only",
        action="store_true",
        help="skip the 1-token run (one prefill less per row): only in-run tok/s, for the largest "
        "batches, whose prefill is most of the time",
    )
    ap.add_argument(
        "--job",
        type=int,
        default=0,
        metavar="P",
        help="serve P prompts: every method at its own batch (--job-batch), one real round measured, "
        "the job's time and tok/s for N = 256, 2048, 8192 new tokens from its rates",
    )
    ap.add_argument(
        "--job-batch",
        default=None,
        metavar="M=B,...",
        help="with --job: each method's batch, e.g. fp16=28,ours=200 (the length is --cases')",
    )
    ap.add_argument(
        "--tables-from",
        metavar="A.json,...",
        help="measure nothing: print the tables (the job table with --job P) from rows that earlier "
        "runs wrote with --json, e.g. two methods measured in separate GPU calls",
    )
    ap.add_argument(
        "--stop-check",
        choices=("sync", "deferred"),
        default="sync",
        help="sync: generate()'s stop check reads the device every step (transformers' default on CUDA); "
        "deferred: every method under vecinfer_compile.defer_stop_check(), the host queues the "
        "next step while the GPU runs this one (in-run host stamps are then not taken)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU: checks the script, not speed")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", help="also write the rows to this JSON file (after every row)")
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="run every (case, method) in its own process, so no method inherits another's "
        "memory (CUDA-graph pools, allocator cache)",
    )
    ap.add_argument(
        "--geometry",
        choices=sorted(C.GEOMETRIES),
        default="8b",
        help="Llama-3.1 geometry of the random-weight model (default 8b; ignored with --smoke)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the geometry's own; e.g. --geometry 70b --layers 8)",
    )
    ap.add_argument(
        "--save-model",
        metavar="DIR",
        help="write the random-weight model to DIR (bf16 checkpoint; reused if there) and exit",
    )
    ap.add_argument(
        "--tp-model",
        metavar="DIR",
        help="tensor parallel: every rank loads DIR (from --save-model; its geometry is DIR's) "
        "with tp_plan='auto'; run under torchrun --nproc-per-node N (N=1: TP=1)",
    )
    args = ap.parse_args(argv)
    if args.tables_from:
        rows = [row for path in args.tables_from.split(",") for row in json.loads(Path(path).read_text())]
        print(f"# from {args.tables_from} (rows of separate runs)")
        print("\n".join(job_table(rows, args.job) if args.job else summary(rows)), flush=True)
        return rows
    device = args.device
    if args.tp_model and not args.smoke and device is None:
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"  # rank r's GPU (never touch another rank's)
    setup = C.bench_setup(args.smoke, device, args.geometry, args.layers)
    if args.save_model:
        print(f"# {C.save_random_model(setup, args.save_model)}", flush=True)
        return []
    cases = C.parse_cases(args.cases or ("2x24" if args.smoke else "1x32768,1x131072,16x32768"))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}: pick from {', '.join(METHODS)}")
    chunks = per_method(args.prefill_chunk, methods, "--prefill-chunk")
    row_groups = per_method(args.prefill_rows, methods, "--prefill-rows")
    runs = [(b, t, m) for b, t in cases for m in methods]
    if args.job:
        if not args.job_batch or len({t for _, t in cases}) != 1:
            raise SystemExit("--job needs --job-batch (e.g. fp16=28,ours=200) and one length in --cases (e.g. 1x32768)")
        batches = per_method(args.job_batch, [], "--job-batch")
        methods = [m for m in METHODS if batches.get(m)]
        runs = [(batches[m], cases[0][1], m) for m in methods]
    new_tokens = args.new_tokens or (3 if args.smoke else 32)
    if new_tokens < 2:
        raise SystemExit("--new-tokens must be at least 2 (the 1-token run is subtracted)")
    residual = args.residual if args.residual is not None else (8 if args.smoke else 128)
    warmup_len = args.warmup_len or (8 if args.smoke else 256)
    tp, json_out = None, args.json
    if args.tp_model:
        if args.isolate:
            raise SystemExit("--isolate and --tp-model do not mix: run one torchrun per (case, method) instead")
        model = C.load_tp_model(setup, args.tp_model)
        setup = replace(setup, config=model.config)
        tp = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if tp > 1 and torch.distributed.get_rank() != 0:  # every rank measures, rank 0 reports
            sys.stdout, json_out = open(os.devnull, "w"), None
        built = f"loaded with tp_plan='auto' in {model._bench_build_s:.1f} s, TP={tp}"
    elif args.isolate:
        model, built = None, "per process"
    else:
        model = C.build_model(setup)
        built = f"built in {model._bench_build_s:.1f} s"
    codebooks = None if model is None else C.random_codebooks(setup.config, args.bits)
    if codebooks is not None:
        codebooks.metadata["key_parallel_weight"] = check_parallel_weight(args.key_parallel_weight)
        if args.weighted_codes:
            with_identity_metrics(codebooks)
        if args.trellis_states:
            with_trellis_codecs(codebooks, args.trellis_states)
    print(
        f"# generate() decode throughput, {setup.label}, random weights ({built}); "
        f"ours = {args.bits:g}-bit VecInferCache R={residual}"
        f"{'' if args.key_parallel_weight == 1 else f' (score-aware keys, weight {args.key_parallel_weight:g})'}"
        f"{' (error-weighted codes, identity metrics)' if args.weighted_codes else ''}"
        f"{f' (trellis codecs of {args.trellis_states} states)' if args.trellis_states else ''}; "
        f"N={new_tokens} new tokens, greedy; "
        f"stop check {args.stop_check}; "
        f"tok/s = B / (mean decode step), steps timed by CUDA events (host stamps on the CPU); "
        f"prefill s = time to first token of the N run (* chunked: prefill chunks "
        f"{', '.join(f'{m} {c}' for m, c in chunks.items() if c) or 'none'}"
        + "".join(f", {m} {g} rows at a time" for m, g in row_groups.items() if g)
        + "); cross-checks: in-run = host "
        "stamps after a sync per step, by subtraction = B*(N-1)/(t(N)-t(1)) (two prefills' noise in it); "
        "warm-up s includes compilation; peak = max allocated incl. weights"
        + (
            f"; SYNTHETIC prefill: {args.synthetic_prefill} real tokens, the rest random cache content"
            if args.synthetic_prefill
            else ""
        )
        + ("; KV/GPU = rank 0's cache bytes, KV total = all ranks'" if tp else "")
    )
    print(HEADER + (TP_HEADER if tp else ""))
    print("|---" * (HEADER.count("|") - 1 + (3 if tp else 0)) + "|", flush=True)
    rows, failed_at = [], {}  # (method, T) -> smallest failing batch (--until-error)
    for batch, length, method in runs:
        if args.until_error and batch > failed_at.get((method, length), batch):
            continue
        if args.isolate:
            row = run_isolated(passthrough_args(args, new_tokens, residual, warmup_len), batch, length, method)
        else:
            try:
                row = run_method(
                    method,
                    model,
                    setup,
                    codebooks,
                    batch,
                    length,
                    new_tokens,
                    residual,
                    warmup_len,
                    args.profile,
                    chunks[method],
                    args.in_run_only,
                    args.synthetic_prefill,
                    row_groups[method],
                    args.stop_check,
                )
            except Exception as exc:  # OOM, compile failure...: report and go on
                row = {"B": batch, "T": length, "method": method, "error": C.short_error(exc)}
                del exc
            reset_compiled(model)
        if tp:
            row["tp"] = tp
        if "error" in row:
            failed_at[(method, length)] = min(batch, failed_at.get((method, length), batch))
        rows.append(row)
        print(format_row(row), flush=True)
        if "profile" in row:
            print_profile(row)
        if json_out:  # rewritten after every row: partial results survive a kill
            C.write_json(json_out, rows)
    print()
    print("\n".join(job_table(rows, args.job) if args.job else summary(rows)), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
