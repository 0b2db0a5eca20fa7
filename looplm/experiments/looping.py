"""`looplm experiment looping RUN`: training-free looping of an imported pretrained model, measured.

A pretrained stack of L layers is re-cut at every span I:J asked for (layers 0..I-1 the prelude, I..J-1 the
shared core, J..L-1 the coda: `relayout`, the same module objects, no copy) and run at `--rounds` rounds
with every round update asked for (model.round_update: plain repetition, damped steps s <- s + eta
(core(s) - s), Euler sub-steps of each layer). Each setting is scored two ways against the unlooped model
(one round, which is the pretrained stack exactly):

- held-out text: the mean next-token loss over windows of English prose (Python's own reference manual,
  `pydoc_data.topics`, in every Python install; or --data);
- a multiple-choice task: cloze questions cut from the same prose (which of four endings completes the
  sentence; three endings come from other sentences), scored as lm-eval scores multiple choice: the summed
  log-likelihood of each ending after the context, the likeliest chosen (acc).

Both sets are split in two: the best setting is chosen on the selection half and reported on the
confirmation half, as a paired difference against one round with its spread over bootstrap resamples of
the confirmation windows / questions (so "better" means better on data the choice never saw). The
heatmaps show every setting's difference on the selection half.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError


# ----------------------------------------------------------------------------- data

def reference_prose() -> str:
    """Python's reference manual as plain text (pydoc_data.topics: every install has it; the model was not
    tuned on this split of it, which is all held-out text needs)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise UserError("pydoc_data (Python's reference manual) is missing from this Python; pass --data FILE") from None
    return "\n\n".join(topics[k] for k in sorted(topics))


def text_windows(tokenizer: Any, text: str, n: int, length: int) -> torch.Tensor:
    """(2n, length + 1) token windows spread evenly over `text` (the first n: selection, the rest: confirmation)."""
    ids = tokenizer.encode(text)
    need = 2 * n * (length + 1)
    if len(ids) < need:
        raise UserError(f"held-out text: {len(ids)} tokens, {need} needed for 2 x {n} windows of {length + 1}")
    step = len(ids) // (2 * n)
    return torch.tensor([ids[i * step: i * step + length + 1] for i in range(2 * n)])


_SENTENCE = re.compile(r"(?<=[.!?] )[A-Z][a-z][^.!?]{60,200}[.!?](?= [A-Z])")
"""A sentence of prose: begins after another's end with a capitalised word, ends before the next."""


def cloze_questions(text: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n four-way cloze questions from `text`: a sentence's first words as the context, its real ending and
    three endings of other sentences (of similar length) as the choices; the answer's place is shuffled."""
    flat = " ".join(text.split())                      # paragraphs' line breaks are not sentence ends
    sentences = sorted(s for s in set(_SENTENCE.findall(flat)) if not re.search(r"[=*_`{}<>|\[\]]|\s{2}", s))
    rng = random.Random(seed)
    rng.shuffle(sentences)
    cut = []
    for s in sentences:
        words = s.split(" ")
        if len(words) >= 12:
            k = len(words) // 2
            cut.append((" ".join(words[:k]), " " + " ".join(words[k:])))
    if len(cut) < n + 3:
        raise UserError(f"multiple-choice questions: the text holds {len(cut)} usable sentences, {n + 3} needed")
    questions = []
    for i in range(n):
        ctx, right = cut[i]
        pool = sorted((c for j, c in enumerate(cut) if j != i), key=lambda c: abs(len(c[1]) - len(right)))
        wrong = [c[1] for c in rng.sample(pool[:40], 3)]
        choices = wrong + [right]
        rng.shuffle(choices)
        questions.append({"context": ctx, "choices": choices, "answer": choices.index(right)})
    return questions


CLOZE_TASK = """task: looplm_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
"""The cloze questions as an lm-eval task (each choice begins with its space, so no delimiter is added)."""


def write_lm_eval_task(out: Path, questions: list[dict[str, Any]]) -> Path:
    """OUT/data.jsonl and OUT/looplm_cloze.yaml: `lm_eval --tasks looplm_cloze --include_path OUT` scores any
    model on the same questions (looplm's through `python -m looplm.lm_eval --model looplm`, or lm-eval's hf)."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions))
    (out / "looplm_cloze.yaml").write_text(CLOZE_TASK.format(data=json.dumps(str(data.resolve()))))
    return out


# ----------------------------------------------------------------------------- models

def pretrained_layers(run: Any) -> int:
    """The number of pretrained layers of an import kept whole at one round (every block one layer)."""
    import json as _json
    rec = run.path / "import.json"
    if not rec.is_file():
        raise UserError(f"{run.path}: not a `looplm import`ed run (no import.json); the looping sweep re-cuts a "
                        "pretrained stack")
    info = _json.loads(rec.read_text())
    if info.get("dropped") or info.get("core_blocks") != len(info.get("core", [])):
        raise UserError(f"{run.path}: an import with dropped or averaged layers; import with every layer kept "
                        "(the default layout)")
    return int(info["layers"])


def relayout(model: Any, span: tuple[int, int], **fields: Any) -> Any:
    """The same pretrained blocks cut at span I:J (prelude = blocks before I, core = I..J-1, coda = the rest)
    with model fields `fields` (round_update, ...): a new LoopedLM whose modules are `model`'s own (no copy)."""
    from ..model.looped import LoopedLM
    blocks = [*model.prelude, *model.core, *model.coda]
    i, j = span
    if not 0 <= i < j <= len(blocks):
        raise UserError(f"span {i}:{j}: must satisfy 0 <= I < J <= {len(blocks)}")
    cfg = replace(model.cfg, n_prelude=i, n_core=j - i, n_coda=len(blocks) - j, **fields)
    with torch.device("meta"):             # the shell only: every module and table is the model's own
        new = LoopedLM(cfg, model.nominal_rounds)
    new.embed, new.final_norm, new.head = model.embed, model.final_norm, model.head
    new.prelude = torch.nn.ModuleList(blocks[:i])
    new.core = torch.nn.ModuleList(blocks[i:j])
    new.coda = torch.nn.ModuleList(blocks[j:])
    for name, buf in model.named_buffers(recurse=False):
        setattr(new, name, buf)
    left = [n for n, t in [*new.named_parameters(), *new.named_buffers()] if t.is_meta]
    if left:
        raise UserError(f"relayout: {left[:3]} have no pretrained value (a model with extra parts)")
    return new.eval()


# ----------------------------------------------------------------------------- scoring

@torch.no_grad()
def window_losses(model: Any, windows: torch.Tensor, rounds: int, batch: int = 4) -> torch.Tensor:
    """(N,) mean next-token loss of each window at `rounds` rounds (whole-sequence forwards)."""
    from ..model.losses import token_losses
    out = []
    device = next(model.parameters()).device
    for w in windows.split(batch):
        w = w.to(device)
        logits = model(w[:, :-1], rounds=rounds).logits
        out.append(token_losses(logits, w[:, 1:]).mean(1))
    return torch.cat(out).cpu()


@torch.no_grad()
def choice_logprobs(model: Any, tokenizer: Any, questions: list[dict[str, Any]], rounds: int,
                    batch: int = 32) -> list[list[float]]:
    """Each question's choices' summed log-likelihoods after its context (lm-eval's loglikelihood request),
    every (context + choice) row of several questions in one right-padded forward (causal: padding after a
    row's tokens changes none of them)."""
    rows = []                                   # (question, context ids, choice ids)
    limit = model.cfg.context
    for qi, q in enumerate(questions):
        ctx = tokenizer.encode(q["context"])
        for c in q["choices"]:
            k = tokenizer.encode(c)
            if len(k) >= limit:
                raise UserError(f"a choice of {len(k)} tokens does not fit the model's context of {limit}")
            rows.append((qi, ctx[-(limit - len(k)):], k))     # the context cut from the left, as lm-eval does
    out: list[list[float]] = [[] for _ in questions]
    device = next(model.parameters()).device
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        width = max(len(c) + len(k) for _, c, k in part)
        ids = torch.tensor([c + k + [0] * (width - len(c) - len(k)) for _, c, k in part])
        at = torch.zeros(ids.shape, dtype=torch.bool)           # the positions that predict a choice's tokens
        for r, (_, c, k) in enumerate(part):
            at[r, len(c) - 1: len(c) - 1 + len(k)] = True
        logits = model(ids.to(device), rounds=rounds, readout_at=at.to(device)).logits
        logp = torch.log_softmax(logits.float(), -1).cpu()                                       # (N, V)
        targets = torch.cat([torch.tensor(k) for _, _, k in part])
        picked = logp[torch.arange(len(targets)), targets]
        for (qi, _, k), lp in zip(part, picked.split([len(k) for _, _, k in part])):
            out[qi].append(float(lp.sum()))
    return out


def mc_correct(model: Any, tokenizer: Any, questions: list[dict[str, Any]], rounds: int) -> torch.Tensor:
    """(N,) 1.0 where the likeliest choice is the answer."""
    scores = choice_logprobs(model, tokenizer, questions, rounds)
    return torch.tensor([float(max(range(len(lp)), key=lp.__getitem__) == q["answer"])
                         for lp, q in zip(scores, questions)])


def bootstrap(diff: torch.Tensor, resamples: int = 1000, seed: int = 0) -> dict[str, float]:
    """Mean of paired differences and its spread: the std and the 2.5 / 97.5 % points over resamples."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(diff), (resamples, len(diff)), generator=g)
    means = diff.double()[idx].mean(1)
    return {"mean": float(diff.double().mean()), "std": float(means.std()),
            "low": float(means.quantile(0.025)), "high": float(means.quantile(0.975)), "n": len(diff)}


# ----------------------------------------------------------------------------- the sweep

UPDATES = ("plain", "damped:0.25", "damped:0.5", "damped:0.75", "euler:2", "euler:3")


def parse_update(text: str) -> dict[str, Any]:
    """plain | damped:ETA | euler:K -> model fields."""
    kind, _, arg = text.partition(":")
    try:
        if kind == "plain" and not arg:
            return {"round_update": "plain"}
        if kind == "damped":
            return {"round_update": "damped", "round_eta": float(arg)}
        if kind == "euler":
            return {"round_update": "euler", "round_substeps": int(arg)}
    except ValueError:
        pass
    raise UserError(f"--updates {text!r}: expected plain, damped:ETA (0 < ETA <= 1) or euler:K (K >= 2)")


def parse_spans(text: str, layers: int) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            i, j = (int(x) for x in part.split(":"))
        except ValueError:
            raise UserError(f"--spans {part!r}: expected I:J (the half-open span of layers that loops)") from None
        if not 0 <= i < j <= layers:
            raise UserError(f"--spans {part}: must satisfy 0 <= I < J <= {layers}")
        out.append((i, j))
    return out


def default_spans(layers: int) -> list[tuple[int, int]]:
    """Six spans over the middle of the stack: four of a fifth of it at successive depths, a third, the
    middle half."""
    w = max(1, layers // 5)
    starts = [layers // 10 + k * w for k in range(4)]
    spans = [(s, min(s + w, layers)) for s in starts]
    spans += [(layers // 3, 2 * layers // 3), (layers // 4, 3 * layers // 4)]
    return sorted(set(spans))


def run_looping(run: Any, *, spans: list[tuple[int, int]], updates: list[str], rounds: int, windows: int,
                length: int, questions: int, text: str | None, say: Any = None) -> dict[str, Any]:
    """The sweep (see the module docstring): the result as one JSON-able dict."""
    import time
    say = say or (lambda msg: None)
    model, tok = run.model.eval(), run.tokenizer
    fields = {u: parse_update(u) for u in updates}
    prose = text if text is not None else reference_prose()
    win = text_windows(tok, prose, windows, length)
    qs = cloze_questions(prose, 2 * questions)
    sel_w, con_w, sel_q, con_q = win[:windows], win[windows:], qs[:questions], qs[questions:]
    t0 = time.perf_counter()
    base = {"selection": {"loss": window_losses(model, sel_w, 1), "acc": mc_correct(model, tok, sel_q, 1)},
            "confirmation": {"loss": window_losses(model, con_w, 1), "acc": mc_correct(model, tok, con_q, 1)}}
    say(f"one round: selection loss {base['selection']['loss'].mean():.4f}, acc {base['selection']['acc'].mean():.3f} "
        f"({time.perf_counter() - t0:.0f} s)")
    cells = []
    for span in spans:
        for u in updates:
            m = relayout(model, span, **fields[u])
            loss, acc = window_losses(m, sel_w, rounds), mc_correct(m, tok, sel_q, rounds)
            cells.append({"span": f"{span[0]}:{span[1]}", "update": u,
                          "loss": float(loss.mean()), "acc": float(acc.mean()),
                          "d_loss": float((loss - base["selection"]["loss"]).mean()),
                          "d_acc": float((acc - base["selection"]["acc"]).mean())})
            say(f"  span {span[0]}:{span[1]} {u}: d_loss {cells[-1]['d_loss']:+.4f}, d_acc {cells[-1]['d_acc']:+.3f} "
                f"({time.perf_counter() - t0:.0f} s)")
    best = {"loss": min(cells, key=lambda c: c["d_loss"]), "acc": max(cells, key=lambda c: (c["d_acc"], -c["d_loss"]))}
    confirmed = {}
    for metric, cell in best.items():
        span = tuple(int(x) for x in cell["span"].split(":"))
        m = relayout(model, span, **fields[cell["update"]])
        if metric == "loss":
            got = window_losses(m, con_w, rounds)
            diff = got - base["confirmation"]["loss"]
        else:
            got = mc_correct(m, tok, con_q, rounds)
            diff = got - base["confirmation"]["acc"]
        better = cell[f"d_{metric}"] < 0 if metric == "loss" else cell[f"d_{metric}"] > 0
        confirmed[metric] = {"span": cell["span"], "update": cell["update"], "selection_delta": cell[f"d_{metric}"],
                             "beats_one_round_on_selection": better,
                             "value": float(got.mean()), "base": float(base["confirmation"][metric].mean()),
                             "delta": bootstrap(diff)}
    return {"questions": {"selection": sel_q, "confirmation": con_q},
            "rounds": rounds, "layers": len([*model.prelude, *model.core, *model.coda]),
            "text": {"windows_per_split": windows, "tokens_per_window": length,
                     "source": "pydoc_data.topics" if text is None else "--data"},
            "questions_per_split": questions,
            "base": {split: {"loss": float(v["loss"].mean()), "acc": float(v["acc"].mean())} for split, v in base.items()},
            "cells": cells, "best": confirmed, "wall_time_s": time.perf_counter() - t0}


def write_heatmap(out: Path, result: dict[str, Any]) -> str:
    """heatmap.png: the selection half's change against one round, per span x update (loss; accuracy)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = result["cells"]
    spans = list(dict.fromkeys(c["span"] for c in cells))
    updates = list(dict.fromkeys(c["update"] for c in cells))
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.3 * len(updates) * 2, 1.2 + 0.5 * len(spans)))
    for ax, key, title, cmap in ((axes[0], "d_loss", "held-out loss change (nats)", "RdBu_r"),
                                 (axes[1], "d_acc", "cloze accuracy change", "RdBu")):
        grid = torch.tensor([[next(c[key] for c in cells if c["span"] == s and c["update"] == u) for u in updates]
                             for s in spans])
        lim = float(grid.abs().max()) or 1.0
        ax.imshow(grid.numpy(), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
        ax.set_xticks(range(len(updates)), updates, rotation=30, ha="right")
        ax.set_yticks(range(len(spans)), spans)
        ax.set_ylabel("looped span I:J")
        ax.set_title(f"{title}, {result['rounds']} rounds vs 1")
        for y in range(len(spans)):
            for x in range(len(updates)):
                ax.text(x, y, f"{grid[y, x]:+.3f}", ha="center", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "heatmap.png", dpi=110)
    plt.close(fig)
    return "heatmap.png"


def markdown(result: dict[str, Any], run: str) -> str:
    b = result["base"]
    lines = [f"# Training-free looping of {run}", "",
             f"{result['layers']} pretrained layers; each span looped for {result['rounds']} rounds. One round "
             f"(the pretrained stack): selection loss {b['selection']['loss']:.4f}, accuracy "
             f"{b['selection']['acc']:.3f}; confirmation loss {b['confirmation']['loss']:.4f}, accuracy "
             f"{b['confirmation']['acc']:.3f}.", "", "![heatmap](heatmap.png)", "",
             "| chosen by | span | update | selection change | confirmation change (mean, bootstrap 95%) |",
             "|---|---|---|---|---|"]
    for metric, c in result["best"].items():
        d = c["delta"]
        lines.append(f"| {metric} | {c['span']} | {c['update']} | {c['selection_delta']:+.4f} | "
                     f"{d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}] |")
    return "\n".join(lines) + "\n"


def summary_lines(result: dict[str, Any]) -> list[str]:
    out = []
    for metric, c in result["best"].items():
        d = c["delta"]
        out.append(f"best by {metric}: span {c['span']} {c['update']}: confirmation {metric} {c['value']:.4f} vs "
                   f"{c['base']:.4f} at one round ({d['mean']:+.4f}, 95% [{d['low']:+.4f}, {d['high']:+.4f}])"
                   + ("" if c["beats_one_round_on_selection"] else
                      f"; no setting beat one round on the selection split"))
    return out


def save(out: Path, result: dict[str, Any], run: str) -> dict[str, Any]:
    """OUT/result.json, heatmap.png, report.md and lm_eval_task/ (every question of both splits); the result
    without the questions (what --json prints)."""
    out.mkdir(parents=True, exist_ok=True)
    questions = result.pop("questions")
    write_lm_eval_task(out / "lm_eval_task", questions["selection"] + questions["confirmation"])
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    write_heatmap(out, result)
    (out / "report.md").write_text(markdown(result, run))
    return result
