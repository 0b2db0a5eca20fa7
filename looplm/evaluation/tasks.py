"""Task evaluation: exact-match accuracy and answer-token loss by difficulty x rounds.

The one scoring path for task runs: the trainer's report (`task_report`), `looplm eval` on a task
run (with or without `--data FILE.jsonl`), the extrapolation experiment and early exit on task
examples all go through `score_task_sets` / `evaluate_examples_exit`. Answers decoded by the cached
engine in a feedback model's prompt modes (`looplm eval --prompt-mode`, benchmarks/feedback_probes.py)
go through `prompt_mode_accuracy`.
"""

from __future__ import annotations

import time
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..data.tasks import ANSWER_END, SEPARATOR, Example
from ..data.taskdata import TaskSampler, TaskSource, encode_examples, format_for_training
from ..errors import UserError
from ..model.losses import token_losses
from ..recipe.config import Recipe

def logits_by_rounds(model: torch.nn.Module, x: torch.Tensor, rounds_list: list[int],
                     at: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """round -> (B, T, V) logits, or (N, V) at the N True positions of `at` (B, T) bool (row-major, as
    `tensor[at]` orders them). A looped model reads every round out of one forward pass at the largest
    depth (a fixed generator keeps a random initial state reproducible), with the head at `at` alone
    (LoopedLM's readout_at, LSTMLM's at); a model without rounds (the LSTM) gives the same logits for
    every entry."""
    from ..model.looped import LoopedLM
    from ..model.lstm import LSTMLM

    param = next(model.parameters(), None)  # a model without parameters (a test's table) stays where x is
    if param is not None:
        x = x.to(param.device)
        at = None if at is None else at.to(param.device)
    if isinstance(model, LoopedLM):
        out = model(x, max(rounds_list), readout_rounds=tuple(rounds_list),
                    generator=torch.Generator().manual_seed(0), readout_at=at)
        return out.round_logits
    if at is None:
        logits = model(x)
    else:
        logits = model(x, at=at) if isinstance(model, LSTMLM) else model(x)[at]
    return {r: logits for r in rounds_list}


@torch.no_grad()
def _score(model: torch.nn.Module, tok: Any, examples: list[Example], rounds_list: list[int],
           batch_size: int, separator: bool, contrast: tuple[int, float] | None = None
           ) -> tuple[dict[int, int], dict[int, float], int]:
    """(exact matches, summed answer-token loss) by rounds, and the answer tokens scored. contrast (r, beta):
    score the LoopCD logits z_R + beta (z_R - z_r) at every R of rounds_list (each > r) instead of z_R; per
    token only where the readout is (a model without a coda). Logits are read out at the answer tokens only."""
    model.eval()
    correct = {r: 0 for r in rounds_list}
    loss_sum = {r: 0.0 for r in rounds_list}
    tokens = 0
    context = getattr(getattr(model, "cfg", None), "context", None)
    for i in range(0, len(examples), batch_size):
        b = encode_examples(tok, examples[i:i + batch_size], context, separator)
        by_round = logits_by_rounds(model, b.x, sorted(set(rounds_list) | ({contrast[0]} if contrast else set())),
                                    at=b.mask)
        if contrast is not None:
            from ..inference.engine import contrast_logits
            by_round = {r: contrast_logits(by_round[r], by_round[contrast[0]], contrast[1]) for r in rounds_list}
        rows = b.mask.nonzero()[:, 0]                           # (N,) the example of each answer token
        for r in rounds_list:
            logits = by_round[r]                                # (N, V)
            y, rows_r = b.y[b.mask].to(logits.device), rows.to(logits.device)
            wrong = torch.zeros(len(b.x), dtype=torch.long, device=logits.device)
            wrong.index_add_(0, rows_r, (logits.argmax(-1) != y).long())
            correct[r] += int((wrong == 0).sum())
            loss_sum[r] += token_losses(logits, y).sum().item()
        tokens += int(b.mask.sum())
    return correct, loss_sum, tokens


def _rates(correct: dict[int, int], loss_sum: dict[int, float], n: int, tokens: int) -> dict[int, dict[str, float]]:
    return {r: {"accuracy": correct[r] / max(1, n), "loss": loss_sum[r] / max(1, tokens)} for r in correct}


def evaluate_examples(model: torch.nn.Module, tok: Any, examples: list[Example], rounds_list: list[int],
                      batch_size: int = 64, separator: bool = True) -> dict[int, dict[str, float]]:
    """rounds -> {"accuracy": exact match, "loss": mean answer-token loss} over `examples`."""
    correct, loss_sum, tokens = _score(model, tok, examples, rounds_list, batch_size, separator)
    return _rates(correct, loss_sum, len(examples), tokens)


def score_task_sets(model: torch.nn.Module, tok: Any, eval_sets: dict[int, list[Example]], rounds_list: list[int],
                    batch_size: int = 64, separator: bool = True,
                    contrast: tuple[int, float] | None = None) -> dict[str, Any]:
    """The task evaluation of the trainer's report and of `looplm eval` on a task run:
    {"rounds": rounds -> {"accuracy", "loss"} over every example (loss per answer token),
     "by_difficulty": difficulty -> rounds -> {"accuracy", "loss"},
     "examples": difficulty -> examples scored}."""
    by_level: dict[int, dict[int, dict[str, float]]] = {}
    correct = {r: 0 for r in rounds_list}
    loss_sum = {r: 0.0 for r in rounds_list}
    tokens = n = 0
    for d, exs in sorted(eval_sets.items()):
        c, ls, t = _score(model, tok, exs, rounds_list, batch_size, separator, contrast)
        by_level[d] = _rates(c, ls, len(exs), t)
        for r in rounds_list:
            correct[r] += c[r]
            loss_sum[r] += ls[r]
        tokens, n = tokens + t, n + len(exs)
    return {"rounds": _rates(correct, loss_sum, n, tokens), "by_difficulty": by_level,
            "examples": {d: len(exs) for d, exs in sorted(eval_sets.items())}}


@torch.no_grad()
def evaluate_examples_exit(model: torch.nn.Module, tok: Any, examples: list[Example], policy: Any, rounds: int,
                           batch_size: int = 64, separator: bool = True,
                           missing: str = "copy_forward") -> dict[str, float]:
    """Exact match and answer loss under a per-token exit policy, with the rounds it used.

    The prompt runs all `rounds` rounds (as a prefill would); the positions that predict answer
    tokens (the prompt's last token and the answer's) exit by the policy, and the rounds after
    their exit are not computed (inference.early_exit). mean_rounds averages over those positions,
    mean_rounds_first_token over the positions that predict the answer's first token; wall_time_s
    times the early-exit forward passes."""
    from ..inference.early_exit import early_exit

    model.eval()
    correct, loss_sum, tokens, used, used_first, wall = 0, 0.0, 0, 0, 0, 0.0
    device = next(model.parameters()).device
    for i in range(0, len(examples), batch_size):
        b = encode_examples(tok, examples[i:i + batch_size], getattr(model.cfg, "context", None), separator)
        b = dataclasses.replace(b, **{f: getattr(b, f).to(device) for f in ("x", "y", "mask")})
        t0 = time.perf_counter()
        out = early_exit(model, b.x, policy, rounds, generator=torch.Generator().manual_seed(0), may_exit=b.mask,
                         missing=missing)
        wall += time.perf_counter() - t0
        hit = (out.logits.argmax(-1) == b.y) | ~b.mask                          # (B, T)
        correct += int(hit.all(-1).sum())
        loss_sum += token_losses(out.logits, b.y, b.mask).sum().item()
        tokens += int(b.mask.sum())
        used += int(out.rounds_used[b.mask].sum())
        first = torch.tensor([p - 1 for p in b.prompt_lens])                    # predicts the answer's first token
        used_first += int(out.rounds_used[torch.arange(len(first)), first].sum())
    n = max(1, len(examples))
    return {"accuracy": correct / n, "loss": loss_sum / max(1, tokens), "mean_rounds": used / max(1, tokens),
            "mean_rounds_first_token": used_first / n, "wall_time_s": wall}


def accuracy_table(model: torch.nn.Module, tok: Any, eval_sets: dict[int, list[Example]],
                   rounds_list: list[int], batch_size: int = 64,
                   separator: bool = True) -> dict[int, dict[int, dict[str, float]]]:
    """difficulty -> rounds -> {"accuracy", "loss"} (score_task_sets's by_difficulty)."""
    return score_task_sets(model, tok, eval_sets, rounds_list, batch_size, separator)["by_difficulty"]


@torch.no_grad()
def greedy_answers(model: torch.nn.Module, tok: Any, prompts: list[str], rounds: int | None = None,
                   max_new_tokens: int = 16, batch_size: int = 64, separator: bool = True,
                   prompt_mode: str | None = None) -> list[str]:
    """Greedy answers to prompts (the separator is appended here unless separator=False), each up to its newline.

    Without a prompt_mode this is the slow reference: every token from a whole forward pass over the
    rows so far. With one (standard, soft or fused) the cached engine decodes them in that prompt mode
    at a fixed depth, as a served feedback model answers: soft and fused feedback is carried from token
    to token, which no plain forward pass reproduces. Either way the answer is read off the generated
    tokens by the same rule (up to the first newline token)."""
    model.eval()
    newline = tok.encode(ANSWER_END)
    if len(newline) != 1:
        raise UserError("greedy_answers needs a tokenizer that encodes the newline as one token")
    r = rounds if rounds is not None else getattr(model, "nominal_rounds", 1)
    ids = [tok.encode(p + (SEPARATOR if separator else "")) for p in prompts]
    out: list[list[int]] = []
    if prompt_mode is not None:
        from ..inference import SamplingParams
        # the newline stop ends a row on the token the rule below cuts at; eos does not end it, as it
        # does not end the reference's rows
        sp = SamplingParams(max_new_tokens=max_new_tokens, stop=(ANSWER_END,), stop_at_eos=False,
                            prompt_mode=prompt_mode)
        engine = answer_engine(model, tok, r)
        for start in range(0, len(ids), batch_size):
            out += [c.tokens for c in engine.generate(ids[start:start + batch_size], sp)]
    else:
        for start in range(0, len(ids), batch_size):
            out += _greedy_by_forward(model, ids[start:start + batch_size], r, max_new_tokens, tok.eos_id, newline[0])
    return [tok.decode(o[:-1] if o and o[-1] == newline[0] else o) for o in out]


def _greedy_by_forward(model: torch.nn.Module, ids: list[list[int]], rounds: int, max_new_tokens: int, eos: int,
                       newline: int) -> list[list[int]]:
    """Each row's greedy tokens, up to and including its newline, by whole forward passes.

    Rows are right-padded; each row's next token is read at its own last position, which
    causal attention makes independent of the padding after it."""
    B, lens = len(ids), torch.tensor([len(i) for i in ids])
    buf = torch.full((B, int(lens.max()) + max_new_tokens), eos, dtype=torch.long)
    for i, row in enumerate(ids):
        buf[i, :len(row)] = torch.tensor(row)
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool)
    for _ in range(max_new_tokens):
        T = int(lens.max())
        logits = logits_by_rounds(model, buf[:, :T], [rounds])[rounds]  # (B, T, V)
        nxt = logits[torch.arange(B), lens - 1].argmax(-1).cpu()     # (B,)
        for i in range(B):
            if done[i]:
                continue
            out[i].append(int(nxt[i]))
            buf[i, lens[i]] = nxt[i]
            lens[i] += 1
            done[i] = int(nxt[i]) == newline
        if bool(done.all()):
            break
    return out


def answer_engine(model: torch.nn.Module, tok: Any, rounds: int | None = None, modes: Sequence[str] = ()) -> Any:
    """The cached engine answers are decoded by, at a fixed depth of `rounds` (a feedback model decodes at
    no other; default the model's nominal depth). Each of `modes` is checked against the model before any
    decoding, as `looplm generate` checks it (Engine.prompt_mode: a mode the model lacks is refused)."""
    from ..inference import Engine, GenerationConfig, SamplingParams
    engine = Engine(model, tok, GenerationConfig(rounds=rounds))
    for mode in modes:
        engine.prompt_mode(SamplingParams(prompt_mode=mode))
    return engine


def prompt_mode_accuracy(model: torch.nn.Module, tok: Any, eval_sets: dict[int, list[Example]], modes: list[str],
                         rounds: int | None = None, batch_size: int = 64,
                         separator: bool = True) -> dict[str, dict[int, float]]:
    """mode -> difficulty -> exact match of the greedy answers the cached engine decodes in that prompt
    mode (greedy_answers), at a fixed depth of `rounds` (default the model's nominal depth).

    A feedback model's teacher-forced accuracy (score_task_sets) is its plain pass's; how it answers
    with feedback carried from token to token is only seen by decoding. Every mode is checked before
    any decoding (answer_engine)."""
    engine = answer_engine(model, tok, rounds, modes)
    out: dict[str, dict[int, float]] = {}
    for mode in modes:
        out[mode] = {}
        for d, exs in sorted(eval_sets.items()):
            # a right answer is its own tokens and the newline; decoding further cannot make a wrong one right
            budget = max((len(tok.encode(format_for_training(ex, separator)[1])) for ex in exs), default=1)
            got = greedy_answers(model, tok, [ex.prompt for ex in exs], engine.rounds, budget, batch_size,
                                 separator, prompt_mode=mode)
            out[mode][d] = sum(g == ex.answer for g, ex in zip(got, exs)) / max(1, len(exs))
    return out


def prompt_tokens_by_difficulty(tok: Any, eval_sets: dict[int, list[Example]],
                                separator: bool = True) -> dict[int, float]:
    """Mean prompt tokens per difficulty (the length dial, reported apart from difficulty)."""
    return {d: sum(len(tok.encode(format_for_training(ex, separator)[0])) for ex in exs) / max(1, len(exs))
            for d, exs in eval_sets.items()}


def markdown_table(table: dict[int, dict[Any, float]], corner: str = "difficulty \\ rounds",
                   columns: list[Any] | None = None) -> str:
    """difficulty -> rounds -> accuracy as a Markdown table (percent); `columns`: other column keys in
    the order given (prompt modes), instead of the rounds sorted."""
    rounds = columns if columns is not None else sorted({r for row in table.values() for r in row})
    lines = [f"| {corner} | " + " | ".join(str(r) for r in rounds) + " |",
             "|---:|" + "---:|" * len(rounds)]
    for d, row in sorted(table.items()):
        cells = [f"{100 * row[r]:.0f}" if r in row else "" for r in rounds]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def task_report(model: torch.nn.Module, recipe: Recipe, sampler: TaskSampler, source: TaskSource,
                rounds_list: list[int]) -> dict[str, Any]:
    """The trainer's report fields for task data: answer loss and exact match by rounds, the
    accuracy table by difficulty x rounds (with prompt lengths reported apart), and which
    difficulties were trained and evaluated, with examples per difficulty."""
    eval_sets = source.eval_sets(recipe.data.eval_examples)
    sep = recipe.data.separator
    scores = score_task_sets(model, sampler.tok, eval_sets, rounds_list, separator=sep)
    overall = scores["rounds"]
    acc = {d: {r: v["accuracy"] for r, v in row.items()} for d, row in scores["by_difficulty"].items()}
    lengths = prompt_tokens_by_difficulty(sampler.tok, eval_sets, sep)
    difficulties = {
        "trained": source.train_levels,
        "evaluated": sorted(eval_sets),
        "train_examples": None if source.train_counts is None else {str(d): n for d, n in source.train_counts.items()},
        "eval_examples": {str(d): n for d, n in scores["examples"].items()},
        "unused_examples": {str(d): n for d, n in source.unused_counts.items()},
        # a JSONL file with length dials: the training lines they allow, by difficulty and length
        **({"train_length_counts": {str(d): {str(n): c for n, c in sorted(b.items())}
                                    for d, b in source.train_length_counts.items()}}
           if getattr(source, "train_length_counts", None) else {}),
    }
    if source.builtin:
        trained = (f"trained on difficulties {source.train_levels[0]}..{source.train_levels[-1]} (fresh examples "
                   f"every batch)")
    else:
        trained = ("trained on the file's lines by difficulty: " + ", ".join(f"{d}: {n}" for d, n in
                                                                            source.train_counts.items())
                   if source.levelled else f"the file gives no difficulties (every line reads as 0); trained on "
                                           f"{sum(source.train_counts.values())} of its lines")
        if getattr(source, "train_length_counts", None):
            unit = recipe.data.length_unit
            trained += ("; by prompt length in " + unit + " (lines): " + "; ".join(
                f"{d}: " + ", ".join(f"{n}: {c}" for n, c in sorted(b.items()))
                for d, b in source.train_length_counts.items()))
        c = sampler.crop_counts
        if c["lines"]:
            trained += (f"; data.crop_curriculum = {recipe.data.crop_curriculum} cut {c['lines']} training lines, "
                        f"which kept {c['kept']} of their {c['spare']} unneeded statements "
                        f"({100 * c['kept'] / max(1, c['spare']):.0f}%; the others were dropped)")
        if source.unused_counts:
            trained += ("; lines outside the trained and evaluated difficulties, unused: "
                        + ", ".join(f"{d}: {n}" for d, n in source.unused_counts.items()))
    note = (f"Task `{recipe.data.task}`, exact match (%) on held-out examples by difficulty ("
            + ", ".join(f"{d}: {n}" for d, n in scores["examples"].items()) + f"); {trained}. "
            f"Prompt length: {'as in the file' if source.length is None else f'{source.length} items'}; mean prompt "
            f"tokens by difficulty: " + ", ".join(f"{d}: {n:.0f}" for d, n in lengths.items()) + ".")
    from .chance import chance_by_difficulty, chance_markdown
    chance = chance_by_difficulty(eval_sets, acc)          # is each accuracy above what guessing gets?
    report = {
        "val": {r: {"loss": v["loss"]} for r, v in overall.items()},
        "val_accuracy_by_rounds": {str(r): v["accuracy"] for r, v in overall.items()},
        "task": recipe.data.task,
        "task_accuracy": {str(d): {str(r): a for r, a in row.items()} for d, row in acc.items()},
        "task_difficulties": difficulties,
        "prompt_length_items": source.length,
        **({"crop_counts": dict(sampler.crop_counts)} if sampler.crop_counts["lines"] else {}),
        "prompt_tokens_by_difficulty": {str(d): n for d, n in lengths.items()},
        "train_data_tokens": source.train_token_count() or sampler.unique_tokens(),
        "task_chance": {str(d): {"chance": row["chance"], "examples": row["examples"],
                                 "by_rounds": {str(r): v for r, v in row["by_rounds"].items()}}
                        for d, row in chance.items()},
        "task_learned": any(v["above_chance"] for row in chance.values() for v in row["by_rounds"].values()),
        "sections": [{"title": "Task accuracy by difficulty x rounds", "markdown": note + "\n\n" + markdown_table(acc)
                      + "\n\n" + chance_markdown(chance)}],
    }
    if recipe.data.depth_by_difficulty:  # the recipe card's depth/supervision lines are overridden
        report["sections"].insert(0, {"title": "Depth by difficulty", "markdown": (
            "data.depth_by_difficulty is on: each micro-batch held one difficulty d, ran a number of rounds drawn "
            + ("uniformly from max(d + 1, depth.min)..depth.max (an untied model: its fixed depth), and supervised "
               "every round with equal weights, round 1 on the name the prompt asks about, round r + 1 < d + 1 on "
               "the example's trace (the intermediate result after r steps), and the final round and rounds from "
               "d + 1 on on the answer" if recipe.data.round_targets == "query_trace" else
               "uniformly from max(d, depth.min)..depth.max (an untied model: its fixed depth), and supervised "
               + ("every round with equal weights, round r < d on the example's trace (the intermediate result after "
                  "r steps) and the final round and rounds from d on on the answer"
                  if recipe.data.round_targets == "trace" else "every round from d on with equal weights"))
            + ". The sampled-depth and supervised-round histograms above count what actually ran.")})
    return report
