"""Registration, schemas, ``torch.library.opcheck`` and argument errors of the ``vecinfer`` ops."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_ops_reference import attention_case, decode_case

import vecinfer_compile.ops as ops
from vecinfer_compile.ops.coded_kv import bundle_coded_kv
from vecinfer_compile.quant import unpack_codes

CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA_ONLY])]


def to(args, device):
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def test_registration_is_idempotent():
    for family in (ops.append, ops.attention, ops.decode, ops.dequantize, ops.encode):
        importlib.reload(family)
    schema = str(torch.ops.vecinfer.decode_attention.default._schema)
    assert schema.startswith("vecinfer::decode_attention(Tensor q, Tensor k_codes, Tensor v_codes")
    assert "Tensor? kv_start, float scale) -> Tensor" in schema


@pytest.mark.parametrize(
    "device,residual,mask_kind,causal",
    [
        ("cpu", 2, "float", True),  # one CPU case: opcheck costs ~12 s per case here
        pytest.param("cuda", 0, "none", True, marks=[pytest.mark.cuda, CUDA_ONLY]),
        pytest.param("cuda", 3, "bool", False, marks=[pytest.mark.cuda, CUDA_ONLY]),
        pytest.param("cuda", 2, "float", True, marks=[pytest.mark.cuda, CUDA_ONLY]),
    ],
)
def test_opcheck_attention(device, residual, mask_kind, causal):
    gen = torch.Generator().manual_seed(residual)
    args = attention_case(
        gen,
        b=2,
        hkv=2,
        group=2,
        tq=5,
        tk=7,
        d=16,
        kspec=(256, 4),
        vspec=(4096, 8),
        mask_kind=mask_kind,
        causal=causal,
        residual=residual,
        dtype=torch.float32,
    )
    torch.library.opcheck(torch.ops.vecinfer.attention.default, to(args, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_start", [False, True])
def test_opcheck_decode(device, with_start):
    gen = torch.Generator().manual_seed(1)
    args = decode_case(
        gen,
        b=2,
        hkv=2,
        group=4,
        tmax=9,
        n_coded=6,
        r=4,
        n_window=2,
        d=16,
        kspec=(256, 4),
        vspec=(256, 2),
        with_start=with_start,
        dtype=torch.bfloat16,
    )
    torch.library.opcheck(torch.ops.vecinfer.decode_attention.default, to(args, device))


@pytest.mark.parametrize("n_coded,with_start", [(0, False), (37, True), (37, False), (500, True)])
def test_cpu_decode_reads_the_filled_codes_only(n_coded, with_start, monkeypatch):
    """On a CPU the decode op hands the reference only the first n_coded positions of a 500-slot
    cache (so an eager step costs what the cache holds, not its capacity) and returns what the
    reference returns over every slot, masked."""
    gen = torch.Generator().manual_seed(5)
    args = decode_case(
        gen,
        b=2,
        hkv=2,
        group=4,
        tmax=500,
        n_coded=n_coded,
        r=16,
        n_window=9,
        d=32,
        kspec=(4096, 4),
        vspec=(256, 4),
        with_start=with_start,
        dtype=torch.float32,
    )
    want = ops.reference.decode_attention(*bundle_coded_kv(args, 1))
    seen = []
    real = ops.reference.decode_attention
    monkeypatch.setattr(ops.reference, "decode_attention", lambda *a: seen.append(a[1].k_codes.shape[2]) or real(*a))
    torch.testing.assert_close(torch.ops.vecinfer.decode_attention(*args), want, rtol=1e-6, atol=1e-6)
    assert seen == [n_coded]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entries", [256, 4096])
def test_opcheck_encode(device, entries):
    x = torch.randn(2, 3, 5, 16, dtype=torch.float16)
    lam = torch.rand(3, 16) + 0.5
    args = (x, lam, torch.eye(16), torch.randn(entries, 4))
    torch.library.opcheck(torch.ops.vecinfer.encode.default, to(args, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entries", [256, 4096])
def test_opcheck_quantize(device, entries):
    x = torch.randn(2, 3, 5, 16, dtype=torch.bfloat16)
    args = (x, None, None, torch.randn(entries, 4))
    torch.library.opcheck(torch.ops.vecinfer.quantize.default, to(args, device))


@pytest.mark.parametrize("entries", [256, 4096])
def test_quantize_is_dequantized_codes(entries):
    x = torch.randn(2, 3, 5, 16)
    lam, rot, cent = torch.rand(3, 16) + 0.5, torch.eye(16), torch.randn(entries, 4)
    out = torch.ops.vecinfer.quantize(x, lam, rot, cent)
    codes = torch.ops.vecinfer.encode(x, lam, rot, cent)
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 5, 4 if entries == 256 else 6)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, cent[unpack_codes(codes, entries)].reshape(x.shape), rtol=0, atol=0)


def _attention_args(**overrides):
    gen = torch.Generator().manual_seed(0)
    args = dict(
        zip(
            [
                "q",
                "k_codes",
                "v_codes",
                "k_centroids",
                "v_centroids",
                "k_full",
                "v_full",
                "attn_mask",
                "is_causal",
                "scale",
                "residual",
            ],
            attention_case(
                gen,
                b=1,
                hkv=1,
                group=2,
                tq=3,
                tk=3,
                d=16,
                kspec=(256, 4),
                vspec=(256, 4),
                mask_kind="none",
                causal=True,
                residual=0,
                dtype=torch.float32,
            ),
        )
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(residual=2), ValueError, "needs k_full and v_full"),
        (dict(k_codes=torch.zeros(1, 1, 3, 4, dtype=torch.int32)), TypeError, "must be uint8 stored codes.*pack_codes"),
        (dict(k_codes=torch.zeros(1, 1, 3, 4, dtype=torch.int16)), TypeError, "must be uint8 stored codes.*pack_codes"),
        # 12-bit codes given unpacked (one byte each) or at a wrong width
        (
            dict(k_centroids=torch.randn(4096, 4), k_codes=torch.zeros(1, 1, 3, 4, dtype=torch.uint8)),
            ValueError,
            r"4 bytes per head vector but 4 12-bit codes .* stored in 6; pack them with .*pack_codes",
        ),
        (
            dict(k_codes=torch.zeros(1, 1, 3, 6, dtype=torch.uint8)),
            ValueError,
            "6 bytes per head vector but 4 8-bit codes",
        ),
        (dict(k_centroids=torch.randn(5000, 4)), ValueError, "at most 4096 entries"),
        (dict(k_centroids=torch.randn(256, 3)), ValueError, "not divisible by the sub-vector size 3"),
        (dict(k_centroids=torch.randn(256, 4, dtype=torch.float64)), TypeError, "centroids.float"),
        (dict(q=torch.randn(1, 2, 3, 16, dtype=torch.float64)), TypeError, "float16, bfloat16 or float32"),
        (dict(q=torch.randn(1, 3, 3, 16)), ValueError, "not a multiple of 1 KV heads|3 query heads"),
    ],
)
def test_attention_errors_name_the_fix(overrides, error, match):
    args = _attention_args(**overrides)
    if "q" in overrides and overrides["q"].shape[1] == 3:
        args["k_codes"] = torch.zeros(1, 2, 3, 4, dtype=torch.uint8)
        args["v_codes"] = torch.zeros(1, 2, 3, 4, dtype=torch.uint8)
    with pytest.raises(error, match=match):
        torch.ops.vecinfer.attention(*args.values())


def test_decode_rejects_python_ints_for_lengths():
    gen = torch.Generator().manual_seed(0)
    args = list(
        decode_case(
            gen,
            b=1,
            hkv=1,
            group=1,
            tmax=4,
            n_coded=2,
            r=2,
            n_window=1,
            d=16,
            kspec=(256, 4),
            vspec=(256, 4),
            with_start=False,
            dtype=torch.float32,
        )
    )
    args[5] = torch.tensor([2])
    with pytest.raises(TypeError, match="0-d int32/int64 tensor"):
        torch.ops.vecinfer.decode_attention(*args)


def test_unknown_score_variant():
    with pytest.raises(ValueError, match="score must be one of"):
        ops.decode_attention_triton(*([None] * 4), score="fast")
