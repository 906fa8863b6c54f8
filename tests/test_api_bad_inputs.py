"""The Python API refuses what the command line refuses, with an error naming the fix before any work:
a bad ``$VECINFER_KERNEL``."""

from __future__ import annotations

import warnings

import pytest

import vecinfer_compile as vc
from vecinfer_compile import kernel_env
from vecinfer_compile.codebooks import load_codebooks
from vecinfer_compile.models import default_codebooks_dir

CODEBOOKS = default_codebooks_dir() / "vecinfer-2bit.safetensors"


@pytest.fixture
def kernel_variables(monkeypatch):
    for name in (kernel_env.ENV, kernel_env.OLD_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(kernel_env, "_warned", set())
    return monkeypatch


def test_a_bad_kernel_variable_is_refused_when_configured(kernel_variables, tiny_model):
    kernel_variables.setenv("VECINFER_KERNEL", "bogus")
    match = "VECINFER_KERNEL='bogus' is not a kernel choice: use one of auto, cuda, triton"
    with pytest.raises(ValueError, match=match):
        vc.vecinfer_backend.configure(CODEBOOKS)
    with pytest.raises(ValueError, match=match):
        vc.VecInferCache(tiny_model[0], load_codebooks(CODEBOOKS), max_cache_len=32)
    # An explicit decode_kernel wins over the variable, as before.
    assert vc.vecinfer_backend.configure(CODEBOOKS, decode_kernel="triton").config.decode_kernel == "triton"


def test_the_old_kernel_variable_warns_once(kernel_variables):
    from vecinfer_compile.ops import kernel_request

    kernel_variables.setenv("VECINFER_DECODE_KERNEL", "Triton")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernel_request.requested() == "triton"
        assert kernel_request.requested() == "triton"
    assert [(w.category, str(w.message).split(":")[0]) for w in caught] == [
        (FutureWarning, "VECINFER_DECODE_KERNEL is renamed VECINFER_KERNEL (it chooses the append, encode and "
                        "Viterbi kernels too, not only decode)")]
    kernel_variables.setenv("VECINFER_KERNEL", "cuda")  # the new name wins
    assert kernel_request.requested() == "cuda"
