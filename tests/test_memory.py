"""Peak memory per run: runs trained one after another in one process each report their own peak."""

from __future__ import annotations

import json
import sys

import pytest

import looplm.runs.report
from looplm.memory import RunMemory, process_peak_rss_bytes
from looplm.train.trainer import train

from conftest import tiny_recipe

MiB = 2**20
# ~10M stored parameters: weights, gradients and AdamW's two moments hold ~150 MiB more than TINY's
LARGE = {"model.d_model": 384, "model.ffn_hidden": 1536, "model.n_heads": 6, "model.head_dim": 64}
ONE_STEP = {"train.steps": 1, "train.eval_batches": 1, "train.checkpoint_every": 1, "train.log_every": 1}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the RSS high-water mark resets on Linux only")
def test_a_small_run_after_a_large_one_reports_its_own_peak(tmp_path, text_dir, monkeypatch):
    monkeypatch.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])   # seconds of matplotlib
    data = {"data.path": str(text_dir), **ONE_STEP}
    large = train(tiny_recipe(**data, **LARGE), tmp_path / "large", quiet=True)
    small = train(tiny_recipe(**data), tmp_path / "small", quiet=True)
    for rep in (large, small):
        assert rep["peak_rss_scope"] == "run"
        assert rep["rss_growth_bytes"] >= 0 and rep["rss_growth_bytes_per_rank"] == [rep["rss_growth_bytes"]]
        assert rep["peak_rss_bytes_per_rank"] == [rep["peak_rss_bytes"]]
        assert rep["peak_rss_bytes"] >= rep["rss_growth_bytes"]
    assert large["rss_growth_bytes"] > 100 * MiB
    # the process's peak is the large run's; the small run's own lies well below it
    assert small["peak_rss_bytes"] < large["peak_rss_bytes"] - 80 * MiB
    assert small["rss_growth_bytes"] < large["rss_growth_bytes"] / 4
    # the kernel syncs each thread's RSS counter into the process's lazily (up to ~64 pages per thread),
    # so two reads of the high-water mark may differ by tens of KiB
    assert process_peak_rss_bytes() >= large["peak_rss_bytes"] - MiB
    saved = json.loads((tmp_path / "small" / "report.json").read_text())
    assert saved["peak_rss_bytes"] == small["peak_rss_bytes"] and saved["peak_rss_scope"] == "run"
    assert "this run's own" in (tmp_path / "small" / "report.md").read_text()


def test_without_a_reset_the_figure_is_the_process_peak(monkeypatch):
    monkeypatch.setattr("looplm.memory.reset_rss_peak", lambda: None)
    got = RunMemory().report()
    assert got["peak_rss_scope"] == "process" and got["peak_rss_bytes"] == process_peak_rss_bytes()
    assert got["peak_device_memory_bytes"] is None
