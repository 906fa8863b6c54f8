"""Tensor parallelism (transformers' tp_plan="auto"): the shard and its per-head state, the
errors that name the fix, and two gloo ranks on the tiny model against one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import vecinfer_compile as vc
from vecinfer_compile.backend import VecInferBackend
from vecinfer_compile.codebooks import LayerCodebooks
from vecinfer_compile.hf.tensor_parallel import TPShard, local_layer, model_shard, total_kv_bytes
from vecinfer_compile.quant.transform import KeyTransform

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "vecinfer_compile" / "data"
TINY, CODEBOOKS = DATA / "tiny", DATA / "tiny_codebooks" / "vecinfer-2bit.safetensors"


def test_kv_heads_slice_per_rank_and_error_when_ranks_do_not_divide():
    assert [TPShard(r, 4).kv_heads(8) for r in range(4)] == [slice(2 * r, 2 * r + 2) for r in range(4)]
    with pytest.raises(ValueError, match="3 does not divide.*--nproc-per-node"):
        TPShard(0, 3).kv_heads(2)


def test_local_layer_cuts_per_head_state_and_keeps_codebooks_whole():
    layer = vc.load_codebooks(CODEBOOKS).layer(1)
    local = local_layer(layer, TPShard(1, 2).kv_heads(2))
    assert torch.equal(local.transform.lam, layer.transform.lam[1:2])
    assert local.keys is layer.keys and local.values is layer.values
    qa = LayerCodebooks(
        KeyTransform(4, None, True, torch.randn(2, 4, 4), torch.randn(2, 4, 4)),
        torch.zeros(256, 4),
        torch.zeros(256, 4),
        key_metric=torch.randn(2, 4, 4),
        value_metric=torch.randn(2, 4, 4),
    )
    cut = local_layer(qa, slice(0, 1))
    assert torch.equal(cut.transform.key_matrix, qa.transform.key_matrix[:1])
    assert torch.equal(cut.transform.query_matrix, qa.transform.query_matrix[:1])
    assert torch.equal(cut.key_metric, qa.key_metric[:1]) and torch.equal(cut.value_metric, qa.value_metric[:1])


class _Mesh:
    mesh_dim_names, ndim = ("pp", "fsdp", "tp"), 3

    def get_local_rank(self, dim):
        return 1

    def size(self, dim=None):
        return 2


def _fake_tp_model(attn="sdpa", plan=None):
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(_attn_implementation=attn)
    model.tp_size, model._device_mesh = 2, _Mesh()
    model._tp_plan = plan or {"model.layers.*.self_attn.k_proj": "colwise"}
    return model


def test_model_shard_reads_the_mesh_and_names_the_fix():
    assert model_shard(_fake_tp_model()) == TPShard(1, 2)
    assert model_shard(torch.nn.Linear(1, 1)) is None  # not tensor parallel
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        model_shard(_fake_tp_model(attn="eager"))
    with pytest.raises(ValueError, match="sharded colwise"):
        model_shard(_fake_tp_model(plan={"model.layers.*.self_attn.k_proj": "rowwise"}))


def test_backend_cuts_codebooks_to_the_rank_and_rejects_another_model():
    cb = vc.load_codebooks(CODEBOOKS)
    site = SimpleNamespace(layer=2, head_dim=64, kv_heads=1)
    got = VecInferBackend._given_layer(cb, site, TPShard(1, 2))
    assert torch.equal(got.transform.lam, cb.layer(2).transform.lam[1:])
    with pytest.raises(ValueError, match="tensor parallel rank 0 of 2.*vecinfer calibrate"):
        VecInferBackend._given_layer(cb, SimpleNamespace(layer=0, head_dim=64, kv_heads=2), TPShard(0, 2))


def test_total_kv_bytes_without_distributed_is_the_cache_bytes():
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    cache = vc.VecInferCache(model, vc.load_codebooks(CODEBOOKS), batch_size=1, max_cache_len=8, residual=2)
    assert cache.tp_shard is None
    assert total_kv_bytes(cache) == cache.total_kv_bytes() == cache.kv_bytes()


# -- two gloo ranks against one process ---------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def one_process():
    """The tiny model in one process (no TP), float32, SDPA."""
    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation="sdpa").eval()


def _greedy(model, ids, new_tokens, residual):
    cache = vc.VecInferCache(
        model, vc.load_codebooks(CODEBOOKS), batch_size=1, max_cache_len=ids.shape[1] + new_tokens, residual=residual
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **vc.cache_kwargs(cache),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist(), cache


def test_example_two_ranks_compiled_decode_equals_one_process(one_process):
    """examples/tensor_parallel.py, decode compiled by the backend on 2 ranks: the same greedy
    tokens as one process, every attention call on codes, each rank holding half the KV heads."""
    out = _torchrun(
        "examples/tensor_parallel.py",
        "--model",
        str(TINY),
        "--codebooks",
        str(CODEBOOKS),
        "--residual",
        "4",
        "--max-new-tokens",
        "8",
        "--json",
    )
    report = json.loads(out.strip().splitlines()[-1])
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from tensor_parallel import PROMPT
    finally:
        sys.path.remove(str(ROOT / "examples"))
    ids = AutoTokenizer.from_pretrained(TINY)(PROMPT, return_tensors="pt").input_ids
    tokens, cache = _greedy(one_process, ids, 8, 4)
    assert report["tokens"] == tokens
    assert report["world_size"] == 2 and report["decode_rewrites"] == 4
    assert report["kv_bytes_total"] == 2 * report["kv_bytes_rank"]
    # half the heads per rank; the codebooks (and rotation) are whole on each rank
    assert report["kv_bytes_rank"] < cache.kv_bytes() < report["kv_bytes_total"]


def test_two_ranks_eager_tokens_and_simulate_logits_equal_one_process(one_process, tmp_path):
    ids = torch.arange(5, 30)[None]
    _torchrun(
        "tests/tp_worker.py", str(TINY), str(CODEBOOKS), ",".join(map(str, ids[0].tolist())), str(tmp_path / "rank0.pt")
    )
    tp = torch.load(tmp_path / "rank0.pt")
    assert tp["kv_heads"] == 1 and tp["sdpa_rewrites"] == 4
    cb = vc.load_codebooks(CODEBOOKS)
    assert torch.equal(tp["lam"], cb.layer(0).transform.lam[:1])
    tokens, _ = _greedy(one_process, ids, 8, 4)
    assert tp["tokens"].tolist() == tokens
    torch._dynamo.reset()
    compiled = torch.compile(one_process, backend=vc.vecinfer_backend.configure(codebooks=cb), fullgraph=True)
    with torch.no_grad():
        logits = compiled(ids).logits
        fp = one_process(ids).logits
    assert (logits - fp).abs().amax() > 1e-2  # quantization really happened in both
    torch.testing.assert_close(tp["logits"], logits, rtol=1e-4, atol=1e-4)


def test_bench_generate_tp_mode_two_ranks(tmp_path):
    """benchmarks/bench_generate.py's TP mode: the random-weight model saved once, then loaded with
    tp_plan="auto" by 2 gloo ranks; rank 0's rows for ours and fp16 carry the TP size and each
    rank's KV bytes, which sum to the all-reduced total."""
    from vecinfer_compile.commands.bench import benchmarks_dir, load_script

    model_dir, rows_json = tmp_path / "model", tmp_path / "rows.json"
    smoke, threads = ["--smoke", "--layers", "1"], torch.get_num_threads()
    try:
        assert load_script("generate", benchmarks_dir()).main([*smoke, "--save-model", str(model_dir)]) == []
    finally:
        torch.set_num_threads(threads)  # --smoke pins one thread
    out = _torchrun(
        "benchmarks/bench_generate.py",
        *smoke,
        "--tp-model",
        str(model_dir),
        "--methods",
        "ours,fp16",
        "--cases",
        "2x16",
        "--new-tokens",
        "2",
        "--json",
        str(rows_json),
    )
    rows = json.loads(rows_json.read_text())
    assert [r["method"] for r in rows] == ["ours", "fp16"]
    for r in rows:
        assert "error" not in r, r
        # the in-run rate: with 2 new tokens t(N) - t(1) is noise and may be <= 0 (tok_s nan)
        assert (r["tp"], r["B"], r["T"]) == (2, 2, 16) and r["step_ms"] > 0 and r["in_run_tok_s"] > 0
        assert r["timed_compiles"] == 0
        per_rank = r["kv_bytes_per_rank"]
        assert len(per_rank) == 2 and min(per_rank) > 0 and sum(per_rank) == r["kv_bytes_total"]
    assert "| KV/GPU | KV total | TP |" in out and out.count("| 2 |\n") == 2  # rank 0 alone prints


def test_tp_load_kwargs_follow_the_installed_transformers(monkeypatch):
    """``distributed_config=DistributedConfig(tp_plan=...)`` where transformers takes it (5.24
    deprecates ``tp_plan=`` in from_pretrained), ``tp_plan=`` where it does not."""
    import transformers.distributed as td

    from vecinfer_compile import tp_load_kwargs

    kwargs = tp_load_kwargs("auto")
    assert list(kwargs) == ["distributed_config"] and kwargs["distributed_config"].tp_plan == "auto"

    class OldConfig:  # a DistributedConfig without tp_plan, as older transformers had
        def __init__(self, enable_expert_parallel=False):
            pass

    monkeypatch.setattr(td, "DistributedConfig", OldConfig)
    assert tp_load_kwargs("auto") == {"tp_plan": "auto"}
