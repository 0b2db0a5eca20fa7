"""Depth extrapolation on a user's own JSONL: two pointer-chasing formats unlike the built-in chain.

    python benchmarks/pointer_jsonl.py --format arrows|pairs [--out DIR] [--seeds 0,1,2] [--set key=value ...]
    python benchmarks/pointer_jsonl.py --format arrows --write-only FILE.jsonl

Writes the format's file (training difficulties 1-4 at every prompt length 2..10 statements, held-out
difficulties 5-8 at 10 statements, each line with "difficulty" and a one-token-per-hop "trace"), then runs
`looplm experiment extrapolate` on it with the built-in `extrapolate` recipe, whose curricula read the
file's own lengths (data.length_unit = "items" split at the format's separator), and prints the
per-seed lookup verdicts and the 8-hop accuracy. The two formats differ from the built-in chain
("b=7; c=b; ? c", lowercase names, digit answers, disjoint distractor chains) in every surface choice:

    arrows   "Q->R" statements, one per line; uppercase names; answers among the lowercase letters p..y;
             distractors are trees: a distractor name may point into any chain already written (also the
             queried one, upstream of the query, so it never changes the answer); "follow Q" at the end
    pairs    "(r<q)" statements (the target first), separated by " , "; names among lowercase letters
             and the symbols #$%&*+; answers among the uppercase letters A..J; distractors are cycles and
             chains ending in an answer letter; "ask q" at the end
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

FORMATS = {
    "arrows": {"names": string.ascii_uppercase, "answers": "pqrstuvwxy", "separator": "\n"},
    "pairs": {"names": string.ascii_lowercase[:20] + "#$%&*+", "answers": "ABCDEFGHIJ", "separator": " , "},
}
TRAIN_DIFFICULTIES = range(1, 5)
EVAL_DIFFICULTIES = range(5, 9)
LENGTH = 10


def _statement(fmt: str, src: str, dst: str) -> str:
    """src points to dst."""
    return f"{src}->{dst}" if fmt == "arrows" else f"({dst}<{src})"


def _query(fmt: str, name: str) -> str:
    return f"follow {name}" if fmt == "arrows" else f"ask {name}"


def make_example(fmt: str, rng: random.Random, hops: int, length: int) -> dict:
    spec = FORMATS[fmt]
    names = rng.sample(spec["names"], length)
    answer = rng.choice(spec["answers"])
    chain = names[:hops]                   # chain[0] -> answer, chain[i] -> chain[i-1]; the query is chain[-1]
    edges = [(chain[0], answer)] + [(chain[i], chain[i - 1]) for i in range(1, hops)]
    rest = names[hops:]
    others = [a for a in spec["answers"] if a != answer]
    if fmt == "arrows":     # trees: each distractor points at an answer letter or at a name already written
        written = [answer] + chain[:-1]    # never the query itself: the query's own pointer is the chain's
        roots = [rng.choice(others)]
        for n in rest:
            target = rng.choice(written[1:] + roots) if rng.random() < 0.5 and len(written) > 1 else rng.choice(roots)
            if rng.random() < 0.3:
                roots.append(rng.choice(others))
                target = roots[-1]
            edges.append((n, target))
            if target not in chain:
                written.append(n)
    else:                   # a cycle of up to 3 names, the rest chains ending in another answer letter
        cyc = rest[:min(3, len(rest))] if len(rest) >= 2 else []
        for i, n in enumerate(cyc):
            edges.append((n, cyc[(i + 1) % len(cyc)]))
        prev = rng.choice(others)
        for n in rest[len(cyc):]:
            edges.append((n, prev))
            prev = n if rng.random() < 0.7 else rng.choice(others)
    rng.shuffle(edges)
    prompt = spec["separator"].join([_statement(fmt, s, d) for s, d in edges] + [_query(fmt, chain[-1])])
    # trace: the name reached after r hops from the query, r = 1..hops-1
    trace = [chain[hops - 1 - r] for r in range(1, hops)]
    return {"prompt": prompt, "answer": answer, "difficulty": hops, "trace": trace}


def write_format(fmt: str, path: Path, seed: int = 0, per_length: int = 1200, eval_lines: int = 400) -> Path:
    rng = random.Random(f"{fmt}-{seed}")
    lines = []
    for hops in TRAIN_DIFFICULTIES:
        for length in range(max(2, hops), LENGTH + 1):
            lines += [make_example(fmt, rng, hops, length) for _ in range(per_length)]
    for hops in EVAL_DIFFICULTIES:
        lines += [make_example(fmt, rng, hops, LENGTH) for _ in range(eval_lines)]
    rng.shuffle(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def resolve(line: dict, fmt: str) -> str:
    """Follow the query's pointers in a written prompt (an independent check of the generator)."""
    spec = FORMATS[fmt]
    *stmts, query = line["prompt"].split(spec["separator"])
    ptr = {}
    for s in stmts:
        src, dst = s.split("->") if fmt == "arrows" else s.strip("()").split("<")[::-1]
        assert src not in ptr, f"{src} points twice"
        ptr[src] = dst
    node = query.split(" ")[1]
    while node not in spec["answers"]:
        node = ptr[node]
    return node


def main() -> int:
    from _runs import extrapolate_on
    from looplm.recipe.config import parse_override

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", choices=sorted(FORMATS), required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--write-only", metavar="FILE")
    args = p.parse_args()
    if args.write_only:
        write_format(args.format, Path(args.write_only))
        return 0
    out = Path(args.out or f"runs/pointer-{args.format}-{time.strftime('%Y%m%d-%H%M%S')}")
    data = write_format(args.format, out / f"{args.format}.jsonl")
    sep = FORMATS[args.format]["separator"]
    # a prompt's items are its statements and the query: 10 statements are 11 items
    overrides = {"data.task": str(data), "data.length_unit": "items", "data.item_separator": sep,
                 "data.task_length": LENGTH + 1, "data.train_length_min": 3,
                 **dict(parse_override(s) for s in args.set)}
    return extrapolate_on(overrides, out, args.seeds)


if __name__ == "__main__":
    sys.exit(main())
