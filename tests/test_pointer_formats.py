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
    over the same chain; it keeps every statement the chase follows, and of the m others (trees hanging into
    the chain, statements pointing at the answer's value among them) round(keep x m), in their order."""
    from looplm.data.tasks import Example
    from looplm.data.taskdata import crop_items
    fmt = pf.draw_format(seed)
    g = random.Random(seed)
    for hops in list(range(1, 9)) * 2:
        line = pf.make_line(fmt, hops, g)
        ex = Example(line["prompt"], line["answer"], hops, {"trace": line["trace"], "difficulty": hops})
        *statements, _ = line["prompt"].split(fmt.separator)
        chain = read_answer(fmt, line["prompt"])
        # the statements followed: sources from the queried name along the path, by the template
        link = re.escape(fmt.link).replace(re.escape("{a}"), r"(\w+)").replace(re.escape("{b}"), r"\w+")
        query = re.fullmatch(re.escape(fmt.query).replace(re.escape("{a}"), r"(\w+)"), line["prompt"].split(fmt.separator)[-1])
        followed = [query.group(1), *chain[2]]
        needed = [s for s in statements if re.fullmatch(link, s).group(1) in followed]
        assert len(needed) == hops
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


@pytest.mark.parametrize("seed", range(8))
def test_the_link_spans_cut_the_prompt_into_its_statements(seed):
    """--attention's spans: read in order, each span's bytes are one statement the independent split finds, with the
    separator after it, and they cover the prompt up to the query."""
    fmt = pf.draw_format(seed)
    g = random.Random(seed)
    for hops in (1, 3, 8):
        line = pf.make_line(fmt, hops, g)
        where = sorted(pf.spans(fmt, line).values())
        raw = line["prompt"].encode()
        *statements, query = line["prompt"].split(fmt.separator)
        assert [raw[a:b].decode() for a, b in where] == [st + fmt.separator for st in statements]
        assert where[0][0] == 0 and all(x[1] == y[0] for x, y in zip(where, where[1:]))
        assert raw[where[-1][1]:].decode() == query


def test_the_recorded_attention_is_what_sdpa_computed():
    """answer_attention's weights for the last position, from a float64 recomputation with the mask written out
    here, and one row per attention call of a looped forward (prelude, each round's core, coda)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 7, 7, generator=g) > 0.3
    mask[..., -1, 0] = True
    rows: list = []
    with pf.answer_attention(rows):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        F.scaled_dot_product_attention(q[..., :5, :], k, v, is_causal=True)    # 5 queries, 7 keys: top-left aligned
    assert len(rows) == 3
    s = (q[..., -1, :].double().unsqueeze(-2) @ k.double().transpose(-1, -2)).squeeze(-2) / 2.0   # (2, 3, 7)
    torch.testing.assert_close(rows[0].double(), s.softmax(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows[1].double(), s.masked_fill(~mask[..., -1, :], float("-inf")).softmax(-1),
                               atol=1e-5, rtol=1e-5)
    s5 = (q[..., 4, :].double().unsqueeze(-2) @ k.double().transpose(-1, -2)).squeeze(-2) / 2.0
    torch.testing.assert_close(rows[2].double(), s5.masked_fill(torch.arange(7) > 4, float("-inf")).softmax(-1),
                               atol=1e-5, rtol=1e-5)

    from looplm.model.looped import build_model
    from looplm.recipe.config import load_recipe

    recipe = load_recipe("extrapolate", {"model.n_prelude": 2, "model.n_coda": 1})
    model = build_model(recipe).eval()
    rows.clear()
    with torch.no_grad(), pf.answer_attention(rows):
        model(torch.randint(0, 100, (1, 12), generator=g), rounds=3)
    assert len(rows) == 2 + 3 * recipe.model.n_core + 1
    assert all(torch.allclose(w.sum(-1), torch.ones(())) for w in rows)
