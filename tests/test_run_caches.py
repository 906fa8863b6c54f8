"""A test run cannot be broken by an earlier interrupted one: it compiles into caches of its own
(``run_caches``), and what a killed run left is removed, never read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import run_caches


def _run_root() -> Path:
    root = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent
    if not root.name.startswith(run_caches.PREFIX):
        pytest.skip("TORCHINDUCTOR_CACHE_DIR was set before the run: the caches are the user's choice")
    return root


def test_this_run_compiles_into_caches_of_its_own():
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    root = _run_root()
    assert run_caches._try_lock(root / run_caches.LOCK) is None, "this run holds the lock on its caches"
    # kernels, Triton kernels, and the precompiled headers (which ignore TORCHINDUCTOR_CACHE_DIR)
    for path in (
        cache_dir(),
        os.environ["TRITON_CACHE_DIR"],
        default_cache_dir(),
        getattr(codecache, "_HEADER_DIR", default_cache_dir()),
    ):
        assert Path(path).is_relative_to(root), path


def test_a_killed_runs_truncated_caches_are_removed_and_a_live_runs_kept(tmp_path):
    def plant(name: str) -> Path:
        root = tmp_path / f"{run_caches.PREFIX}{name}"
        for sub in ("inductor/ab", "torchinductor_root/precompiled_headers"):
            (root / sub).mkdir(parents=True)
        (root / "inductor/ab/cabc.so").write_bytes(b"\x7fELF" + b"\0" * 60)  # cut off mid-write
        (root / "torchinductor_root/precompiled_headers/c123.h.gch").write_bytes(b"gpch" + b"\0" * 60)
        (root / run_caches.LOCK).touch()
        return root

    killed = plant("killed")  # its process is gone, so nobody holds its lock
    live = plant("live")
    held = run_caches._try_lock(live / run_caches.LOCK)  # as the live run's process does
    try:
        env = {}
        mine = run_caches.isolate(environ=env, parent=tmp_path)
        try:
            assert not killed.exists() and live.exists()
            assert mine.root not in (killed, live)
            assert env["TORCHINDUCTOR_CACHE_DIR"] == str(mine.root / "inductor")
            assert env["TMPDIR"] == str(mine.root) and env["PYTEST_DEBUG_TEMPROOT"] == str(tmp_path)
            # the next run, started after this one ends normally, finds nothing of it
        finally:
            mine.remove()
        assert not mine.root.exists() and run_caches.prune(tmp_path) == []
    finally:
        os.close(held)
    assert run_caches.prune(tmp_path) == [live]  # once the live run is gone


def test_a_cache_dir_the_user_chose_is_left_alone():
    env = {"TORCHINDUCTOR_CACHE_DIR": "/somewhere/warm"}
    assert run_caches.isolate(environ=env) is None
    assert env == {"TORCHINDUCTOR_CACHE_DIR": "/somewhere/warm"}
