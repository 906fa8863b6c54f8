"""The decode step's cache append, per layer: how the codes of the token leaving the window are
chosen, side by side on one GPU.

Rows: the CUDA append with nearest-centroid codes (one launch; the baseline), with score-aware key
codes (``vq_weigh_flush`` then the append), with error-weighted codes (the same, the descent under
random symmetric metrics) and the torch form of the last (what ran before the CUDA encoder: the
ops Inductor would compile, here eager); then the append of a layer whose keys and values the
trellis codec codes (:mod:`vecinfer_compile.codecs.trellis.cache_layer`), at ``--trellis-states``: the
cache's key transform, then ``vecinfer::trellis_append`` (one launch: each side's KLT and walk, the
window's shift, the counters; :mod:`vecinfer_compile.codecs.trellis.cuda.append`) and, over the same
buffers, its torch form (each side's KLT in torch ops and one Viterbi launch). Each row
but the torch one is ``STEPS`` appends captured in one CUDA graph and replayed, timed by CUDA
events (device time per append, launch gaps included); the window is full, so every append encodes
a token. Shapes: a Llama-3.1-8B layer (8 KV heads, head_dim 128, bf16 windows of 128 slots).

    python benchmarks/bench_append.py [--batches 1,8] [--bits 2,1.5]
"""

from __future__ import annotations

import argparse

import torch

import vecinfer_compile.ops  # noqa: F401  (registers torch.ops.vecinfer)
from vecinfer_compile.ops.append import append_reference
from vecinfer_compile.presets import get_preset
from vecinfer_compile.quant.packing import pack_codes

HKV, D, R = 8, 128, 128
STEPS, REPLAYS = 32, 20
ROWS = (
    ("nearest (CUDA append)", 1.0, False),
    ("score-aware keys, w=8", 8.0, False),
    ("error-weighted, w=8", 8.0, True),
)


def layer_state(b: int, bits: float, weight: float, weighted: bool, gen: torch.Generator) -> dict:
    """The op's arguments for one layer with a full window and room for every timed append."""
    preset = get_preset(bits)
    tmax = 16 + STEPS * (REPLAYS + 2)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def spd():
        a = randn(HKV, D, D)
        return (a @ a.transpose(-1, -2) / D + 0.1 * torch.eye(D)).cuda()

    k, v = preset.key, preset.value
    args = dict(
        key=randn(b, HKV, 1, D),
        value=randn(b, HKV, 1, D),
        k_codes=pack_codes(torch.randint(0, k.entries, (b, HKV, tmax, D // k.dims), generator=gen), k.entries),
        v_codes=pack_codes(torch.randint(0, v.entries, (b, HKV, tmax, D // v.dims), generator=gen), v.entries),
        k_window=randn(b, HKV, R, D),
        v_window=randn(b, HKV, R, D),
        n_coded=torch.tensor(16),
        n_window=torch.tensor(R),
        arrivals=torch.zeros(1, dtype=torch.int32),
        k_centroids=randn(k.entries, k.dims),
        v_centroids=randn(v.entries, v.dims),
        key_mean=None,
        lam=None,
        key_matrix=(randn(D, D) / D**0.5),
    )
    args = {
        n: (t.cuda().to(torch.bfloat16) if n in ("key", "value", "k_window", "v_window") else t.cuda())
        if isinstance(t, torch.Tensor)
        else t
        for n, t in args.items()
    }
    args.update(
        key_parallel_weight=weight, key_metric=spd() if weighted else None, value_metric=spd() if weighted else None
    )
    return args


def time_graph(args: dict) -> float:
    """Device microseconds per append: STEPS appends in one CUDA graph, replayed REPLAYS times."""
    return time_captured(lambda: torch.ops.vecinfer.cache_append_cuda(*args.values()))


def time_captured(append) -> float:
    """Device microseconds per call of ``append`` (run once outside the capture to build and load
    its kernels): STEPS calls in one CUDA graph, replayed REPLAYS times."""
    append()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(STEPS):
            append()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * STEPS)


def time_torch(args: dict, n: int = 5) -> float:
    """Microseconds per append of the torch form, eager, synchronised."""
    append_reference(*args.values())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        append_reference(*args.values())
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def trellis_appends(b: int, bits: float, states: int, gen: torch.Generator):
    """One layer's trellis append as two functions of no arguments, over the same buffers, each after
    the key transform the cache runs (:func:`~vecinfer_compile.ops.append.transform_keys`): the op
    (one launch) and its torch form (the ops around one Viterbi launch a side, as before the
    kernel). Codecs of ``states`` states fitted on random keys and values with a decaying spectrum,
    a full window and room for every timed append."""
    from vecinfer_compile.codecs.trellis.code import TrellisCodec
    from vecinfer_compile.codecs.trellis.operands import TrellisOperands
    from vecinfer_compile.codecs.trellis.packing import packed_bytes
    from vecinfer_compile.ops.append import append_through_window, transform_keys

    spectrum = torch.logspace(0, -1, D)
    codecs = [
        TrellisCodec.fit(
            (torch.randn(HKV, 4096, D, generator=gen) * spectrum).cuda(),
            bits,
            states.bit_length() - 1,
            train_vectors=1024,
            rounds=1,
        )
        for _ in range(2)
    ]
    operands = [list(TrellisOperands.of(c, "cuda")) for c in codecs]
    width = packed_bytes(codecs[0].bits)
    tmax = 16 + 2 * STEPS * (REPLAYS + 2)
    key, value = (torch.randn(b, HKV, 1, D, generator=gen).cuda().bfloat16() for _ in range(2))
    k_codes, v_codes = (torch.zeros(b, HKV, tmax, width, dtype=torch.uint8, device="cuda") for _ in range(2))
    k_window, v_window = (torch.randn(b, HKV, R, D, generator=gen).cuda().bfloat16() for _ in range(2))
    n_coded, n_window = torch.tensor(16, device="cuda"), torch.tensor(R, device="cuda")
    arrivals = torch.zeros(1, dtype=torch.int32, device="cuda")
    key_matrix = (torch.randn(D, D, generator=gen) / D**0.5).cuda()

    def op():
        kt = transform_keys(key, None, None, key_matrix)
        torch.ops.vecinfer.trellis_append(
            kt, value, k_codes, v_codes, k_window, v_window, n_coded, n_window, arrivals, operands[0], operands[1]
        )

    def torch_form():
        kt = transform_keys(key, None, None, key_matrix)
        append_through_window(
            kt,
            value,
            k_codes,
            v_codes,
            k_window,
            v_window,
            n_coded,
            n_window,
            lambda x: torch.ops.vecinfer.trellis_encode(x, operands[0], width),
            lambda x: torch.ops.vecinfer.trellis_encode(x, operands[1], width),
        )

    return op, torch_form


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--bits", default="2", help="presets, comma-separated")
    ap.add_argument(
        "--trellis-states", default="1024,4096", help="trellis key codec sizes, comma-separated ('' for none)"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    print(
        f"# decode-step cache append of one layer, {torch.cuda.get_device_name()}: {HKV} KV heads, head_dim {D}, "
        f"bf16 window of {R} (full); us per append, device-timed ({STEPS} appends per CUDA graph)"
    )
    print("| bits | B | codes | us / append | vs nearest |")
    print("|---|---|---|---|---|")
    for bits in (float(b) for b in args.bits.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            gen = torch.Generator().manual_seed(0)
            base = None
            for label, weight, weighted in ROWS:
                us = time_graph(layer_state(b, bits, weight, weighted, gen))
                base = us if base is None else base
                print(f"| {bits:g} | {b} | {label} | {us:.1f} | {us / base:.2f}x |")
            us = time_torch(layer_state(b, bits, 8.0, True, gen))
            print(f"| {bits:g} | {b} | error-weighted, w=8, torch ops (eager) | {us:.1f} | {us / base:.2f}x |")
            for states in (int(x) for x in args.trellis_states.split(",") if x):
                op, torch_form = trellis_appends(b, bits, states, gen)
                for label, append in (("one launch", op), ("torch ops around two walks", torch_form)):
                    us = time_captured(append)
                    print(
                        f"| {bits:g} | {b} | trellis keys and values, {states} states, {label} | {us:.1f} | "
                        f"{us / base:.2f}x |"
                    )


if __name__ == "__main__":
    main()
