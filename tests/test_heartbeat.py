"""Heartbeats: a long per-layer fit shows what it is doing on the calibration's progress bar."""

from __future__ import annotations

import io

import torch
from tqdm.auto import tqdm

from vecinfer_compile.heartbeat import beat, reporting
from vecinfer_compile.quant.kmeans import kmeans


def test_kmeans_beats_on_the_reporting_bar_and_nowhere_else():
    out = io.StringIO()
    bar = tqdm(range(3), file=out, mininterval=0, desc="fitting codebooks")
    x = torch.randn(500, 4, generator=torch.Generator().manual_seed(0))
    with reporting(bar):
        kmeans(x, 8, iters=3, seed=0)
    assert "k-means 8 entries, iteration" in out.getvalue()
    kmeans(x, 8, iters=3, seed=0)  # no bar: a beat does nothing
    beat("outside")
    assert "outside" not in out.getvalue()
    bar.close()


def test_a_disabled_bar_stays_silent():
    out = io.StringIO()
    bar = tqdm(range(3), file=out, disable=True)
    with reporting(bar):
        beat("hidden")
    assert out.getvalue() == ""
