"""A minimal third codec, kept in the tests to show what the codec seam asks of a new codec: plain
scalar quantization, each number of a side coded on ``b`` whole bits (``b`` in 1, 2, 4, 8) between
its head and channel's calibration minimum and maximum, ``8 / b`` codes a byte.

Everything here is pure torch on any device: the fit, the file section (``{side}_scalar.lo`` and
``.step``, ``[A, H_kv, D]``), the simulate path, and the cache's four registered ops
(``vecinfer::scalar_append``, ``scalar_cache_kv``, ``scalar_decode_attention``,
``scalar_chunk_attention``) with their table entry for the compile pass. The conformance suite runs
it through :func:`registered` (the registry line a product codec would add)."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vecinfer_compile.codecs import registry
from vecinfer_compile.codecs.base import CacheRewrite, Codec, FitContext
from vecinfer_compile.ops.append import append_through_window
from vecinfer_compile.ops.registry import define
from vecinfer_compile.ops.split_attention.chunk import attend_over_buffers

NAME = "scalar"


class ScalarCode(NamedTuple):
    """One side of one layer: ``lo``, ``step`` ``[H, D]`` float32; ``bits`` a number."""

    lo: torch.Tensor
    step: torch.Tensor
    bits: int


def _encode(x: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """``x [B, H, T, D]`` -> packed codes ``[B, H, T, D * bits / 8]`` uint8."""
    levels = (1 << bits) - 1
    q = ((x.float() - lo[:, None]) / step[:, None]).round().clamp(0, levels).to(torch.uint8)
    per = 8 // bits
    q = q.reshape(*q.shape[:-1], -1, per)
    shifts = torch.arange(per, device=x.device, dtype=torch.uint8) * bits
    return (q << shifts).sum(-1, dtype=torch.uint8)


def _decode(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed ``codes [B, H, T, W]`` -> ``[B, H, T, D]`` float32."""
    per = 8 // bits
    shifts = torch.arange(per, device=codes.device, dtype=torch.uint8) * bits
    q = (codes[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(*codes.shape[:-1], -1).float() * step[:, None] + lo[:, None]


def _dense(k_codes, v_codes, n_coded, k_window, v_window, n_window, kl, ks, vl, vs, bits):
    """Every slot's ``(K~, V)`` float32: decoded codes, then the window, zeros after."""
    slot = torch.arange(k_codes.shape[2], device=k_codes.device)[:, None]
    kt, v = _decode(k_codes, kl, ks, bits), _decode(v_codes, vl, vs, bits)
    r = k_window.shape[2]
    if r:
        at = (slot[:, 0] - n_coded).clamp(0, r - 1)
        inside = (slot >= n_coded) & (slot < n_coded + n_window)
        kt = torch.where(inside, k_window.float().index_select(2, at), kt)
        v = torch.where(inside, v_window.float().index_select(2, at), v)
    valid = slot < n_coded + n_window
    return torch.where(valid, kt, 0.0), torch.where(valid, v, 0.0)


def scalar_append(
    kt: torch.Tensor,
    value: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_coded: torch.Tensor,
    n_window: torch.Tensor,
    kl: torch.Tensor,
    ks: torch.Tensor,
    vl: torch.Tensor,
    vs: torch.Tensor,
    bits: int,
) -> None:
    append_through_window(
        kt,
        value,
        k_codes,
        v_codes,
        k_window,
        v_window,
        n_coded,
        n_window,
        lambda x: _encode(x, kl, ks, bits),
        lambda x: _encode(x, vl, vs, bits),
    )


def scalar_cache_kv(
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    lam: torch.Tensor | None,
    rotation: torch.Tensor | None,
    kl: torch.Tensor,
    ks: torch.Tensor,
    vl: torch.Tensor,
    vs: torch.Tensor,
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    kt, v = _dense(k_codes, v_codes, n_coded, k_window, v_window, n_window, kl, ks, vl, vs, bits)
    if rotation is not None:
        kt = kt @ rotation.float().T
    if lam is not None:
        kt = kt * lam.float()[None, :, None, :]
    return kt.to(k_window.dtype), v.to(v_window.dtype)


def scalar_decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    kv_start: torch.Tensor | None,
    scale: float,
    kl: torch.Tensor,
    ks: torch.Tensor,
    vl: torch.Tensor,
    vs: torch.Tensor,
    bits: int,
) -> torch.Tensor:
    kt, v = _dense(k_codes, v_codes, n_coded, k_window, v_window, n_window, kl, ks, vl, vs, bits)
    group = q.shape[1] // kt.shape[1]
    slot = torch.arange(kt.shape[2], device=q.device)
    keep = (slot < n_coded + n_window)[None].expand(q.shape[0], -1)
    if kv_start is not None:
        keep = keep & (slot[None] >= kv_start[:, None])
    out = F.scaled_dot_product_attention(
        q.float(),
        kt.repeat_interleave(group, 1),
        v.repeat_interleave(group, 1),
        attn_mask=keep[:, None, None],
        scale=scale,
    )
    return out.to(q.dtype)


class ScalarPrefix(NamedTuple):
    """A chunk's prefix over scalar codes: the workspace holds ``K~`` and ``V`` themselves."""

    kl: torch.Tensor
    ks: torch.Tensor
    vl: torch.Tensor
    vs: torch.Tensor
    bits: int

    def dense(self, k_codes, v_codes):
        return _decode(k_codes, self.kl, self.ks, self.bits), _decode(v_codes, self.vl, self.vs, self.bits)

    def queries(self, q, scale):
        return q, None

    def fill(self, k_codes, v_codes, length, k_out, v_out):
        k, v = self.dense(k_codes[:, :, :length], v_codes[:, :, :length])
        k_out.copy_(k.transpose(1, 2))
        v_out.copy_(v.transpose(1, 2))

    def outputs(self, o):
        return o


def scalar_chunk_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    n_coded: torch.Tensor,
    k_window: torch.Tensor,
    v_window: torch.Tensor,
    n_window: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    kl: torch.Tensor,
    ks: torch.Tensor,
    vl: torch.Tensor,
    vs: torch.Tensor,
    bits: int,
) -> torch.Tensor:
    return attend_over_buffers(
        q, k_codes, v_codes, ScalarPrefix(kl, ks, vl, vs, bits), n_coded, k_window, v_window, n_window, attn_mask, scale
    )


def _register_ops() -> None:
    define(
        "scalar_append",
        scalar_append,
        kind="opaque",
        fake=lambda *args: None,
        mutates=("k_codes", "v_codes", "k_window", "v_window", "n_coded", "n_window"),
    )
    define(
        "scalar_cache_kv",
        scalar_cache_kv,
        kind="opaque",
        fake=lambda kc, vc, n, kw, vw, *rest: (
            kw.new_empty((*kc.shape[:3], kw.shape[-1])),
            vw.new_empty((*vc.shape[:3], vw.shape[-1])),
        ),
    )
    define("scalar_decode_attention", scalar_decode_attention, kind="opaque", fake=lambda q, *rest: torch.empty_like(q))
    define(
        "scalar_chunk_attention",
        scalar_chunk_attention,
        kind="opaque",
        fake=lambda q, *rest: q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3])).transpose(1, 2),
        tags=(torch.Tag.cudagraph_unsafe,),
    )


BUFFERS, LAM, ROT, OPERANDS = slice(0, 6), 6, 7, slice(8, 13)
REWRITE = CacheRewrite(
    read_op="scalar_cache_kv",
    transform=lambda a: (a[LAM], a[ROT]),
    decode=lambda q, a, kv_start, scale, kernel: (
        torch.ops.vecinfer.scalar_decode_attention.default,
        (*a[BUFFERS], kv_start, scale, *a[OPERANDS]),
    ),
    chunk=lambda a, mask, scale: (
        torch.ops.vecinfer.scalar_chunk_attention.default,
        (*a[BUFFERS], mask, scale, *a[OPERANDS]),
    ),
    write_ops=("scalar_append",),
)


class ScalarCodec(Codec):
    name = NAME
    code_type = ScalarCode
    rewrite = REWRITE

    def check_plan(self, bits, head_dim, options) -> None:
        for b in bits:
            if b not in (1, 2, 4, 8):
                raise ValueError(f"the scalar codec codes 1, 2, 4 or 8 bits a number, not {b:g}")

    def fit(self, vectors, side, ctx: FitContext) -> ScalarCode:
        self.check_plan([ctx.bits], None, {})
        lo, hi = vectors.float().amin(1), vectors.float().amax(1)
        return ScalarCode(lo, ((hi - lo) / ((1 << int(ctx.bits)) - 1)).clamp_min(1e-8), int(ctx.bits))

    def write(self, side, codes, present):
        return {
            f"{side}_scalar.lo": torch.stack([c.lo for c in codes]),
            f"{side}_scalar.step": torch.stack([c.step for c in codes]),
        }

    def read(self, side, tensors, *, path, present, layer_bits, geometry):
        shape = (len(present), geometry["num_kv_heads"], geometry["head_dim"])
        parts = []
        for part in ("lo", "step"):
            name = f"{side}_scalar.{part}"
            if name not in tensors:
                raise ValueError(f"{path}: tensor {name!r} is missing (corrupt file)")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, not {shape} (corrupt file)")
            if not torch.isfinite(tensors[name]).all():
                raise ValueError(f"{path}: {name} holds NaN or inf (corrupt file)")
            parts.append(tensors[name].float())
        return [ScalarCode(parts[0][n], parts[1][n], int(layer_bits[i])) for n, i in enumerate(present)]

    def tensor_names(self, side, tensors):
        return [n for n in tensors if n.startswith(f"{side}_scalar.")]

    def quantize_dequantize(self, code, x, *, metric=None, parallel_weight=1.0):
        lo, step = code.lo.to(x.device), code.step.to(x.device)
        return _decode(_encode(x, lo, step, code.bits), lo, step, code.bits).to(x.dtype)

    def code_bytes(self, code, head_dim):
        return head_dim * code.bits // 8

    def state_tensors(self, code):
        return [code.lo, code.step]

    def select_heads(self, code, heads):
        return ScalarCode(code.lo[heads], code.step[heads], code.bits)

    def random_code(self, gen, kv_heads, head_dim, bits, side):
        self.check_plan([bits], head_dim, {})
        lo = -2 - torch.rand(kv_heads, head_dim, generator=gen)
        return ScalarCode(lo, (-2 * lo) / ((1 << int(bits)) - 1), int(bits))

    def operands(self, layer, device):
        return tuple(
            t.to(device, torch.float32).contiguous()
            for t in (layer.keys.lo, layer.keys.step, layer.values.lo, layer.values.step)
        )

    def operand_tensors(self, operands):
        return list(operands)

    def fill(self, storage, kt, v, quantizer):
        kl, ks, vl, vs = quantizer.operands
        bits = quantizer.codes[0].bits
        storage.fill_by_window(kt, v, lambda x: _encode(x, kl, ks, bits), lambda x: _encode(x, vl, vs, bits))

    def append(self, storage, k, v, quantizer):
        s = storage
        torch.ops.vecinfer.scalar_append(
            quantizer.transform_keys(k, s.dtype),
            v,
            s.k_codes,
            s.v_codes,
            s.k_window,
            s.v_window,
            s.n_coded,
            s.n_window,
            *quantizer.operands,
            quantizer.codes[0].bits,
        )

    def read_kv(self, k_codes, v_codes, n_coded, k_window, v_window, n_window, quantizer):
        return torch.ops.vecinfer.scalar_cache_kv(
            k_codes,
            v_codes,
            n_coded,
            k_window,
            v_window,
            n_window,
            quantizer.lam,
            quantizer.rotation,
            *quantizer.operands,
            quantizer.codes[0].bits,
        )

    def decode(self, storage, quantizer, q_t, kv_start, scale):
        s = storage
        return torch.ops.vecinfer.scalar_decode_attention(
            q_t,
            s.k_codes,
            s.v_codes,
            s.n_coded,
            s.k_window,
            s.v_window,
            s.n_window,
            kv_start,
            scale,
            *quantizer.operands,
            quantizer.codes[0].bits,
        )

    def prefix(self, quantizer):
        return ScalarPrefix(*quantizer.operands, quantizer.codes[0].bits)


@contextlib.contextmanager
def registered():
    """The scalar codec in the registry within the block (a product codec's one registry line)."""
    _register_ops()
    with registry.extra(NAME, ScalarCodec()):
        yield
