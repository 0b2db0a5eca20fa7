"""Whether a task accuracy is above what guessing gets: the chance level a task's answers and prompts allow,
computed from the examples, and a one-sided exact test of the hits against it.

The guesser. It knows the task's answer set A (every answer among the examples scored) and reads the prompt:
it picks uniformly among the members of A the prompt contains (as text), or among all of A when the prompt
contains none of them or not the answer. So an example's chance is 1 / |{a in A : a occurs in its prompt}|
when its answer occurs there, else 1 / |A|. On a pointer chase whose values are digits this is
"guessing among the prompt's digits"; on the built-in chain, among the names the prompt holds. It is a
generous guesser (a substring counts), so "above chance" is a conservative verdict.

The test. The hits of n examples with chances p_1..p_n under guessing follow a Poisson-binomial
distribution; the p-value of k hits is P(X >= k), computed exactly (a dynamic program over the examples,
float64). Above chance: p < ALPHA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ALPHA = 0.01
"""The one-sided level at which an accuracy counts as above chance."""


def chance_levels(prompts: Sequence[str], answers: Sequence[str], answer_set: Sequence[str] | None = None
                  ) -> list[float]:
    """Each example's chance of exact match by the guesser of the module docstring; `answer_set` defaults to
    the distinct answers given."""
    pool = sorted(set(answer_set if answer_set is not None else answers))
    if not pool:
        return []
    out = []
    for prompt, answer in zip(prompts, answers):
        seen = [a for a in pool if a and a in prompt]
        out.append(1.0 / len(seen) if answer in seen else 1.0 / len(pool))
    return out


def tail_probability(chances: Sequence[float], hits: int) -> float:
    """P(X >= hits) for X the number of successes of independent trials with these probabilities (exact)."""
    dist = [1.0]                                             # dist[k] = P(k successes so far)
    for p in chances:
        nxt = [0.0] * (len(dist) + 1)
        for k, q in enumerate(dist):
            nxt[k] += q * (1.0 - p)
            nxt[k + 1] += q * p
        dist = nxt
    return min(1.0, max(0.0, sum(dist[max(0, hits):])))


def verdict(chances: Sequence[float], accuracy: float) -> dict[str, Any]:
    """{"chance": the mean chance, "accuracy", "hits", "p_value", "above_chance"} for an exact-match accuracy
    over examples with these chances."""
    n = len(chances)
    hits = round(accuracy * n)
    p = tail_probability(chances, hits) if n else 1.0
    return {"chance": sum(chances) / n if n else 0.0, "accuracy": accuracy, "hits": hits, "p_value": p,
            "above_chance": bool(n and p < ALPHA)}


def chance_by_difficulty(eval_sets: dict[int, list[Any]], accuracy: dict[int, dict[int, float]]
                         ) -> dict[int, dict[str, Any]]:
    """difficulty -> {"chance", "examples", "by_rounds": rounds -> verdict}: each difficulty's examples
    (`Example`s: prompt, answer) against the answer set of every example scored, and its accuracy at each
    depth (accuracy: difficulty -> rounds -> exact match)."""
    every = [ex.answer for exs in eval_sets.values() for ex in exs]
    out = {}
    for d, exs in sorted(eval_sets.items()):
        ch = chance_levels([ex.prompt for ex in exs], [ex.answer for ex in exs], every)
        out[d] = {"chance": sum(ch) / len(ch) if ch else 0.0, "examples": len(ch),
                  "by_rounds": {r: verdict(ch, a) for r, a in sorted(accuracy.get(d, {}).items())}}
    return out


def chance_markdown(table: dict[int, dict[str, Any]]) -> str:
    """The recipe card's paragraph: chance per difficulty, and whether the run learned anything measurable."""
    lines = [f"| difficulty | chance (%) | above chance (p < {ALPHA:g}) at rounds |", "|---:|---:|---|"]
    any_above = False
    for d, row in sorted(table.items()):
        above = [r for r, v in row["by_rounds"].items() if v["above_chance"]]
        any_above = any_above or bool(above)
        lines.append(f"| {d} | {100 * row['chance']:.0f} | {', '.join(map(str, above)) or 'none'} |")
    head = ("Chance: a guesser that picks uniformly among the answers its prompt contains (the answers of every "
            "example scored; evaluation/chance.py), tested one-sided and exactly against the hits.")
    if not any_above:
        head += (" **This run learned nothing measurable: no difficulty is above chance at any depth evaluated.** "
                 "The accuracy table above is guessing.")
    return head + "\n\n" + "\n".join(lines)
