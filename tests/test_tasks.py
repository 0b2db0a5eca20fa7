"""Tests for looplm.data.tasks: determinism, answers vs. the independent solvers, the two dials,
JSONL loading and the answer mask."""

import json

import pytest

from looplm.errors import UserError
from looplm.data.tasks import (
    ANSWER_END,
    SEPARATOR,
    TASKS,
    Example,
    answer_mask,
    format_example,
    generate,
    load_jsonl,
    solve,
)

# difficulties to sweep per task (each starts at the task's minimum)
LEVELS = {
    "chain": range(1, 13),
    "latest_write": range(0, 10),
    "completion": range(1, 12),
    "delayed_memory": range(0, 16),
    "addition": range(1, 12),
    "parity": range(1, 20),
}


def count_items(task: str, prompt: str) -> int:
    """Number of statements / items in a prompt, counted from the text."""
    if task == "addition":
        return len(prompt.split("+")[0])
    if task == "parity":
        return len(prompt)
    return len(prompt.split("; ")) - 1  # minus the question


def test_every_task_is_listed():
    assert set(TASKS) == set(LEVELS)


@pytest.mark.parametrize("task", sorted(LEVELS))
def test_deterministic_in_seed(task):
    a = generate(task, 30, LEVELS[task], seed=7)
    b = generate(task, 30, LEVELS[task], seed=7)
    c = generate(task, 30, LEVELS[task], seed=8)
    assert a == b
    assert [e.prompt for e in a] != [e.prompt for e in c]
    # a longer request starts with the shorter one
    assert generate(task, 60, LEVELS[task], seed=7)[:30] == a


@pytest.mark.parametrize("task", sorted(LEVELS))
def test_answers_match_independent_solver(task):
    for d in LEVELS[task]:
        for ex in TASKS[task](seed=d, difficulty=d, n=40):
            assert ex.answer == solve(task, ex.prompt), ex
            assert ex.difficulty == d and ex.meta["difficulty"] == d
            assert count_items(task, ex.prompt) == ex.meta["length"]
    # and with padding well beyond the minimum length
    top = max(LEVELS[task])
    for ex in generate(task, 200, LEVELS[task], seed=1, length=min(top + 10, 26)):
        assert ex.answer == solve(task, ex.prompt), ex


@pytest.mark.parametrize("task", sorted(LEVELS))
def test_length_is_separate_from_difficulty(task):
    lo, hi = min(LEVELS[task]), max(LEVELS[task])
    length = 20
    easy = list(TASKS[task](seed=0, difficulty=lo, n=20, length=length))
    hard = list(TASKS[task](seed=0, difficulty=hi, n=20, length=length))
    for ex in easy + hard:
        assert count_items(task, ex.prompt) == length == ex.meta["length"]
    assert {e.difficulty for e in easy} == {lo} and {e.difficulty for e in hard} == {hi}
    if task != "completion":  # (completion's target count can have 1 or 2 digits)
        assert {len(e.prompt) for e in easy + hard} == {len(easy[0].prompt)}


@pytest.mark.parametrize("task", sorted(LEVELS))
def test_mixed_difficulty_defaults_to_one_length(task):
    exs = generate(task, 40, LEVELS[task], seed=3)
    assert {e.meta["length"] for e in exs} == {TASKS[task].default_length(max(LEVELS[task]))}
    assert {e.difficulty for e in exs} == set(LEVELS[task])
    # round-robin over the levels
    assert [e.difficulty for e in exs[: len(LEVELS[task])]] == list(LEVELS[task])


def test_difficulty_means_what_it_says():
    # chain: the number of assignments from the digit to the queried name
    for ex in generate("chain", 50, 5, seed=0, length=15):
        stmts, q = ex.prompt.split("; ")[:-1], ex.prompt.split("? ")[1]
        binding = dict(s.split("=") for s in stmts)
        hops = 1
        while not binding[q].isdigit():
            q, hops = binding[q], hops + 1
        assert hops == 5
    # latest_write: the queried register is written difficulty + 1 times
    for ex in generate("latest_write", 50, 4, seed=0, length=12):
        q = ex.prompt.split("? ")[1]
        assert sum(s.startswith(q + "=") for s in ex.prompt.split("; ")[:-1]) == 5
    # delayed_memory: exactly `delay` statements between the write and the question
    for ex in generate("delayed_memory", 50, 6, seed=0, length=12):
        stmts, q = ex.prompt.split("; ")[:-1], ex.prompt.split("? ")[1]
        [pos] = [i for i, s in enumerate(stmts) if s.startswith(q + "=")]
        assert len(stmts) - 1 - pos == 6
    # addition: operands have exactly `digits` significant digits; parity: `bits` bits
    for ex in generate("addition", 50, 4, seed=0, length=9):
        assert all(len(str(int(a))) == 4 for a in ex.prompt.split("+"))
    for ex in generate("parity", 50, 7, seed=0, length=12):
        assert sum(ch in "01" for ch in ex.prompt) == 7


def test_completion_and_parity_roughly_balanced():
    for task in ("completion", "parity"):
        exs = generate(task, 600, LEVELS[task], seed=0)
        answers = [e.answer for e in exs]
        first = "yes" if task == "completion" else "1"
        assert set(answers) == ({"yes", "no"} if task == "completion" else {"0", "1"})
        assert 0.4 < answers.count(first) / len(answers) < 0.6


def test_chain_distractors_rooted_at_other_digits():
    for ex in generate("chain", 100, 3, seed=0, length=12):
        digits = [s.split("=")[1] for s in ex.prompt.split("; ")[:-1] if s.split("=")[1].isdigit()]
        assert digits.count(ex.answer) == 1 and len(digits) == 4


@pytest.mark.parametrize("call", [
    lambda: generate("nope", 5, 1, seed=0),
    lambda: generate("chain", 5, 0, seed=0),  # below the minimum difficulty
    lambda: generate("chain", 5, 27, seed=0),  # more hops than names
    lambda: generate("chain", 5, 5, seed=0, length=4),  # too short for the difficulty
    lambda: generate("chain", 5, 5, seed=0, length=27),
    lambda: generate("parity", 5, range(0), seed=0),
    lambda: generate("parity", 5, "3", seed=0),
    lambda: generate("parity", -1, 3, seed=0),
    lambda: generate("parity", 5, 2.0, seed=0),
    lambda: generate("parity", 5, True, seed=0),
    lambda: TASKS["addition"](seed=0, difficulty=3, n=1, length=2),  # raised at call time
])
def test_bad_arguments_raise_user_error(call):
    with pytest.raises(UserError):
        call()


def test_format_example_and_mask_cover_exactly_the_answer():
    for task in LEVELS:
        for ex in generate(task, 20, LEVELS[task], seed=0):
            prompt_text, answer_text = format_example(ex)
            assert prompt_text == ex.prompt + SEPARATOR and prompt_text.endswith(SEPARATOR)
            assert answer_text == ex.answer + ANSWER_END and answer_text.endswith("\n")
            p, a = list(prompt_text.encode()), list(answer_text.encode())
            ids, mask = answer_mask(p, a)
            targets = ids[1:]
            assert len(mask) == len(targets) == len(ids) - 1
            assert bytes(t for t, m in zip(targets, mask) if m).decode() == answer_text
            assert sum(mask) == len(a)


def test_answer_mask_convention():
    ids, mask = answer_mask([10, 11, 12], [20, 21])
    assert ids == [10, 11, 12, 20, 21]
    assert mask == [False, False, True, True]  # targets are [11, 12, 20, 21]
    ids, mask = answer_mask([1], [2])
    assert ids == [1, 2] and mask == [True]
    with pytest.raises(UserError):
        answer_mask([], [1])
    with pytest.raises(UserError):
        answer_mask([1], [])


def test_solve_rejects_malformed_prompts():
    with pytest.raises(UserError):
        solve("chain", "a=b; b=a; ? a")  # cycle
    with pytest.raises(UserError):
        solve("latest_write", "a=1; b=2")  # no question
    with pytest.raises(UserError):
        solve("unknown", "x")


# --- JSONL -----------------------------------------------------------------------------


def write(tmp_path, content: bytes | str, name: str = "data.jsonl"):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_load_jsonl_reads_examples_and_skips_blank_lines(tmp_path):
    lines = [
        json.dumps({"prompt": "a=1; ? a", "answer": "1"}),
        "",
        "   ",
        json.dumps({"prompt": "é+1", "answer": "no", "difficulty": 3, "extra": [1]}),
    ]
    path = write(tmp_path, "\n".join(lines) + "\n")
    exs = load_jsonl(path)
    assert [(e.prompt, e.answer, e.difficulty) for e in exs] == [("a=1; ? a", "1", 0), ("é+1", "no", 3)]
    assert exs[1].meta["line"] == 4 and exs[1].meta["source"] == str(path)
    assert all(isinstance(e, Example) for e in exs)


def test_load_jsonl_round_trips_generated_examples(tmp_path):
    exs = generate("chain", 10, range(1, 4), seed=0)
    path = write(tmp_path, "".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in exs))
    assert [(e.prompt, e.answer) for e in load_jsonl(str(path))] == [(e.prompt, e.answer) for e in exs]


def test_load_jsonl_crlf_and_bom(tmp_path):
    path = write(tmp_path, b'\xef\xbb\xbf{"prompt": "p", "answer": "a"}\r\n{"prompt": "q", "answer": "b"}\r\n')
    assert [e.prompt for e in load_jsonl(path)] == ["p", "q"]


GOOD = '{"prompt": "p", "answer": "a"}\n'


@pytest.mark.parametrize("bad_line, words", [
    (b'{"prompt": "p", "answer": ', "invalid JSON"),
    (b'{"answer": "a"}', "missing field 'prompt'"),
    (b'{"prompt": "p"}', "missing field 'answer'"),
    (b'{"prompt": 3, "answer": "a"}', "'prompt' must be a string"),
    (b'{"prompt": "p", "answer": null}', "'answer' must be a string"),
    (b'{"prompt": "p", "answer": ""}', "'answer' is empty"),
    (b'{"prompt": "p", "answer": "a\\nb"}', "newline"),
    (b'{"prompt": "p", "answer": "a", "difficulty": "hard"}', "'difficulty' must be an integer"),
    (b'["p", "a"]', "JSON object"),
    (b'{"prompt": "p", "answer": "a", "trace": "b"}', "'trace' must be a list"),
    (b'{"prompt": "p", "answer": "a", "trace": ["b", ""]}', "'trace' must be a list"),
    (b'{"prompt": "caf\xe9", "answer": "a"}', "not valid UTF-8"),
])
def test_load_jsonl_errors_name_the_line(tmp_path, bad_line, words):
    # the bad line is line 4: two good lines and a blank one come first
    path = write(tmp_path, GOOD.encode() * 2 + b"\n" + bad_line + b"\n" + GOOD.encode())
    with pytest.raises(UserError) as err:
        load_jsonl(path)
    msg = str(err.value)
    assert str(path) in msg and "line 4" in msg and words in msg


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_load_jsonl_empty_file(tmp_path, content):
    path = write(tmp_path, content)
    with pytest.raises(UserError, match="empty") as err:
        load_jsonl(path)
    assert str(path) in str(err.value)


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        load_jsonl(tmp_path / "nope.jsonl")


def test_chain_trace_follows_the_bindings_hop_by_hop():
    from looplm.data.tasks import trace_chain
    assert trace_chain("c=b; a=7; b=a; ? c") == ["b", "a"]
    assert trace_chain("a=7; b=3; ? a") == []
    for hops in (1, 2, 5, 8):
        for ex in generate("chain", 20, hops, seed=hops, length=12):
            trace = trace_chain(ex.prompt)
            assert len(trace) == hops - 1
            # independently: each name is bound to the next one, the last to the answer
            binding = dict(s.split("=") for s in ex.prompt.split("; ? ")[0].split("; "))
            query = ex.prompt.rsplit("? ", 1)[1]
            path = [query] + trace
            assert all(binding[a] == b for a, b in zip(path, path[1:]))
            assert binding[path[-1]] == ex.answer == solve("chain", ex.prompt)


def test_load_jsonl_keeps_a_trace(tmp_path):
    path = write(tmp_path, b'{"prompt": "p", "answer": "a", "trace": ["x", "y"]}\n')
    assert load_jsonl(path)[0].meta["trace"] == ["x", "y"]


def test_load_jsonl_marks_a_missing_difficulty(tmp_path):
    """A line without "difficulty" is difficulty 0 with meta["difficulty"] None, so a file that
    gives no difficulties can be told from one whose lines are all difficulty 0."""
    path = write(tmp_path, '{"prompt": "p", "answer": "a"}\n{"prompt": "q", "answer": "b", "difficulty": 0}\n')
    exs = load_jsonl(path)
    assert [e.difficulty for e in exs] == [0, 0]
    assert [e.meta["difficulty"] for e in exs] == [None, 0]
    with pytest.raises(UserError, match="line 1.*'difficulty' must be an integer"):
        load_jsonl(write(tmp_path, '{"prompt": "p", "answer": "a", "difficulty": null}\n', "null.jsonl"))
