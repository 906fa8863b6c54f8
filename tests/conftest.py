"""Shared fixtures: paths to ../shared/data (skipped with a reason when absent), the embedded tiny
model, loaded once per session, and a fresh Dynamo for every test. The run compiles into caches of
its own (``run_caches``: a run killed mid-write cannot break the next one); torch loads after that."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_caches import isolate

RUN_CACHES = isolate()


def pytest_unconfigure(config):
    if RUN_CACHES is not None:
        RUN_CACHES.remove()


REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from a clean Dynamo with empty counters, as if it ran alone: the graphs an
    earlier test compiled count toward the recompile limit of code that tests share (transformers'
    forward wrappers), and counters would carry its rewrites."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent: these tests need the shared data next to the repo (../shared/data)")
    return path


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return _require(SHARED_DATA)


@pytest.fixture(scope="session")
def evalmodel_dir(shared_data) -> Path:
    return _require(shared_data / "evalmodel")


@pytest.fixture(scope="session")
def shared_tiny_dir(shared_data) -> Path:
    return _require(shared_data / "tiny")


@pytest.fixture(scope="session")
def wikitext_path(shared_data) -> Path:
    return _require(shared_data / "text" / "wikitext2_test.raw")


@pytest.fixture(scope="session")
def calibration_text_path(shared_data) -> Path:
    return _require(shared_data / "text" / "calibration.txt")


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The tiny model embedded in the package (always present)."""
    from vecinfer_compile.models import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def sample_text_path() -> Path:
    """The public-domain text embedded in the package."""
    from vecinfer_compile.models import default_text_path

    return default_text_path()


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """``(model, tokenizer)``: the embedded tiny model in float32 on the CPU, eval mode.
    Tests that switch attention must switch it back (use ``evaluation.ablation.applied``)."""
    from vecinfer_compile.models import load_model

    return load_model(tiny_dir, "float32", "cpu")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny tensors (OpenMP spin costs more than it gives on a
    shared 2-core machine); use as ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
