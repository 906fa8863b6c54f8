"""``defer_stop_check``: transformers' deferred stop check switched on for CUDA.

- CPU: inside the block transformers' own test answers yes for a CUDA device under its own
  conditions (croppable or private cache, no assistant), and everything is as before outside it.
- transformers' deferred loop through ``VecInferCache`` (CPU, several shapes, methods, eager and
  compiled, a sliding-window model) and, ``cuda``, ``defer_stop_check`` around a compiled
  ``generate()``: stopped by a criterion computed on the device (as EOS is), the same tokens
  deferred as synced, and the cache it hands back holds the same state (the extra step the
  deferred loop ran was cropped: a token pushed out of a full window came back).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_cache import generate, left_padded, random_codebooks, tiny_config  # noqa: E402
from transformers import CompileConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

import vecinfer_compile
from vecinfer_compile.cache import VecInferCache
from vecinfer_compile.cache.storage import LayerStorage

DeferredStopCheck = pytest.importorskip("transformers.generation.utils").DeferredStopCheck
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class _Uncroppable:
    is_croppable = False


def test_defer_stop_check_switches_cuda_on_inside_the_block_only():
    cfg = tiny_config()
    ours = VecInferCache(cfg, random_codebooks(cfg), batch_size=1, max_cache_len=16, residual=4)
    supported = DeferredStopCheck.is_supported
    assert ours.is_croppable
    assert not supported(CUDA, ours, True, False)  # transformers' default: mps only
    with vecinfer_compile.defer_stop_check():
        assert DeferredStopCheck.is_supported(CUDA, ours, True, False)
        assert DeferredStopCheck.is_supported(CUDA, None, False, False)
        assert DeferredStopCheck.is_supported(CUDA, _Uncroppable(), False, False)  # not handed back
        assert not DeferredStopCheck.is_supported(CUDA, _Uncroppable(), True, False)
        assert not DeferredStopCheck.is_supported(CUDA, ours, True, True)  # an assistant model
        assert not DeferredStopCheck.is_supported(CPU, ours, True, False)  # no events on the CPU
    assert DeferredStopCheck.is_supported is supported
    assert not DeferredStopCheck.is_supported(CUDA, ours, True, False)


def test_defer_stop_check_restores_after_an_error():
    supported = DeferredStopCheck.is_supported
    with pytest.raises(KeyError), vecinfer_compile.defer_stop_check():
        raise KeyError("inside")
    assert DeferredStopCheck.is_supported is supported


def test_defer_stop_check_names_the_fix_without_transformers_support(monkeypatch):
    monkeypatch.delattr("transformers.generation.utils.DeferredStopCheck")
    with pytest.raises(RuntimeError, match="leave it out"), vecinfer_compile.defer_stop_check():
        pass


@pytest.mark.parametrize("residual", [0, 3])
def test_record_undo_opcheck(residual):
    import vecinfer_compile.ops  # noqa: F401  registers the op

    b, h, d = 2, 3, 8
    k_window, v_window = torch.randn(b, h, residual, d), torch.randn(b, h, residual, d)
    counts, kv = torch.zeros(2, dtype=torch.int64), torch.zeros(2, b, h, d)
    args = (counts, kv, torch.tensor(7), torch.tensor(residual), k_window, v_window)
    torch.library.opcheck(torch.ops.vecinfer.record_undo, args)
    torch.ops.vecinfer.record_undo(*args)
    assert counts.tolist() == [7, residual]
    if residual:
        assert torch.equal(kv[0], k_window[:, :, 0]) and torch.equal(kv[1], v_window[:, :, 0])


def _opaque_append():
    """``vecinfer::cache_append``'s torch form as an opaque op that mutates the cache buffers,
    as the CUDA append is (that kernel runs on CUDA only)."""
    from vecinfer_compile.ops.append import MUTATES as APPEND_MUTATES
    from vecinfer_compile.ops.append import append_reference

    if not hasattr(torch.ops.vecinfer_test, "opaque_append"):

        def opaque_append(
            key: torch.Tensor,
            value: torch.Tensor,
            k_codes: torch.Tensor,
            v_codes: torch.Tensor,
            k_window: torch.Tensor,
            v_window: torch.Tensor,
            n_coded: torch.Tensor,
            n_window: torch.Tensor,
            arrivals: torch.Tensor,
            k_centroids: torch.Tensor,
            v_centroids: torch.Tensor,
            key_mean: torch.Tensor | None,
            lam: torch.Tensor | None,
            key_matrix: torch.Tensor | None,
        ) -> None:
            append_reference(
                key,
                value,
                k_codes,
                v_codes,
                k_window,
                v_window,
                n_coded,
                n_window,
                arrivals,
                k_centroids,
                v_centroids,
                key_mean,
                lam,
                key_matrix,
            )

        op = torch.library.custom_op("vecinfer_test::opaque_append", opaque_append, mutates_args=APPEND_MUTATES)
        op.register_fake(lambda *args: None)
    return torch.ops.vecinfer_test.opaque_append


def test_compiled_step_records_the_window_before_an_opaque_append(monkeypatch):
    """Compiled by Inductor, a step whose append is an opaque op that mutates the window in
    place (the CUDA append on the GPU) must record window slot 0 as it was before the append: a
    plain ``copy_`` of the slice was computed lazily, after the append (seen on the H200; here
    with this stand-in), and ``crop(-1)`` then put the wrong token back."""
    from test_cache import make_layer

    append = _opaque_append()
    monkeypatch.setattr(
        LayerStorage,
        "append",
        lambda self, k, v, q: append(
            k,
            v,
            self.k_codes,
            self.v_codes,
            self.k_window,
            self.v_window,
            self.n_coded,
            self.n_window,
            self.append_arrivals,
            q.operands.key_centroids,
            q.operands.value_centroids,
            q.key_mean,
            q.lam,
            q.key_transform_matrix,
        ),
    )
    layer = make_layer(1, 2, 16, 4, 16)
    gen = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, 2, 6, 16, generator=gen), torch.randn(1, 2, 6, 16, generator=gen))  # window full
    layer.activate_past_recording()
    s = layer.storage
    before = [t.clone() for t in (s.k_window, s.v_window, s.n_coded, s.n_window)]
    step = torch.compile(lambda k, v: layer.update(k, v)[0].sum(), fullgraph=True)
    step(torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen))
    assert int(s.n_coded) == int(before[2]) + 1  # the step pushed a token into the codes
    assert torch.equal(s.undo_kv[0], before[0][:, :, 0]) and torch.equal(s.undo_kv[1], before[1][:, :, 0])
    layer.crop(-1)
    for now, then in zip((s.k_window, s.v_window, s.n_coded, s.n_window), before):
        assert torch.equal(now, then)


class _HostEvent:
    """Stands in for ``torch.Event`` on the CPU (which has none; its work is done when queued)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass


class _StopAtLength(StoppingCriteria):
    """Stops every row once the sequence is ``length`` long, decided on the device as EOS is (so
    a deferred loop learns it one step late), whatever tokens a random model draws."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


def _deferred_equals_synced(model, cb, ids, mask, compile_config, deferring, monkeypatch, *, residual=4, stop=5):
    """Greedy generate() stopped by a device-side criterion after ``stop`` new tokens, synced and
    deferred (inside ``deferring()``): the same tokens, one step undone when the cache can undo
    it (else no deferral at all), and the coded layers hold the same state."""
    b, prompt = ids.shape

    def run(deferred):
        cache = VecInferCache(model, cb, batch_size=b, max_cache_len=prompt + 20, residual=residual)
        kw = dict(
            max_new_tokens=12,
            do_sample=False,
            compile_config=compile_config,
            stopping_criteria=StoppingCriteriaList([_StopAtLength(prompt + stop)]),
        )
        with deferring() if deferred else contextlib.nullcontext():
            return generate(model, ids, mask, cache, **kw), cache

    undone = []
    finish = DeferredStopCheck.finish
    monkeypatch.setattr(DeferredStopCheck, "finish", lambda self: undone.append(finish(self)) or undone[-1])
    synced, synced_cache = run(deferred=False)
    deferred, deferred_cache = run(deferred=True)
    # the deferred loop ran one step past the stop and undid it
    assert undone == ([1] if deferred_cache.is_croppable else []), undone
    assert synced.shape[1] == prompt + stop and torch.equal(deferred, synced)
    for a, b in zip(deferred_cache.coded_layers(), synced_cache.coded_layers()):
        assert not a.record_past  # generate() switched the recording off again
        a, b = a.storage, b.storage
        c, w = int(b.n_coded), int(b.n_window)
        assert (int(a.n_coded), int(a.n_window)) == (c, w) and w == residual
        assert torch.equal(a.k_codes[:, :, :c], b.k_codes[:, :, :c]) and torch.equal(
            a.v_codes[:, :, :c], b.v_codes[:, :, :c]
        )
        assert torch.equal(a.k_window, b.k_window) and torch.equal(a.v_window, b.v_window)


SHAPES = {  # (query heads, KV heads, head_dim)
    "gqa": (8, 2, 64),
    "mqa": (4, 1, 128),
    "mha": (4, 4, 64),
}


def _tiny_model(device, dtype, shape="gqa", method="vecinfer"):
    """A random Llama of the shape, its random codebooks, two 20-token prompts (the first
    left-padded by 3) and their mask."""
    heads, kv_heads, head_dim = SHAPES[shape]
    torch.manual_seed(0)
    cfg = tiny_config(
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=heads * head_dim
    )
    model = LlamaForCausalLM(cfg).eval().to(device, dtype)
    ids, mask = left_padded(length=20, pad=3)
    return model, random_codebooks(cfg, method=method), ids.to(device), mask.to(device)


@contextlib.contextmanager
def _deferring_on_the_cpu(monkeypatch):
    """transformers' deferred loop on the CPU: its device check lifted as ``defer_stop_check``
    lifts it for CUDA, its other conditions kept; a stand-in event."""
    original = DeferredStopCheck.__dict__["is_supported"].__func__
    with monkeypatch.context() as patch:
        patch.setattr(torch, "Event", _HostEvent)
        patch.setattr(
            DeferredStopCheck,
            "is_supported",
            staticmethod(lambda device, *args, **kwargs: original(torch.device("mps"), *args, **kwargs)),
        )
        yield


def _cpu_compile_config():
    from test_cache_compile import CaptureBackend

    torch._dynamo.reset()
    config = CompileConfig(backend=CaptureBackend(), fullgraph=True)
    config._compile_all_devices = True  # let generate() compile decode on CPU
    return config


@pytest.mark.parametrize(
    "shape, method, compiled",
    [
        ("gqa", "vecinfer", False),
        ("gqa", "vecinfer", True),
        ("gqa", "qaware", True),
        ("mqa", "vecinfer", True),
        ("mha", "qaware", False),
    ],
)
def test_deferred_loop_through_the_cache_equals_the_synced_one(shape, method, compiled, monkeypatch):
    """transformers' deferred loop itself, on the CPU, batch 2 with left padding: eager and
    compiled (the compiled step records the undo state), GQA / MQA / MHA, head_dim 64 and 128,
    smoothed+rotated and query-aware (centred) codebooks."""
    model, cb, ids, mask = _tiny_model("cpu", torch.float32, shape, method)
    config = _cpu_compile_config() if compiled else None
    _deferred_equals_synced(model, cb, ids, mask, config, lambda: _deferring_on_the_cpu(monkeypatch), monkeypatch)


def test_deferred_loop_on_a_sliding_window_model(monkeypatch):
    """Gemma 3 (sliding layers in transformers' own window layers beside coded ones): transformers
    marks a window layer croppable only when the cache is no longer than its window, so here (5.17
    to 5.25) the cache is not, and the loop keeps its sync instead of deferring a step it could not
    undo. The same tokens as synced."""
    from test_hybrid_cache import build

    model = build("gemma3")
    ids, mask = left_padded(length=20, pad=3)
    _deferred_equals_synced(
        model, random_codebooks(model.config), ids, mask, None, lambda: _deferring_on_the_cpu(monkeypatch), monkeypatch
    )


@pytest.mark.cuda
def test_deferred_generate_equals_synced_and_crops_the_extra_step(monkeypatch):
    """The product's path on the GPU: ``defer_stop_check`` around generate() compiled with
    ``vecinfer_backend`` (CUDA graphs), bf16."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vecinfer_compile.backend import vecinfer_backend

    model, cb, ids, mask = _tiny_model("cuda", torch.bfloat16)
    config = CompileConfig(backend=vecinfer_backend.configure(codebooks=cb), fullgraph=True, mode="reduce-overhead")
    _deferred_equals_synced(model, cb, ids, mask, config, vecinfer_compile.defer_stop_check, monkeypatch)
