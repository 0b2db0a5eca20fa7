"""Devices, mixed precision and compilation, applied from outside the model.

CPU tests run everywhere; the CUDA ones skip cleanly without a GPU (benchmarks/gpu.py measures speed
when one is available)."""

from __future__ import annotations

import json

import pytest
import torch

import looplm
from looplm.cli import main
from looplm.device import grad_scaler, resolve_device
from looplm.errors import UserError
from looplm.train.trainer import train

from conftest import tiny_recipe

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resolve_device():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="expected one of"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_train_on_missing_cuda_is_bad_input(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "r"), "--set", "train.device=cuda", "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0]


def test_unknown_device_is_refused_by_the_recipe():
    with pytest.raises(UserError, match="train.device"):
        tiny_recipe(**{"train.device": "gpu"})


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(tmp_path, text_dir, precision):
    common = {"data.path": str(text_dir), "train.log_every": 1}
    train(tiny_recipe(**common), tmp_path / "fp32", quiet=True)
    report = train(tiny_recipe(**common, **{"train.dtype": precision}), tmp_path / precision, quiet=True)
    ref, got = losses(tmp_path / "fp32"), losses(tmp_path / precision)
    assert report["precision"] == precision and report["device"] == "cpu"
    assert all(abs(a - b) < 0.05 * a for a, b in zip(ref, got)), (ref, got)   # rounding, not a different run
    assert got != ref                                                          # autocast really ran


def test_fp16_scales_the_loss_and_bf16_does_not():
    cpu = torch.device("cpu")
    assert grad_scaler(cpu, "fp16").is_enabled() and not grad_scaler(cpu, "bf16").is_enabled()


def test_compile_wraps_the_model_from_outside(tmp_path, text_dir, monkeypatch):
    """train.compile routes every training forward through torch.compile (here with a counting backend
    instead of inductor, whose C++ build takes minutes on this machine); the losses equal eager training
    and the saved weights are the plain module's."""
    import looplm.train.trainer as train_mod
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(train_mod, "compiled", lambda model, enabled: (
        torch.compile(model, backend=counting_backend) if enabled else model))
    common = {"data.path": str(text_dir), "train.log_every": 1}
    train(tiny_recipe(**common), tmp_path / "eager", quiet=True)
    report = train(tiny_recipe(**common, **{"train.compile": True}), tmp_path / "compiled", quiet=True)
    assert graphs and report["compiled"] is True
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)
    looplm.load_run(tmp_path / "compiled")        # plain parameter names: no "_orig_mod." prefix


@CUDA
def test_cuda_training_matches_cpu(tmp_path, text_dir):
    common = {"data.path": str(text_dir), "train.log_every": 1}
    train(tiny_recipe(**common, **{"train.device": "cpu"}), tmp_path / "cpu", quiet=True)
    report = train(tiny_recipe(**common, **{"train.device": "cuda"}), tmp_path / "cuda", quiet=True)
    assert report["device"].startswith("cuda") and report["peak_device_memory_bytes"] > 0
    assert losses(tmp_path / "cuda") == pytest.approx(losses(tmp_path / "cpu"), rel=2e-3)


@CUDA
def test_cuda_cached_decoding_equals_full_forward(tmp_path, text_dir):
    from looplm.inference.engine import Engine
    train(tiny_recipe(**{"data.path": str(text_dir)}), tmp_path / "run", quiet=True)
    run = looplm.load_run(tmp_path / "run", device="cuda")
    assert next(run.model.parameters()).is_cuda
    out = Engine(run.model, run.tokenizer).generate(["def f"])[0]
    ids = run.tokenizer.encode("def f") + out.tokens
    with torch.no_grad():
        logits = run.model(torch.tensor([ids], device="cuda")).logits[0]
    assert logits[len(ids) - len(out.tokens) - 1:-1].argmax(-1).tolist() == out.tokens


def test_commands_take_a_device(tmp_path, text_dir, capsys):
    train(tiny_recipe(**{"data.path": str(text_dir)}), tmp_path / "run", quiet=True)
    run = str(tmp_path / "run")
    assert main(["generate", run, "--prompt", "def", "--max-new-tokens", "3", "--device", "cpu", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 3
    assert main(["eval", run, "--rounds", "1,2", "--device", "auto", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["rounds"]) == {"1", "2"}
    assert main(["generate", run, "--prompt", "def", "--device", "tpu"]) == 2
    assert "--device 'tpu'" in capsys.readouterr().err
    assert looplm.load_run(run, device="auto").model.embed.weight.device == resolve_device("auto")
