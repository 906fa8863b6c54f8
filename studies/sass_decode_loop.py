"""Instructions in the CUDA decode kernel's main loop, per build, without a GPU.

Compiles ``ops/cuda/decode.cu`` with NVRTC for sm_90 at ``--warps`` warps per CTA (12 by default;
the H200 runs 8 where a 12-warp build spills: the launch line of ``bench_decode_attention.py``
says which), disassembles the cubin with
``nvdisasm`` (from the ``nvidia-cuda-nvdisasm`` wheel or ``PATH``), and prints, for the plain
build and (4096-entry books) the lean one, the build's registers a thread and stack bytes (spills, which the product's launch refuses: it
takes the next launch shape instead), and the innermost loops that hold tensor-core products: their length and most frequent opcodes. The
first of them is the loop over codebook blocks (64 positions a warp), the second the
full-precision window's. A static count, not a timing: it says where a change moves the issued
instructions (the 2-bit kernel is issue-bound), and ``bench_decode_attention.py`` on the GPU
says whether that is time. Run it from two checkouts to compare a kernel change.

    python studies/sass_decode_loop.py --bits 2 [--head-dim 128 --group 4]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if (
    Path(__file__).resolve().parents[1] / "vecinfer_compile"
).is_dir():  # a checkout times its own package, even beside an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


@dataclass(frozen=True)
class Loop:
    """A backward branch's body: instructions from its target label to the branch, inclusive."""

    start: int
    end: int
    opcodes: collections.Counter

    @property
    def length(self) -> int:
        return self.end - self.start + 1


def opcode(instruction: str) -> str:
    """``@!P0 IMAD.MOV.U32 R1, RZ, RZ, R2`` -> ``IMAD`` (predicate and modifiers dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def innermost_mma_loops(sass: str) -> list[Loop]:
    """The loops of ``nvdisasm -c`` output that contain an ``HMMA`` and no other such loop, in
    program order."""
    labels, instructions = {}, []
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            labels[m.group(1)] = len(instructions)
        elif m := _INSTR.search(line):
            instructions.append(m.group(1))
    loops = []
    for i, ins in enumerate(instructions):
        m = _BRANCH.search(ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            body = instructions[labels[m.group(1)] : i + 1]
            if any(opcode(x) == "HMMA" for x in body):
                loops.append(Loop(labels[m.group(1)], i, collections.Counter(opcode(x) for x in body)))
    inner = [a for a in loops if not any(b is not a and a.start <= b.start and b.end <= a.end for b in loops)]
    return sorted(inner, key=lambda loop: loop.start)


def nvdisasm() -> str:
    """The nvdisasm executable: from the ``nvidia-cuda-nvdisasm`` wheel, else ``PATH``."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for found in sorted(Path(root).glob("*/bin/nvdisasm")):
            return str(found)
    found = shutil.which("nvdisasm")
    if found is None:
        raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm (a pip wheel, no CUDA toolkit needed)")
    return found


_REGCOUNT, _FRAME_SIZE = 0x2F, 0x11  # EIATTR_REGCOUNT, EIATTR_FRAME_SIZE of a cubin's .nv.info


def resources(cubin: bytes) -> dict[str, int]:
    """Registers a thread and stack-frame bytes (spills; 0 without) of the cubin's kernel, read
    from its ELF ``.nv.info`` section: records of (format, attribute, size, payload), the payload
    of these two being (function symbol, value)."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    found = {}
    for h in headers:
        name = cubin[names + h[0] : cubin.index(b"\0", names + h[0])]
        if name != b".nv.info":
            continue
        at, end = h[4], h[4] + h[5]
        while at < end:
            fmt, attr = cubin[at], cubin[at + 1]
            if fmt != 4:  # EIFMT_SVAL carries a size; the others are 2 or 4 bytes in all
                at += 4 if fmt == 3 else 2
                continue
            (size,) = struct.unpack_from("<H", cubin, at + 2)
            if attr in (_REGCOUNT, _FRAME_SIZE):
                found["registers" if attr == _REGCOUNT else "stack_bytes"] = struct.unpack_from("<I", cubin, at + 8)[0]
            at += 4 + size
    return found


def disassemble(
    head_dim: int, group: int, kspec: tuple[int, int], vspec: tuple[int, int], warps: int, lean: bool = False
) -> tuple[str, dict[str, int]]:
    from vecinfer_compile.ops.cuda import decode as cuda_decode
    from vecinfer_compile.ops.cuda.nvrtc import compile_source

    variant = cuda_decode.Variant(head_dim, group, *kspec, *vspec, False, lean=lean)
    image, is_cubin = compile_source(
        cuda_decode.source(), "vq_decode", 90, ["--use_fast_math", "--std=c++17", *variant.defines(warps), "-DMINB=1"]
    )
    if not is_cubin:
        raise SystemExit("NVRTC returned PTX, not a cubin: this NVRTC cannot target sm_90")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(image)
        f.flush()
        sass = subprocess.run([nvdisasm(), "-c", f.name], check=True, capture_output=True, text=True).stdout
    return sass, resources(image)


def main(argv: list[str] | None = None) -> list[dict]:
    from vecinfer_compile.ops.cuda import decode as cuda_decode
    from vecinfer_compile.presets import get_preset

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", default="2", help="comma-separated presets, e.g. 4,3,2,1.5,1.25,1")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--warps", type=int, default=12, help="warps per CTA the build is sized for")
    ap.add_argument("--top", type=int, default=10, help="opcodes to list per loop")
    args = ap.parse_args(argv)
    rows = []
    for bits in args.bits.split(","):
        p = get_preset(float(bits))
        kspec, vspec = (p.key.entries, p.key.dims), (p.value.entries, p.value.dims)
        print(
            f"\n{bits}-bit (K {kspec[0]}x{kspec[1]}, V {vspec[0]}x{vspec[1]}), head_dim {args.head_dim}, "
            f"group {args.group}, {args.warps} warps, sm_90"
        )
        print(
            "| build | registers | stack bytes | loop | instructions | HMMA | LDS | opcodes |\n"
            "|---|---:|---:|---|---:|---:|---:|---|"
        )
        plain = cuda_decode.Variant(args.head_dim, args.group, *kspec, *vspec, False)
        for lean in (False, True) if plain.can_be_lean else (False,):
            name = "lean" if lean else "plain"
            sass, res = disassemble(args.head_dim, args.group, kspec, vspec, args.warps, lean)
            for i, loop in enumerate(innermost_mma_loops(sass)):
                common = ", ".join(f"{k} {v}" for k, v in loop.opcodes.most_common(args.top))
                print(
                    f"| {name} | {res.get('registers', '?')} | {res.get('stack_bytes', '?')} | {i} | {loop.length} "
                    f"| {loop.opcodes['HMMA']} | {loop.opcodes['LDS']} | {common} |"
                )
                rows.append(
                    dict(
                        bits=float(bits), lean=lean, loop=i, instructions=loop.length, opcodes=dict(loop.opcodes), **res
                    )
                )
    return rows


if __name__ == "__main__":
    main()
