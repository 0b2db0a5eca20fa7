"""Devices, mixed precision and compilation, applied from outside the model.

CPU tests run everywhere; the CUDA ones skip cleanly without a GPU (benchmarks/gpu.py measures speed
when one is available)."""

from __future__ import annotations

import json
import math

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


def spied_training(tmp_path, recipe, name):
    """Train `recipe` into tmp_path/name, recording at every training visit of core block 0 whether
    autocast was on and the dtype its attention's products came out in. -> (run folder, records)."""
    import looplm.train.trainer as train_mod
    seen, real_build = [], train_mod.build_model

    def build_and_spy(rec):
        model = real_build(rec)
        attn = model.core[0].attn
        real = attn.forward    # blocks call attn.forward directly (no module hooks): wrap it on the instance

        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            if attn.training:  # not the report's evaluation after training
                seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
            return out
        attn.forward = spy
        return model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_mod, "build_model", build_and_spy)
        train(recipe, tmp_path / name, quiet=True)
    return tmp_path / name, seen


def final_weights(run_dir):
    from safetensors.torch import load_file
    return load_file(str(run_dir / "checkpoint" / "model.safetensors"))


def distance(a, b):
    return math.sqrt(sum((a[k].double() - b[k].double()).pow(2).sum().item() for k in a))


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    """The fp32 reference run the mixed-precision runs are compared with, and its initial weights."""
    from conftest import write_corpus
    tmp = tmp_path_factory.mktemp("fp32")
    common = {"data.path": str(write_corpus(tmp / "corpus")), "train.log_every": 1}
    recipe = tiny_recipe(**common)
    torch.manual_seed(recipe.train.seed)     # the trainer's initialisation
    init = looplm.build_model(recipe).state_dict()
    run, seen = spied_training(tmp, recipe, "fp32")
    return common, run, seen, init


def cpu_autocast_supported(dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            return torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype == dtype
    except (RuntimeError, AssertionError):
        return False


# unit roundoff: half the spacing of the numbers just above 1 (7 and 10 stored mantissa bits)
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(tmp_path, fp32_run, precision):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if not cpu_autocast_supported(dtype):
        pytest.skip(f"torch {torch.__version__} has no {precision} autocast on the CPU")
    common, ref_dir, ref_seen, init = fp32_run
    run, seen = spied_training(tmp_path, tiny_recipe(**common, **{"train.dtype": precision}), precision)
    report = json.loads((run / "report.json").read_text())
    assert report["precision"] == precision and report["device"] == "cpu"
    # autocast ran inside the forward: every training visit of the core (6 steps x 3 rounds) multiplied
    # at `precision`; the fp32 run's never did
    assert seen == [(True, dtype)] * 18 and ref_seen == [(False, torch.float32)] * 18
    ref, got = losses(ref_dir), losses(run)
    # step 0: the same weights and batch, only rounded. Cross entropy moves by at most
    # 2 max|logit change| (its gradient in the logits has L1 norm <= 2); the fresh model's logits are
    # under 1 in size and come out rounded at relative u: |change| <= 2u. A different batch (or
    # initialisation) moves the loss by more than that (the fp32 run's losses of steps 0 and 1
    # differ by ~0.014).
    tol = 2 * UNIT_ROUNDOFF[precision]
    assert abs(got[0] - ref[0]) <= tol, (got[0], ref[0], tol)
    assert abs(ref[-1] - ref[0]) > tol and abs(got[-1] - got[0]) > tol       # the loss moves by more than that
    # the final weights: where fp32 training took them, up to rounding. Adam's update is about lr per
    # step whatever the gradient's size, so a 20% change of the learning rate moves them ~20% of the
    # distance training went (measured: lr x0.8 -> 0.21, x1.25 -> 0.27, x0 -> 1.0); bf16 rounding
    # moved them 1.6%, fp16 0.5%.
    ref_w, got_w = final_weights(ref_dir), final_weights(run)
    travelled = distance(ref_w, init)
    assert travelled > 0.5                    # fp32 training moved them (1.77 here)
    assert distance(got_w, ref_w) < 0.1 * travelled, (distance(got_w, ref_w), travelled)


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
