"""The chance verdict (evaluation/chance.py): chance levels and the exact tail against hand computations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from looplm.data.tasks import Example
from looplm.evaluation.chance import chance_by_difficulty, chance_levels, chance_markdown, tail_probability, verdict


def test_chance_is_one_over_the_answers_the_prompt_holds():
    prompts = ["k>p p>w w>3 q>z z>1 ?k=", "a>7 b>7 ?a=", "x>y ?x="]
    answers = ["3", "7", "y"]
    # the answer set {3, 7, y}: the first prompt holds 3 (and 1, not an answer): 1/1; the second holds 7: 1/1;
    # add an answer "1" elsewhere and the first prompt holds two candidates
    assert chance_levels(prompts, answers) == [1.0, 1.0, 1.0]
    assert chance_levels(prompts, answers, ["1", "3", "7", "y"]) == [0.5, 1.0, 1.0]
    # an answer the prompt does not hold: uniform over the whole set
    assert chance_levels(["no digits here"], ["4"], ["1", "4", "9"]) == [pytest.approx(1 / 3)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), p=st.floats(0.01, 0.99), k=st.integers(0, 45))
def test_the_tail_of_equal_chances_is_the_binomial_tail(n, p, k):
    want = sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(k, n + 1))
    assert tail_probability([p] * n, k) == pytest.approx(want, abs=1e-12)


def test_unequal_chances_by_hand():
    # two trials, 0.5 and 0.25: P(X >= 1) = 1 - 0.5 * 0.75, P(X >= 2) = 0.125
    assert tail_probability([0.5, 0.25], 1) == pytest.approx(0.625)
    assert tail_probability([0.5, 0.25], 2) == pytest.approx(0.125)
    assert tail_probability([0.5, 0.25], 0) == 1.0


def test_a_table_at_chance_says_the_run_learned_nothing():
    exs = {1: [Example(f"a>{i % 2} b>{1 - i % 2} ?a=", str(i % 2), 1) for i in range(100)],
           2: [Example(f"a>b b>{i % 2} c>{1 - i % 2} ?a=", str(i % 2), 2) for i in range(100)]}
    at_chance = chance_by_difficulty(exs, {1: {1: 0.52, 4: 0.49}, 2: {1: 0.5, 4: 0.55}})
    assert at_chance[1]["chance"] == 0.5 and at_chance[2]["chance"] == 0.5      # two digits in every prompt
    assert not any(v["above_chance"] for row in at_chance.values() for v in row["by_rounds"].values())
    assert "learned nothing measurable" in chance_markdown(at_chance)
    learned = chance_by_difficulty(exs, {1: {1: 0.52, 4: 0.75}, 2: {1: 0.5, 4: 0.55}})
    assert learned[1]["by_rounds"][4]["above_chance"] and not learned[2]["by_rounds"][4]["above_chance"]
    assert learned[1]["by_rounds"][4]["p_value"] == pytest.approx(
        sum(math.comb(100, j) for j in range(75, 101)) / 2 ** 100)
    assert "learned nothing" not in chance_markdown(learned)
    assert verdict([0.5] * 10, 1.0)["hits"] == 10
