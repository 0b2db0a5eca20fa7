"""LoopCD-style contrastive decoding (GenerationConfig.contrast, generate/serve/eval --contrast) against
hand computations from the model's own forward: z = z_R + beta (z_R - z_r), argmax, token by token.

Without a coda, z_r is the logit lens of the forward (`round_logits[r]`). With a coda, a decoded token's
round-r readout attends to the earlier tokens' cached coda entries, which are their round-R ones (one coda
slot, last write wins): the hand computation applies `model.readout` to [earlier tokens' round-R states,
this token's round-r state]; the prompt's prefill reads out round r over the whole prompt (the lens).
One tiny trained run (2 steps, a coda) serves the CLI tests; the coda-free case uses a fresh model."""

from __future__ import annotations

import json

import pytest
import torch

import looplm
from conftest import cli, tiny_recipe
from looplm.inference import Engine, SamplingParams
from looplm.model.looped import initial_noise_table

PROMPT = "def f(x):"


@pytest.fixture
def run_dir(tiny_run):
    return tiny_run


@torch.no_grad()
def by_hand(model, ids: list[int], n: int, r: int, beta: float, sign: float = 1.0) -> tuple[list[int], list[float]]:
    """n greedy tokens and their log-probabilities from whole forwards over the sequence so far (no cache):
    z_R + beta (z_R - z_r) at the last position, z_r as the engine's cache semantics define it (module doc).
    `sign` = -1 is a broken implementation (the difference's sign flipped), for the tests' own check."""
    R = model.nominal_rounds
    seq, toks, lps = list(ids), [], []
    for i in range(n):
        x = torch.tensor([seq])
        s0 = initial_noise_table(model.cfg, 0)[None, :len(seq)] if model.cfg.init_state == "random" else None
        out = model(x, R, readout_rounds=(r, R), initial_state=s0, collect_stats=True)
        zR = out.logits[0, -1].float()
        if i == 0 or model.cfg.n_coda == 0:          # the prompt's prefill, or no coda: the logit lens
            zr = out.round_logits[r][0, -1].float()
        else:                                        # earlier tokens' coda entries are their round-R ones
            mixed = torch.cat([out.round_states[R - 1][:, :-1], out.round_states[r - 1][:, -1:]], 1)
            zr = model.readout(mixed, model.rope(0, len(seq)))[0, -1].float()
        z = zR + sign * beta * (zR - zr)
        tok = int(z.argmax())
        toks.append(tok)
        lps.append(float(torch.log_softmax(z, -1)[tok]))
        seq.append(tok)
    return toks, lps


def engine_greedy(model, tok, ids, n, contrast):
    eng = Engine(model, tok, looplm.inference.GenerationConfig(contrast=contrast))
    out = eng.generate([ids], SamplingParams(max_new_tokens=n, logprobs=0, stop_at_eos=False))[0]
    return out.tokens, out.logprobs


@pytest.mark.parametrize("n_coda", [0, 1])
def test_engine_greedy_equals_hand_contrast_and_not_a_broken_one(run_dir, n_coda):
    if n_coda:
        model = looplm.load_run(run_dir).model
    else:
        model = looplm.model.looped.LoopedLM(tiny_recipe(**{"model.n_coda": 0, "model.init_std": 0.3}).model, 3).eval()
    ids, n, (r, beta) = [5, 17, 3, 9, 11], 8, (1, 1.5)
    got_t, got_lp = engine_greedy(model, None, ids, n, (r, beta))
    want_t, want_lp = by_hand(model, ids, n, r, beta)
    assert got_t == want_t and got_lp == pytest.approx(want_lp, abs=1e-4)
    plain_t, plain_lp = engine_greedy(model, None, ids, n, None)
    assert got_lp != pytest.approx(plain_lp, abs=1e-3)                  # the contrast changed something
    flipped = by_hand(model, ids, n, r, beta, sign=-1.0)
    wrong_round = by_hand(model, ids, n, 2, beta)
    assert (flipped[0], flipped[1]) != (got_t, pytest.approx(got_lp, abs=1e-4))
    assert (wrong_round[0], wrong_round[1]) != (got_t, pytest.approx(got_lp, abs=1e-4))


def test_beta_zero_is_plain_decoding_exactly(run_dir):
    run = looplm.load_run(run_dir)
    params = SamplingParams(max_new_tokens=6, logprobs=2, temperature=0.9, seed=3)
    a = Engine.from_run(run, contrast=(2, 0.0)).generate([PROMPT, "x = 1"], params)
    b = Engine.from_run(run).generate([PROMPT, "x = 1"], params)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]


def test_generate_contrast_equals_the_engine_and_counts_the_extra_readout(run_dir, capsys):
    code, out, err = cli(capsys, "generate", run_dir, "--prompt", PROMPT, "--max-new-tokens", 5, "--logprobs", 0,
                         "--contrast", "1:0.5", "--json")
    assert code == 0, err
    got = json.loads(out)
    run = looplm.load_run(run_dir)
    want = Engine.from_run(run, contrast=(1, 0.5)).generate([PROMPT], SamplingParams(max_new_tokens=5, logprobs=0))[0]
    assert got["tokens"] == want.tokens and got["contrast"] == {"round": 1, "beta": 0.5, "final_round": 3}
    code, out, _ = cli(capsys, "generate", run_dir, "--prompt", PROMPT, "--max-new-tokens", 5, "--json")
    plain = json.loads(out)
    cfg = run.model.cfg
    from looplm.model.flops import DecodeWork
    one, two = DecodeWork(cfg), DecodeWork(cfg)     # one decode column at position 20: 1 vs 2 readouts
    one.add("decode", 20, 3)
    two.add("decode", 20, 3, readouts=2, heads=2)
    extra = two.total() - one.total()
    assert extra > 0
    n_dec = got["flops"]["decode"] / max(got["flops_per_token"]["decode"], 1e-9)       # decode tokens
    assert got["flops"]["decode"] > plain["flops"]["decode"]
    assert got["flops"]["decode"] - plain["flops"]["decode"] == pytest.approx(
        n_dec * extra, rel=0.05)   # attention of the extra coda grows with position; tokens are near 20


def test_serve_passes_contrast_to_its_engine(run_dir, capsys, monkeypatch):
    pytest.importorskip("fastapi")
    import looplm.serve
    seen = {}
    monkeypatch.setattr(looplm.serve, "serve", lambda run, **kw: seen.update(kw))
    assert cli(capsys, "serve", run_dir, "--contrast", "2:0.25")[0] == 0
    assert seen["engine_options"]["contrast"] == (2, 0.25)
    assert Engine.from_run(looplm.load_run(run_dir), **seen["engine_options"]).config.contrast == (2, 0.25)


def test_eval_contrast_equals_column_by_column_hand_computation(run_dir, capsys):
    code, out, err = cli(capsys, "eval", run_dir, "--rounds", "1,3", "--contrast", "1:0.5", "--json")
    assert code == 0, err
    got = json.loads(out)
    rep = got["contrast"]
    assert rep["method"] == "column_by_column"
    run = looplm.load_run(run_dir)
    from looplm.evaluation.rounds import eval_batches_for
    model, count = run.model, 0
    total, hits = {"plain": 0.0, "contrast": 0.0}, {"plain": 0, "contrast": 0}
    with torch.no_grad():
        for x, y in eval_batches_for(run):
            # the initial state eval --rounds draws: N(0, std^2) from a CPU generator seeded per batch
            s0 = torch.randn(*x.shape, model.cfg.d_model, generator=torch.Generator().manual_seed(count)) \
                * model.cfg.init_state_std
            out = model(x, 3, readout_rounds=(1, 3), initial_state=s0, collect_stats=True)
            zR, st = out.round_logits[3].float(), out.round_states
            for t in range(x.shape[1]):       # each column decoded: earlier coda entries are round 3's
                mixed = torch.cat([st[2][:, :t], st[0][:, t:t + 1]], 1)
                zr = model.readout(mixed, model.rope(0, t + 1))[:, -1].float()
                for name, z in (("plain", zR[:, t]), ("contrast", zR[:, t] + 0.5 * (zR[:, t] - zr))):
                    total[name] += torch.nn.functional.cross_entropy(z, y[:, t], reduction="sum").item()
                    hits[name] += int((z.argmax(-1) == y[:, t]).sum())
            count += y.numel()
    assert rep["tokens"] == count and min(hits.values()) > 0, hits       # accuracy compared where it is not 0
    for name in ("plain", "contrast"):
        assert rep[name]["loss"] == pytest.approx(total[name] / count, abs=1e-4), name
        assert rep[name]["accuracy"] == hits[name] / count, name
    assert rep["contrast"]["loss"] != pytest.approx(rep["plain"]["loss"], abs=1e-3)
    assert got["rounds"]["3"]["loss"] == pytest.approx(total["plain"] / count, abs=1e-5)   # eval --rounds, the same


@pytest.mark.parametrize("argv,message", [
    (["generate", "RUN", "--prompt", "a", "--contrast", "3:0.5"], "1 <= ROUND < 3"),
    (["generate", "RUN", "--prompt", "a", "--contrast", "0:0.5"], "1 <= ROUND < 3"),
    (["generate", "RUN", "--prompt", "a", "--contrast", "1:-0.5"], "BETA must be a finite number >= 0"),
    (["generate", "RUN", "--prompt", "a", "--contrast", "1"], "expected ROUND:BETA"),
    (["generate", "RUN", "--prompt", "a", "--contrast", "1:0.5", "--exit", "entropy:1.0"],
     "--contrast: not available with the early-exit policy"),
    (["generate", "RUN", "--prompt", "a", "--contrast", "1:0.5", "--speculative", "1:2"],
     "--contrast: not available with --speculative"),
    (["generate", "RUN", "--prompt", "a", "--no-cache", "--contrast", "1:0.5"], "it takes none of: --contrast"),
    (["eval", "RUN", "--contrast", "3:0.5"], "1 <= ROUND < 3"),
    (["eval", "RUN", "--contrast", "1:0.5", "--exit", "entropy:1.0"], "--contrast: not available with --exit"),
])
def test_refusals_exit_2_naming_the_reason(run_dir, capsys, argv, message):
    code, out, err = cli(capsys, *[run_dir if a == "RUN" else a for a in argv])
    assert code == 2 and message in err and out == "", err


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """A tiny `completion`-task run ("yes"/"no" answers) without a coda and with a deterministic initial state
    (the extrapolate recipe's anatomy), trained 60 steps (~5 s): it answers about half the held-out examples
    right (0.42 to 0.75 by difficulty), so an exact match computed wrongly shows, where a model that answers
    nothing scores 0 either way; a batch scores as its examples one at a time."""
    import looplm.runs.report
    from looplm.train.trainer import train
    out = tmp_path_factory.mktemp("loopcd-task") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(looplm.runs.report, "write_plots", lambda run_dir, report: [])     # seconds of matplotlib
        torch.manual_seed(0)
        train(tiny_recipe(**{"data.task": "completion", "model.n_coda": 0, "train.steps": 60,
                             "train.checkpoint_every": 1000, "model.init_state": "prelude", "optim.lr": 3e-3,
                             "data.difficulty_max": 2, "data.eval_examples": 12, "data.probe_examples": 0,
                             "model.init_std": 0.3, "train.threads": 1}), out, quiet=True)
    return out


def test_eval_contrast_on_a_task_run_equals_hand_exact_match(task_run, capsys):
    from looplm.data.taskdata import TaskSource
    from looplm.evaluation.tasks import encode_examples
    code, out, err = cli(capsys, "eval", task_run, "--rounds", "1,2,3", "--contrast", "1:0.7", "--json")
    assert code == 0, err
    rep = json.loads(out)["contrast"]
    assert rep["round"] == 1 and rep["beta"] == 0.7 and set(rep["rounds"]) == {"2", "3"}   # only R > r
    run = looplm.load_run(task_run)
    sets = TaskSource(run.recipe).eval_sets(run.recipe.data.eval_examples)
    loss = {2: 0.0, 3: 0.0}
    tokens = 0
    accuracy = {}
    for d, exs in sets.items():
        for R in (2, 3):
            hits = 0
            with torch.no_grad():
                for ex in exs:                                   # one example at a time: no padding
                    b = encode_examples(run.tokenizer, [ex], run.model.cfg.context, run.recipe.data.separator)
                    o = run.model(b.x, R, readout_rounds=(1, R))
                    z = o.round_logits[R] + 0.7 * (o.round_logits[R] - o.round_logits[1])
                    hits += int(((z.argmax(-1) == b.y) | ~b.mask).all())
                    loss[R] += torch.nn.functional.cross_entropy(z[b.mask], b.y[b.mask], reduction="sum").item()
                    tokens += int(b.mask.sum()) if R == 2 else 0
            accuracy[d, R] = hits / len(exs)
            assert rep["by_difficulty"][str(d)][str(R)] == pytest.approx(accuracy[d, R]), (d, R)
    # the comparison bites: the model answers some examples right and some wrong at every depth scored
    assert all(0 < a < 1 for a in accuracy.values()), accuracy
    for R in (2, 3):   # the answer loss under the contrast
        assert rep["rounds"][str(R)]["loss"] == pytest.approx(loss[R] / tokens, rel=1e-5)
    # a coda's readout is not per token in decoding: refused there, naming why
    code, out, err = cli(capsys, "eval", task_run, "--contrast", "1:0.5", "--prompt-mode", "standard")
    assert code == 2 and "--contrast: not available with --prompt-mode" in err


def test_eval_contrast_refused_on_a_task_run_with_a_coda(tmp_path, capsys):
    from looplm.train.trainer import train
    train(tiny_recipe(**{"data.task": "chain", "train.steps": 1, "data.difficulty_max": 1, "data.eval_examples": 2,
                         "data.probe_examples": 0}), tmp_path / "run", quiet=True)
    code, out, err = cli(capsys, "eval", tmp_path / "run", "--contrast", "1:0.5")
    assert code == 2 and "a task run with a coda" in err
