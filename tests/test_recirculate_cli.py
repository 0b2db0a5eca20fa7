"""`looplm recirculate` and `--recirculate` (cli.py, evaluation/recirculation.py) against independent
computations: the calibration's numbers recomputed for one cell from the validation tokens (the base
loss by the model's own forward, the recirculated loss by hand through the Engine, one window at a
time); alpha 0 changing nothing; generate --recirculate equal to the Engine configured the same way;
the visit plan's length; the blockwise comparison; and the refusals (exit 2, naming the field). One
tiny trained run (2 steps, a random initial loop state, 8 visits) serves every test; an untied copy of
its recipe shows the plan of an untied model."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import looplm
from conftest import cli, tiny_recipe
from looplm.data.text import open_tokens
from looplm.inference import Engine, GenerationConfig, SamplingParams
from looplm.inference.recirculation import Recirculation
from looplm.runs.checkpoint import save_checkpoint, write_text


@pytest.fixture
def run_dir(tiny_run):
    return tiny_run


def test_visits_lists_prelude_every_rounds_core_and_coda(run_dir, capsys, tmp_path):
    code, out, _ = cli(capsys, "recirculate", run_dir, "--visits", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["rounds"] == 3 and not plan["untied"]
    assert len(plan["visits"]) == 1 + 3 * 2 + 1 and [v["index"] for v in plan["visits"]] == list(range(8))
    assert [(v["part"], v["round"], v["block"]) for v in plan["visits"]][:4] == [
        ("prelude", 0, 0), ("core", 1, 0), ("core", 1, 1), ("core", 2, 0)]
    code, text, _ = cli(capsys, "recirculate", run_dir, "--visits")
    assert text.splitlines()[0].startswith("8 visits at 3 rounds") and text.splitlines()[-1] == "7: coda block 0"
    # an untied model of the same recipe: the same plan, each round's blocks its own
    untied = tmp_path / "untied"
    recipe = tiny_recipe(**{"model.untied": True})
    save_checkpoint(untied, looplm.build_model(recipe), {"step": 0})
    looplm.load_run(run_dir).tokenizer.save(untied / "checkpoint")
    write_text(untied / "recipe.toml", recipe.to_toml())
    code, out, _ = cli(capsys, "recirculate", untied, "--visits", "--json")
    assert code == 0 and json.loads(out)["untied"] and len(json.loads(out)["visits"]) == 8


def by_hand(run, rc, tokens, width, start=0):
    """(base loss, recirculated loss) over tokens // width validation windows from window `start` on, each window
    alone, read straight from val.bin by offset: the base by `model(x)` (eval mode: the seed-0 initial-state
    table), the recirculated one through an Engine prefill of that window with every position's logits."""
    val = torch.from_numpy(open_tokens(run.path / "data" / "val.bin")[:(start * width) + tokens + 1].astype("int64"))
    eng = Engine(run.model, None, GenerationConfig(recirculation=rc))
    base = rec = 0.0
    with torch.inference_mode():
        for i in range(start, start + tokens // width):
            x, y = val[i * width:(i + 1) * width][None], val[i * width + 1:(i + 1) * width + 1]
            base += F.cross_entropy(run.model(x).logits[0], y, reduction="sum").item()
            noise = eng.initial_noise([SamplingParams()], next(run.model.parameters()))
            logits = eng.run_chunk(x, 0, eng.new_cache(1, width), phase="prefill", noise=noise, all_logits=True).logits
            rec += F.cross_entropy(logits[0], y, reduction="sum").item()
    return base / tokens, rec / tokens


def test_calibrate_picks_on_one_split_and_confirms_on_another_that_a_recomputation_agrees_with(run_dir, capsys,
                                                                                              tmp_path):
    """256 tokens = 8 windows of 32: the sweep picks on windows 0..3, the best setting is confirmed on windows
    4..7. Both splits' numbers recomputed by hand from val.bin at their own offsets (the reference schedule,
    serial; the sweep runs resume), so a confirmation scored on the selection's text (or any other) fails."""
    code, out, err = cli(capsys, "recirculate", run_dir, "--calibrate", "--tokens", 256, "--pairs", "3:1,7:2",
                         "--alphas", "0.3", "--out", tmp_path / "cal", "--json")
    assert code == 0, err
    table = json.loads(out)
    sel, conf = table["selection"], table["confirmation"]
    assert table["window"] == 32 and len(sel["cells"]) == 2
    assert sel["windows"] == [0, 4] and conf["windows"] == [4, 8] and sel["tokens"] == conf["tokens"] == 128
    png, md = (tmp_path / "cal" / "recirculation_calibration.png"), (tmp_path / "cal" / "recirculation_calibration.md")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "cal" / "recirculation_calibration.json").read_text())["confirmation"] == conf
    run = looplm.load_run(run_dir)
    cell = next(c for c in sel["cells"] if (c["s"], c["d"]) == (7, 2))
    base, rec = by_hand(run, Recirculation(source=7, dest=2, alpha=0.3, schedule="serial"), 128, 32)
    assert abs(sel["base"]["loss"] - base) < 1e-5 and abs(cell["loss"] - rec) < 1e-5 and abs(rec - base) > 1e-4
    want = (math.exp(base) - math.exp(rec)) / math.exp(base) * 100          # positive = better
    assert abs(cell["change_pct"] - want) < 1e-3
    best = sel["best"]
    assert best["change_pct"] == max(c["change_pct"] for c in sel["cells"])
    # the confirmation: the best setting, scored by hand on the other four windows
    cbase, crec = by_hand(run, Recirculation(source=best["s"], dest=best["d"], alpha=best["alpha"], schedule="serial"),
                          128, 32, start=4)
    assert (conf["best"]["s"], conf["best"]["d"], conf["best"]["alpha"]) == (best["s"], best["d"], best["alpha"])
    assert abs(conf["base"]["loss"] - cbase) < 1e-5 and abs(conf["best"]["loss"] - crec) < 1e-5
    cwant = (math.exp(cbase) - math.exp(crec)) / math.exp(cbase) * 100
    assert abs(conf["best"]["change_pct"] - cwant) < 1e-3
    assert abs(cbase - sel["base"]["loss"]) > 1e-3                      # different text: the splits are not one
    assert table["loss"] == pytest.approx(crec, abs=1e-5) and table["base_loss"] == pytest.approx(cbase, abs=1e-5)
    text = md.read_text()
    assert "negative = worse" in text and "selection** split (windows 0..3, 128 tokens)" in text
    assert f"| 7 -> 2 | {want:+.3f} |" in text and f"**{cwant:+.3f}%**" in text
    gap = table["blockwise_gap_at_best"]
    assert gap["gap"] == pytest.approx(gap["blockwise"]["loss"] - gap["exact"]["loss"], abs=1e-9)
    assert gap["scored_tokens"] == 64 and "blockwise" in text       # columns 16..31 of the 4 confirmation windows
    # its base and exact losses by hand on those columns: the base by model(x), the exact schedule by the mixer
    # trainer's eager serial schedule (train/mixer.py, its own implementation), whole windows: an exact
    # schedule's prompt chunk runs column by column, so the split into prompt and decoded columns changes nothing
    from looplm.train.mixer import recirculated_logits
    rc = Recirculation(source=best["s"], dest=best["d"], alpha=best["alpha"], schedule="serial")
    assert abs(gap["base"]["loss"] - _loss_on_columns(run, lambda x: run.model(x).logits, 4, 8, 32, 16)) < 1e-5
    exact = _loss_on_columns(run, lambda x: recirculated_logits(run.model, rc, x), 4, 8, 32, 16)
    assert abs(gap["exact"]["loss"] - exact) < 1e-5 and abs(exact - gap["base"]["loss"]) > 1e-5


def _loss_on_columns(run, logits_of, first, stop, width, p):
    """Mean loss of logits_of(x) (1, width, V) on columns p..width-1 of validation windows first..stop-1."""
    val = torch.from_numpy(open_tokens(run.path / "data" / "val.bin")[:stop * width + 1].astype("int64"))
    total = n = 0
    with torch.no_grad():
        for i in range(first, stop):
            x, y = val[i * width:(i + 1) * width][None], val[i * width + 1:(i + 1) * width + 1]
            total += F.cross_entropy(logits_of(x)[0, p:].float(), y[p:], reduction="sum").item()
            n += width - p
    return total / n


def test_split_windows_is_two_disjoint_halves_in_order(run_dir):
    """Every held-out window is in exactly one split, the selection the first half in order; one window cannot
    be split and is refused by name."""
    from looplm.errors import UserError
    from looplm.evaluation.recirculation import heldout_windows, split_windows
    run = looplm.load_run(run_dir)
    windows = heldout_windows(run, 7 * 16, 16)                          # 7 windows: 3 select, 4 confirm
    pick, confirm, n = split_windows(windows)
    rows = torch.cat([x for x, _ in windows])
    assert n == 7 and torch.equal(torch.cat([x for x, _ in pick]), rows[:3])
    assert torch.equal(torch.cat([x for x, _ in confirm]), rows[3:])
    assert torch.equal(torch.cat([y for _, y in confirm]), torch.cat([y for _, y in windows])[3:])
    with pytest.raises(UserError, match="at least two held-out windows"):
        split_windows(heldout_windows(run, 16, 16))


def test_alpha_zero_changes_nothing_and_blockwise_reports_its_gap(run_dir, capsys):
    code, out, err = cli(capsys, "recirculate", run_dir, "--s", 5, "--d", 2, "--alpha", 0, "--tokens", 64)
    res = json.loads(out)
    assert code == 0 and res["change_pct"] == 0.0 and res["recirculated"] == res["base"] and res["tokens"] == 64
    # the identity is not merely skipped: the exact schedules at alpha 0 give the base loss too
    from looplm.evaluation.recirculation import engine_for, heldout_loss, heldout_windows
    run = looplm.load_run(run_dir)
    for schedule in ("resume", "serial"):
        rc = Recirculation(source=5, dest=2, alpha=0.0, schedule=schedule)
        assert abs(heldout_loss(engine_for(run, rc), heldout_windows(run, 64))["loss"] - res["base"]["loss"]) < 1e-5
    code, out, err = cli(capsys, "recirculate", run_dir, "--s", 5, "--d", 2, "--alpha", 0.5, "--tokens", 64,
                         "--window", 16, "--schedule", "blockwise", "--prompt", "def f(", "--max-new-tokens", 4)
    res = json.loads(out)
    assert code == 0 and res["window"] == 16 and res["schedule"] == "blockwise" and res["prompt"] == 8
    assert res["tokens"] == 32 and set(res["generation"]) >= {"base", "recirculated", "prompt"}  # columns 8..15 scored
    assert res["gap"] == pytest.approx(res["recirculated"]["loss"] - res["exact"]["loss"], abs=1e-9)
    assert res["gap"] != 0 and res["recirculated"] != res["base"]
    # why blockwise is compared after a prompt: a whole window as one chunk is the base model exactly
    windows = heldout_windows(run, 64, 16)
    block = Recirculation(source=5, dest=2, alpha=0.5, schedule="blockwise")
    assert heldout_loss(engine_for(run, block), windows) == heldout_loss(engine_for(run), windows)


def test_generate_with_recirculate_equals_the_engine_configured_so(run_dir, capsys):
    code, out, err = cli(capsys, "generate", run_dir, "--prompt", "def f(x):", "--max-new-tokens", 6, "--logprobs", 1,
                         "--recirculate", "6:1:0.4", "--recirculate-beta", "one", "--recirculate-ramp", 2, "--json")
    assert code == 0, err
    got = json.loads(out)
    run = looplm.load_run(run_dir)
    rc = Recirculation(source=6, dest=1, alpha=0.4, beta="one", ramp=2)
    params = SamplingParams(max_new_tokens=6, logprobs=1)
    want = Engine.from_run(run, recirculation=rc).generate(["def f(x):"], params)[0]
    plain = Engine.from_run(run).generate(["def f(x):"], params)[0]
    assert got["tokens"] == want.tokens and got["logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
    assert got["recirculation"]["source"] == 6 and abs(want.logprobs[0] - plain.logprobs[0]) > 1e-5


def test_serve_passes_recirculation_to_its_engine(run_dir, capsys, monkeypatch):
    pytest.importorskip("fastapi")
    import looplm.serve
    seen = {}
    monkeypatch.setattr(looplm.serve, "serve", lambda run, **kw: seen.update(kw))
    assert cli(capsys, "serve", run_dir, "--recirculate", "6:1:0.4", "--recirculate-schedule", "blockwise")[0] == 0
    rc = seen["engine_options"]["recirculation"]
    assert rc == Recirculation(source=6, dest=1, alpha=0.4, schedule="blockwise")
    assert Engine.from_run(looplm.load_run(run_dir), **seen["engine_options"]).config.recirculation == rc


@pytest.mark.parametrize("argv,message", [
    (["recirculate", "RUN", "--s", 2, "--d", 2], "0 <= d < s"),
    (["recirculate", "RUN", "--s", 8, "--d", 1, "--tokens", 32], "--s 8: this model runs visits 0..7"),
    (["recirculate", "RUN", "--calibrate", "--pairs", "3:1,1:3"], "0 <= d < s"),
    (["recirculate", "RUN", "--calibrate", "--alpha", 0.2], "--alpha: not an option of recirculate --calibrate"),
    (["recirculate", "RUN"], "pass one of --visits, --calibrate or --s S --d D"),
    (["generate", "RUN", "--prompt", "a", "--recirculate", "5:2:0.3", "--exit", "entropy:1.0"],
     "recirculation: not available with an early-exit policy"),
    (["generate", "RUN", "--prompt", "a", "--recirculate", "5:2"], "--recirculate '5:2': expected S:D:ALPHA"),
    (["generate", "RUN", "--prompt", "a", "--recirculate", "5:2:1.5"], "--recirculate 5:2:1.5: recirculation --alpha"),
    (["generate", "RUN", "--prompt", "a", "--recirculate-beta", "one"], "--recirculate-beta: options of --recirculate"),
    (["serve", "RUN", "--recirculate", "5:2:0.3", "--recirculate-schedule", "fast"],
     "--schedule 'fast': resume, serial"),
    (["generate", "RUN", "--prompt", "a", "--no-cache", "--recirculate", "5:2:0.3"], "it takes none of: --recirculate"),
])
def test_refusals_exit_2_naming_the_field(run_dir, capsys, argv, message):
    code, out, err = cli(capsys, *[run_dir if a == "RUN" else a for a in argv])
    assert code == 2 and message in err and out == ""


def test_train_mixer_saves_mixers_that_generate_uses_and_scores_them_against_the_fixed_mix(run_dir, capsys, tmp_path):
    """--train-mixer: the model's weights untouched, each kind saved, its held-out loss equal to the eager
    schedule's with the saved mixer recomputed here; generate --recirculate-mixer equals the Engine so
    configured; options of the wrong mode refused."""
    from looplm.model.mixer import load_mixer
    from looplm.train.mixer import heldout_loss
    run = looplm.load_run(run_dir)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    code, out, err = cli(capsys, "recirculate", run_dir, "--s", 6, "--d", 2, "--train-mixer",
                         "constant_scalar,conditional_vector", "--steps", 2, "--tokens", 128, "--window", 16,
                         "--out", tmp_path)
    assert code == 0, err
    res = json.loads(out)
    assert set(res["kinds"]) == {"constant_scalar", "conditional_vector"} and res["train_windows"] == 4
    d = run.model.cfg.d_model
    assert res["kinds"]["conditional_vector"]["matrix_weights"] == 5 * d * d
    assert all(torch.equal(before[k], v) for k, v in looplm.load_run(run_dir).model.state_dict().items())
    from looplm.evaluation.recirculation import heldout_windows
    x, y = (torch.cat(p) for p in zip(*heldout_windows(run, 128, 16)))
    rows = torch.cat([x, y[:, -1:]], 1)[4:]
    mixer = load_mixer(tmp_path / "mixer-conditional_vector.safetensors", d)
    again = heldout_loss(run.model.eval(), Recirculation(source=6, dest=2), rows, mixer)
    assert again == pytest.approx(res["kinds"]["conditional_vector"]["loss"], abs=1e-6)
    path = str(tmp_path / "mixer-conditional_vector.safetensors")
    code, out, _ = cli(capsys, "generate", run_dir, "--prompt", "ab", "--max-new-tokens", 4, "--json",
                       "--recirculate", "6:2", "--recirculate-mixer", path)
    want = Engine.from_run(run, exit="fixed", recirculation=Recirculation(source=6, dest=2, mixer=path)).generate(
        ["ab"], SamplingParams(max_new_tokens=4))[0].tokens
    assert code == 0 and json.loads(out)["tokens"] == want
    assert cli(capsys, "recirculate", run_dir, "--s", 6, "--d", 2, "--steps", 3)[0] == 2
    assert cli(capsys, "recirculate", run_dir, "--s", 6, "--d", 2, "--train-mixer", "wide")[0] == 2
    assert cli(capsys, "generate", run_dir, "--prompt", "ab", "--recirculate", "6:2:0.15", "--recirculate-mixer",
               path)[0] == 2                          # the mixer gives alpha: S:D only
    assert cli(capsys, "recirculate", run_dir, "--s", 6, "--d", 2, "--alpha", 0.2, "--mixer", path)[0] == 2
