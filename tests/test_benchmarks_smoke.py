"""benchmarks/bench_memory.py and bench_generate.py end to end on the CPU (--smoke: tiny Llama),
and the `vecinfer bench` command that runs them."""

from __future__ import annotations

import json

import pytest
import torch

from vecinfer_compile.cli import COMMANDS, main
from vecinfer_compile.commands.bench import SCRIPTS, benchmarks_dir, load_script


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()  # --smoke pins one thread
    yield
    torch.set_num_threads(before)


def test_bench_registered_and_scripts_present():
    assert "bench" in COMMANDS
    folder = benchmarks_dir()
    for script, _ in SCRIPTS.values():
        assert (folder / script).is_file(), script


def test_bench_chunked_prefill_smoke(capsys):
    """The compiled chunked prefill attends over the codes (the chunk op, nothing left over a
    dequantized read) and gives the eager one's first token."""
    rows = load_script("chunked-prefill", benchmarks_dir()).main(["--smoke"])
    eager, compiled = rows
    assert eager["first_token"] == compiled["first_token"]
    assert compiled["chunk_rewrites"] > 0 and compiled["unfused"] == 0, compiled
    assert "compiled / eager:" in capsys.readouterr().out


def test_bench_memory_smoke(capsys):
    rows = load_script("memory", benchmarks_dir()).main(["--smoke", "--lengths", "64,200"])
    out = capsys.readouterr().out
    assert [r["T"] for r in rows] == [64, 200]
    for r in rows:
        assert not [k for k in r if k.endswith("_error")], r
        # smoke caches hold float32: HF caches hold exactly twice the FP16 bytes
        assert r["dynamic_kv_bytes"] == r["static_kv_bytes"] == 2 * r["fp16_bytes"]
        assert r["ours_kv_bytes"] > 0 and r["ratio"] == r["ours_kv_bytes"] / r["fp16_bytes"]
    # codes grow by 2 bits per element; the window and codebooks are fixed
    assert rows[1]["ours_kv_bytes"] - rows[0]["ours_kv_bytes"] < rows[1]["fp16_bytes"] - rows[0]["fp16_bytes"]
    assert "| T | B | ours KV | ours fixed | ours codes+window |" in out and "| 200 | 1 |" in out
    for r in rows:  # the fixed state reported apart: the same at every length
        assert r["ours_fixed_bytes"] + r["ours_token_bytes"] == r["ours_kv_bytes"]
        assert r["ours_fixed_bytes"] == rows[0]["ours_fixed_bytes"]


def test_bench_memory_reports_the_query_aware_fixed_state():
    script = load_script("memory", benchmarks_dir())
    plain, qaware = (script.main(["--smoke", "--lengths", "64", "--method", m])[0] for m in ("vecinfer", "qaware"))
    assert qaware["ours_token_bytes"] == plain["ours_token_bytes"]
    # tiny smoke config: 2 layers x 2 KV heads x two [16, 16] float32 matrices, the rotation folded in,
    # the key mean instead of the smoothing factors
    assert qaware["ours_fixed_bytes"] - plain["ours_fixed_bytes"] == 2 * 2 * 2 * 16 * 16 * 4 - 16 * 16 * 4


def test_vecinfer_bench_memory_cli(capsys):
    assert main(["bench", "memory", "--smoke", "--lengths", "64"]) == 0
    out = capsys.readouterr().out
    assert "| 64 | 1 |" in out


def test_vecinfer_bench_errors(capsys, tmp_path):
    assert main(["bench", "--benchmarks-dir", str(tmp_path / "nope"), "memory"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["bench", "--benchmarks-dir", str(tmp_path), "memory"]) == 2
    assert "is missing" in capsys.readouterr().err
    assert main(["bench", "nosuch"]) == 2
    assert main(["bench", "memory", "--no-such-option"]) == 2
    assert main(["bench", "memory", "--help"]) == 0


@pytest.mark.slow
def test_bench_generate_smoke(capsys):
    """Every method at one tiny case, with the profile; ours, fp16 and static compile the decode
    step (Inductor on the CPU: the slow part, ~20-60 s depending on the machine and the compile
    cache)."""
    rows = load_script("generate", benchmarks_dir()).main(
        ["--smoke", "--cases", "2x24", "--new-tokens", "3", "--profile", "2"]
    )
    out = capsys.readouterr().out
    assert [r["method"] for r in rows] == ["ours", "fp16", "static", "dynamic"]
    for r in rows:
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["in_run_tok_s"] > 0 and r["time_n_s"] > 0 and r["time_1_s"] > 0
        assert r["step_timing"] == "host" and 0 < r["ttft_s"] < r["time_n_s"] and r["subtraction_tok_s"] is not None
        assert r["profile"]["wall_us"] > 0
    assert "| B | T | ours tok/s | fp16 tok/s |" in out and "HF dynamic, eager" in out
    assert "tok/s (device-timed steps)" in out and "prefill s (TTFT)" in out
    assert "# profile 2x24 full precision, valid-length flash, compiled" in out


def test_bench_generate_weighted_codes_smoke(capsys):
    """--weighted-codes: ours with identity metrics on every layer, the compiled step keeping the
    opaque weigh_codes op (one row, no error; the header says what ran)."""
    rows = load_script("generate", benchmarks_dir()).main(
        ["--smoke", "--methods", "ours", "--cases", "1x16", "--new-tokens", "3", "--weighted-codes"]
    )
    assert [r["method"] for r in rows] == ["ours"] and "error" not in rows[0], rows
    assert rows[0]["in_run_tok_s"] > 0
    assert "(error-weighted codes, identity metrics)" in capsys.readouterr().out


def _valid_length_inputs(device, dtype, b=3, hq=8, hkv=2, tq=1, tmax=40, d=16):
    g = torch.Generator(device="cpu").manual_seed(b * 100 + tq)
    q = torch.randn(b, hq, tq, d, generator=g).to(device, dtype)
    k = torch.randn(b, tmax, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(b, tmax, hkv, d, generator=g).to(device, dtype)
    used = torch.tensor([tmax, tq + 5, tmax - 7][:b], dtype=torch.int32, device=device)
    return q, k, v, used


def _valid_length_expected(q, k, v, used, causal):
    """Plain float32 SDPA over each row's first used[b] keys, GQA by repeating K/V."""
    b, hq, tq, d = q.shape
    rows = []
    for i in range(b):
        n = int(used[i])
        kk = k[i, :n].float().transpose(0, 1).repeat_interleave(hq // k.shape[2], 0)
        vv = v[i, :n].float().transpose(0, 1).repeat_interleave(hq // k.shape[2], 0)
        mask = torch.ones(tq, n, dtype=torch.bool, device=q.device).tril(n - tq) if causal else None
        rows.append(
            torch.nn.functional.scaled_dot_product_attention(q[i].float(), kk, vv, attn_mask=mask).transpose(0, 1)
        )
    return torch.stack(rows)


def _check_valid_length_op(device, dtype, atol):
    import fp16_valid_cache as fv

    for tq, causal in ((1, False), (6, True)):
        q, k, v, used = _valid_length_inputs(device, dtype, tq=tq)
        k[0, used[0] :] = float("nan")  # slots past the used length must never be read
        k[1, used[1] :] = float("nan")
        k[2, used[2] :] = float("nan")
        got = fv.flash_valid_length(q, k, v, used, q.shape[-1] ** -0.5, causal)
        want = _valid_length_expected(q, k, v, used, causal)
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


def test_valid_length_baseline_reads_only_used_keys():
    """The strong full-precision baseline's attention op (CPU path) equals SDPA over each row's
    used keys, GQA, decode and a causal chunk; NaN beyond the used length would show if read."""
    import sys

    sys.path.insert(0, str(benchmarks_dir()))
    _check_valid_length_op("cpu", torch.float32, 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_valid_length_baseline_flash_varlen_cuda():
    """The same check on the GPU, where the op is torch's varlen flash kernel with seqused_k."""
    import sys

    sys.path.insert(0, str(benchmarks_dir()))
    _check_valid_length_op("cuda", torch.bfloat16, 2e-2)


def test_bench_generate_isolate_runs_each_method_in_a_child(capsys):
    """--isolate: the row comes back from a child process (same fields as in-process)."""
    rows = load_script("generate", benchmarks_dir()).main(
        ["--smoke", "--isolate", "--methods", "dynamic", "--cases", "1x16", "--new-tokens", "3"]
    )
    assert [r["method"] for r in rows] == ["dynamic"]
    assert "error" not in rows[0], rows[0]
    assert rows[0]["in_run_tok_s"] > 0 and (rows[0]["B"], rows[0]["T"]) == (1, 16)
    assert "random weights (per process)" in capsys.readouterr().out


def test_gather_ceiling_probes_under_interpreter(tmp_path):
    """The ceiling probes of bench_gather_ceiling.py compute what they claim to read (a probe that
    skipped work would report a false ceiling): sums checked against torch, in a child process
    with TRITON_INTERPRET=1 (set before the kernels are decorated)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    check = (
        "import torch, bench_gather_ceiling as g\n"
        "codes = torch.randint(0, 256, (2, 3, 600, g.NSUB), dtype=torch.uint8)\n"
        "cent = torch.randn(256, g.DSUB)\n"
        "splits, chunk = g.num_splits(6, 600, codes.device, g.SplitConfig(block_n=32))\n"
        "assert splits > 1 and 600 % chunk, (splits, chunk)  # several splits, a partial last one\n"
        "out = torch.empty(6 * splits)\n"
        "g.gather_only_kernel[(splits, 6)](codes, cent, out, 600, chunk, NSUB=g.NSUB, DSUB=g.DSUB, BLOCK_N=32)\n"
        "want = cent[codes.long()].reshape(6, -1).sum(1)\n"
        "torch.testing.assert_close(out.view(6, splits).sum(1), want, rtol=1e-4, atol=1e-2)\n"
        "g.codes_only_kernel[(splits, 6)](codes, out, 600, chunk, NSUB=g.NSUB, BLOCK_N=32)\n"
        "assert torch.equal(out.view(6, splits).sum(1), codes.reshape(6, -1).float().sum(1))\n"
        "print('ok', splits, chunk)\n"
    )
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(root / "benchmarks"), str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", check], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


def _generate_counting_forwards(model, make_runner, ids):
    """``(tokens, forwards)``: the tokens that an eager ``generate(ids, 4)`` of the runner
    ``make_runner()`` builds returns (the runner closed after), and the forward passes of ``model``
    from the runner's making on."""
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        runner = make_runner()
        runner.compile_config = None
        try:
            return runner.generate(ids, 4)[2], len(calls)
        finally:
            runner.close()
    finally:
        hook.remove()


@pytest.mark.parametrize("method", ["fp16", "static", "dynamic"])
def test_bench_generate_chunked_prefill_gives_the_same_tokens(method):
    """--prefill-chunk: a baseline's prompt through the model in eager chunks of 7 tokens (the
    last chunk short, the last token left to generate()) gives the greedy tokens of the one-shot
    prefill, and the chunks really run (5 more forwards for 29 tokens). Eager decode here (the
    compiled step is covered by the smoke test above)."""
    mod = load_script("generate", benchmarks_dir())
    setup = mod.C.bench_setup(True)
    model = mod.C.build_model(setup)
    ids = torch.randint(3, setup.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    outs = {}
    for chunk in (0, 7):
        outs[chunk], forwards = _generate_counting_forwards(
            model, lambda: mod.Runner(method, model, setup, None, 2, 40, 8, prefill_chunk=chunk), ids
        )
        assert forwards == 4 + (5 if chunk else 0), (chunk, forwards)
    assert torch.equal(outs[0], outs[7])


@pytest.mark.parametrize("method", ["fp16", "ours"])
def test_bench_generate_prefill_by_rows_gives_the_same_tokens(method):
    """--prefill-rows 1: each row's prompt prefilled on its own (filling_rows, 7-token chunks),
    then the batch decoded together, gives the tokens of the whole-batch chunked prefill, with
    twice the prefill forwards (2 rows x 5 chunks)."""
    mod = load_script("generate", benchmarks_dir())
    setup = mod.C.bench_setup(True)
    model = mod.C.build_model(setup)
    codebooks = mod.C.random_codebooks(setup.config, 2.0) if method == "ours" else None
    ids = torch.randint(3, setup.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    outs = {}
    for rows in (0, 1):
        outs[rows], forwards = _generate_counting_forwards(
            model,
            lambda: mod.Runner(method, model, setup, codebooks, 2, 40, 8, prefill_chunk=7, prefill_rows=rows),
            ids,
        )
        assert forwards == 4 + (10 if rows else 5), (rows, forwards)
    assert torch.equal(outs[0], outs[1])


def _eager_ours_runner(mod):
    """An eager (uncompiled) ``ours`` Runner of bench_generate on the smoke model, 7-token prefill
    chunks, batch 2, 40 slots; and a 30-token prompt for it."""
    setup = mod.C.bench_setup(True)
    model = mod.C.build_model(setup)
    codebooks = mod.C.random_codebooks(setup.config, 2.0)
    ids = torch.randint(3, setup.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    runner = mod.Runner("ours", model, setup, codebooks, 2, 40, 8, prefill_chunk=7)
    runner.compile_config = None
    return runner, ids


def test_bench_generate_chunked_prefill_ours():
    """--prefill-chunk with VecInferCache: the chunks go into the compressed cache (a chunk after
    the first reads older tokens from codes), then generate() decodes; 4 new tokens come out and
    the cache holds the whole prompt plus them."""
    mod = load_script("generate", benchmarks_dir())
    runner, ids = _eager_ours_runner(mod)
    try:
        out = runner.generate(ids, 4)[2]
    finally:
        runner.close()
    assert out.shape == (2, 34) and torch.equal(out[:, :30], ids)
    assert int(runner.cache.get_seq_length()) == 33  # the last new token is never fed back


def test_bench_generate_profiles_the_last_prefill_chunk(capsys):
    """--profile with --prefill-chunk: the profiled generate() also records its last prefill chunk
    (printed after the decode kernels), and the chunked prefill's own time is kept for the row."""
    mod = load_script("generate", benchmarks_dir())
    runner, ids = _eager_ours_runner(mod)
    try:
        profile = mod.profile_decode(runner, ids, 2)
    finally:
        runner.close()
    assert runner.prefill_s > 0 and runner.chunk_profiler is None
    assert profile["prefill_chunk"]["n_kernels"] == 0  # recorded; the CPU has no device kernels
    mod.print_profile({"B": 2, "T": 30, "method": "ours", "prefill_chunk": 7, "profile": profile})
    assert "the last prefill chunk of 7 tokens: GPU busy 0.00 ms" in capsys.readouterr().out
    row = {"B": 2, "T": 30, "method": "ours", "tok_s": None, "warmup_s": 1.0, "prefill_chunks_s": 2.5, "ttft_s": 2.75}
    assert "| 2.75* |" in mod.format_row(row)


def test_bench_generate_until_error_skips_larger_batches(monkeypatch, capsys):
    """--until-error: once a method fails at a batch size, the larger batch sizes of that length
    are not tried (the sweep for the largest batch that fits); other lengths still run."""
    mod = load_script("generate", benchmarks_dir())
    tried = []

    def fake_run_method(method, model, setup, codebooks, batch, length, *args, **kwargs):
        tried.append((batch, length))
        if batch >= 2 and length == 16:
            raise RuntimeError("CUDA out of memory (stand-in)")
        return {
            "B": batch,
            "T": length,
            "method": method,
            "tok_s": 1.0,
            "in_run_tok_s": 1.0,
            "step_ms": 1.0,
            "time_1_s": 0.1,
            "warmup_s": 0.1,
            "peak_bytes": 1,
        }

    monkeypatch.setattr(mod, "run_method", fake_run_method)
    rows = mod.main(["--smoke", "--until-error", "--methods", "dynamic", "--cases", "1x16,2x16,3x16,2x12"])
    assert tried == [(1, 16), (2, 16), (2, 12)]
    assert ["error" in r for r in rows] == [False, True, False]
    assert "out of memory" in capsys.readouterr().out


def test_bench_generate_in_run_only_skips_the_one_token_run(monkeypatch):
    """--in-run-only: one generate of N tokens per row (no 1-token run to subtract), so the row has
    the in-run tok/s and no subtraction figure."""
    mod = load_script("generate", benchmarks_dir())
    lengths = []
    original = mod.Runner.generate

    def counting_generate(self, ids, new_tokens, extra_criteria=()):
        lengths.append((ids.shape[1], new_tokens))
        return original(self, ids, new_tokens, extra_criteria)

    monkeypatch.setattr(mod.Runner, "generate", counting_generate)
    rows = mod.main(["--smoke", "--in-run-only", "--methods", "dynamic", "--cases", "2x24", "--new-tokens", "3"])
    assert lengths == [(8, 3), (24, 3)]  # the warm-up, then the timed run; no (24, 1)
    (row,) = rows
    assert row["in_run_only"] and row["subtraction_tok_s"] is None and "time_1_s" not in row
    assert row["tok_s"] > 0 and row["in_run_tok_s"] > 0


def test_bench_generate_job_serves_every_method_at_its_own_batch(monkeypatch, capsys):
    """--job P --job-batch: one run per method at its own batch and per-method prefill chunks; the job
    table is the arithmetic of the measured rates, rounds * (TTFT + (N - 1) * step), and ours' job
    throughput over the baseline's."""
    mod = load_script("generate", benchmarks_dir())
    runs = []

    def fake_run_method(
        method, model, setup, codebooks, batch, length, new_tokens, residual, warmup_len, profile, chunk, *args
    ):
        runs.append((method, batch, length, chunk))
        step = {"ours": 50.0, "fp16": 40.0}[method]
        return {
            "B": batch,
            "T": length,
            "method": method,
            "new_tokens": new_tokens,
            "tok_s": batch * 1e3 / step,
            "step_ms": step,
            "ttft_s": {"ours": 100.0, "fp16": 10.0}[method],
            "warmup_s": 1.0,
            "peak_bytes": 10 * 2**30,
            "weights_bytes": 2**30,
            "kv_bytes_total": 8 * 2**30,
        }

    monkeypatch.setattr(mod, "run_method", fake_run_method)
    mod.main(
        [
            "--smoke",
            "--job",
            "8",
            "--job-batch",
            "fp16=2,ours=8",
            "--cases",
            "1x24",
            "--prefill-chunk",
            "ours=4,fp16=16",
        ]
    )
    assert runs == [("ours", 8, 24, 4), ("fp16", 2, 24, 16)]
    out = capsys.readouterr().out
    ours_s, fp16_s = 1 * (100 + 255 * 0.05), 4 * (10 + 255 * 0.04)  # N=256: one round vs four
    assert f"| {ours_s:.0f} | {8 * 256 / ours_s:.0f} |" in out and f"| {fp16_s:.0f} | {8 * 256 / fp16_s:.0f} |" in out
    assert f"ours / fp16: N=256 {fp16_s / ours_s:.2f}x" in out and "| 1.00 GiB |" in out
    with pytest.raises(SystemExit, match="--job-batch"):
        mod.main(["--smoke", "--job", "8", "--cases", "1x24"])


def test_bench_generate_tables_from_saved_rows(tmp_path, capsys):
    """--tables-from: the job table of rows that separate runs wrote (measures nothing)."""
    mod = load_script("generate", benchmarks_dir())
    rows = {
        "ours": {"B": 8, "T": 24, "method": "ours", "new_tokens": 3, "step_ms": 50.0, "ttft_s": 100.0},
        "fp16": {"B": 2, "T": 24, "method": "fp16", "new_tokens": 3, "step_ms": 40.0, "ttft_s": 10.0},
    }
    paths = []
    for method, row in rows.items():
        paths.append(tmp_path / f"{method}.json")
        paths[-1].write_text(json.dumps([row]))
    assert mod.main(["--tables-from", ",".join(map(str, paths)), "--job", "8"]) == list(rows.values())
    ours_s, fp16_s = 100 + 255 * 0.05, 4 * (10 + 255 * 0.04)
    assert f"ours / fp16: N=256 {fp16_s / ours_s:.2f}x" in capsys.readouterr().out


def test_gpu_suite_test_groups_cover_every_cuda_test_file():
    """benchmarks/run_gpu_suite.sh runs the `cuda` tests by named groups of files: every test file
    with a cuda-marked test is in one group (a new file must be added there to run on the GPU)."""
    import re

    root = benchmarks_dir().parent
    script = (benchmarks_dir() / "run_gpu_suite.sh").read_text()
    grouped = {f for files in re.findall(r'^\s+\[\w+\]="([^"]+)"', script, re.M) for f in files.split()}
    marked = {f"tests/{p.name}" for p in (root / "tests").glob("test_*.py") if "pytest.mark.cuda" in p.read_text()}
    assert marked and marked <= grouped, sorted(marked - grouped)
    assert all((root / f).is_file() for f in grouped)


def test_bench_mask_smoke(capsys):
    rows = load_script("mask", benchmarks_dir()).main(["--smoke"])
    assert len(rows) == 1 and rows[0]["sdpa_mask_us"] > 0 and rows[0]["ours_us"] > 0
    assert "sdpa_mask / ours" in capsys.readouterr().out


_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDS.64 R4, [R2] ;
.L_x_1:
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0030*/              @!P0 IMAD.MOV.U32 R2, RZ, RZ, R3 ;
        /*0040*/               @P1 BRA `(.L_x_1) ;
        /*0050*/                   PRMT R3, R2, 0x7604, R3 ;
        /*0060*/                   BRA `(.L_x_0) ;
.L_x_2:
        /*0070*/                   FADD R1, R1, R1 ;
        /*0080*/                   BRA `(.L_x_2) ;
        /*0090*/                   EXIT ;
"""


def test_sass_loop_finder_keeps_the_innermost_loops_with_products():
    """studies/sass_decode_loop.py on a hand-written listing: the inner loop (3 instructions, one
    HMMA) is kept, the loop around it and the loop without a product are not; opcodes lose their
    predicates and modifiers."""
    sass = load_script_path("sass_decode_loop.py")
    loops = sass.innermost_mma_loops(_SASS)
    assert [(loop.start, loop.length) for loop in loops] == [(2, 3)]
    assert loops[0].opcodes == {"HMMA": 1, "IMAD": 1, "BRA": 1}
    assert sass.opcode("@!P0 IMAD.MOV.U32 R2, RZ, RZ, R3") == "IMAD"


def _cubin_with_info(records: bytes) -> bytes:
    """A minimal ELF64 image whose only sections are the string table and ``.nv.info`` holding
    ``records``: enough for sass_decode_loop.resources, which reads nothing else."""
    import struct

    names = b"\0.shstrtab\0.nv.info\0"
    data_at = 64
    shoff = data_at + len(names) + len(records)
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 1)  # e_shentsize, e_shnum, e_shstrndx

    def section(name_at, offset, size):
        return struct.pack("<IIQQQQIIQQ", name_at, 0, 0, 0, offset, size, 0, 0, 1, 0)

    return (
        bytes(header)
        + names
        + records
        + section(0, 0, 0)
        + section(1, data_at, len(names))
        + section(11, data_at + len(names), len(records))
    )


def test_sass_resources_reads_registers_and_stack_from_nv_info():
    """sass_decode_loop.resources on a synthetic cubin: EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE
    (0x11) records (format 4: size, then function symbol and value) are read; records of other
    formats (3: two bytes of payload) and attributes are stepped over."""
    import struct

    sass = load_script_path("sass_decode_loop.py")
    records = (
        bytes([3, 0x1B, 0x20, 0x00])  # a format-3 record, skipped
        + bytes([4, 0x2F])
        + struct.pack("<HII", 8, 7, 168)
        + bytes([4, 0x12])
        + struct.pack("<HII", 8, 7, 99)  # another attribute, skipped
        + bytes([4, 0x11])
        + struct.pack("<HII", 8, 7, 24)
    )
    assert sass.resources(_cubin_with_info(records)) == {"registers": 168, "stack_bytes": 24}
    assert sass.resources(_cubin_with_info(b"")) == {}


def load_script_path(name: str):
    """A studies/ script (`vecinfer bench` does not run it), imported as a module (registered in
    sys.modules, as its dataclasses need)."""
    import importlib.util
    import sys
    from pathlib import Path

    studies = Path(__file__).resolve().parents[1] / "studies"
    spec = importlib.util.spec_from_file_location(f"vecinfer_study_{name.removesuffix('.py')}", studies / name)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
