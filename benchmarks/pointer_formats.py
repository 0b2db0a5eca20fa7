"""Pointer-chase JSONL files in surface forms drawn at random, so that a change to the extrapolation recipe is
tried on formats no one tuned it for (issue 42).

    python benchmarks/pointer_formats.py --seed 3 --out formats/ [--count 5] [--train 60000] [--eval 800]
    python benchmarks/pointer_formats.py --describe --seed 3
    python benchmarks/pointer_formats.py --issue --out formats/         # the issue's own file (below)
    python benchmarks/pointer_formats.py --seed 3 --run [--seeds 0,1,2] [--set key=value ...]
    python benchmarks/pointer_formats.py --issue --probe RUN [--difficulties 1,2,4]   # does RUN read the query?

`--issue` writes the format a user tried (issue 42): "k>p p>w w>3 ?k=", single lowercase names, digit
values, disjoint distractor chains padding every prompt to 10 links. `--run` writes the format's
task.jsonl (training lines 1..4 hops, held-out lines 5..8 hops in one file) and runs
`looplm experiment extrapolate --recipe extrapolate --set data.task=task.jsonl` on it with the recipe as
it is plus `--set` overrides, printing the per-seed verdicts and the wall time.

A format (`draw_format(seed)`) fixes every surface choice at random:
- names: single lowercase or uppercase letters, two-letter names, or words (several tokens each);
- values (answers): digits, letters of another case, or colour words;
- the link template: "a>b", "a -> b", "a points to b.", "set a to b;", "(b<a)", "a: b";
- the separator between links;
- the query: "?a=", "follow a", "Where does a lead?", "a => ?";
- the distractors: disjoint chains of one or two links, disjoint chains as long as the queried one ending in
  other values ("equal", the built-in chain's rule: neither depth nor the answer's value gives it away), or
  trees hanging off the queried chain upstream of the query;
- fixed-length prompts (every prompt padded to `length` links) or lengths that vary with the draw.

A line: {"prompt", "answer", "difficulty" (hops), "trace" (the names reached after each hop but the last)}.
Training lines have 1..4 hops, held-out lines 1..8. tests/test_pointer_formats.py reads each answer off its
prompt with a parser of its own, built from the format's templates.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

NAMES = {"lower": list(string.ascii_lowercase), "upper": list(string.ascii_uppercase),
         "pairs": [a + b for a in "bcdfghjklm" for b in "aeiou"],
         "words": ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "ember", "lotus", "raven", "cedar",
                   "amber", "delta", "orbit", "quartz", "sable", "tundra", "willow", "zephyr", "harbor"]}
VALUES = {"digits": list("0123456789"), "letters": list("PQRSTUVWXY"),
          "colours": ["red", "blue", "green", "gold", "grey", "pink", "teal", "navy"]}
LINKS = ["{a}>{b}", "{a} -> {b}", "{a} points to {b}.", "set {a} to {b};", "({b}<{a})", "{a}: {b}"]
SEPARATORS = [" ", " | ", "\n", ", "]
QUERIES = ["?{a}=", "follow {a}", "Where does {a} lead?", "{a} => ?"]


@dataclass(frozen=True)
class Format:
    names: str
    values: str
    link: str
    separator: str
    query: str
    distractors: str          # "chains" | "equal" | "trees"
    length: int               # links per prompt (fixed) or the most (varying)
    fixed: bool


def draw_format(seed: int) -> Format:
    """Every surface choice drawn from `seed` (values never overlap names: the answer set is the values)."""
    g = random.Random(seed)
    names, values = g.choice(list(NAMES)), g.choice(list(VALUES))
    if names == "upper" and values == "letters":
        values = "digits"
    link, query = g.choice(LINKS), g.choice(QUERIES)
    # a separator that occurs in neither template, so that a reader can split a prompt into its statements
    separator = g.choice([sep for sep in SEPARATORS if sep not in link and sep not in query])
    return Format(names=names, values=values, link=link, separator=separator, query=query,
                  distractors=g.choice(["chains", "equal", "trees"]), length=g.choice([10, 12, 16]), fixed=g.random() < 0.5)


ISSUE = Format(names="lower", values="digits", link="{a}>{b}", separator=" ", query="?{a}=",
               distractors="chains", length=10, fixed=True)


def make_line(fmt: Format, hops: int, g: random.Random) -> dict:
    """One example: a chain of `hops` links ending in a value, distractor links, shuffled, then the query."""
    pool = NAMES[fmt.names][:]
    g.shuffle(pool)
    chain = [pool.pop() for _ in range(hops)]                      # chain[0] -> chain[1] -> ... -> value
    answer = g.choice(VALUES[fmt.values])
    links = [(chain[i], chain[i + 1]) for i in range(hops - 1)] + [(chain[-1], answer)]
    total = fmt.length if fmt.fixed else g.randint(hops, max(hops, fmt.length))
    while len(links) < total and pool:
        src = pool.pop()
        if fmt.distractors == "equal":
            # a disjoint chain as long as the queried one (the last may be shorter), ending in another value:
            # neither chain depth nor the answer's value tells the queried chain (the built-in chain's rule)
            names = [src] + [pool.pop() for _ in range(min(hops, total - len(links), len(pool) + 1) - 1)]
            end = g.choice([v for v in VALUES[fmt.values] if v != answer])
            links += [(names[i], names[i + 1]) for i in range(len(names) - 1)] + [(names[-1], end)]
        elif fmt.distractors == "trees" and hops > 1 and g.random() < 0.5:
            links.append((src, chain[g.randrange(0, hops)]))         # into the queried chain, never from it
        elif len(links) + 2 <= total and pool:
            mid = pool.pop()                                         # a disjoint chain of two links
            links += [(src, mid), (mid, g.choice(VALUES[fmt.values]))]
        else:
            links.append((src, g.choice(VALUES[fmt.values])))
    g.shuffle(links)
    return {"prompt": render(fmt, links, chain[0]), "answer": answer, "difficulty": hops, "trace": chain[1:],
            "links": links, "query": chain[0]}


def _public(line: dict) -> dict:
    """A line as the file holds it: prompt, answer, difficulty, trace."""
    return {k: v for k, v in line.items() if k not in ("links", "query")}


def render(fmt: Format, links: list[tuple[str, str]], query: str) -> str:
    return fmt.separator.join(fmt.link.format(a=a, b=b) for a, b in links) + fmt.separator + fmt.query.format(a=query)


def swapped(line: dict) -> tuple[str, str] | None:
    """The line's other query: the head of another chain (a name nothing points to) that leads elsewhere
    than the answer, and where it leads; None when the prompt has none."""
    edges = dict(line["links"])
    for head in (a for a in edges if a not in edges.values() and a != line["query"]):
        end = head
        while end in edges:
            end = edges[end]
        if end != line["answer"]:
            return head, end
    return None


def probe(fmt: Format, run_dir: str, difficulties: list[int], n: int = 200) -> None:
    """Does a run read the query? Fresh lines of the format, each asked again about the head of another chain:
    exact match on both, and how often the prediction stays the same when the query changes (a model that
    ignores the query answers from the rest of the prompt, e.g. the end of its longest chain)."""
    import looplm
    from looplm.evaluation.tasks import greedy_answers

    run = looplm.load_run(run_dir)
    g = random.Random(12345)
    for d in difficulties:
        lines = [x for x in (make_line(fmt, d, g) for _ in range(4 * n)) if swapped(x)][:n]
        other = [swapped(x) for x in lines]
        a = greedy_answers(run.model, run.tokenizer, [x["prompt"] for x in lines], d, separator=run.recipe.data.separator)
        b = greedy_answers(run.model, run.tokenizer, [render(fmt, x["links"], h) for x, (h, _) in zip(lines, other)], d,
                           separator=run.recipe.data.separator)
        k = len(lines)
        print(f"{d} hops at {d} rounds ({k} lines): exact {sum(p == x['answer'] for p, x in zip(a, lines)) / k:.0%}; "
              f"other query: exact {sum(p == t for p, (_, t) in zip(b, other)) / k:.0%}; prediction unchanged "
              f"{sum(p == q for p, q in zip(a, b)) / k:.0%}", flush=True)


def write(fmt: Format, path: Path, lines: int, hops: range, seed: int) -> None:
    g = random.Random(seed)
    path.write_text("".join(json.dumps(_public(make_line(fmt, g.choice(list(hops)), g))) + "\n" for _ in range(lines)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=1, help="formats, seeds seed..seed+count-1")
    ap.add_argument("--out", default="formats")
    ap.add_argument("--train", type=int, default=60000)
    ap.add_argument("--eval", type=int, default=800)
    ap.add_argument("--describe", action="store_true")
    ap.add_argument("--issue", action="store_true", help="the issue's format instead of a drawn one")
    ap.add_argument("--run", action="store_true", help="run the extrapolation experiment on the format")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--probe", metavar="RUN", help="does RUN (trained on this format) read the query?")
    ap.add_argument("--difficulties", default="1,2,4")
    a = ap.parse_args()
    if a.probe:
        probe(ISSUE if a.issue else draw_format(a.seed), a.probe, [int(x) for x in a.difficulties.split(",")])
        return 0
    if a.run:
        return run(ISSUE if a.issue else draw_format(a.seed), a)
    for s in range(a.seed, a.seed + a.count):
        fmt = ISSUE if a.issue else draw_format(s)
        if a.describe:
            print(s, json.dumps(asdict(fmt)), "\n  ", make_line(fmt, 3, random.Random(s))["prompt"][:200])
            continue
        out = Path(a.out) / ("issue" if a.issue else f"format{s}")
        out.mkdir(parents=True, exist_ok=True)
        write(fmt, out / "train.jsonl", a.train, range(1, 5), s)
        write(fmt, out / "eval.jsonl", a.eval, range(1, 9), s + 10_000)
        (out / "format.json").write_text(json.dumps(asdict(fmt), indent=1) + "\n")
        print(out)
        if a.issue:
            break
    return 0


def run(fmt: Format, a: argparse.Namespace) -> int:
    """The extrapolation experiment on one format: task.jsonl holds training and held-out lines."""
    from _runs import extrapolate_on
    from looplm.recipe.config import parse_override, read_recipe_dict

    out = Path(a.out) / ("issue" if a.issue else f"format{a.seed}")
    out.mkdir(parents=True, exist_ok=True)
    g = random.Random(a.seed)
    lines = [_public(make_line(fmt, g.choice(range(1, 5)), g)) for _ in range(a.train)]
    lines += [_public(make_line(fmt, g.choice(range(5, 9)), g)) for _ in range(a.eval)]
    data = out / "task.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    (out / "format.json").write_text(json.dumps(asdict(fmt), indent=1) + "\n")
    # the format's statement separator for data.crop_curriculum, and a context that holds the longest line
    # (prompt + answer + its end, in bytes: task runs are byte-tokenized)
    longest = max(len((x["prompt"] + x["answer"]).encode()) + 2 for x in lines)
    sets = dict(parse_override(s) for s in a.set)
    crop = float(sets.get("data.crop_curriculum", read_recipe_dict("extrapolate")["data"].get("crop_curriculum", 0)))
    overrides = {"data.task": str(data), **({"data.item_separator": fmt.separator} if crop else {}),
                 **({"model.context": -(-longest // 32) * 32} if longest > 128 else {}), **sets}
    return extrapolate_on(overrides, out, a.seeds)


if __name__ == "__main__":
    sys.exit(main())
