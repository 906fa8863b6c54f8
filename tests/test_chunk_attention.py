"""Chunk attention over a compressed cache (:mod:`vecinfer_compile.ops.split_attention.chunk`) against
its oracle.

Both codecs of the prefix (:mod:`vecinfer_compile.ops.split_attention.prefix`): the codebooks'
codes and the trellis codec's (whose prefix attends in the components).

- CPU: the fast path's orchestration (the varlen offsets of each row's padding, row groups of the
  prefix workspace, the trellis codec's query and output transforms and its log-sum-exp offset,
  the merge by log-sum-exp, empty rows) with FlashAttention-2 replaced by a dense stand-in of its
  documented varlen contract and the workspace's kernels by torch (the kernels themselves are
  checked under ``TRITON_INTERPRET=1`` in ``test_ops_triton.py``); the dense row-group path; the
  prompt NLL of a chunked prefill against the simulate path on evalmodel.
- ``cuda``: the real path (the workspace's kernels + torch's FlashAttention-2 / cuDNN) against the
  oracle in float32, with the rule ``err(ours) <= 2 * err(bf16 SDPA over the same keys) + atol``.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from vecinfer_compile.codecs.trellis.code import random_code as random_trellis_codec
from vecinfer_compile.codecs.trellis.operands import TrellisOperands
from vecinfer_compile.codecs.trellis.prefix import TrellisPrefix
from vecinfer_compile.ops import reference
from vecinfer_compile.ops.reference import dequantize
from vecinfer_compile.ops.split_attention import chunk as ca
from vecinfer_compile.ops.split_attention.prefix import CodebookPrefix
from vecinfer_compile.quant.packing import pack_codes

pytestmark = pytest.mark.usefixtures("one_thread")

# (entries, dims) of key and value codebooks: every preset's books, packed 12-bit codes included
BOOKS = [(256, 4), (256, 2), (256, 8), (4096, 4), (4096, 8)]


def dense_flash_varlen(q, k, v, cu_q, cu_k, used_k, max_q, max_k, causal, scale):
    """:func:`ca.flash_varlen`'s contract (FlashAttention-2 varlen), densely in float64: sequence
    ``s`` reads keys ``k[cu_k[s]:cu_k[s] + used_k[s]]``, causal bottom-right; ``+inf`` lse and zero
    output for a query that sees no key."""
    nq, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(nq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.full((hq, nq), float("inf"), device=q.device)
    for s in range(cu_q.numel() - 1):
        q0, q1, k0, n = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(used_k[s])
        assert q1 - q0 <= max_q and n <= max_k
        if n == 0:
            continue
        qs = q[q0:q1].double().transpose(0, 1)
        ks, vs = (x[k0 : k0 + n].double().transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))
        scores = qs @ ks.transpose(-1, -2) * scale
        if causal:
            i, j = torch.arange(q1 - q0)[:, None], torch.arange(n)[None]
            scores = scores.masked_fill(j > n - (q1 - q0) + i, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
        total = p.sum(-1, keepdim=True)
        out[q0:q1] = ((p @ vs) / total.clamp_min(1e-300)).transpose(0, 1).to(q.dtype)
        lse[:, q0:q1] = torch.where(total[..., 0] > 0, (top + total.log())[..., 0], float("inf")).float()
    return out, lse


def dense_cudnn_prefix(q, k, v, scale):
    """:func:`ca.cudnn_prefix`'s contract densely: non-causal, GQA, (out, natural-log lse)."""
    group = q.shape[1] // k.shape[1]
    scores = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v.double().repeat_interleave(group, 1)
    return out.to(q.dtype), lse.float()


class TorchCodebookPrefix(CodebookPrefix):
    """The codebooks' prefix with its workspace written by the torch reference."""

    def fill(self, k_codes, v_codes, length, k_out, v_out):
        k_out.copy_(dequantize(k_codes[:, :, :length], self.key_centroids).transpose(1, 2))
        v_out.copy_(dequantize(v_codes[:, :, :length], self.value_centroids).transpose(1, 2))


class TorchTrellisPrefix(TrellisPrefix):
    """The trellis codec's prefix with its workspace (unit entries) written by torch."""

    def fill(self, k_codes, v_codes, length, k_out, v_out):
        k_out.copy_(self.keys.entries(k_codes[:, :, :length].transpose(1, 2)))
        v_out.copy_(self.values.entries(v_codes[:, :, :length].transpose(1, 2)))


def chunk_case(
    gen, *, b, hkv, group, d, chunk, n_coded, window, kbook, vbook, dtype, device="cpu", spare=7, trellis=False
):
    """Random codes (``spare`` slots more than ``n_coded``, garbage: must never be read), their codec
    (centroids of ``kbook``, ``vbook``; or with ``trellis`` random trellis codecs of 2 bits an element
    and 2^8 states, any string a valid code), full-precision window + chunk and queries. Returns
    ``(q, keys)``; the prefix's workspace is written by torch on CPU, by the kernels on CUDA."""
    slots = n_coded + spare

    def codes(book):
        entries, dims = book
        return pack_codes(torch.randint(0, entries, (b, hkv, slots, d // dims), generator=gen), entries).to(device)

    def cent(book):
        return torch.randn(*book, generator=gen).to(device)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    if trellis:
        keys_ops, values_ops = (TrellisOperands.of(random_trellis_codec(gen, hkv, d, 2.0, 8), device) for _ in range(2))
        k_codes, v_codes = (
            torch.randint(0, 256, (b, hkv, slots, d // 4), generator=gen, dtype=torch.uint8).to(device)
            for _ in range(2)
        )
        prefix = (TrellisPrefix if device == "cuda" else TorchTrellisPrefix)(keys_ops, values_ops)
    else:
        k_codes, v_codes = codes(kbook), codes(vbook)
        prefix = (CodebookPrefix if device == "cuda" else TorchCodebookPrefix)(cent(kbook), cent(vbook))
    keys = ca.ChunkKeys(
        k_codes, v_codes, prefix, n_coded, rand(b, window + chunk, hkv, d), rand(b, window + chunk, hkv, d)
    )
    return rand(b, hkv * group, chunk, d), keys


def start_of(gen, b: int, length: int, device="cpu") -> torch.Tensor:
    """Left padding per row: anywhere from none to every slot (rows whose queries see nothing)."""
    return torch.randint(0, length + 1, (b,), generator=gen, dtype=torch.int32).to(device)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 4),
    hkv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 4, 8, 16]),
    chunk=st.integers(2, 13),
    n_coded=st.integers(0, 40),
    window=st.sampled_from([0, 1, 5, 8]),
    kbook=st.sampled_from(BOOKS),
    vbook=st.sampled_from(BOOKS),
    padding=st.booleans(),
    rows_at_once=st.sampled_from([1, 2, None]),
    prefix_kernel=st.sampled_from(["flash", "cudnn"]),
    trellis=st.booleans(),
)
def test_split_path_equals_the_oracle(
    seed, b, hkv, group, chunk, n_coded, window, kbook, vbook, padding, rows_at_once, prefix_kernel, trellis
):
    """The fast path's bookkeeping: the coded prefix a few rows at a time (FlashAttention-2 varlen
    with each row's start, or cuDNN when no row is padded) plus the window and chunk through
    FlashAttention-2's varlen contract, merged: equal to the dense oracle for odd chunk and prefix
    lengths, an empty, partial or full window, left padding of any length (rows with nothing to
    see included), GQA 1-16, either codec."""
    gen = torch.Generator().manual_seed(seed)
    q, keys = chunk_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        d=16,
        chunk=chunk,
        n_coded=n_coded,
        window=window,
        kbook=kbook,
        vbook=vbook,
        dtype=torch.float32,
        trellis=trellis,
    )
    kv_start = start_of(gen, b, keys.length) if padding and prefix_kernel == "flash" else None
    workspace = 1 << 30 if rows_at_once is None else rows_at_once * 2 * n_coded * hkv * 16 * 4
    with (
        mock.patch.object(ca, "flash_varlen", dense_flash_varlen),
        mock.patch.object(ca, "WORKSPACE_BYTES", workspace),
        mock.patch.object(ca, "cudnn_prefix", dense_cudnn_prefix),
    ):
        got = ca.split_flash(q, keys, kv_start, 0.3, prefix_kernel=prefix_kernel)
    torch.testing.assert_close(got, reference.chunk_attention(q, keys, kv_start, 0.3), rtol=1e-4, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    chunk=st.integers(2, 9),
    n_coded=st.integers(0, 30),
    window=st.sampled_from([0, 3]),
    mask_kind=st.sampled_from(["none", "bool", "float"]),
    rows_at_once=st.sampled_from([1, None]),
    trellis=st.booleans(),
)
def test_dense_path_equals_the_oracle(seed, b, hkv, group, chunk, n_coded, window, mask_kind, rows_at_once, trellis):
    """The path off the fast kernels (CPU, float32, any mask): SDPA over the slots a few rows at a
    time, with the standard mask from the padding or a given bool / additive mask, either codec."""
    gen = torch.Generator().manual_seed(seed)
    q, keys = chunk_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        d=16,
        chunk=chunk,
        n_coded=n_coded,
        window=window,
        kbook=(256, 4),
        vbook=(4096, 8),
        dtype=torch.float32,
        trellis=trellis,
    )
    kv_start = start_of(gen, b, keys.length - 1)  # every row sees its last query's key at least
    mask = None
    if mask_kind != "none":
        mask = reference.chunk_mask(b, chunk, keys.length, kv_start, "cpu").expand(b, hkv * group, chunk, keys.length)
        mask = mask & (torch.rand(mask.shape, generator=gen) > 0.2)  # holes, per head
        if mask_kind == "float":
            mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) - torch.rand(mask.shape, generator=gen)
    workspace = 1 << 30 if rows_at_once is None else 1
    with mock.patch.object(ca, "WORKSPACE_BYTES", workspace):
        got = ca.reference_by_rows(q, keys, kv_start, 0.3, mask)
    torch.testing.assert_close(got, reference.chunk_attention(q, keys, kv_start, 0.3, mask), rtol=1e-5, atol=1e-5)


def op_inputs(gen, keys: ca.ChunkKeys, spare_window: int):
    """A compiled chunk's cache buffers and counters for ``keys``: ``(k_codes, v_codes, n_coded,
    k_window, v_window, n_window)``, the window buffers ``[B, H, W, D]`` holding the ``w + C``
    full-precision slots then ``spare_window`` garbage ones (never read)."""
    b, length_full, h, d = keys.k_full.shape

    def window(full):
        garbage = torch.randn(b, h, spare_window, d, generator=gen).to(full.dtype).to(full.device) * 1e3
        return torch.cat([full.transpose(1, 2), garbage], 2)

    counter = lambda n: torch.tensor(n, device=keys.k_full.device)  # noqa: E731
    return (
        keys.k_codes,
        keys.v_codes,
        counter(keys.n_coded),
        window(keys.k_full),
        window(keys.v_full),
        counter(length_full),
    )


def chunk_op(gen, q, keys: ca.ChunkKeys, spare_window: int, mask, scale: float):
    """The op a compiled chunk runs for ``keys``' codec (``vecinfer::chunk_attention`` or
    ``vecinfer::trellis_chunk_attention``) over :func:`op_inputs`."""
    k_codes, v_codes, n_coded, k_window, v_window, n_window = op_inputs(gen, keys, spare_window)
    p = keys.prefix
    if isinstance(p, TrellisPrefix):
        return torch.ops.vecinfer.trellis_chunk_attention(
            q, k_codes, v_codes, n_coded, k_window, v_window, n_window, mask, scale, list(p.keys), list(p.values)
        )
    return torch.ops.vecinfer.chunk_attention(
        q, k_codes, v_codes, p.key_centroids, p.value_centroids, n_coded, k_window, v_window, n_window, mask, scale
    )


def hf_chunk_mask(gen, keys: ca.ChunkKeys, chunk: int, kind: str, heads: int):
    """``(mask over every slot or None, kv_start or None, mask over the valid slots as the oracle
    reads it or None)``: ``"none"``; HF's causal + left padding over the ``S`` slots as ``"bool"`` or
    additive ``"float"``; or ``"holes"``, per-head holes the op must apply as they are."""
    b, slots, length = keys.k_codes.shape[0], keys.k_codes.shape[2], keys.length
    if kind == "none":
        return None, None, None
    device = keys.k_codes.device
    kv_start = start_of(gen, b, length - 1, device)
    valid = reference.chunk_mask(b, chunk, length, kv_start, device)
    if kind == "holes":
        valid = valid.expand(b, heads, chunk, length) & (torch.rand(b, heads, chunk, length, generator=gen) > 0.2).to(
            device
        )
    mask = F.pad(valid, (0, slots - length))
    if kind == "float":
        mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask, (None if kind == "holes" else kv_start), (valid if kind == "holes" else None)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4, 16]),
    chunk=st.integers(2, 9),
    n_coded=st.integers(0, 30),
    window=st.sampled_from([0, 1, 5]),
    spare_window=st.sampled_from([0, 3]),
    mask_kind=st.sampled_from(["none", "bool", "float", "holes"]),
    d=st.sampled_from([16, 64]),
    trellis=st.booleans(),
)
def test_op_equals_the_oracle(seed, b, hkv, group, chunk, n_coded, window, spare_window, mask_kind, d, trellis):
    """``vecinfer::chunk_attention`` / ``trellis_chunk_attention`` (what a compiled chunk runs) from
    the cache's buffers and counters and HF's mask over every slot: the oracle's rule over the valid
    slots (garbage code and window slots past the counters never read), laid out as its fake says."""
    gen = torch.Generator().manual_seed(seed)
    q, keys = chunk_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        d=d,
        chunk=chunk,
        n_coded=n_coded,
        window=window,
        kbook=(256, 4),
        vbook=(256, 2),
        dtype=torch.float32,
        spare=window + chunk + 5,
        trellis=trellis,
    )
    mask, kv_start, explicit = hf_chunk_mask(gen, keys, chunk, mask_kind, hkv * group)
    got = chunk_op(gen, q, keys, spare_window, mask, 0.3)
    torch.testing.assert_close(got, reference.chunk_attention(q, keys, kv_start, 0.3, explicit), rtol=1e-4, atol=1e-4)
    fake = ca._output_like(q)
    assert got.shape == fake.shape and got.stride() == fake.stride()


def test_standard_mask_is_hf_chunk_mask():
    """``standard_mask`` is what transformers builds for a chunk after a left-padded prompt."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    padding = torch.tensor([[1] * 9, [0, 0, 0] + [1] * 6])
    hf = sdpa_mask(
        batch_size=2,
        q_length=4,
        kv_length=9,
        q_offset=5,
        kv_offset=0,
        mask_function=causal_mask_function,
        attention_mask=padding,
        allow_is_causal_skip=False,
    )
    ours = reference.chunk_mask(2, 4, 9, torch.tensor([0, 3]), "cpu")
    assert torch.equal(hf, ours)


def test_chunk_mask_check_is_once_per_mask():
    """The check of a chunk mask (standard? padded?) runs once per mask object and version (HF
    shares one across a forward's layers), and sees an in-place change."""
    from vecinfer_compile.ops.decode_inputs import chunk_mask_layout

    start = torch.tensor([0, 2])
    mask = reference.chunk_mask(2, 3, 8, start, "cpu").clone()
    arange = torch.arange
    with mock.patch("torch.arange", side_effect=arange) as calls:
        assert chunk_mask_layout(mask, start, 8) == (True, True)
        first = calls.call_count
        assert chunk_mask_layout(mask, start, 8) == (True, True)
    assert first > 0 and calls.call_count == first
    mask[1, 0, 2, 4] = False  # a hole
    assert chunk_mask_layout(mask, start, 8) == (False, True)
    unpadded = reference.chunk_mask(2, 3, 8, torch.tensor([0, 0]), "cpu")
    assert chunk_mask_layout(unpadded, torch.tensor([0, 0]), 8) == (True, False)
    wide = torch.nn.functional.pad(unpadded, (0, 5))  # over 13 cache slots, 8 valid
    assert chunk_mask_layout(wide, torch.tensor([0, 0]), 8) == (True, False)
    wide = wide.clone()
    wide[0, 0, 1, 10] = True  # attends an empty slot
    assert chunk_mask_layout(wide, torch.tensor([0, 0]), 8) == (False, False)


# -- semantics on a real model -------------------------------------------------------------------
def _prompt_nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item()


@pytest.mark.slow
@pytest.mark.parametrize("method, codec", [("vecinfer", None), ("qaware", None), ("vecinfer", "trellis")])
def test_chunked_prefill_is_never_less_accurate_than_simulate(evalmodel_dir, calibration_text_path, method, codec):
    """The rule's promise on evalmodel (float32, 2 bits): the prompt's NLL through a chunked prefill
    into the cache is at most the simulate path's at the same window R, for chunks shorter and
    longer than R (simulate: query i reads key j in full precision iff i - j < R; the cache's
    chunks see at least that, and their whole chunk); the codebooks' codes, and the trellis codec's
    (2^6 states, keys and values), whose chunks attend over the codes in the components."""
    from vecinfer_compile import calibrate
    from vecinfer_compile.cache import VecInferCache
    from vecinfer_compile.hf.compat import forward_cache_kwargs
    from vecinfer_compile.models import load_model, load_text, tokenize
    from vecinfer_compile.simulate import simulation

    model, tok = load_model(evalmodel_dir, "float32", "cpu")
    text = load_text(calibration_text_path)
    trellis = {"key_codec": "trellis", "value_codec": "trellis", "codec_options": {"states": 64}} if codec else {}
    cb = calibrate(
        model,
        tok,
        text[:200_000],
        bits=2,
        method=method,
        max_tokens=1024,
        seq_len=512,
        iters=10,
        progress=False,
        **trellis,
    )
    ids = tokenize(tok, text[-60_000:])[None, :600]  # the calibration file's end: not calibrated on
    with torch.no_grad():
        full = _prompt_nll(model(ids).logits, ids)
    for residual, chunk in ((32, 96), (64, 40), (16, 200)):
        with simulation(model, method, bits=2, codebooks=cb, residual=residual), torch.no_grad():
            simulate = _prompt_nll(model(ids).logits, ids)
        cache = VecInferCache(model, cb, max_cache_len=ids.shape[1], residual=residual)
        logits = []
        with torch.no_grad():
            for s in range(0, ids.shape[1], chunk):
                e = min(s + chunk, ids.shape[1])
                logits.append(
                    model(
                        input_ids=ids[:, s:e],
                        attention_mask=torch.ones_like(ids[:, :e]),
                        use_cache=True,
                        **forward_cache_kwargs(model, cache),
                    ).logits
                )
        chunked = _prompt_nll(torch.cat(logits, 1), ids)
        print(
            f"{method}{' trellis' if codec else ''} R={residual} chunk={chunk}: prompt NLL full precision {full:.4f}, simulate {simulate:.4f}, "
            f"chunked cache {chunked:.4f}"
        )  # shown with pytest -s (docs/results.md)
        assert chunked <= simulate, (residual, chunk, chunked, simulate)


@pytest.mark.parametrize("book", BOOKS)
@pytest.mark.parametrize("d", [16, 64, 128])
def test_cuda_dequant_source_compiles_for_sm90(book, d):
    """The CUDA prefix dequantization compiles with NVRTC to an sm_90 cubin for every preset's book
    and head dim (syntax and PTX errors caught without a GPU)."""
    from vecinfer_compile.ops.cuda import dequant as cuda_dequant
    from vecinfer_compile.ops.cuda import nvrtc

    try:
        nvrtc.nvrtc()
    except nvrtc.CudaBuildError as exc:
        pytest.skip(str(exc))
    variant = cuda_dequant.DequantVariant(d, *book)
    image, is_cubin = nvrtc.compile_source(
        cuda_dequant.SOURCE.read_text(), "vq_dequant", 90, ["--std=c++17", *variant.defines()]
    )
    assert is_cubin and len(image) > 1000


# -- GPU ------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["cuda", "triton"])
@pytest.mark.parametrize("book", BOOKS)
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_dequantize_kernels_equal_the_reference(kernel, book, d):
    """Both prefix dequantizations (the CUDA kernel the fast path uses, the Triton fallback) write
    exactly the reference's centroids for the first ``length`` positions of a row slice of the
    codes, every preset's book; nothing past ``length`` is written."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vecinfer_compile.ops.cuda import dequant as cuda_dequant
    from vecinfer_compile.ops.triton import dequant as triton_dequant

    gen = torch.Generator().manual_seed(d + book[0] + book[1])
    codes = pack_codes(torch.randint(0, book[0], (4, 3, 1001, d // book[1]), generator=gen), book[0]).cuda()
    cent = torch.randn(*book, generator=gen).cuda().bfloat16()
    out = torch.full((3, 1001, 3, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn = cuda_dequant.dequantize_cuda if kernel == "cuda" else triton_dequant.dequantize_triton
    fn(codes[1:], cent, 999, out[:, :999])
    want = dequantize(codes[1:, :, :999], cent.float()).transpose(1, 2).bfloat16()
    assert torch.equal(out[:, :999], want) and out[:, 999:].isnan().all()


@pytest.mark.cuda
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2, 8]),
    group=st.sampled_from([1, 2, 4, 8, 16]),
    d=st.sampled_from([64, 128]),
    chunk=st.sampled_from([2, 17, 128, 301]),
    n_coded=st.sampled_from([0, 1, 63, 1000, 4097]),
    window=st.sampled_from([0, 37, 128]),
    kbook=st.sampled_from(BOOKS),
    vbook=st.sampled_from(BOOKS),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    padding=st.booleans(),
    trellis=st.booleans(),
)
def test_cuda_chunk_attention_equals_the_oracle(
    seed, b, hkv, group, d, chunk, n_coded, window, kbook, vbook, dtype, padding, trellis
):
    """The real fast path (the workspace's kernel, torch's FlashAttention-2 varlen or cuDNN, the
    merge) against the float32 oracle, either codec: ``err <= 2 * err(bf16/fp16 SDPA over the same
    slots) + atol``."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(seed)
    q, keys = chunk_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        d=d,
        chunk=chunk,
        n_coded=n_coded,
        window=window,
        kbook=kbook,
        vbook=vbook,
        dtype=dtype,
        device="cuda",
        trellis=trellis,
    )
    kv_start = start_of(gen, b, keys.length, "cuda") if padding else None
    scale = d**-0.5
    assert ca.fast_path_serves(q)
    got = ca.attend(q, keys, kv_start, scale)
    assert got.dtype == dtype and got.isfinite().all()
    want = reference.chunk_attention(q.float(), keys, kv_start, scale)
    k, v = reference.chunk_kv_dense(keys, slice(None), dtype)
    mask = reference.chunk_mask(b, chunk, keys.length, kv_start, "cuda")
    low = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    low = torch.where(mask.any(-1, keepdim=True), low, 0)  # rows that see nothing: zeros, as ours
    err, base = (got.float() - want).abs().max().item(), (low.float() - want).abs().max().item()
    assert err <= 2 * base + 2e-3, (err, base)


@pytest.mark.cuda
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    hkv=st.sampled_from([1, 2, 8]),
    group=st.sampled_from([1, 4]),
    d=st.sampled_from([64, 128]),
    chunk=st.sampled_from([2, 17, 300]),
    n_coded=st.sampled_from([0, 63, 1000]),
    window=st.sampled_from([0, 37]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    mask_kind=st.sampled_from(["none", "bool", "float", "holes"]),
    trellis=st.booleans(),
)
def test_cuda_op_equals_the_oracle(seed, b, hkv, group, d, chunk, n_coded, window, dtype, mask_kind, trellis):
    """``vecinfer::chunk_attention`` / ``trellis_chunk_attention`` on CUDA (the fast path for HF's
    causal + padding masks, the dense path for holes) against the float32 oracle:
    ``err <= 2 * err(SDPA in dtype) + atol``."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(seed)
    q, keys = chunk_case(
        gen,
        b=b,
        hkv=hkv,
        group=group,
        d=d,
        chunk=chunk,
        n_coded=n_coded,
        window=window,
        kbook=(256, 4),
        vbook=(256, 4),
        dtype=dtype,
        device="cuda",
        spare=window + chunk + 9,
        trellis=trellis,
    )
    mask, kv_start, explicit = hf_chunk_mask(gen, keys, chunk, mask_kind, hkv * group)
    scale = d**-0.5
    got = chunk_op(gen, q, keys, 5, mask, scale)
    assert got.dtype == dtype and got.isfinite().all()
    want = reference.chunk_attention(q.float(), keys, kv_start, scale, explicit)
    k, v = reference.chunk_kv_dense(keys, slice(None), dtype)
    visible = reference.chunk_mask(b, chunk, keys.length, kv_start, "cuda") if explicit is None else explicit
    low = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    low = torch.where(visible.any(-1, keepdim=True), low, 0)
    err, base = (got.float() - want).abs().max().item(), (low.float() - want).abs().max().item()
    assert err <= 2 * base + 2e-3, (err, base)
