"""`looplm bench train`: the JSON shape and that the looped row counts the real FLOPs (tiny sizes)."""

import json

import pytest

from looplm.bench.train import flops_per_token
from looplm.cli import main


def test_bench_train_quick_json(capsys):
    assert main(["bench", "train", "--quick", "--no-peers", "--runs", "1", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"].startswith("bench-s")
    (row,) = out["results"]
    assert row["engine"] == "looplm"
    for key in ("tokens_per_s", "mfu", "peak_rss_bytes"):
        assert row[key] > 0
    assert row["tokens_per_s"] == pytest.approx(out["batch"] * out["seq_len"] / row["step_s"])
    assert main(["bench", "train", "--runs", "0"]) == 2


def test_flops_count_every_block_visit():
    """8 effective blocks of one shape: the count must match 8 untied blocks, not the 4 stored ones."""
    f = flops_per_token(quick=True)
    d, ff, V, T = 64, 176, 512, 64
    block_params = 4 * d * d + 3 * d * ff
    attn = 2 * 2 * d * (T + 1) / 2          # causal: token t attends to t + 1 keys, (T + 1) / 2 on average
    expected = 3 * (8 * (2 * block_params + attn) + 2 * d * V)
    assert f == pytest.approx(expected)
