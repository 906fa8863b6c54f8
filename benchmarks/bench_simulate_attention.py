"""Compiled simulate attention (prefill) vs bf16 SDPA, side by side, at evalmodel geometry.

The compiled simulate forward is what the backend puts in place of one SDPA call, compiled by
Inductor: the query and key transform (torch ops) and ``vecinfer::quantize`` of the keys and
values, then, without a residual window, the same SDPA over them; with a window of R keys
(``--residual``), torch's fused attention over the quantized keys (cuDNN on sm90+) and
FlashAttention-2's sliding window over the full-precision keys (a blockwise torch band where that
kernel does not serve), merged by log-sum-exp (``passes/windowed.py``, the window plan built in
the graph). ``old R`` is an earlier windowed form, ``vecinfer::encode`` and attention over the codes
(``vecinfer::attention``); both apply the same window rule, so with causal attention their outputs
differ by rounding only (the max-abs-diff column). Here the window plan is built at every call
(one layer); in a model it is built once per forward for all layers. The baseline is causal bf16 SDPA on the same q, k, v (default
backend choice, GQA via ``enable_gqa``). Prints median times and ratios, and the first call of
each compiled form (its compile, cold with ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``); ``--sweep``
adds the old attention kernel's launch shapes, ``--profile`` the time of each kernel of the
no-window and the windowed forms.

    python benchmarks/bench_simulate_attention.py [--cases 1x8192,8x2048] [--bits 2] [--residual 128] [--sweep] [--profile]
"""

from __future__ import annotations

import argparse
import time

import bench_common as C  # a sibling: benchmarks/ is on sys.path (script dir, or `vecinfer bench`)
import torch
import triton

import vecinfer_compile.ops  # noqa: F401  (registers torch.ops.vecinfer)
from vecinfer_compile.ops.split_attention.windowed import window_plan, windowed_attention
from vecinfer_compile.ops.triton.attention import DEFAULT_CONFIG, AttentionConfig, attention_triton
from vecinfer_compile.presets import get_preset
from vecinfer_compile.quant.transform import KeyTransform

HQ, HKV, D = 4, 2, 128  # evalmodel: Llama-3.1-8B per-head geometry, 4 query / 2 KV heads
SWEEP = [
    AttentionConfig(m, n, w, st)
    for m, n, w, st in ((64, 64, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 3), (128, 64, 8, 1))
]


def _transform(q, k, lam, rot):
    lam_q = lam.repeat_interleave(HQ // HKV, 0)
    q_t = ((q.float() * lam_q[None, :, None, :]) @ rot).to(q.dtype)
    k_t = ((k.float() / lam[None, :, None, :]) @ rot).to(k.dtype)
    return q_t, k_t


def simulate_forward(q, k, v, lam, rot, kc, vc, residual: int):
    """q: [B, Hq, T, D] bf16; k, v: [B, Hkv, T, D] bf16 -> [B, Hq, T, D] bf16 (as passes/sdpa.py)."""
    q_t, k_t = _transform(q, k, lam, rot)
    k_hat = torch.ops.vecinfer.quantize(k_t, None, None, kc)
    v_hat = torch.ops.vecinfer.quantize(v, None, None, vc)
    if residual == 0:
        return torch.nn.functional.scaled_dot_product_attention(q_t, k_hat, v_hat, is_causal=True, enable_gqa=True)
    plan = window_plan(q_t, k_t, None, True, residual)
    return windowed_attention(q_t, k_hat, k_t, v_hat, v, plan, D**-0.5)


def old_windowed_forward(q, k, v, lam, rot, kc, vc, residual: int):
    """An earlier windowed form: attention over the codes (vecinfer::attention)."""
    q_t, k_t = _transform(q, k, lam, rot)
    k_codes = torch.ops.vecinfer.encode(k_t, None, None, kc)
    v_codes = torch.ops.vecinfer.encode(v, None, None, vc)
    return torch.ops.vecinfer.attention(q_t, k_codes, v_codes, kc, vc, k_t, v, None, True, D**-0.5, residual)


def _first_call(fn, *args) -> tuple[torch.Tensor, float]:
    """fn(*args) and its wall time in seconds (the compile, on a first call)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--cases", default="1x8192,8x2048")
    ap.add_argument("--bits", type=float, default=2.0)
    ap.add_argument("--residual", type=int, default=128, help="window R of the second form (default 128)")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time the old form's attention kernel (vecinfer::attention) at several launch shapes",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also print the CUDA time of each kernel of the no-window and windowed forwards (torch.profiler)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    preset = get_preset(args.bits)
    dev = "cuda"
    forms = {
        "r0": torch.compile(simulate_forward, fullgraph=True),
        "new": torch.compile(simulate_forward, fullgraph=True),
        "old": torch.compile(old_windowed_forward, fullgraph=True),
    }
    r = args.residual
    print(
        f"# compiled simulate attention vs bf16 SDPA, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"Hq={HQ} Hkv={HKV} D={D}, causal, {args.bits:g}-bit; median ms; first call of each form in s"
    )
    print(
        f"| B | T | SDPA bf16 | R=0 | R=0 / SDPA | old R={r} | old / SDPA | new R={r} | new / SDPA | new / R=0 "
        f"| first call R=0 / old / new (s) | max abs diff new vs old | max abs diff R=0 vs SDPA |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b, t in C.parse_cases(args.cases):
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, HQ, t, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, HKV, t, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, HKV, t, D, device=dev, dtype=torch.bfloat16, generator=g)
        lam = torch.rand(HKV, D, device=dev, generator=g) + 0.5
        rot = KeyTransform(D).rotation(torch.float32, dev)
        kc = torch.randn(preset.key.entries, preset.key.dims, device=dev, generator=g)
        vc = torch.randn(preset.value.entries, preset.value.dims, device=dev, generator=g)
        inputs = (q, k, v, lam, rot, kc, vc)
        out, first_r0 = _first_call(forms["r0"], *inputs, 0)
        new_out, first_new = _first_call(forms["new"], *inputs, r)
        old_out, first_old = _first_call(forms["old"], *inputs, r)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        base = triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            return_mode="median",
        )
        ours = triton.testing.do_bench(lambda: forms["r0"](*inputs, 0), return_mode="median")
        old = triton.testing.do_bench(lambda: forms["old"](*inputs, r), return_mode="median")
        new = triton.testing.do_bench(lambda: forms["new"](*inputs, r), return_mode="median")
        print(
            f"| {b} | {t} | {base:.3f} | {ours:.3f} | {ours / base:.2f}x | {old:.3f} | {old / base:.2f}x | "
            f"{new:.3f} | {new / base:.2f}x | {new / ours:.2f}x | {first_r0:.1f} / {first_old:.1f} / {first_new:.1f} | "
            f"{(new_out.float() - old_out.float()).abs().max().item():.3f} | "
            f"{(out.float() - ref.float()).abs().max().item():.3f} |",
            flush=True,
        )
        if args.profile:
            for name, res in (("R=0", 0), (f"new R={r}", r)):
                print(f"  kernels of {name}:")
                profile_kernels(lambda: forms["r0" if res == 0 else "new"](*inputs, res))
        if args.sweep:
            sweep_kernel(q, k, v, kc, vc, base)


def profile_kernels(forward, calls: int = 10) -> None:
    """CUDA time per kernel over ``calls`` runs of ``forward``, largest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            forward()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]  # kernels, not the ops launching them
    for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:8]:
        print(f"  {e.self_device_time_total / calls:8.1f} us per forward  {e.count // calls} launch(es)  {e.key[:90]}")


def sweep_kernel(q, k, v, kc, vc, sdpa_ms: float) -> None:
    """Attention kernel alone (codes precomputed) at each launch shape of SWEEP, against SDPA."""
    k_codes = torch.ops.vecinfer.encode(k.float(), None, None, kc)
    v_codes = torch.ops.vecinfer.encode(v.float(), None, None, vc)
    for cfg in SWEEP:
        try:
            ms = triton.testing.do_bench(
                lambda: attention_triton(q, k_codes, v_codes, kc, vc, None, None, None, True, D**-0.5, 0, config=cfg),
                return_mode="median",
            )
        except Exception as exc:  # a launch shape this GPU cannot fit (shared memory, registers)
            print(f"  kernel {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
            continue
        mark = " (default)" if cfg == DEFAULT_CONFIG else ""
        print(f"  kernel {cfg}{mark}: {ms:.3f} ms = {ms / sdpa_ms:.2f}x SDPA", flush=True)


if __name__ == "__main__":
    main()
