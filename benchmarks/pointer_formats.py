"""Pointer-chase JSONL files in surface forms drawn at random, so that a change to the extrapolation recipe is
tried on formats no one tuned it for (issue 42).

    python benchmarks/pointer_formats.py --seed 3 --out formats/ [--count 5] [--train 60000] [--eval 800]
    python benchmarks/pointer_formats.py --describe --seed 3
    python benchmarks/pointer_formats.py --issue --out formats/         # the issue's own file (below)
    python benchmarks/pointer_formats.py --seed 3 --run [--seeds 0,1,2] [--set key=value ...]
    python benchmarks/pointer_formats.py --issue --probe RUN [--difficulties 1,2,4]   # does RUN read the query?
    python benchmarks/pointer_formats.py --issue --attention RUN [--difficulties 4]  # where its answer looks
    python benchmarks/pointer_formats.py --issue --format '{"separator": "; "}' --run ...  # one choice changed

`--attention RUN` shows where the answer position of RUN attends, per layer and round, on fresh lines: the
best head's share on what the round should read (hop r's link, with its trailing separator; with
data.round_targets = "query_trace" round 1 the query and round r + 1 hop r's link) against its mean share on
a link no round reads. `--format JSON` changes fields of the chosen format (a study of one surface choice).

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
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
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
    extra = run.recipe.data.answer_round_offset          # query_trace: a round reads the query first
    for d in difficulties:
        lines = [x for x in (make_line(fmt, d, g) for _ in range(4 * n)) if swapped(x)][:n]
        other = [swapped(x) for x in lines]
        a = greedy_answers(run.model, run.tokenizer, [x["prompt"] for x in lines], d + extra,
                           separator=run.recipe.data.separator)
        b = greedy_answers(run.model, run.tokenizer, [render(fmt, x["links"], h) for x, (h, _) in zip(lines, other)],
                           d + extra, separator=run.recipe.data.separator)
        k = len(lines)
        print(f"{d} hops at {d + extra} rounds ({k} lines): exact {sum(p == x['answer'] for p, x in zip(a, lines)) / k:.0%}; "
              f"other query: exact {sum(p == t for p, (_, t) in zip(b, other)) / k:.0%}; prediction unchanged "
              f"{sum(p == q for p, q in zip(a, b)) / k:.0%}", flush=True)


def spans(fmt: Format, line: dict) -> dict[str, tuple[int, int]]:
    """Each link's (start, end) byte offsets in the prompt, keyed by its source name; a link's span runs to the
    end of the separator after it (where a statement ends, which is all a causal model can read it at)."""
    out, pos = {}, 0
    for a, b in line["links"]:
        text = fmt.link.format(a=a, b=b) + fmt.separator
        out[a] = (len(line["prompt"][:pos].encode()), len(line["prompt"][:pos + len(text)].encode()))
        pos += len(text)
    return out


@contextmanager
def answer_attention(rows: list):
    """Within the block, every attention call appends the last query position's weights (B, H, S) to `rows`,
    recomputed from its q and k and checked against SDPA's own output for that position."""
    import torch
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                   enable_gqa=enable_gqa)
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        s = q[..., -1:, :] @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)     # (B, H, 1, S)
        if is_causal:   # SDPA's causal mask is aligned top-left: the last of T queries sees keys 0..T-1
            s = s.masked_fill(torch.arange(k.shape[-2], device=s.device) >= q.shape[-2], float("-inf"))
        if attn_mask is not None:
            m = attn_mask[..., -1:, :]
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        w = s.softmax(-1)
        if not torch.allclose(w @ v, out[..., -1:, :], atol=1e-4, rtol=1e-3):
            raise AssertionError("recomputed attention weights do not reproduce SDPA's output")
        rows.append(w[..., 0, :])
        return out

    F.scaled_dot_product_attention = recording
    try:
        yield rows
    finally:
        F.scaled_dot_product_attention = sdpa


def attention(fmt: Format, run_dir: str, hops: int, n: int = 100) -> list[tuple[str, float, float]]:
    """Where RUN's answer position attends on fresh `hops`-hop lines: per attention call (prelude layers,
    then each round's core layers, then the coda), the head with the largest share on what the round should
    read (hop r's link; with query_trace round 1 the query, round r + 1 hop r's link; the prelude and coda:
    hop 1's link) -> (call, that share, its mean share on a link read by no round), averaged over lines."""
    import torch
    import looplm
    from looplm.data.tasks import SEPARATOR

    run = looplm.load_run(run_dir)
    m, extra = run.recipe.model, run.recipe.data.answer_round_offset
    labels = ([f"prelude {i + 1}" for i in range(m.n_prelude)]
              + [f"round {r + 1} core {i + 1}" for r in range(hops + extra) for i in range(m.n_core)]
              + [f"coda {i + 1}" for i in range(m.n_coda)])
    g = random.Random(4242)
    total = torch.zeros(len(labels), 2)
    for _ in range(n):
        line = make_line(fmt, hops, g)
        where = spans(fmt, line)
        chain = [line["query"]] + line["trace"]
        text = line["prompt"] + (SEPARATOR if run.recipe.data.separator else "")
        rows: list = []
        with torch.no_grad(), answer_attention(rows):
            run.model(torch.tensor([run.tokenizer.encode(text)]), rounds=hops + extra)
        if len(rows) != len(labels):
            raise SystemExit(f"{len(rows)} attention calls, expected {len(labels)} ({', '.join(labels)})")
        query = (max(y for _, y in where.values()), len(line["prompt"].encode()))      # the query item's span
        for c, (label, w) in enumerate(zip(labels, rows)):
            r = int(label.split()[1]) - extra if label.startswith("round") else 1
            a, b = where[chain[r - 1]] if r >= 1 else query
            others = [w[0, :, x:y].sum(-1) for name, (x, y) in where.items() if name not in chain]
            share = w[0, :, a:b].sum(-1)                                            # (H,)
            best = int(share.argmax())
            total[c] += torch.tensor([share[best], torch.stack(others)[:, best].mean() if others else 0.0])
    total /= n
    return [(label, float(x), float(y)) for label, (x, y) in zip(labels, total)]


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
    ap.add_argument("--attention", metavar="RUN", help="where RUN's answer position attends, per layer and round")
    ap.add_argument("--difficulties", default="1,2,4")
    ap.add_argument("--format", default="{}", metavar="JSON", help='change fields of the format, e.g. {"separator": "; "}')
    a = ap.parse_args()
    chosen = lambda s: replace(ISSUE if a.issue else draw_format(s), **json.loads(a.format))  # noqa: E731
    if a.probe:
        probe(chosen(a.seed), a.probe, [int(x) for x in a.difficulties.split(",")])
        return 0
    if a.attention:
        for d in (int(x) for x in a.difficulties.split(",")):
            print(f"{d} hops: the head with the largest share on what the round reads; that head on a link no round reads")
            for label, share, other in attention(chosen(a.seed), a.attention, d):
                print(f"  {label:<18} {share:6.1%}  {other:6.1%}")
        return 0
    if a.run:
        return run(chosen(a.seed), a)
    for s in range(a.seed, a.seed + a.count):
        fmt = chosen(s)
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
    # the format's statement separator for data.crop_curriculum and round_targets = "query_trace", and a context
    # that holds the longest line (prompt + answer + its end, in bytes: task runs are byte-tokenized)
    longest = max(len((x["prompt"] + x["answer"]).encode()) + 2 for x in lines)
    sets = dict(parse_override(s) for s in a.set)
    data_fields = read_recipe_dict("extrapolate")["data"]
    crop = float(sets.get("data.crop_curriculum", data_fields.get("crop_curriculum", 0)))
    query = sets.get("data.round_targets", data_fields.get("round_targets")) == "query_trace"
    overrides = {"data.task": str(data), **({"data.item_separator": fmt.separator} if crop or query else {}),
                 **({"model.context": -(-longest // 32) * 32} if longest > 128 else {}), **sets}
    return extrapolate_on(overrides, out, a.seeds)


if __name__ == "__main__":
    sys.exit(main())
