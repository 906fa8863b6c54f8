"""Triton kernels of the trellis codec: its encoder (the Viterbi walk) and decode attention over its codes.

**Encode** (:func:`viterbi_walks`): the encoder of :mod:`vecinfer_compile.codecs.trellis.walk` in one launch.

One program codes one vector (a token's components of one KV head): the ``2^L`` path costs live in
registers, and each step is the reference's move, a min over the high bits of the cost vector
viewed ``[2^k, 2^(L-k)]``, then the new states' squared errors added. The step's width ``k`` is
read at run time from the head's bit allocation (one branch per width, widths up to ``MAX_K``);
components with 0 bits are skipped. The argmin's high bits (one byte a state; two where a width
exceeds 8 bits) go to a scratch buffer in global memory and the walk is traced back at the end of
the same program. Every row and head of a call is one launch, where the torch reference takes a
few kernels a component and head (about 1,500 launches a layer per decode step).

**Decode** (:func:`decode_components`): flash-decoding over the codes in the components. A program
takes one (batch row, KV head) and one split of the coded prefix, a block of tokens at a time:
each component's state from its string's bytes, its unit table entry gathered (through L1: Triton
has no shared-memory gather), scores against the group's query heads by ``tl.dot`` in float32,
online softmax, and the values' entries accumulated the same way (docs/results/decode-speed.md:
correct, and far slower than FP16).

**Entries** (:func:`entries_into`): a chunk's coded prefix as unit table entries, position-major,
for the split attention of :mod:`..split_attention.chunk` (its queries and outputs go to and from
the components instead, :mod:`..split_attention.prefix`): one program per (batch row, KV head,
block of positions) reads each string once and writes a ``[BLOCK_T, D]`` tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.split_attention.lse_merge import LOG2E, merge_splits
from ...ops.triton.common import launch, unit_last_stride
from .packing import bit_ends, packed_bytes

SCRATCH_BYTES = 1 << 30  # trace-back bytes one launch may use; larger calls go in row chunks
MAX_STATE_BITS = 13  # 2^13 path costs a program: 64 float32 registers a thread at 4 warps


@triton.jit
def _viterbi_kernel(
    x_ptr,
    bits_ptr,
    tables_ptr,
    trace_ptr,
    walk_ptr,
    ends_ptr,
    codes_ptr,
    H,
    D,
    nbytes,
    stride_xn,
    stride_xh,
    stride_bh,
    stride_th,
    stride_tw,
    stride_wn,
    stride_wh,
    stride_cn,
    stride_ch,
    L: tl.constexpr,
    MAX_K: tl.constexpr,
    WALKS: tl.constexpr,
    CODES: tl.constexpr,
    NB: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    S: tl.constexpr = 1 << L
    HALF: tl.constexpr = S // 2
    states = tl.arange(0, S)
    cost = tl.where(states == 0, 0.0, float("inf"))
    trace = trace_ptr + (row * H + h).to(tl.int64) * D * HALF
    for t in range(D):
        k = tl.load(bits_ptr + h * stride_bh + t)
        x = tl.load(x_ptr + row * stride_xn + h * stride_xh + t)
        for kk in tl.static_range(1, MAX_K + 1):
            if k == kk:
                view = tl.reshape(cost, (1 << kk, S >> kk))
                best, high = tl.min(view, axis=0, return_indices=True)
                tl.store(trace + t * HALF + tl.arange(0, S >> kk), high.to(trace_ptr.dtype.element_ty))
                table = tl.load(tables_ptr + h * stride_th + (kk - 1) * stride_tw + states)
                err = x - table
                spread = tl.broadcast_to(tl.reshape(best, (S >> kk, 1)), (S >> kk, 1 << kk))
                cost = tl.reshape(spread, (S,)) + err * err
    s = tl.argmin(cost, axis=0).to(tl.int32)
    byte = tl.arange(0, NB)
    packed = tl.zeros([NB], tl.int32)
    for i in range(D):
        t = D - 1 - i
        k = tl.load(bits_ptr + h * stride_bh + t)
        if k > 0:
            if WALKS:
                tl.store(walk_ptr + row * stride_wn + h * stride_wh + t, s)
            if CODES:  # the new bits (the state's low k) at string bits [end - k, end), most significant first
                start = tl.load(ends_ptr + h * D + t) - k
                window = (s & ((1 << k) - 1)) << (24 - (start & 7) - k)  # 3 bytes from the start's byte
                rel = byte - (start >> 3)
                inside = (rel >= 0) & (rel <= 2)
                packed |= tl.where(inside, (window >> tl.where(inside, 8 * (2 - rel), 0)) & 255, 0)
            high = tl.load(trace + t * HALF + (s >> k)).to(tl.int32)
            s = (s >> k) | (high << (L - k))
    if CODES:
        tl.store(codes_ptr + row * stride_cn + h * stride_ch + byte, packed.to(tl.uint8), mask=byte < nbytes)


def viterbi_walks(x: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor, wrap: bool = False) -> torch.Tensor:
    """Least-squared-error walks of every row and head: ``x: [N, H, D]`` float32 components (unit
    scale), ``bits: [H, D]`` integer bits of each component (0: not coded), ``tables: [H, W, 2^L]``
    float32 (row ``k - 1``: the ``k``-bit table) -> states ``[N, H, D]`` int32 (0 where a component
    has 0 bits). The same walks as :func:`vecinfer_compile.codecs.trellis.walk.viterbi` on each head's
    coded components, up to ties in cost."""
    return _viterbi(x, bits, tables, walks=True, codes=False, wrap=wrap)[0]


def viterbi_codes(
    x: torch.Tensor, bits: torch.Tensor, tables: torch.Tensor, wrap: bool = False, nbytes: int | None = None
) -> torch.Tensor:
    """:func:`viterbi_walks`' walks in the stored layout, written by the same launch:
    ``[N, H, nbytes]`` uint8 (:func:`vecinfer_compile.codecs.trellis.packing.pack_walks`). ``nbytes``:
    the string's bytes when the caller knows them (reading them off ``bits`` on the GPU is a host
    sync, which a CUDA graph's capture refuses)."""
    return _viterbi(x, bits, tables, walks=False, codes=True, wrap=wrap, nbytes=nbytes)[1]


def _viterbi(
    x: torch.Tensor,
    bits: torch.Tensor,
    tables: torch.Tensor,
    *,
    walks: bool,
    codes: bool,
    wrap: bool,
    nbytes: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    n, h, d = x.shape
    if bits.shape != (h, d) or tables.dim() != 3 or tables.shape[0] != h:
        raise ValueError(
            f"x [N, H, D], bits [H, D], tables [H, W, 2^L]: got {tuple(x.shape)}, {tuple(bits.shape)}, "
            f"{tuple(tables.shape)}"
        )
    width, states = tables.shape[1:]
    lbits = states.bit_length() - 1
    if states != 1 << lbits or not 1 <= lbits <= MAX_STATE_BITS or width > lbits:
        raise ValueError(
            f"tables of 2^L entries (1 <= L <= {MAX_STATE_BITS}) and at most L widths, got "
            f"{tuple(tables.shape)}; larger trellises run the torch reference"
        )
    x = x.float().contiguous()
    bits = bits.to(device=x.device, dtype=torch.int32).contiguous()
    tables = tables.to(device=x.device, dtype=torch.float32).contiguous()
    nbytes = (packed_bytes(bits) if nbytes is None else nbytes) if codes else 1
    walk_out = torch.zeros(n if walks else 1, h, d, dtype=torch.int32, device=x.device)
    code_out = torch.zeros(n if codes else 1, h, nbytes, dtype=torch.uint8, device=x.device)
    ends = bit_ends(bits).int().contiguous()
    trace_dtype = torch.uint8 if width <= 8 else torch.int16  # a step's high bits: < 2^k
    rows = max(1, SCRATCH_BYTES // (h * d * (states // 2) * trace_dtype.itemsize))
    for start in range(0, n, rows):
        part = x[start : start + rows]
        w = walk_out[start : start + rows] if walks else walk_out
        c = code_out[start : start + rows] if codes else code_out
        trace = torch.empty(part.shape[0] * h * d * (states // 2), dtype=trace_dtype, device=x.device)
        launch(
            _viterbi_kernel,
            (part.shape[0], h),
            wrap,
            part,
            bits,
            tables,
            trace,
            w,
            ends,
            c,
            h,
            d,
            nbytes,
            part.stride(0),
            part.stride(1),
            bits.stride(0),
            tables.stride(0),
            tables.stride(1),
            w.stride(0),
            w.stride(1),
            c.stride(0),
            c.stride(1),
            L=lbits,
            MAX_K=width,
            WALKS=walks,
            CODES=codes,
            NB=triton.next_power_of_2(nbytes),
            num_warps=4 if lbits <= 10 else 8,
        )
    return (walk_out if walks else None), (code_out if codes else None)


@triton.jit
def _entries(codes_row, t_mask, first, shift, mask, rows, tables_ptr, NBYTES):
    """Unit table entries ``[BLOCK_T, D]`` float32 of the tokens whose code rows start at
    ``codes_row [BLOCK_T, 1]``: each component's state from its window of up to three bytes, then
    its table entry (0 for a component of 0 bits or a masked token)."""
    f = first[None, :]
    b0 = tl.load(codes_row + f, mask=t_mask, other=0).to(tl.int32)
    b1 = tl.load(codes_row + f + 1, mask=t_mask & (f + 1 < NBYTES), other=0).to(tl.int32)
    b2 = tl.load(codes_row + f + 2, mask=t_mask & (f + 2 < NBYTES), other=0).to(tl.int32)
    state = (((b0 << 16) | (b1 << 8) | b2) >> shift[None, :]) & mask[None, :]
    return tl.load(tables_ptr + rows[None, :] + state, mask=t_mask & (mask[None, :] > 0), other=0.0)


@triton.jit
def _entries_kernel(
    codes_ptr,
    first_ptr,
    shift_ptr,
    mask_ptr,
    rows_ptr,
    tables_ptr,
    out_ptr,
    s_cb,
    s_ch,
    s_ct,
    s_ob,
    s_ot,
    s_oh,
    H,
    T,
    nbytes,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = (t < T)[:, None]
    c = tl.arange(0, D)
    e = _entries(
        codes_ptr + b * s_cb + h * s_ch + t[:, None] * s_ct,
        t_mask,
        tl.load(first_ptr + h * D + c),
        tl.load(shift_ptr + h * D + c),
        tl.load(mask_ptr + h * D + c),
        tl.load(rows_ptr + h * D + c),
        tables_ptr,
        nbytes,
    )
    dst = out_ptr + b * s_ob + t[:, None] * s_ot + h * s_oh + c[None, :]
    tl.store(dst, e.to(out_ptr.dtype.element_ty), mask=t_mask)


ENTRIES_BLOCK_T = 32


def entries_into(codes: torch.Tensor, operands, length: int, out: torch.Tensor) -> torch.Tensor:
    """Write the unit table entries of the first ``length`` positions of ``codes`` into ``out``:
    codes ``[B, H, Tmax, nbytes]`` uint8 (a unit last stride), ``operands`` the codec's
    :class:`~vecinfer_compile.codecs.trellis.operands.TrellisOperands`, out ``[B, length, H, D]`` (any float
    dtype, a unit last stride; position-major). Entry ``[b, t, h, c]`` is
    ``operands.entries(codes)[b, h, t, c]`` (0 for a component of 0 bits). Returns ``out``; runs
    under ``TRITON_INTERPRET=1`` on CPU tensors (the tests)."""
    b, h, tmax, nbytes = codes.shape
    d = out.shape[-1]
    if tuple(out.shape) != (b, length, h, d) or out.stride(-1) != 1:
        raise ValueError(
            f"out must be [B, length, H, D] = {(b, length, h, d)} with a unit last stride, "
            f"got {tuple(out.shape)} strides {out.stride()}"
        )
    if not 0 <= length <= tmax:
        raise ValueError(f"length {length} is outside the {tmax} code slots")
    if d & (d - 1) or tuple(operands.first.shape) != (h, d):
        raise ValueError(
            f"a power-of-two head_dim and operands of {h} heads are needed, got head_dim {d} and "
            f"operands for {tuple(operands.first.shape)}"
        )
    if length == 0 or b == 0:
        return out
    codes = unit_last_stride(codes)
    launch(
        _entries_kernel,
        (triton.cdiv(length, ENTRIES_BLOCK_T), b * h),
        False,
        codes,
        operands.first,
        operands.shift,
        operands.mask,
        operands.rows,
        operands.tables,
        out,
        codes.stride(0),
        codes.stride(1),
        codes.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        h,
        length,
        nbytes,
        D=d,
        BLOCK_T=ENTRIES_BLOCK_T,
        num_warps=4,
    )
    return out


@triton.jit
def _decode_kernel(
    qc_ptr,
    bias_ptr,
    k_ptr,
    v_ptr,
    kf_ptr,
    ks_ptr,
    km_ptr,
    kr_ptr,
    kt_ptr,
    vf_ptr,
    vs_ptr,
    vm_ptr,
    vr_ptr,
    vt_ptr,
    start_ptr,
    n_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    n_coded,
    hkv,
    k_nbytes,
    v_nbytes,
    split_len,
    scale2,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_START: tl.constexpr,
    N_ON_DEVICE: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = bh // hkv
    h = bh % hkv
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, D)
    g_mask = g < GROUP
    qrow = bh * GROUP + g  # query heads of this KV head, [B * Hq] flattened
    q = tl.load(qc_ptr + qrow[:, None] * D + c[None, :], mask=g_mask[:, None], other=0.0)
    bias = tl.load(bias_ptr + qrow, mask=g_mask, other=0.0)
    kf = tl.load(kf_ptr + h * D + c)
    ks = tl.load(ks_ptr + h * D + c)
    km = tl.load(km_ptr + h * D + c)
    kr = tl.load(kr_ptr + h * D + c)
    vf = tl.load(vf_ptr + h * D + c)
    vs = tl.load(vs_ptr + h * D + c)
    vm = tl.load(vm_ptr + h * D + c)
    vr = tl.load(vr_ptr + h * D + c)
    if N_ON_DEVICE:
        n_coded = tl.load(n_ptr).to(tl.int32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n_coded)
    if HAS_START:
        lo = tl.maximum(lo, tl.load(start_ptr + b))
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = (t < hi)[:, None]
        ek = _entries(
            k_ptr + b * stride_kb + h * stride_kh + t[:, None] * stride_kt, t_mask, kf, ks, km, kr, kt_ptr, k_nbytes
        )
        s = (tl.dot(q, tl.trans(ek), input_precision="ieee") + bias[:, None]) * scale2
        s = tl.where(tl.trans(t_mask), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        ev = _entries(
            v_ptr + b * stride_vb + h * stride_vh + t[:, None] * stride_vt, t_mask, vf, vs, vm, vr, vt_ptr, v_nbytes
        )
        acc = acc * alpha[:, None] + tl.dot(p, ev, input_precision="ieee")
        m_i = m_new
    out = (bh * splits + split) * BLOCK_G + g
    tl.store(acc_ptr + out[:, None] * D + c[None, :], acc)
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)


def decode_components(
    qc: torch.Tensor,
    bias: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    keys,
    values,
    n_coded,
    kv_start: torch.Tensor | None,
    scale: float,
    *,
    block_t: int = 32,
    splits: int | None = None,
    num_warps: int = 4,
    wrap: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over trellis codes in the components (:mod:`vecinfer_compile.codecs.trellis.operands`):
    ``qc [B, Hq, D]`` and ``bias [B, Hq]`` float32 (:func:`~vecinfer_compile.codecs.trellis.operands.query_components`),
    ``k_codes, v_codes [B, Hkv, Tmax, nbytes]`` uint8, ``keys, values``:
    :class:`~vecinfer_compile.codecs.trellis.operands.TrellisOperands`; slots ``[kv_start[b], n_coded)``
    (``n_coded``: an int, or a 0-d integer tensor the kernel reads on the device, no host sync; the
    splits then cover every slot). The coded prefix is cut into ``splits`` (default: enough programs
    to fill a GPU), each a program per KV head, merged here by log-sum-exp. Returns ``(o [B, Hq, D], lse [B, Hq])`` float32: the
    softmax-weighted mean of the values' unit entries, and the natural log-sum-exp of the scores
    (zeros and ``-inf`` for a row with nothing to attend)."""
    b, hq, d = qc.shape
    hkv = k_codes.shape[1]
    group = hq // hkv
    block_g = max(16, triton.next_power_of_2(group))
    on_device = isinstance(n_coded, torch.Tensor)
    span = k_codes.shape[2] if on_device else max(n_coded, 1)
    if splits is None:
        splits = max(1, min(triton.cdiv(span, block_t), 512 // max(1, b * hkv)))
    split_len = triton.cdiv(triton.cdiv(span, splits), block_t) * block_t
    k_codes = unit_last_stride(k_codes)
    v_codes = unit_last_stride(v_codes)
    acc = torch.empty(b * hkv, splits, block_g, d, dtype=torch.float32, device=qc.device)
    m = torch.empty(b * hkv, splits, block_g, dtype=torch.float32, device=qc.device)
    l_sum = torch.empty_like(m)
    start = kv_start.to(torch.int32).contiguous() if kv_start is not None else m  # unread without HAS_START
    launch(
        _decode_kernel,
        (b * hkv, splits),
        wrap,
        qc.float().contiguous(),
        bias.float().contiguous(),
        k_codes,
        v_codes,
        keys.first,
        keys.shift,
        keys.mask,
        keys.rows,
        keys.tables,
        values.first,
        values.shift,
        values.mask,
        values.rows,
        values.tables,
        start,
        n_coded if on_device else m,
        acc,
        m,
        l_sum,
        0 if on_device else n_coded,
        hkv,
        k_codes.shape[-1],
        v_codes.shape[-1],
        split_len,
        scale * LOG2E,
        k_codes.stride(0),
        k_codes.stride(1),
        k_codes.stride(2),
        v_codes.stride(0),
        v_codes.stride(1),
        v_codes.stride(2),
        GROUP=group,
        BLOCK_G=block_g,
        D=d,
        BLOCK_T=block_t,
        HAS_START=kv_start is not None,
        N_ON_DEVICE=on_device,
        num_warps=num_warps,
    )
    o, lse = merge_splits(acc, m, l_sum, group)
    return o.reshape(b, hq, d), lse.reshape(b, hq)
