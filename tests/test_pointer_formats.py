"""benchmarks/pointer_formats.py: every drawn format's lines are well-formed and solvable; an independent reader
built from the format's templates reads each answer off its prompt."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import pointer_formats as pf  # noqa: E402


def read_answer(fmt: pf.Format, prompt: str) -> tuple[str, int, list[str]]:
    """(answer, hops, names passed) by parsing the prompt: statements split at the separator, each matched
    against the link template, then followed from the queried name."""
    *statements, query = prompt.split(fmt.separator)
    q = re.fullmatch(re.escape(fmt.query).replace(re.escape("{a}"), r"(\w+)"), query)
    link = re.escape(fmt.link).replace(re.escape("{a}"), r"(?P<a>\w+)").replace(re.escape("{b}"), r"(?P<b>\w+)")
    edges: dict[str, str] = {}
    for st in statements:
        m = re.fullmatch(link, st)
        assert m, (fmt, st)
        assert m.group("a") not in edges, "a name points twice"
        edges[m.group("a")] = m.group("b")
    node, path = q.group(1), []
    while node in edges:
        path.append(node)
        node = edges[node]
    return node, len(path), path[1:]


@pytest.mark.parametrize("seed", range(24))
def test_every_line_is_well_formed_and_solvable(seed):
    fmt = pf.draw_format(seed)
    g = random.Random(seed)
    for hops in list(range(1, 9)) * 4:
        line = json.loads(json.dumps(pf._public(pf.make_line(fmt, hops, g))))
        assert set(line) == {"prompt", "answer", "difficulty", "trace"}
        answer, n, passed = read_answer(fmt, line["prompt"])
        assert (answer, n, passed) == (line["answer"], hops, line["trace"]) == (answer, line["difficulty"], passed)
        assert answer in pf.VALUES[fmt.values]
        statements = len(line["prompt"].split(fmt.separator)) - 1
        assert statements == max(hops, fmt.length) if fmt.fixed else hops <= statements <= max(hops, fmt.length)


def test_the_draws_cover_the_surface_choices():
    fmts = [pf.draw_format(s) for s in range(200)]
    for field, choices in (("names", pf.NAMES), ("values", pf.VALUES), ("link", pf.LINKS), ("query", pf.QUERIES)):
        assert {getattr(f, field) for f in fmts} == set(choices), field
    assert {f.fixed for f in fmts} == {True, False} and {f.distractors for f in fmts} == {"chains", "equal", "trees"}


@pytest.mark.parametrize("seed", range(12))
def test_a_cropped_line_keeps_its_answer_and_drops_what_it_was_asked_to(seed):
    """data.crop_curriculum's crop_items: whatever it keeps, the independent reader finds the same answer
    over the same chain; of the m items naming neither a trace entry nor the answer it keeps round(keep x m),
    and drops no other."""
    from looplm.data.tasks import Example
    from looplm.data.taskdata import crop_items
    fmt = pf.draw_format(seed)
    g = random.Random(seed)
    for hops in list(range(1, 9)) * 2:
        line = pf.make_line(fmt, hops, g)
        ex = Example(line["prompt"], line["answer"], hops, {"trace": line["trace"], "difficulty": hops})
        *statements, _ = line["prompt"].split(fmt.separator)
        chain = read_answer(fmt, line["prompt"])
        # on the chain: the statements whose target is a trace entry or the answer, by the template
        link = re.escape(fmt.link).replace(re.escape("{a}"), r"\w+").replace(re.escape("{b}"), r"(\w+)")
        needed = [s for s in statements if re.fullmatch(link, s).group(1) in [*line["trace"], line["answer"]]]
        spare = len(statements) - len(needed)
        for keep in (0.0, 0.3, 0.5, 1.0):
            cut = crop_items(ex, fmt.separator, keep, random.Random(hops))
            assert read_answer(fmt, cut.prompt) == chain
            kept = cut.prompt.split(fmt.separator)[:-1]
            assert all(s in kept for s in needed)
            assert len(kept) - len(needed) == round(keep * spare)
            assert kept == [s for s in statements if s in kept]          # in their order


@pytest.mark.parametrize("seed", range(6))
def test_the_probe_asks_about_another_chain_with_another_answer(seed):
    """--probe's second prompt differs from the first in its query alone, and the independent reader finds
    there the answer swapped() says, which is not the line's."""
    fmt = pf.draw_format(seed)
    g = random.Random(seed)
    found = 0
    for hops in list(range(1, 9)) * 3:
        line = pf.make_line(fmt, hops, g)
        other = pf.swapped(line)
        if other is None:
            continue
        found += 1
        prompt = pf.render(fmt, line["links"], other[0])
        assert prompt.split(fmt.separator)[:-1] == line["prompt"].split(fmt.separator)[:-1]
        assert read_answer(fmt, prompt)[0] == other[1] != line["answer"]
    assert found > 10
