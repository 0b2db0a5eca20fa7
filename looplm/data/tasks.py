"""Synthetic reasoning tasks whose difficulty is a dial, plus the plumbing to train on them.

Looped models are interesting because they can spend more compute (more loop iterations)
on harder inputs. To measure that we need tasks where "harder" is one integer we control,
and where the *length* of the prompt is a separate integer. Otherwise a model (or a plot)
can confuse "needs more reasoning steps" with "has more tokens to read".

So every task generator has the same signature

    TASKS[name](seed, difficulty, n, length=None) -> Iterator[Example]

- `difficulty` is the reasoning depth (hops, overwrites, delay, digits, bits...).
- `length` is the number of statements / items in the prompt. Distractor statements (or
  padding items) fill the prompt up to `length`, so two difficulties can share one length.
  None means `default_length(task, difficulty)`; `generate()` with several difficulties uses
  the default for the largest one, so a mixed dataset has one prompt length throughout.
- Output is deterministic in (task, seed, difficulty, n, length), and the first k examples
  of a stream do not depend on n.

Prompts use a tiny fixed vocabulary: single-letter names a-z, digits, and `= + ? ; . space`,
so that a byte tokenizer sees one token per name or digit. Statements are separated by "; "
and the question comes last, starting with "? ". For example:

    chain           "c=b; a=7; b=a; ? c"     -> "7"    follow k assignments back to a digit
    latest_write    "a=3; b=1; a=5; ? a"     -> "5"    last value written to a register
    completion      "x+2; y+1; x+1; ? x=3"   -> "yes"  did the counter reach the count?
    delayed_memory  "m=1; n=0; k=1; ? m"     -> "1"    recall a bit after `delay` statements
    addition        "0123+0456"              -> "579"  operands zero-padded to `length` digits
    parity          "1.0..1"                 -> "0"    parity of the bits; "." is padding

`solve(task, prompt)` re-derives an answer from the prompt text alone; it shares no code with
the generators, so tests can check every generated answer against it.

For training, `format_example` turns an example into (prompt_text, answer_text) where the
prompt ends with SEPARATOR and the answer ends with "\\n", and `answer_mask` builds the
next-token-prediction mask that selects exactly the answer tokens.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .sources import jsonl_objects

# The prompt says "here comes the answer" with this; the answer then ends with a newline,
# which is also where greedy decoding stops.
SEPARATOR = ">"
ANSWER_END = "\n"

LETTERS = string.ascii_lowercase  # the names; one byte each
DIGITS = string.digits


@dataclass(frozen=True)
class Example:
    """One prompt/answer pair. meta always holds "difficulty" and "length" (None if unknown)."""

    prompt: str
    answer: str
    difficulty: int
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# Example makers: (rng, difficulty, length) -> (prompt, answer). Arguments are validated
# by Task.__call__ before these run.


def _join(statements: list[str], query: str) -> str:
    return "; ".join(statements + ["? " + query])


def _make_chain(rng: random.Random, hops: int, length: int) -> tuple[str, str]:
    # `length` distinct variables, each assigned exactly once, so the binding is unambiguous
    # no matter how the statements are shuffled.
    names = rng.sample(LETTERS, length)
    answer = rng.choice(DIGITS)

    def chain(root: str, chain_names: list[str]) -> list[str]:
        # root -> n0 -> n1 -> ... : "n0=root; n1=n0; ..."
        rhs = [root] + chain_names[:-1]
        return [f"{lhs}={r}" for lhs, r in zip(chain_names, rhs)]

    statements = chain(answer, names[:hops])
    query = names[hops - 1]
    # Distractor chains as long as the real one (the last may be shorter), rooted at other
    # digits, so neither chain depth nor "the only digit in the prompt" gives the answer away.
    other_digits = [d for d in DIGITS if d != answer]
    rest = names[hops:]
    while rest:
        take = rest[: min(hops, len(rest))]
        statements += chain(rng.choice(other_digits), take)
        rest = rest[len(take):]
    rng.shuffle(statements)
    return _join(statements, query), answer


def _make_latest_write(rng: random.Random, overwrites: int, length: int) -> tuple[str, str]:
    query, *others = rng.sample(LETTERS, 4)
    # Which statement slots write the queried register; the rest write distractor registers
    # (which get overwritten too, so "a register written twice" is not a tell).
    writes = set(rng.sample(range(length), overwrites + 1))
    current: dict[str, str] = {}
    statements = []
    for slot in range(length):
        reg = query if slot in writes else rng.choice(others)
        # Each write changes the value; an "overwrite" with the same digit would not test
        # whether the model tracks the latest write.
        value = rng.choice([d for d in DIGITS if d != current.get(reg)])
        current[reg] = value
        statements.append(f"{reg}={value}")
    return _join(statements, query), current[query]


def _make_completion(rng: random.Random, steps: int, length: int) -> tuple[str, str]:
    query, *others = rng.sample(LETTERS, 3)
    ops = set(rng.sample(range(length), steps))
    total = 0
    statements = []
    for slot in range(length):
        reg = query if slot in ops else rng.choice(others)
        inc = rng.randint(1, 3)
        if reg == query:
            total += inc
        statements.append(f"{reg}+{inc}")
    # Coin flip for balance; a wrong target is off by only 1 or 2 so it can't be spotted
    # without actually adding up.
    if rng.random() < 0.5:
        target, answer = total, "yes"
    else:
        target = total + rng.choice([o for o in (-2, -1, 1, 2) if total + o >= 0])
        answer = "no"
    return _join(statements, f"{query}={target}"), answer


def _make_delayed_memory(rng: random.Random, delay: int, length: int) -> tuple[str, str]:
    query, *others = rng.sample(LETTERS, 5)
    bit = rng.choice("01")
    # The remembered write sits exactly `delay` statements before the question; extra
    # length goes in front of it, so padding never changes the delay.
    slot = length - 1 - delay
    statements = [f"{rng.choice(others)}={rng.choice('01')}" for _ in range(length)]
    statements[slot] = f"{query}={bit}"
    return _join(statements, query), bit


def _make_addition(rng: random.Random, digits: int, length: int) -> tuple[str, str]:
    # Exactly `digits` significant digits per operand; zero padding up to `length` keeps
    # the prompt the same size across difficulties.
    low = 10 ** (digits - 1) if digits > 1 else 0
    a = rng.randint(low, 10**digits - 1)
    b = rng.randint(low, 10**digits - 1)
    return f"{a:0{length}d}+{b:0{length}d}", str(a + b)


def _make_parity(rng: random.Random, bits: int, length: int) -> tuple[str, str]:
    # `bits` real bits scattered among "." padding, so their positions vary.
    slots = set(rng.sample(range(length), bits))
    chars = [rng.choice("01") if i in slots else "." for i in range(length)]
    return "".join(chars), str(chars.count("1") % 2)


# ---------------------------------------------------------------------------------------
# Task registry


@dataclass(frozen=True)
class Task:
    """A task generator plus the rules for its two dials. Call it to get examples."""

    name: str
    make: Callable[[random.Random, int, int], tuple[str, str]]
    min_difficulty: int
    min_length: Callable[[int], int]  # fewest items that can hold this difficulty
    default_length: Callable[[int], int]
    max_length: int | None = None  # limited by the number of names, where that applies

    def __call__(self, seed: int, difficulty: int, n: int, length: int | None = None) -> Iterator[Example]:
        """Yield n examples. Arguments are checked now, not on the first next()."""
        _check_int("seed", seed)
        _check_int("n", n, low=0)
        # A difficulty needs at least min_length(difficulty) items, so max_length caps it too.
        _check_int(f"{self.name} difficulty", difficulty, low=self.min_difficulty,
                   high=self.max_length)
        if length is None:
            length = self.default_length(difficulty)
        _check_int(f"{self.name} length at difficulty {difficulty}", length,
                   low=self.min_length(difficulty), high=self.max_length)
        return self._stream(seed, difficulty, n, length)

    def _stream(self, seed: int, difficulty: int, n: int, length: int) -> Iterator[Example]:
        # A string seed goes through sha512 in random.Random, so it is stable across runs
        # and Python versions (unlike hash()). Each (task, seed, difficulty) is its own stream.
        rng = random.Random(f"looplm.tasks/{self.name}/{seed}/{difficulty}")
        meta = {"task": self.name, "difficulty": difficulty, "length": length}
        for _ in range(n):
            prompt, answer = self.make(rng, difficulty, length)
            yield Example(prompt, answer, difficulty, dict(meta))


def _chain_default_length(hops: int) -> int:
    return min(2 * hops, len(LETTERS))


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("chain", _make_chain, 1, lambda k: k, _chain_default_length, max_length=len(LETTERS)),
        Task("latest_write", _make_latest_write, 0, lambda d: d + 1, lambda d: 2 * (d + 1)),
        Task("completion", _make_completion, 1, lambda d: d, lambda d: 2 * d),
        Task("delayed_memory", _make_delayed_memory, 0, lambda d: d + 1, lambda d: d + 1),
        Task("addition", _make_addition, 1, lambda d: d, lambda d: d),
        Task("parity", _make_parity, 1, lambda d: d, lambda d: d),
    ]
}


def _check_int(what: str, value: object, low: int | None = None, high: int | None = None) -> None:
    # bool is an int subclass, but difficulty=True is a mistake, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{what} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise UserError(f"{what} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise UserError(f"{what} must be <= {high}, got {value}")


def get_task(task: str) -> Task:
    if task not in TASKS:
        raise UserError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[task]


def default_length(task: str, difficulty: int) -> int:
    """The prompt length used when length=None."""
    return get_task(task).default_length(difficulty)


def _difficulties(difficulty: int | Iterable[int]) -> list[int]:
    if isinstance(difficulty, int) and not isinstance(difficulty, bool):
        return [difficulty]
    if isinstance(difficulty, (str, bytes)) or not isinstance(difficulty, Iterable):
        raise UserError(f"difficulty must be an integer or a range/list of integers, got {difficulty!r}")
    levels = list(difficulty)
    if not levels:
        raise UserError("difficulty range is empty")
    for d in levels:
        _check_int("difficulty", d)
    return levels


def generate(task: str, n: int, difficulty: int | Iterable[int], seed: int,
             length: int | None = None) -> list[Example]:
    """n examples of `task`. With several difficulties, example i has difficulties[i % m],
    so levels are balanced and a longer list starts with the shorter one.

    length=None uses the task's default length for the *largest* difficulty for every
    example, so prompt length carries no information about difficulty.
    """
    spec = get_task(task)
    _check_int("n", n, low=0)
    levels = _difficulties(difficulty)
    for d in levels:
        _check_int(f"{task} difficulty", d, low=spec.min_difficulty, high=spec.max_length)
    if length is None:
        length = spec.default_length(max(levels))
    m = len(levels)
    streams = [spec(seed, d, len(range(j, n, m)), length) for j, d in enumerate(levels)]
    return [next(streams[i % m]) for i in range(n)]


# ---------------------------------------------------------------------------------------
# Independent solvers: parse the prompt text and compute the answer from scratch.


def _parse(prompt: str, task: str) -> tuple[list[str], str]:
    *statements, question = prompt.split("; ")
    if not question.startswith("? "):
        raise UserError(f"{task} prompt must end with '; ? <query>': {prompt!r}")
    return statements, question[2:]


def _split_statement(s: str, op: str, task: str) -> tuple[str, str]:
    lhs, sep, rhs = s.partition(op)
    if not sep or not lhs or not rhs:
        raise UserError(f"{task}: cannot parse statement {s!r}")
    return lhs, rhs


def solve_chain(prompt: str) -> str:
    statements, var = _parse(prompt, "chain")
    binding: dict[str, str] = {}
    for s in statements:
        lhs, rhs = _split_statement(s, "=", "chain")
        if lhs in binding:
            raise UserError(f"chain: {lhs} is assigned twice")
        binding[lhs] = rhs
    seen = set()
    while not var.isdigit():
        if var in seen or var not in binding:
            raise UserError(f"chain: {var} has no value (cycle or unbound)")
        seen.add(var)
        var = binding[var]
    return var


def solve_latest_write(prompt: str) -> str:
    statements, reg = _parse(prompt, "latest_write")
    registers: dict[str, str] = {}
    for s in statements:  # in program order; later writes replace earlier ones
        lhs, rhs = _split_statement(s, "=", "latest_write")
        registers[lhs] = rhs
    if reg not in registers:
        raise UserError(f"latest_write: {reg} is never written")
    return registers[reg]


def solve_completion(prompt: str) -> str:
    statements, question = _parse(prompt, "completion")
    reg, target = _split_statement(question, "=", "completion")
    counters: dict[str, int] = {}
    for s in statements:
        lhs, rhs = _split_statement(s, "+", "completion")
        counters[lhs] = counters.get(lhs, 0) + int(rhs)
    return "yes" if counters.get(reg, 0) == int(target) else "no"


def solve_delayed_memory(prompt: str) -> str:
    statements, reg = _parse(prompt, "delayed_memory")
    value = None
    for s in statements:
        lhs, rhs = _split_statement(s, "=", "delayed_memory")
        if lhs == reg:
            value = rhs
    if value is None:
        raise UserError(f"delayed_memory: {reg} is never written")
    return value


def solve_addition(prompt: str) -> str:
    a, b = _split_statement(prompt, "+", "addition")
    return str(int(a) + int(b))


def solve_parity(prompt: str) -> str:
    return str(sum(ch == "1" for ch in prompt) % 2)


def trace_chain(prompt: str) -> list[str]:
    """The names a chain query passes through before its digit: "c=b; a=7; b=a; ? c" -> ["b", "a"]
    (the result after hop 1, hop 2, ...; the answer after the last hop is not included)."""
    statements, var = _parse(prompt, "chain")
    binding = dict(_split_statement(s, "=", "chain") for s in statements)
    out: list[str] = []
    while var in binding and not binding[var].isdigit():
        var = binding[var]
        if var in out:
            raise UserError(f"chain: cycle through {var}")
        out.append(var)
    return out


def query_chain(prompt: str) -> str:
    """The name a chain prompt asks about: "c=b; a=7; b=a; ? c" -> "c"."""
    return _parse(prompt, "chain")[1]


# Intermediate results step by step, for data.round_targets = "trace": round r of a looped model
# can be trained to read out trace[r - 1] (a k-step example has k - 1 entries).
TRACERS: dict[str, Callable[[str], list[str]]] = {"chain": trace_chain}
# The name a prompt asks about, for data.round_targets = "query_trace" (round 1 reads it out).
QUERIED: dict[str, Callable[[str], str]] = {"chain": query_chain}


SOLVERS: dict[str, Callable[[str], str]] = {
    "chain": solve_chain,
    "latest_write": solve_latest_write,
    "completion": solve_completion,
    "delayed_memory": solve_delayed_memory,
    "addition": solve_addition,
    "parity": solve_parity,
}


def solve(task: str, prompt: str) -> str:
    """The answer to `prompt`, computed from its text alone."""
    get_task(task)
    return SOLVERS[task](prompt)


# ---------------------------------------------------------------------------------------
# Training plumbing


def format_example(ex: Example) -> tuple[str, str]:
    """(prompt_text, answer_text): prompt + SEPARATOR, answer + "\\n".

    The model reads prompt_text and is trained to produce answer_text; the trailing newline
    is part of the answer so the model learns where to stop.
    """
    return ex.prompt + SEPARATOR, ex.answer + ANSWER_END


def answer_mask(prompt_ids: list[int], answer_ids: list[int]) -> tuple[list[int], list[bool]]:
    """Concatenate prompt and answer tokens and mark which *targets* are answer tokens.

    Convention (next-token prediction): with ids = prompt_ids + answer_ids, the model input
    is x = ids[:-1] and the target is y = ids[1:]. The returned mask has len(ids) - 1 entries,
    one per target, and mask[j] is True exactly when y[j] = ids[j + 1] is an answer token,
    i.e. when j >= len(prompt_ids) - 1. So the loss is taken at the last prompt position
    (predicting the first answer token) through the second-to-last answer position.

        prompt_ids = [p0, p1, p2], answer_ids = [a0, a1]
        ids  = [p0, p1, p2, a0, a1]
        y    = [p1, p2, a0, a1]
        mask = [F,  F,  T,  T ]
    """
    if len(prompt_ids) == 0:
        raise UserError("answer_mask needs a non-empty prompt (something must predict the first answer token)")
    if len(answer_ids) == 0:
        raise UserError("answer_mask needs a non-empty answer")
    ids = list(prompt_ids) + list(answer_ids)
    first = len(prompt_ids) - 1  # target index of the first answer token
    mask = [j >= first for j in range(len(ids) - 1)]
    return ids, mask


def load_jsonl(path: str | Path) -> list[Example]:
    """Read examples from a JSON Lines file: one {"prompt": str, "answer": str} per line.

    Optional "difficulty" (int) is kept, and optional "trace" (a list of strings: the intermediate
    result after each step, for data.round_targets = "trace"); other fields are ignored. Blank
    lines are skipped (sources.jsonl_objects, the one JSON Lines reader, streams the lines). A line
    without "difficulty" reads as difficulty 0 with meta["difficulty"] None, so a caller can tell a
    file that gives no difficulties (taskdata.read_task_file refuses a file that gives them on some
    lines only).
    Any problem raises UserError naming the file and the 1-based line number.
    """
    path = Path(path)
    examples = []
    for lineno, obj in jsonl_objects(path, 'with "prompt" and "answer"'):
        where = f"{path}, line {lineno}"
        for key in ("prompt", "answer"):
            if key not in obj:
                raise UserError(f"{where}: missing field {key!r}")
            if not isinstance(obj[key], str):
                raise UserError(f"{where}: field {key!r} must be a string, got {type(obj[key]).__name__}")
        if obj["answer"] == "":
            raise UserError(f"{where}: field 'answer' is empty")
        # The answer is terminated by a newline during training and decoding, so one
        # inside it would end generation early.
        if ANSWER_END in obj["answer"]:
            raise UserError(f"{where}: field 'answer' must not contain a newline")
        difficulty = obj.get("difficulty")
        if "difficulty" in obj and (not isinstance(difficulty, int) or isinstance(difficulty, bool)):
            raise UserError(f"{where}: field 'difficulty' must be an integer, got {difficulty!r}")
        meta = {"difficulty": difficulty, "length": None, "source": str(path), "line": lineno}
        if "trace" in obj:
            trace = obj["trace"]
            if not isinstance(trace, list) or not all(isinstance(t, str) and t for t in trace):
                raise UserError(f"{where}: field 'trace' must be a list of non-empty strings, got {trace!r}")
            meta["trace"] = list(trace)
        examples.append(Example(obj["prompt"], obj["answer"], 0 if difficulty is None else difficulty, meta))
    if not examples:
        raise UserError(f"{path}: no examples (the file is empty)")
    return examples
