"""The CUDA decode-attention kernel (``ops/cuda/decode.cu``) and the choice between it and Triton.

- CPU: every preset's builds (plain, cluster, paired values, lean) compile with NVRTC to an sm_90 cubin
  (syntax and PTX errors are caught without a GPU; NVRTC comes from the ``nvidia-cuda-nvrtc``
  wheel of the dev extras), and the kernel-choice rules.
- ``cuda``: the kernel against the reference on random shapes (hypothesis: every preset, GQA
  groups 1-16, head_dim 64/128, lengths off every block size, empty/partial/full windows,
  left padding), with the rule ``err(ours) <= 2 * err(torch bf16 SDPA on the dequantized K/V) +
  atol``; CUDA-graph capture with a length that changes between replays; the op's dispatch; the
  persistent per-stream arrival counters (left zero, shared by shapes, graphs and streams), the
  cluster merge against the global one at every cluster size, the lazy softmax on scores that
  climb and fall across blocks by far more than its slack, and each shape-chosen layout (interleaved
  books, paired values, byte books, the lean build) against the layout it replaces, forced for the
  test (:func:`_against_layout`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops_reference import decode_case, reference_decode
from test_ops_triton import _check_rule, _cuda, _decode_baseline_err

import vecinfer_compile.ops as ops
from vecinfer_compile import log_once
from vecinfer_compile.ops import decode, kernel_request
from vecinfer_compile.ops.coded_kv import bundle_coded_kv
from vecinfer_compile.ops.cuda import decode as cuda_decode
from vecinfer_compile.ops.cuda.nvrtc import CudaBuildError, compile_source
from vecinfer_compile.presets import PRESETS

PRESET_SPECS = sorted({((p.key.entries, p.key.dims), (p.value.entries, p.value.dims)) for p in PRESETS.values()})
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def nvrtc_or_skip():
    """Loads NVRTC, or skips the test (compiling a kernel needs no GPU, only the library)."""
    try:
        ops.cuda.nvrtc.nvrtc()
    except CudaBuildError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("kspec,vspec", PRESET_SPECS)
def test_cuda_source_compiles_for_sm90(kspec, vspec):
    """Each preset's kernel compiles to an sm_90 cubin, with 4 and 12 warps per CTA, plain and in
    its cluster build (the lean build at 12 warps where the books have one; GQA 3 with the paired
    value product, GQA 16 without)."""
    nvrtc_or_skip()
    lean = cuda_decode.Variant(128, 4, *kspec, *vspec, False).can_be_lean
    for head_dim, group, fp16, nwarps, cluster in (
        (128, 4, False, 4, False),
        (128, 4, False, 4, True),
        (64, 16, True, 12, True),
        (64, 2, False, 4, True),
        (128, 3, True, 12, False),
    ):
        variant = cuda_decode.Variant(
            head_dim, group, *kspec, *vspec, fp16, cluster=cluster, lean=lean and nwarps == 12
        )
        image, is_cubin = compile_source(
            cuda_decode.source(),
            "vq_decode",
            90,
            ["--use_fast_math", "--std=c++17", *variant.defines(nwarps), "-DMINB=1"],
        )
        assert is_cubin and image[:4] == b"\x7fELF"
        assert b"vq_decode" in image


def test_variant_shared_memory_copies_and_launch_shapes():
    assert cuda_decode.Variant.copies(256, 4) == 16 and cuda_decode.Variant.copies(256, 8) == 8
    assert cuda_decode.Variant.copies(256, 2) == 32 and cuda_decode.Variant.copies(4096, 8) == 1
    # two 256-entry books are interleaved in 256-byte rows at a 64 KiB boundary: 128 KiB with that
    # room, one CTA of 12 warps
    for k, v in ((256, 4), (256, 4)), ((256, 2), (256, 2)), ((256, 8), (256, 8)):
        interleaved = cuda_decode.Variant(128, 4, *k, *v, False)
        assert interleaved.interleaved and interleaved.smem_bytes(12) == 128 * 1024
        assert cuda_decode.launches_for(interleaved) == [(1, 12), (1, 8), (1, 4)]
        assert "-DINTERLEAVE=1" in interleaved.defines(12)
    # 4096-entry books of 4 or 8 dims stay apart, one byte a channel: half the shared memory of
    # 16-bit centroids, so that 1.5 bits fits the 99 KiB of sm_86/89 too; 256-entry books stay 16-bit
    for (k, v), kib in ((((4096, 4), (4096, 4)), 32), (((4096, 8), (4096, 8)), 64), (((4096, 8), (256, 8)), 64)):
        byte = cuda_decode.Variant(128, 4, *k, *v, False)
        assert not byte.interleaved and "-DINTERLEAVE=0" in byte.defines(8)
        assert byte.smem_bytes(8) == kib * 1024
        assert f"-DKBYTE={int(k[0] > 256)}" in byte.defines(8) and f"-DVBYTE={int(v[0] > 256)}" in byte.defines(8)
    three = cuda_decode.Variant(128, 4, 4096, 4, 4096, 4, False)
    assert cuda_decode.launches_for(three)[:3] == [(1, 12), (1, 8), (3, 4)]
    assert not cuda_decode.Variant(128, 4, 4096, 2, 4096, 2, False).byte_book(4096, 2)
    # a 4096 x 2 book keeps 16-bit centroids (16 KiB): with another, 32 KiB
    assert cuda_decode.Variant(128, 4, 4096, 2, 4096, 2, False).smem_bytes(8) == 32 * 1024
    # the launch shapes follow the device's shared memory: on sm_86/89 (100 KiB an SM, 99 a CTA) the
    # 256-entry books are not interleaved (64 KiB), and the 1.5-bit byte books (64 KiB) fit
    small = dict(smem_per_sm=100 * 1024)
    consumer = cuda_decode.Variant(128, 4, 256, 4, 256, 4, False, **small)
    assert not consumer.interleaved and consumer.smem_bytes(12) == 64 * 1024
    assert cuda_decode.launches_for(consumer) == [(1, 12), (1, 8), (1, 4)]
    assert cuda_decode.launches_for(cuda_decode.Variant(128, 4, 4096, 8, 4096, 8, False, **small))[:1] == [(1, 12)]
    a100 = dict(smem_per_sm=164 * 1024)
    assert cuda_decode.Variant(128, 4, 256, 4, 256, 4, False, **a100).interleaved
    assert cuda_decode.launches_for(cuda_decode.Variant(128, 4, 4096, 8, 4096, 8, False, **a100))[:3] == [
        (1, 12),
        (1, 8),
        (2, 4),
    ]
    # the lean build puts the query fragments after non-interleaved books (NH x KSTEPS x 32 lanes x
    # 8 bytes) and keeps one block of codes; interleaved (256-entry) presets have none
    for (k, v), can in ((((4096, 4), (4096, 4)), True), (((4096, 8), (256, 8)), True), (((256, 4), (256, 4)), False)):
        for group, d in ((4, 128), (16, 64)):
            plain = cuda_decode.Variant(d, group, *k, *v, False)
            assert plain.can_be_lean == can and "-DQSMEM=0" in plain.defines(12)
            if not can:
                with pytest.raises(ValueError, match="no lean build"):
                    dataclasses.replace(plain, lean=True)
                continue
            lean = dataclasses.replace(plain, lean=True)
            assert lean.book_bytes() == plain.book_bytes() + (group + 7) // 8 * (d // 16) * 256
            assert "-DQSMEM=1" in lean.defines(12) and "-DSTAGGER=1" in lean.defines(12)
    # the warps' partials reuse the codebook memory; it is grown when they need more
    assert cuda_decode.Variant(128, 16, 256, 8, 256, 8, False, **small).smem_bytes(4) == 32 * 1024 + 32 * 1024
    assert cuda_decode.Variant(128, 16, 16, 8, 16, 8, False, **small).smem_bytes(4) == 4 * 16 * 130 * 4
    assert cuda_decode.Variant(128, 16, 16, 8, 16, 8, False, **small).smem_bytes(12) == 12 * 16 * 130 * 4


def test_lean_build_only_for_long_calls_that_gain_warps(monkeypatch):
    """A call runs the lean build when that build has more warps an SM than the plain one and the
    call has at least LEAN_MIN_BLOCKS_PER_WARP blocks of 64 positions a warp of the plain build
    (shapes only); the plain build otherwise, and always for the 256-entry presets."""
    plain, lean = (cuda_decode.Built(f"kernel-{w}", w, 1) for w in (8, 12))
    builds = {False: plain, True: lean}
    monkeypatch.setattr(cuda_decode, "kernels_for", lambda variant, device: builds[variant.lean])
    monkeypatch.setattr(cuda_decode, "sm_count", lambda index: 132)
    monkeypatch.setattr(cuda_decode, "device_index", lambda device: 0)
    three_bit = cuda_decode.Variant(128, 4, 4096, 4, 4096, 4, False)
    need = cuda_decode.LEAN_MIN_BLOCKS_PER_WARP * 132 * 8  # blocks: 25,344 for the threshold of 24
    assert cuda_decode.lean_build(three_bit, None, 64, 131072) is lean  # B=8, Hkv=8, T=128k: 131,072 blocks
    assert cuda_decode.lean_build(three_bit, None, 8, 131072) is plain  # B=1: 16,384
    assert cuda_decode.lean_build(three_bit, None, 64, 4096) is plain
    assert cuda_decode.lean_build(three_bit, None, 64, 32768) is lean  # B=8/T=32k: 32,768 blocks
    assert cuda_decode.lean_build(three_bit, None, 32, 32768) is plain  # B=4/T=32k: 16,384
    assert cuda_decode.lean_build(three_bit, None, need // 64, 64 * 64) is lean
    assert cuda_decode.lean_build(three_bit, None, need // 64 - 1, 64 * 64) is plain
    assert cuda_decode.lean_build(cuda_decode.Variant(128, 4, 256, 4, 256, 4, False), None, 64, 131072) is plain
    builds[True] = cuda_decode.Built("kernel-12", 12, 1)  # a variant whose plain build has 12 warps already
    builds[False] = cuda_decode.Built("kernel-12p", 12, 1)
    assert cuda_decode.lean_build(three_bit, None, 64, 131072) is builds[False]


def test_build_error_compiles_the_lean_build_too(monkeypatch):
    """Before tracing, build_error compiles a 4096-entry variant's plain build and, where the plain
    one runs fewer than the most warps an SM, its lean build (the call picks one by its shapes
    later); a 256-entry variant's one build."""
    built, plain_warps = [], {}

    def kernels_for(variant, device):
        built.append(variant)
        return cuda_decode.Built("kernel", 12 if variant.lean else plain_warps["n"], 1)

    monkeypatch.setattr(cuda_decode, "kernels_for", kernels_for)
    q = torch.empty(3, 8, 1, 128, device="meta", dtype=torch.bfloat16)
    k_codes = torch.empty(3, 2, 500, 32, device="meta", dtype=torch.uint8)
    for entries, warps, lean in ((4096, 8, True), (4096, 12, False), (256, 8, False)):
        variant = cuda_decode.Variant(128, 4, entries, 4, entries, 4, False)
        monkeypatch.setattr(cuda_decode, "variant_for", lambda *args, variant=variant: variant)
        built.clear()
        plain_warps["n"] = warps
        assert cuda_decode.build_error(q, k_codes, None, None) is None
        assert built == [variant] + ([dataclasses.replace(variant, lean=True)] if lean else [])


def test_prepared_book_is_kept_until_its_codebook_changes():
    """The kernel's 16-bit codebooks: one conversion per codebook tensor and dtype, made again
    after an in-place change, dropped with the codebook."""
    cent = torch.randn(256, 4)
    book = cuda_decode.prepared_book(cent, torch.bfloat16)
    assert book.dtype == torch.bfloat16 and torch.equal(book, cent.to(torch.bfloat16))
    assert cuda_decode.prepared_book(cent, torch.bfloat16) is book
    half = cuda_decode.prepared_book(cent, torch.float16)
    assert half.dtype == torch.float16 and half is not book
    cent.mul_(2)  # an in-place change (e.g. load_state_dict) must not leave a stale copy
    again = cuda_decode.prepared_book(cent, torch.bfloat16)
    assert again is not book and torch.equal(again, cent.to(torch.bfloat16))
    key = (id(cent), torch.bfloat16)
    assert key in cuda_decode._BOOKS
    del cent, book, half, again
    assert key not in cuda_decode._BOOKS
    with torch.inference_mode():
        frozen = torch.randn(16, 8)
        assert cuda_decode.prepared_book(frozen, torch.float16) is cuda_decode.prepared_book(frozen, torch.float16)


def test_splits_depend_on_shapes_only():
    assert cuda_decode.num_splits(8, 4096, 3, 132, 4) == 16  # bounded by the length: 4096 / (64 * 4)
    assert cuda_decode.num_splits(8, 4096, 1, 132, 12) == 6  # 4096 / (64 * 12), rounded up
    assert cuda_decode.num_splits(64, 131072, 3, 132, 4) == 6  # one wave of 3 CTAs per SM, no partial second
    assert cuda_decode.num_splits(64, 131072, 2, 132, 4) == 4
    assert cuda_decode.num_splits(8, 131072, 3, 132, 4) == 49
    assert cuda_decode.num_splits(512, 131072, 3, 132, 4) == 1
    assert cuda_decode.num_splits(8, 1, 3, 132, 4) == 1


class _StubClusterKernel:
    """Stands in for a loaded cluster build: answers the occupancy query, counts the queries."""

    def __init__(self, active: int):
        self.handle, self.active, self.queries = ctypes.c_void_p(id(self)), active, 0

    def max_active_clusters(self, cluster, block):
        self.queries += 1
        return self.active


def test_cluster_merge_only_where_every_row_fits_at_once():
    """Clusters up to 8 CTAs, only when all rows' clusters are resident together (else the global
    merge), a split of one always, none without the cluster build (before sm_90)."""
    stub = _StubClusterKernel(active=12)
    built = cuda_decode.Built(kernel=None, nwarps=8, ctas_per_sm=1, cluster=stub)
    assert cuda_decode.cluster_size(built, 8, 8) == 8
    assert cuda_decode.cluster_size(built, 12, 8) == 8
    assert cuda_decode.cluster_size(built, 13, 8) is None  # a second wave of clusters
    assert cuda_decode.cluster_size(built, 8, 9) is None  # past the portable size
    assert cuda_decode.cluster_size(built, 1000, 1) == 1
    assert stub.queries == 1  # cached per (kernel, cluster size)
    assert cuda_decode.cluster_size(cuda_decode.Built(kernel=None, nwarps=8, ctas_per_sm=1), 8, 8) is None
    unanswered = _StubClusterKernel(active=12)
    unanswered.max_active_clusters = lambda cluster, block: (_ for _ in ()).throw(CudaBuildError("no query"))
    built = cuda_decode.Built(kernel=None, nwarps=8, ctas_per_sm=1, cluster=unanswered)
    assert cuda_decode.cluster_size(built, 8, 8) is None  # the same kernel's global merge, never a failed call


def test_unsupported_reasons_name_the_limit():
    q = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    codes = torch.zeros(1, 2, 4, 32, dtype=torch.uint8)
    assert "not CUDA" in cuda_decode.unsupported_reason(q, codes, torch.zeros(256, 4), torch.zeros(256, 4))


def test_decode_kernel_request(monkeypatch):
    monkeypatch.delenv(kernel_request.ENV, raising=False)
    assert kernel_request.requested() == "auto"
    monkeypatch.setenv(kernel_request.ENV, "Triton")
    assert kernel_request.requested() == "triton"
    with kernel_request.use_decode_kernel("cuda"):
        assert kernel_request.requested() == "cuda"
    assert kernel_request.requested() == "triton"
    monkeypatch.setenv(kernel_request.ENV, "fast")
    with pytest.raises(ValueError, match="use one of auto, cuda, triton"):
        kernel_request.requested()
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        kernel_request.check_kernel_name("cutlass")


def test_cuda_op_on_cpu_names_the_fix():
    gen = torch.Generator().manual_seed(0)
    args = decode_case(
        gen,
        b=1,
        hkv=1,
        group=2,
        tmax=4,
        n_coded=2,
        r=2,
        n_window=1,
        d=128,
        kspec=(256, 4),
        vspec=(256, 4),
        with_start=False,
        dtype=torch.bfloat16,
    )
    with pytest.raises(CudaBuildError, match="use the Triton kernel"):
        torch.ops.vecinfer.decode_attention_cuda(*args)


# --- GPU -----------------------------------------------------------------------------------------


def _decode(dtype, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    return _cuda(decode_case(gen, dtype=dtype, **kw))


def _kernel(args):
    """The CUDA kernel over :func:`decode_case`'s arguments."""
    return ops.decode_attention_cuda(*bundle_coded_kv(args, 1))


def _check(args, got):
    want = reference_decode(args)
    assert got.dtype == args[0].dtype and got.shape == args[0].shape
    assert torch.isfinite(got).all()
    _check_rule(got, want, _decode_baseline_err(args, want))


def _without(monkeypatch, layout: str):
    """Build the kernel without ``layout`` (a :class:`cuda_decode.Variant` property or the
    ``byte_book`` method, forced False), as it runs for shapes that do not take it; the compiled
    builds are dropped on both sides so that none leaks into another test."""
    off = (lambda self, entries, dims: False) if layout == "byte_book" else property(lambda self: False)
    monkeypatch.setattr(cuda_decode.Variant, layout, off)
    cuda_decode._build.cache_clear()


def _against_layout(args, monkeypatch, layout: str, *, exact: bool) -> None:
    """The kernel on ``args`` (its shape-chosen build, which takes ``layout``) against the reference,
    then against the build without ``layout`` (:func:`_without`): bit for bit when ``exact`` (a
    change of where data sits only), else to rounding (the same products summed in another order)."""
    got = _kernel(args)
    _check(args, got)
    with monkeypatch.context() as m:
        _without(m, layout)
        want = _kernel(args)
    cuda_decode._build.cache_clear()
    if exact:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-3)


@pytest.mark.cuda
@needs_cuda
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    specs=st.sampled_from(PRESET_SPECS),
    group=st.sampled_from([1, 2, 3, 4, 8, 16]),
    d=st.sampled_from([64, 128]),
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    tmax=st.integers(1, 700),
    fill=st.floats(0.0, 1.0),
    r=st.sampled_from([1, 16, 128, 300]),
    window=st.sampled_from(["empty", "partial", "full"]),
    with_start=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_cuda_kernel_matches_reference(seed, specs, group, d, b, hkv, tmax, fill, r, window, with_start, dtype):
    """Windows of up to 300 slots: a warp's run of 64-position blocks may end in the codes and go on
    into the window, or hold window blocks only."""
    n_coded = round(fill * tmax)
    n_window = {"empty": 0, "partial": r // 2, "full": r}[window]
    args = _decode(
        dtype,
        seed,
        b=b,
        hkv=hkv,
        group=group,
        tmax=tmax,
        n_coded=n_coded,
        r=r,
        n_window=n_window,
        d=d,
        kspec=specs[0],
        vspec=specs[1],
        with_start=with_start,
    )
    got = _kernel(args)
    if n_coded + n_window == 0:
        assert (got == 0).all()
        return
    _check(args, got)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("specs", PRESET_SPECS)
def test_cuda_kernel_long_context(specs):
    """Llama-3.1-8B geometry, 20k positions: many splits, every preset."""
    args = _decode(
        torch.bfloat16,
        7,
        b=2,
        hkv=8,
        group=4,
        tmax=20000,
        n_coded=19_873,
        r=128,
        n_window=77,
        d=128,
        kspec=specs[0],
        vspec=specs[1],
        with_start=True,
    )
    _check(args, _kernel(args))


@pytest.mark.cuda
@needs_cuda
def test_op_dispatches_to_cuda_and_env_forces_triton(monkeypatch):
    args = _decode(
        torch.bfloat16,
        3,
        b=2,
        hkv=2,
        group=4,
        tmax=900,
        n_coded=800,
        r=128,
        n_window=50,
        d=128,
        kspec=(256, 4),
        vspec=(256, 4),
        with_start=False,
    )
    monkeypatch.delenv(kernel_request.ENV, raising=False)
    assert decode.choose(args[0], args[1], args[3], args[4]) == "cuda"
    torch.testing.assert_close(torch.ops.vecinfer.decode_attention(*args), _kernel(args), rtol=0, atol=0)
    monkeypatch.setenv(kernel_request.ENV, "triton")
    torch.testing.assert_close(
        torch.ops.vecinfer.decode_attention(*args),
        ops.decode_attention_triton(*bundle_coded_kv(args, 1)),
        rtol=0,
        atol=0,
    )


@pytest.mark.cuda
@needs_cuda
def test_float32_queries_run_triton_with_one_log_line(monkeypatch, caplog):
    monkeypatch.delenv(kernel_request.ENV, raising=False)
    args = _decode(
        torch.float32,
        4,
        b=1,
        hkv=2,
        group=2,
        tmax=100,
        n_coded=90,
        r=16,
        n_window=3,
        d=128,
        kspec=(256, 4),
        vspec=(256, 4),
        with_start=False,
    )
    log_once.forget()
    with caplog.at_level(logging.INFO, logger=kernel_request.log.name):
        assert decode.choose(args[0], args[1], args[3], args[4]) == "triton"
        assert decode.choose(args[0], args[1], args[3], args[4]) == "triton"
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "bfloat16/float16" in caplog.records[0].getMessage()
    with kernel_request.use_decode_kernel("cuda"), pytest.raises(RuntimeError, match="decode_kernel='cuda'"):
        torch.ops.vecinfer.decode_attention(*args)


@pytest.mark.cuda
@needs_cuda
def test_cuda_kernel_in_a_cuda_graph_follows_the_length():
    """Captured once, replayed after the cache grew: the launch reads n_coded on the device."""
    args = list(
        _decode(
            torch.bfloat16,
            5,
            b=2,
            hkv=8,
            group=4,
            tmax=4096,
            n_coded=1000,
            r=128,
            n_window=128,
            d=128,
            kspec=(256, 4),
            vspec=(256, 4),
            with_start=False,
        )
    )
    _kernel(args)  # compile and load outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _kernel(args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _kernel(args)
    for n in (1000, 3001, 4096, 0):
        args[5].fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        if n == 0:
            want = reference_decode(args)
            torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        else:
            _check(args, out.clone())


@pytest.mark.cuda
@needs_cuda
def test_persistent_arrival_counters_are_left_zero_across_shapes_graphs_and_streams(monkeypatch):
    """Launches with the global merge share one counter buffer per stream (no memset): after calls of several grid
    shapes, a captured graph's replays and calls on a second stream, every counter is zero again and
    every output matches the reference."""
    monkeypatch.setattr(cuda_decode, "cluster_size", lambda *a: None)  # the cluster merge uses no counters
    cases = [
        list(
            _decode(
                torch.bfloat16,
                20 + i,
                b=b,
                hkv=hkv,
                group=4,
                tmax=t,
                n_coded=n,
                r=128,
                n_window=w,
                d=128,
                kspec=(256, 4),
                vspec=(256, 4),
                with_start=True,
            )
        )
        for i, (b, hkv, t, n, w) in enumerate([(2, 8, 5000, 4900, 100), (1, 2, 300, 0, 7), (3, 4, 9000, 8999, 128)])
    ]
    for args in cases * 2:
        _check(args, _kernel(args))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = [_kernel(args) for args in cases]  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            graph_outs = [_kernel(args) for args in cases]
        for _ in range(3):
            graph.replay()
    torch.cuda.synchronize()
    for args, out, graph_out in zip(cases, outs, graph_outs):
        _check(args, out)
        _check(args, graph_out)
    assert len([k for k in cuda_decode._COUNTERS if k[1] == side.cuda_stream]) == 1
    for counters in cuda_decode._COUNTERS.values():
        assert int(counters.abs().sum()) == 0


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("specs", PRESET_SPECS)
def test_cluster_merge_at_every_cluster_size(specs, monkeypatch):
    """On sm_90: one row's CTAs as clusters of 1 to 8 (the lengths set the split), in a CUDA graph
    too; each output matches the reference and the global merge of the same partials to rounding."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread-block clusters need sm_90")
    sizes = set()
    for i, (b, hkv, tmax) in enumerate(
        [(1, 1, 60), (1, 2, 700), (1, 1, 1400), (1, 1, 2500), (2, 1, 3500), (1, 1, 4096), (1, 8, 4096)]
    ):
        args = list(
            _decode(
                torch.bfloat16,
                40 + i,
                b=b,
                hkv=hkv,
                group=4,
                tmax=tmax,
                n_coded=tmax - 9,
                r=128,
                n_window=100,
                d=128,
                kspec=specs[0],
                vspec=specs[1],
                with_start=True,
            )
        )
        variant = cuda_decode.variant_for(args[0], args[3], args[4], 4)
        built = cuda_decode.kernels_for(variant, args[0].device)
        splits = cuda_decode.num_splits(b * hkv, tmax, built.ctas_per_sm, ops.cuda.nvrtc.sm_count(0), built.nwarps)
        sizes.add(cuda_decode.cluster_size(built, b * hkv, splits))
        got = _kernel(args)
        _check(args, got)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            graph_out = _kernel(args)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(graph_out, got, rtol=0, atol=0)
        with monkeypatch.context() as m:
            m.setattr(cuda_decode, "cluster_size", lambda *a: None)
            torch.testing.assert_close(_kernel(args).float(), got.float(), rtol=1e-2, atol=1e-3)
    assert None not in sizes and len(sizes) >= 5, sizes  # every case clustered; sizes 1-8 (8 warps), 1-6 (12)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("specs", PRESET_SPECS)
def test_interleaved_books_give_separate_books_output_exactly(specs, monkeypatch):
    """Interleaving changes where the 256-entry books sit in shared memory and how a gather's
    address is formed, not what is gathered or the order of the arithmetic: the output equals that
    of separate books bit for bit (short and long rows, a window, left padding, GQA 4 and 8)."""
    for seed, (b, hkv, group, tmax, n_coded) in enumerate(
        [(2, 4, 4, 3000, 2900), (3, 2, 8, 9000, 8871), (1, 8, 4, 200, 70)]
    ):
        args = _decode(
            torch.bfloat16,
            60 + seed,
            b=b,
            hkv=hkv,
            group=group,
            tmax=tmax,
            n_coded=n_coded,
            r=128,
            n_window=77,
            d=128,
            kspec=specs[0],
            vspec=specs[1],
            with_start=True,
        )
        _against_layout(args, monkeypatch, "interleaved", exact=True)
        assert cuda_decode.variant_for(args[0], args[3], args[4], group).interleaved == (
            max(specs[0][0], specs[1][0]) <= 256
        )


def _sawtooth(direction: int, n_window: int, dtype: torch.dtype):
    """Rows (GQA 4, head_dim 128, 2-bit books) whose scores climb (direction 1) or fall (-1) by ~6
    log2 units from one 64-position block to the next, ~118 over 20 blocks, then start again, with
    a 2-unit spread inside a block: every key sub-vector of position t has code c(t) and centroid
    ((c - 128) / 32) * ones (exact in 16 bits), and q is ones, so a score is
    (c(t) - 128) / 32 * 128 * D**-0.5 (0.51 log2 units a code step). As many rows as the GPU has
    SMs, so that the split is one CTA per row and each warp runs ~20 consecutive blocks (with fewer
    rows each warp would take a single block and never reach the lazy path)."""
    hkv = torch.cuda.get_device_properties(0).multi_processor_count
    tmax = 64 * 20 * 12
    args = list(
        _decode(
            dtype,
            11,
            b=1,
            hkv=hkv,
            group=4,
            tmax=tmax,
            n_coded=tmax,
            r=128,
            n_window=n_window,
            d=128,
            kspec=(256, 4),
            vspec=(256, 4),
            with_start=False,
        )
    )
    t = torch.arange(tmax, device="cuda")
    step = 12 * ((t // 64) % 20) + t % 5
    codes = step if direction > 0 else step.flip(0)
    args[0] = torch.ones_like(args[0])
    args[1] = codes.to(torch.uint8).view(1, 1, tmax, 1).expand(1, hkv, tmax, 32).contiguous()
    args[3] = ((torch.arange(256, device="cuda", dtype=torch.float32) - 128) / 32)[:, None].expand(256, 4).contiguous()
    return tuple(args)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("direction", [1, -1])
@pytest.mark.parametrize("n_window", [0, 77])
def test_lazy_softmax_follows_scores_that_climb_and_fall(dtype, direction, n_window, monkeypatch):
    """The kernel moves its running max only when a block's score passes it by more than 2^8: on
    rows whose scores climb 6 log2 units a block (a rescale every other block, probabilities up to
    2^8 in between) or fall the same way (a max kept for many blocks), its output matches the
    reference. A kernel that never moved its max would overflow float16's P (2^16) here (checked by
    a mutation run on the H200, docs/results)."""
    args = _sawtooth(direction, n_window, dtype)
    _check(args, _kernel(args))
    variant = cuda_decode.variant_for(args[0], args[3], args[4], 4)
    built = cuda_decode.kernels_for(variant, args[0].device)
    assert (
        cuda_decode.num_splits(
            args[1].shape[1], args[1].shape[2], built.ctas_per_sm, ops.cuda.nvrtc.sm_count(0), built.nwarps
        )
        == 1
    )


_PAIRED_CASES = [(specs, 4, 128) for specs in PRESET_SPECS] + [
    (((256, 4), (256, 4)), group, d) for group, d in ((1, 128), (3, 128), (2, 64), (8, 128))
]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("specs,group,d", _PAIRED_CASES)
def test_paired_value_product_matches_the_position_pairs(specs, group, d, monkeypatch):
    """The value product contracts over channel pairs (N = 4 heads x 2 parities) for groups of up
    to 4 query heads and over position pairs above (group 8 here): against the reference and against
    the position pairs (the same products, summed in another order) on a short and a long row, with a window and
    left padding; every preset at GQA 4, the 2-bit one at other groups and head_dim 64. (Each case
    compiles two variants: the random shapes of test_cuda_kernel_matches_reference cover the rest.)"""
    for seed, (b, hkv, tmax, n_coded) in enumerate([(2, 3, 3000, 2900), (1, 8, 200, 70)]):
        args = _decode(
            torch.bfloat16,
            80 + seed,
            b=b,
            hkv=hkv,
            group=group,
            tmax=tmax,
            n_coded=n_coded,
            r=128,
            n_window=77,
            d=d,
            kspec=specs[0],
            vspec=specs[1],
            with_start=True,
        )
        _against_layout(args, monkeypatch, "paired_values", exact=False)
        assert cuda_decode.variant_for(args[0], args[3], args[4], group).paired_values == (group <= 4)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("direction", [1, -1])
def test_paired_value_product_follows_the_lazy_rescale(direction, monkeypatch):
    """The paired value product keeps its accumulator per head tig, not in the scores' layout: a
    rescale reaches it through a shuffle. On rows whose scores climb or fall across blocks (see
    _sawtooth), it matches the reference and the position pairs."""
    args = _sawtooth(direction, 77, torch.float16)
    _against_layout(args, monkeypatch, "paired_values", exact=False)
    assert cuda_decode.variant_for(args[0], args[3], args[4], 4).paired_values


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("specs", [s for s in PRESET_SPECS if max(s[0][0], s[1][0]) > 256])
def test_byte_books_give_16_bit_books_output_exactly(specs, monkeypatch):
    """The 4096-entry books sit in shared memory as bytes, each gathered centroid widened to the
    16-bit value a 16-bit book holds (the codebooks' centroids are 7-bit: make_codes snaps them as
    LayerCodebooks does), so its output equals the 16-bit book's bit for bit (short and long rows, a window,
    left padding, GQA 4 and 8, head_dim 64, float16 and bfloat16, float16 centroids near its range)."""
    cases = [
        (2, 4, 4, 3000, 2900, 128, torch.bfloat16),
        (3, 2, 8, 9000, 8871, 128, torch.bfloat16),
        (1, 8, 4, 200, 70, 128, torch.float16),
        (1, 3, 4, 1500, 1400, 64, torch.float16),
    ]
    for seed, (b, hkv, group, tmax, n_coded, d, dtype) in enumerate(cases):
        args = _decode(
            dtype,
            90 + seed,
            b=b,
            hkv=hkv,
            group=group,
            tmax=tmax,
            n_coded=n_coded,
            r=128,
            n_window=77,
            d=d,
            kspec=specs[0],
            vspec=specs[1],
            with_start=True,
        )
        _against_layout(args, monkeypatch, "byte_book", exact=True)
        variant = cuda_decode.variant_for(args[0], args[3], args[4], group)
        assert [variant.byte_book(*c.shape) for c in args[3:5]] == [c.shape[0] > 256 for c in args[3:5]]
    # float16 centroids of ~16,000 (a step of 256: -(1024 + 64) * step is past float16's range, so
    # the float16 widening adds before it multiplies) still equal the 16-bit book's
    args = list(
        _decode(
            torch.float16,
            95,
            b=1,
            hkv=2,
            group=4,
            tmax=700,
            n_coded=650,
            r=128,
            n_window=40,
            d=128,
            kspec=specs[0],
            vspec=specs[1],
            with_start=False,
        )
    )
    args[0], args[3], args[4] = args[0] / 4096, args[3] * 4096, args[4] * 4096
    byte = _kernel(args)
    with monkeypatch.context() as m:
        _without(m, "byte_book")
        wide = _kernel(args)
    cuda_decode._build.cache_clear()
    assert torch.isfinite(byte).all()
    torch.testing.assert_close(byte, wide, rtol=0, atol=0)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("specs", PRESET_SPECS)
def test_lean_build_gives_the_plain_builds_output(specs, monkeypatch):
    """The lean build (forced here for every length) reads the query fragments from shared memory
    and refills each part of one block of codes with the next block's once gathered (a 4096-entry
    book; the others have no lean build): the same products, but 3 and 1.5 bits run 12 warps a CTA
    where the plain build runs 8, so the positions are split among warps otherwise and the partials
    merged in another order: equal to the plain build to rounding, and to the reference (rows ending
    inside a block and on its edge, several blocks a warp and one, a window, left padding, MHA, GQA
    4, 8 and 16, head_dim 64, float16 and bfloat16). On the H200 one output of 4,096 differed from
    the plain build's, by 6e-8."""
    monkeypatch.setattr(cuda_decode, "LEAN_MIN_BLOCKS_PER_WARP", 0)
    cases = [
        (2, 4, 4, 3000, 2900, 128, torch.bfloat16),
        (3, 2, 8, 9000, 8871, 128, torch.bfloat16),
        (1, 8, 4, 200, 70, 128, torch.float16),
        (1, 3, 4, 1500, 1400, 64, torch.float16),
        (2, 1, 16, 4096, 4096, 64, torch.bfloat16),
        (1, 2, 4, 65, 64, 128, torch.bfloat16),
        (2, 2, 1, 700, 650, 128, torch.bfloat16),
    ]
    for seed, (b, hkv, group, tmax, n_coded, d, dtype) in enumerate(cases):
        args = _decode(
            dtype,
            130 + seed,
            b=b,
            hkv=hkv,
            group=group,
            tmax=tmax,
            n_coded=n_coded,
            r=128,
            n_window=77,
            d=d,
            kspec=specs[0],
            vspec=specs[1],
            with_start=seed % 2 == 0,
        )
        _against_layout(args, monkeypatch, "can_be_lean", exact=False)
