"""The lm-evaluation-harness model (looplm/lm_eval.py) against references computed another way.

Scores are checked against a plain forward pass (`model(idx).logits`, log-softmax, gathered) over
the window the model may see, and against the server's echo + max_tokens 0 path; generation
against greedy decoding by whole forward passes; the `python -m looplm.lm_eval` command line end
to end on the local tasks of examples/lm_eval_task.py. One tiny run (untrained, a random initial
loop state, context 64) serves every test.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import looplm
from looplm.data.text import encode_to_memmap
from looplm.data.tokenizer import ByteTokenizer
from looplm.errors import UserError
from looplm.model.looped import initial_noise_table
from looplm.runs.checkpoint import save_checkpoint, write_text

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from looplm.lm_eval import LoopLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# init_std 0.3 spreads the logits, so greedy choices are far from ties
TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.context": 64,
        "model.init_std": 0.3, "depth.kind": "fixed", "depth.rounds": 3, "data.seq_len": 32}
CTX = 64
TOK = ByteTokenizer()
EOS = TOK.eos_id
VAL = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(40))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One tiny run folder (the quickstart recipe's random initial state) with a validation split."""
    d = tmp_path_factory.mktemp("lm_eval_run")
    recipe = looplm.load_recipe("quickstart", overrides=TINY)
    torch.manual_seed(0)
    save_checkpoint(d, looplm.build_model(recipe), {"step": 0})
    TOK.save(d / "checkpoint")
    write_text(d / "recipe.toml", recipe.to_toml())
    encode_to_memmap([("val.py", VAL), ("b.py", "x = 1\n" * 300)], TOK, d / "data" / "val.bin")
    return d


@pytest.fixture(scope="module")
def lm(run_dir) -> LoopLM:
    return LoopLM(run=str(run_dir), batch_size=3)      # small batches: several batches, shared windows across them


@pytest.fixture(scope="module")
def tasks(run_dir, tmp_path_factory) -> Path:
    """examples/lm_eval_task.py's two tasks for the run (run in this process: no second start-up)."""
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    argv = sys.argv
    sys.argv = ["lm_eval_task.py", str(run_dir), "--out", str(out), "--questions", "6", "--doc-chars", "150"]
    try:
        runpy.run_path(str(ROOT / "examples" / "lm_eval_task.py"), run_name="__main__")
    finally:
        sys.argv = argv
    return out


@torch.no_grad()
def forward_logprobs(model, ids: list[int], rounds: int | None = None) -> torch.Tensor:
    """(T, V) log-probabilities from one forward pass over ids (row t predicts token t + 1), with
    the engine's initial loop state for seed 0 (the noise table by position)."""
    noise = initial_noise_table(model.cfg, 0)[:len(ids)][None]
    return torch.log_softmax(model(torch.tensor([ids]), rounds, initial_state=noise).logits[0].float(), -1)


def forward_score(model, ctx: list[int], cont: list[int], rounds: int | None = None) -> tuple[float, bool]:
    """The continuation's summed log-probability and whether each of its tokens is the argmax,
    over the last CTX tokens of context + continuation."""
    window = (ctx + cont)[-CTX:]
    lp = forward_logprobs(model, window, rounds)
    first = len(window) - len(cont)
    rows = lp[first - 1:len(window) - 1]                       # the rows that predict the continuation
    target = torch.tensor(window[first:])
    return float(rows.gather(1, target[:, None]).sum()), bool(torch.equal(rows.argmax(-1), target))


def greedy_tokens(model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(forward_logprobs(model, ids + out)[-1].argmax()))
    return out


def ascii_greedy(model) -> tuple[str, str]:
    """A context whose greedy continuation starts with at least two ASCII tokens, and that text."""
    for ctx in ["def f1(x):", "hello", "x = 1", "return", "abc"]:
        toks = greedy_tokens(model, TOK.encode(ctx), 4)
        k = next((i for i, t in enumerate(toks) if t >= 128), len(toks))
        if k >= 2:
            return ctx, bytes(toks[:k]).decode()
    raise AssertionError("no context with an ASCII greedy continuation")


def requests(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def token_pair(context: str, continuation: str) -> tuple[list[int], list[int]]:
    """What the model scores for a request with this byte tokenizer: HF's split (the context's
    trailing spaces move to the continuation; an empty context is the end-of-text token)."""
    if not context:
        return [EOS], TOK.encode(continuation)
    kept = context.rstrip()
    return TOK.encode(kept), TOK.encode(context[len(kept):] + continuation)


def pairs_for(model) -> list[tuple[str, str]]:
    greedy_ctx, greedy_cont = ascii_greedy(model)
    long_ctx = VAL[:100]
    return [("def f1(x):", "\n    return x"),
            ("", "hello"),                                    # empty context: conditioned on end-of-text
            ("x = 1 ", "+ 2"),                                # the trailing space is scored with "+ 2"
            (long_ctx, VAL[100:130]),                         # 130 tokens: cut from the left to 64
            ("def f1(x):", "\n    return x"),                 # a repeat: read off the same window
            ("def f1(x):", "\n    ret"),                      # begins the first: read off its window
            (greedy_ctx, greedy_cont),                        # the greedy continuation: is_greedy
            (greedy_ctx, greedy_cont[:1] + "\x00")]           # its first token, then not the likeliest


def test_loglikelihood_equals_a_forward_pass_over_the_window(lm):
    pairs = pairs_for(lm.run.model)
    got = lm.loglikelihood(requests(pairs))
    assert token_pair("x = 1 ", "+ 2") == (TOK.encode("x = 1"), TOK.encode(" + 2"))
    for (context, continuation), (score, greedy) in zip(pairs, got):
        ref, ref_greedy = forward_score(lm.run.model, *token_pair(context, continuation))
        assert score == pytest.approx(ref, abs=1e-4), (context, continuation)
        assert greedy == ref_greedy, (context, continuation)
    assert [g for _, g in got[-2:]] == [True, False]
    assert got[0] == got[4] and got[5][0] > got[0][0]          # a prefix scores fewer (negative) terms


def test_loglikelihood_equals_the_server_path_on_the_example_tasks(lm, run_dir, tasks):
    """The task's multiple-choice requests (and the unconditional ones acc_mutual_info adds), sent
    to the server as token windows with echo, max_tokens 0 and logprobs 1."""
    from fastapi.testclient import TestClient

    from looplm.inference.engine import Engine
    from looplm.serve import ServeLimits, _token_text, create_app

    questions = [json.loads(line) for line in (tasks / "data.jsonl").read_text().splitlines()][:3]
    pairs = [(q["context"], c) for q in questions for c in q["choices"]] + [("", c) for c in questions[0]["choices"]]
    got = lm.loglikelihood(requests(pairs))
    encoded = [token_pair(*p) for p in pairs]
    windows = [(ctx + cont)[-CTX:] for ctx, cont in encoded]
    app = create_app(Engine.from_run(looplm.load_run(run_dir)), limits=ServeLimits(max_batch=len(windows)))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": windows, "echo": True, "max_tokens": 0, "logprobs": 1,
                                                 "temperature": 0, "seed": 0})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for (ctx, cont), window, choice, (score, greedy) in zip(encoded, windows, choices, got):
        lps = choice["logprobs"]["token_logprobs"][len(window) - len(cont):]
        tops = choice["logprobs"]["top_logprobs"][len(window) - len(cont):]
        assert score == pytest.approx(sum(lps), abs=1e-4)
        assert greedy == all(max(top, key=top.get) == _token_text(TOK, t) for top, t in zip(tops, cont))


def rolling_reference(model, doc: list[int]) -> float:
    """Every token scored once: blocks of CTX - 1 tokens, each conditioned on the CTX - 1 tokens
    before its last one (the first block on end-of-text and the document's start)."""
    seq, total = [EOS] + doc, 0.0                     # doc[i] is seq[i + 1]
    for start in range(0, len(doc), CTX - 1):
        end = min(start + CTX - 1, len(doc))
        lo = max(0, end + 1 - CTX)
        lp = forward_logprobs(model, seq[lo:end + 1])
        total += sum(float(lp[i - lo, seq[i + 1]]) for i in range(start, end))
    return total


def test_loglikelihood_rolling_sums_the_forward_pass_over_the_windows(lm):
    docs = [VAL[:150], "hi", VAL[200:263], ""]      # three windows; one; exactly one full window; none
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)])
    for doc, total in zip(docs, got):
        assert total == pytest.approx(rolling_reference(lm.run.model, TOK.encode(doc)), abs=1e-3), doc[:20]
    assert got[-1] == 0


def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(lm):
    model = lm.run.model
    ctx_a, ctx_b = "def f1(x):", "hello"
    ref_a = TOK.decode(greedy_tokens(model, TOK.encode(ctx_a), 10))
    ref_b = TOK.decode(greedy_tokens(model, TOK.encode(ctx_b), 6))
    stop = ref_a[4]                                   # a stop string inside the greedy text
    assert 0 < ref_a.index(stop) < 10
    reqs = [Instance("generate_until", {}, (ctx_a, {"until": [stop], "max_gen_toks": 10}), 0),
            Instance("generate_until", {}, (ctx_b, {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}), 1),
            Instance("generate_until", {}, (ctx_b, {"until": [], "max_gen_toks": 6, "do_sample": True,
                                                     "temperature": 1.0}), 2),
            Instance("generate_until", {}, (ctx_b, {"until": [], "max_gen_toks": 6, "do_sample": True,
                                                     "temperature": 1.0}), 3)]
    got = lm.generate_until(reqs)
    assert got[0] == ref_a.split(stop)[0] and got[1] == ref_b
    assert got[2] != got[3]                           # sampled repeats get their own seeds
    with pytest.raises(UserError, match="num_beams"):
        lm.generate_until([Instance("generate_until", {}, ("x", {"until": [], "num_beams": 4}), 0)])


@pytest.mark.parametrize("args, rounds", [({"rounds": 1}, 1), ({"rounds": 2}, 2), ({"exit": "fixed:2"}, 2),
                                          ({"exit": "entropy:1000"}, 1), ({"exit": "entropy:0"}, 3)])
def test_rounds_and_exit_set_the_function_scored(lm, run_dir, args, rounds):
    """Each model argument scores the forward pass at its depth: rounds R; entropy:1000 stops every
    token after its first round, entropy:0 never early (scored tokens follow the exit policy)."""
    pairs = pairs_for(lm.run.model)[:4]
    other = LoopLM.create_from_arg_string(",".join(f"{k}={v}" for k, v in {"run": run_dir, **args}.items()))
    got = other.loglikelihood(requests(pairs))
    for (context, continuation), (score, _) in zip(pairs, got):
        ref, _ = forward_score(lm.run.model, *token_pair(context, continuation), rounds=rounds)
        assert score == pytest.approx(ref, abs=1e-4), (args, context)
    if rounds != 3:
        assert all(abs(a[0] - b[0]) > 1e-3 for a, b in zip(got, lm.loglikelihood(requests(pairs))))


def test_model_args_and_registration(run_dir, monkeypatch):
    """model_args win over lm-eval's own keywords; lm-eval's default cuda:0 falls back to cpu
    without CUDA; a typo is a UserError; "looplm" resolves to the class, also through the entry point."""
    import importlib.metadata as md

    from lm_eval.api.registry import Registry, get_model, model_registry

    import looplm.lm_eval as mod

    lm = LoopLM.create_from_arg_string(f"run={run_dir},batch_size=5,rounds=2",
                                       {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"})
    assert lm.batch_size == 5 and lm.engine.rounds == 2
    assert lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert lm.get_model_info()["exit"] == "fixed:2"
    with pytest.raises(UserError, match="round"):
        LoopLM.create_from_arg_string(f"run={run_dir},round=2")
    with pytest.raises(UserError, match="run=DIR"):
        LoopLM.create_from_arg_obj({})
    assert get_model("looplm") is LoopLM and "hf" in model_registry        # lm-eval's own models stay listed
    (ep,) = [e for e in md.entry_points(group="lm_eval.models") if e.name == "looplm"]
    fresh = Registry("model")                          # as an lm-eval that reads the entry points fills it
    fresh.register("looplm", target=ep)
    monkeypatch.setattr(mod, "model_registry", fresh)
    mod._register()                                    # leaves the entry point alone (replacing it would raise)
    assert fresh.get("looplm") is LoopLM


def test_the_command_line_runs_lm_eval_on_the_example_tasks(lm, run_dir, tasks, tmp_path):
    """`python -m looplm.lm_eval`: lm-eval's CLI with the model registered writes results equal to
    this module's scores: next-byte accuracy from loglikelihood, bits per byte from the rolling sums."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "looplm.lm_eval", "--model", "looplm", "--model_args", f"run={run_dir},batch_size=8",
         "--tasks", "looplm_next_bytes,looplm_val_bpb", "--include_path", str(tasks), "--limit", "2",
         "--output_path", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    results = json.loads(path.read_text())["results"]
    questions = [json.loads(line) for line in (tasks / "data.jsonl").read_text().splitlines()][:2]
    hits = 0
    for q in questions:
        scores = lm.loglikelihood(requests([(q["context"], c) for c in q["choices"]]))
        hits += max(range(len(scores)), key=lambda i: scores[i][0]) == q["label"]
    assert results["looplm_next_bytes"]["acc,none"] == pytest.approx(hits / len(questions))
    docs = [json.loads(line)["text"] for line in (tasks / "docs.jsonl").read_text().splitlines()][:2]
    totals = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)])
    bpb = -sum(totals) / sum(len(d.encode()) for d in docs) / math.log(2)
    assert results["looplm_val_bpb"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-5)
