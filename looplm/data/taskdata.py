"""Prompt/answer task data for the trainer: batches, answer-only masks, exact match, decoding.

When a recipe sets `data.task` (a built-in generator of looplm.tasks, or a JSONL file of
{"prompt", "answer"} lines) the trainer learns answers instead of a token stream:

    TaskSource      where examples come from: a built-in generator (fresh examples for every
                    batch, one prompt length at every difficulty, so length never tells the
                    difficulty) or a JSONL file split into training and held-out examples
                    (training: difficulty_min..difficulty_max; held out: up to eval_difficulty_max)
    TaskSampler     the training batch of global micro-batch i: one difficulty per micro-batch
                    (under the curriculum), right-padded, with the answer-only loss mask; with
                    data.depth_by_difficulty also the rounds to run and the rounds to supervise
    RoundTargets    data.round_targets = "trace" / "query_trace": what each round is trained to read
                    out (the queried name with query_trace, the intermediate result after r steps,
                    then the answer)
    score_task_sets exact-match accuracy and answer loss by rounds and by difficulty x rounds: the
                    one task evaluation, behind the trainer's report and `looplm eval` on a task run
                    (its held-out examples, or another JSONL file with --data)
    greedy_answers  batched greedy decoding of answers, the slow reference for exact match

Exact match is scored teacher-forced: greedy decoding reproduces the answer iff, given the
correct answer so far, the argmax at every answer position is the answer's next token (by
induction over the answer). So one forward pass at the largest round count scores every
round count at once, because a round's readout does not depend on later rounds.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..recipe.config import DataConfig, Recipe, SupervisionConfig
from ..errors import UserError
from .tasks import QUERIED, SEPARATOR, TASKS, TRACERS, Example, answer_mask, format_example, load_jsonl
from .tokenizer import ByteTokenizer

# Seeds of the generator streams. Training micro-batch i of run seed s draws from seed
# s * TRAIN_STRIDE + i (>= 0); held-out and probe sets use negative seeds, so they never
# share a stream with training.
TRAIN_STRIDE = 1_000_000_000
EVAL_SEED = -1
PROBE_SEED = -2


def is_builtin(task: str) -> bool:
    return task in TASKS


# ---------------------------------------------------------------------------------------
# Encoding


@dataclass
class TaskBatch:
    """Right-padded examples. Row i holds prompt + answer; x = ids[:-1], y = ids[1:]."""

    x: torch.Tensor           # (B, T) inputs, padded with the tokenizer's eos id
    y: torch.Tensor           # (B, T) next-token targets
    mask: torch.Tensor        # (B, T) True exactly at answer targets
    prompt_lens: list[int]    # prompt tokens per row (incl. the separator)
    lengths: list[int]        # prompt + answer tokens per row
    difficulties: list[int]

    def real_inputs(self) -> torch.Tensor:
        """(B, T) True at each row's len(prompt + answer) - 1 inputs, False at the padding after them."""
        return torch.arange(self.x.shape[1]) < torch.tensor(self.lengths)[:, None] - 1


def _where(ex: Example) -> str:
    if "line" in ex.meta:
        return f"{ex.meta.get('source', 'data.task')}, line {ex.meta['line']}"
    return f"{ex.meta.get('task', 'task')} example (difficulty {ex.difficulty})"


def format_for_training(ex: Example, separator: bool = True) -> tuple[str, str]:
    """tasks.format_example, without the trailing separator when separator is False."""
    prompt, answer = format_example(ex)
    return (prompt if separator else prompt[:-len(SEPARATOR)]), answer


def encode_examples(tok: Any, examples: list[Example], context: int | None = None,
                    separator: bool = True) -> TaskBatch:
    """Tokenize and right-pad examples; the mask comes from tasks.answer_mask."""
    if not examples:
        raise UserError("no examples to encode")
    rows = []
    for ex in examples:
        prompt, answer = format_for_training(ex, separator)
        answer_ids = tok.encode(answer)
        ids, mask = answer_mask(tok.encode(prompt), answer_ids)
        if context is not None and len(ids) - 1 > context:
            raise UserError(f"{_where(ex)}: prompt + answer is {len(ids)} tokens, more than "
                            f"model.context + 1 = {context + 1}; shorten it or raise model.context")
        rows.append((ids, mask, len(ids) - len(answer_ids)))
    T = max(len(ids) for ids, _, _ in rows) - 1
    pad = tok.eos_id
    # one tensor from padded lists: a row-by-row copy costs more than the examples' generation
    x = torch.tensor([ids[:-1] + [pad] * (T + 1 - len(ids)) for ids, _, _ in rows], dtype=torch.long)
    y = torch.tensor([ids[1:] + [pad] * (T + 1 - len(ids)) for ids, _, _ in rows], dtype=torch.long)
    m = torch.tensor([mask + [False] * (T + 1 - len(ids)) for ids, mask, _ in rows], dtype=torch.bool)
    return TaskBatch(x, y, m, [p for _, _, p in rows], [len(ids) for ids, _, _ in rows],
                     [ex.difficulty for ex in examples])


@dataclass
class RoundTargets:
    """Per-round targets of one batch (data.round_targets = "trace"). A row whose example has
    k - 1 trace entries is trained, at rounds r < k, on trace[r - 1] at the position of each of
    the answer's own tokens (not its end mark) and nothing else; from round k on, on the whole
    answer (y, mask). ("query_trace": the queried name is entry 0, so everything comes a round
    later.) Each answer token, not only the first: each position runs its own loop, and an answer
    of several tokens ("green" beside "grey") is told apart only at its later positions, which
    must make the same chase (trained at the first alone, all their errors were there). An entry
    of several tokens (a two-letter name, a word) is a bag of them: the target is the distribution
    putting 1/n on each of its n tokens (its cross-entropy is the mean of each token's), so the
    state must tell that entry from the others without the readout spelling it out."""

    y: torch.Tensor           # (B, T) the answer targets, as in TaskBatch
    mask: torch.Tensor        # (B, T)
    chase: torch.Tensor       # (B, T) the answer's own tokens: mask without the end mark
    trace: torch.Tensor       # (B, K) token id of each one-token trace entry (padded with 0)
    steps: torch.Tensor       # (B,) trace entries per row (k - 1)
    bags: torch.Tensor | None = None   # (B, K, V) each entry's token distribution, where any has several tokens
    _built: dict = field(default_factory=dict, repr=False)   # round -> (targets, mask): the step asks twice

    def __call__(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets, mask) for round r: targets (B, T) ids, or (B, T, V) distributions with bags."""
        if r not in self._built:
            self._built[r] = self._build(r)
        return self._built[r]

    def _build(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        before = self.steps >= r                                # (B,) rows still before their answer
        if not before.any():
            return self.y, self.mask
        at = self.chase & before[:, None]                       # (B, T) their answer tokens' positions
        mask = torch.where(before[:, None], at, self.mask)
        if self.bags is not None:
            y = torch.nn.functional.one_hot(self.y, self.bags.shape[-1]).float()      # (B, T, V)
            return torch.where(at[..., None], self.bags[:, r - 1, None, :], y), mask
        return torch.where(at, self.trace[:, r - 1, None], self.y), mask


def example_trace(ex: Example, task: str, query_separator: str | None = None) -> list[str]:
    """An example's intermediate results: a JSONL line's "trace", else the built-in task's tracer; with
    `query_separator` (data.round_targets = "query_trace": a JSONL file's data.item_separator, "" for a
    built-in task) the queried name first."""
    trace = ex.meta["trace"] if "trace" in ex.meta else TRACERS[task](ex.prompt) if task in TRACERS else []
    if query_separator is None:
        return trace
    return [queried_name(ex, task, query_separator), *trace]


def query_split(recipe: Recipe) -> str | None:
    """example_trace's `query_separator` for a recipe: None unless data.round_targets = "query_trace"."""
    return recipe.data.item_separator if recipe.data.answer_round_offset else None


def queried_name(ex: Example, task: str, separator: str) -> str:
    """The name `ex` asks about: a built-in task's (tasks.QUERIED), or in a JSONL prompt split at `separator`
    the one word of its last item (the query) that another item names as a word ("k>p p>w ?k=" -> "k";
    "... Where does delta lead?" -> "delta"); where no word is, the one run of the query's other visible
    characters that another item names, as `chase_links` reads names ("(C<#) , ask #" -> "#"). UserError, naming the line, when there is
    not exactly one."""
    if is_builtin(task):
        return QUERIED[task](ex.prompt)
    *items, query = ex.prompt.split(separator)
    words = dict.fromkeys(_WORD.findall(query))
    # a run of word characters is named as a word exactly where it is one of an item's maximal runs (_names)
    others = set(_WORD.findall(separator.join(items)))
    named = [w for w in words if w in others]
    if not named:   # names written in symbols ("(*<+) , (C<#) , ask #"): a run of other visible characters
        named = [m for m in dict.fromkeys(_MARK.findall(query)) if any(_names(item, m) for item in items)]
    if len(named) != 1:
        raise UserError(f"recipe field data.round_targets = \"query_trace\": {_where(ex)}: the last item {query!r} "
                        f"(split at data.item_separator = {separator!r}) holds "
                        + ("no name" if not named else f"{len(named)} names ({', '.join(named)})")
                        + " that another item names, where one (the queried name) is needed; check "
                        "data.item_separator, or use round_targets = \"trace\"")
    return named[0]


def round_targets(tok: Any, examples: list[Example], b: TaskBatch, task: str, vocab: int,
                  query_separator: str | None = None) -> RoundTargets:
    """The RoundTargets of an encoded batch over a readout of `vocab` ids; entries of several tokens
    become bags (RoundTargets.bags). Entries are non-empty strings (load_jsonl refuses others). With
    `query_separator` (example_trace) round 1 reads out the queried name and the trace comes a round later."""
    traces = [[tok.encode(t) for t in example_trace(ex, task, query_separator)] for ex in examples]
    K = max(1, max(len(t) for t in traces))
    trace = torch.tensor([[i[0] for i in t] + [0] * (K - len(t)) for t in traces], dtype=torch.long)
    bags = None
    if any(len(i) > 1 for t in traces for i in t):
        bags = torch.zeros(len(traces), K, vocab)
        for row, t in enumerate(traces):
            for k, ids in enumerate(t):
                for i in ids:
                    bags[row, k, i] += 1.0 / len(ids)
    target = torch.arange(b.y.shape[1])                                                # (T,)
    start = torch.tensor([p - 1 for p in b.prompt_lens])[:, None]                      # (B, 1)
    size = torch.tensor([len(tok.encode(ex.answer)) for ex in examples])[:, None]      # (B, 1)
    chase = (target >= start) & (target < start + size)
    return RoundTargets(b.y, b.mask, chase, trace, torch.tensor([len(t) for t in traces]), bags)


# ---------------------------------------------------------------------------------------
# Where examples come from


class TaskSource:
    """A built-in generator or a JSONL file, with the recipe's difficulty and length dials."""

    def __init__(self, recipe: Recipe):
        d = recipe.data
        self.task, self.seed, self.length_min = d.task, recipe.train.seed, d.train_length_min
        self.separator = d.separator
        self.builtin = is_builtin(d.task)
        # JSONL length dials (data.length_unit): lines by difficulty, then by prompt length in that unit
        self.length_unit, self.item_separator = d.length_unit, d.item_separator
        self._length_pool: dict[int, dict[int, list[Example]]] | None = None
        self.length_top: int | None = None       # JSONL: the longest training prompt the length dials allow
        self.train_length_counts: dict[int, dict[int, int]] = {}  # JSONL: training lines by difficulty, then length
        self.unused_counts: dict[int, int] = {}  # JSONL lines outside difficulty_min..the evaluated maximum
        self.levelled = True                     # False: a JSONL file whose lines give no "difficulty"
        self.crop = False                        # data.crop_curriculum: training prompts lose unneeded items
        if self.builtin and d.traced and (d.task not in TRACERS or (d.answer_round_offset and d.task not in QUERIED)):
            raise UserError(f"recipe field data.round_targets = \"{d.round_targets}\": task {d.task} has no trace of "
                            f"intermediate results" + (" and queried name" if d.answer_round_offset else "")
                            + f" (tasks with one: {', '.join(QUERIED if d.answer_round_offset else TRACERS)}; "
                            f"a JSONL file can give \"trace\" lists)")
        if self.builtin:
            spec = TASKS[d.task]
            if d.difficulty_min < spec.min_difficulty:
                raise UserError(f"recipe field data.difficulty_min: {d.task} difficulties start at "
                                f"{spec.min_difficulty}, got {d.difficulty_min}")
            self.eval_max = d.eval_difficulty_max or 2 * d.difficulty_max
            if spec.max_length is not None and self.eval_max > spec.max_length:
                raise UserError(f"recipe field data.eval_difficulty_max: {d.task} allows difficulties up to "
                                f"{spec.max_length}; {self.eval_max} was asked (0 means 2 x data.difficulty_max)")
            self.length = d.task_length or spec.default_length(self.eval_max)
            for level in range(d.difficulty_min, max(self.eval_max, d.difficulty_max) + 1):
                try:
                    spec(0, level, 0, self.length)  # validates the (difficulty, length) pair
                except UserError as err:
                    raise UserError(f"recipe field data.task_length = {self.length}: {err}") from None
            self.train_levels = list(range(d.difficulty_min, d.difficulty_max + 1))
            self.eval_levels = list(range(d.difficulty_min, self.eval_max + 1))
            self._train_pool: dict[int, list[Example]] = {}
            self._eval_pool: dict[int, list[Example]] = {}
        else:
            self._split_file(read_task_file(d.task, recipe, traces=d.traced), d)
            self._check_difficulty_dials(recipe)
            if self.length_unit:
                self._select_lengths(d)
            self.crop = d.crop_curriculum > 0
            if self.crop:
                self._check_crop(d)
        # training examples per difficulty (None for a generator: fresh ones every batch)
        self.train_counts = None if self.builtin else {lv: len(p) for lv, p in sorted(self._train_pool.items())}

    def short_prompt_note(self, d: DataConfig) -> str | None:
        """A JSONL file trained on its traces with no curriculum that shortens its prompts, whose training prompts
        are all near one length: say so before training, since the lookup was found on short prompts first in
        our trials (docs/tasks.md) and this file gives none. None where a curriculum applies, the task is a
        generator, or the prompts' lengths vary (the longest over twice the shortest, in bytes)."""
        if self.builtin or not d.traced or self.crop or (self.length_unit and d.train_length_min):
            return None
        sizes = [len(ex.prompt.encode()) for pool in self._train_pool.values() for ex in pool]
        lo, hi = min(sizes), max(sizes)
        if 2 * lo < hi:
            return None
        return (f"data.task {d.task}: every training prompt is {lo}..{hi} bytes long as written, and no curriculum "
                f"gives shorter ones (data.crop_curriculum = 0, no data.length_unit with data.train_length_min); "
                f"the lookup was found on short prompts first in our trials, and data.crop_curriculum (with "
                f"data.item_separator) makes them from the file's own lines (docs/tasks.md)")

    def _split_file(self, examples: list[Example], d: DataConfig) -> None:
        """A JSONL file's training and held-out pools.

        Training draws only lines with difficulty_min <= difficulty <= difficulty_max, less a
        val_fraction held out; every line above difficulty_max up to eval_difficulty_max (0 = 2 x
        difficulty_max) is held out too, so a file can hold the extrapolation experiment. A file
        whose lines give no "difficulty" has nothing to select: all its lines are difficulty 0,
        and difficulty_min/max/eval_difficulty_max other than their defaults are refused rather
        than ignored (a recipe cannot tell a default it left alone from one it set)."""
        path = d.task   # its prompts are used as written (data.length_unit selects them by length, _select_lengths)
        self.levelled = examples[0].meta["difficulty"] is not None  # read_task_file: on every line or none
        if not self.levelled:
            defaults = DataConfig()
            for name in ("difficulty_min", "difficulty_max", "eval_difficulty_max"):
                if getattr(d, name) != getattr(defaults, name):
                    raise UserError(f"recipe field data.{name}: {path} gives no \"difficulty\" on its lines, so there "
                                    f"are no difficulties to select; give every line a \"difficulty\" or leave "
                                    f"data.{name} at its default {getattr(defaults, name)}")
            lo = hi = top = 0
        else:
            lo, hi = d.difficulty_min, d.difficulty_max
            top = d.eval_difficulty_max or 2 * hi
        train = [ex for ex in examples if lo <= ex.difficulty <= hi]
        beyond = [ex for ex in examples if hi < ex.difficulty <= top]
        self.unused_counts = _counts([ex for ex in examples if not lo <= ex.difficulty <= top])
        if not train:
            raise UserError(f"{path}: no line to train on with difficulty in data.difficulty_min..data.difficulty_max "
                            f"= {lo}..{hi}; the file's difficulties (lines): "
                            + ", ".join(f"{lv} ({n})" for lv, n in _counts(examples).items()))
        # val_fraction of each trained difficulty's lines is held out (at least one where there are two)
        rng = random.Random(f"looplm.taskdata/split/{self.seed}")
        kept, held = [], []
        for exs in _by_level(train).values():
            order = list(range(len(exs)))
            rng.shuffle(order)
            n_val = min(len(exs) - 1, max(1, round(d.val_fraction * len(exs))))
            held += [exs[i] for i in order[:n_val]]
            kept += [exs[i] for i in order[n_val:]]
        held += beyond
        if not held:
            raise UserError(f"{path}: nothing to hold out for evaluation; needs at least 2 examples of one difficulty "
                            f"in {lo}..{hi} (one to train on, one held out)"
                            + (f" or one of difficulty {hi + 1}..{top}" if top > hi else ""))
        self._train_pool, self._eval_pool = _by_level(kept), _by_level(held)
        self.train_levels, self.eval_levels = sorted(self._train_pool), sorted(self._eval_pool)
        self.length, self.eval_max = None, max(self.eval_levels)

    def _check_difficulty_dials(self, recipe: Recipe) -> None:
        """A JSONL file: refuse a difficulty schedule that has nothing to schedule (a file without
        difficulties, or a single trained difficulty) rather than run it as a no-op."""
        d, path = recipe.data, recipe.data.task
        if self.levelled and len(self.train_levels) > 1:
            return
        why = (f"{path} gives no \"difficulty\" on its lines" if not self.levelled else
               f"{path} has training lines of one difficulty only ({self.train_levels[0]}) in "
               f"data.difficulty_min..data.difficulty_max = {d.difficulty_min}..{d.difficulty_max}")
        if d.curriculum:
            raise UserError(f"recipe field data.curriculum = {d.curriculum}: {why}, so there is no difficulty to "
                            f"grow; set it to 0 or train on several difficulties")
        if d.warmup_steps and not (self.length_unit and d.train_length_min) and not d.crop_curriculum:
            raise UserError(f"recipe field data.warmup_steps = {d.warmup_steps}: {why}, and no length dial "
                            f"(data.length_unit with data.train_length_min, or data.crop_curriculum) gives "
                            f"warm-up shorter prompts, so "
                            f"warm-up would train what every step trains; set it to 0")
        if d.depth_by_difficulty and not self.levelled:
            raise UserError(f"recipe field data.depth_by_difficulty: {why}, so every line reads as difficulty 0 "
                            f"and there is no depth to match; give every line a \"difficulty\" or set it to false")

    def _select_lengths(self, d: DataConfig) -> None:
        """A JSONL file with data.length_unit: the training lines the length dials allow, by
        difficulty and prompt length (that unit). task_length caps the length (0 = the file's
        longest training prompt); with train_length_min = 0 every training line has exactly
        task_length (task_length 0: no selection), else a difficulty trains its lines of
        train_length_min..task_length, from its shortest such line up (see train_length). Every
        refusal names the field that cannot apply; held-out lines are evaluated whatever their length."""
        path, unit = d.task, self.length_unit
        by_length = {lv: _by_length(pool, unit, self.item_separator) for lv, pool in self._train_pool.items()}

        def lengths(lv: int) -> str:
            return ", ".join(f"{n} ({len(exs)})" for n, exs in by_length[lv].items())

        self.length_top = d.task_length or max(max(b) for b in by_length.values())
        if not d.train_length_min and not d.task_length:
            self.train_length_counts = {lv: {n: len(e) for n, e in b.items()} for lv, b in by_length.items()}
            return   # the unit only records lengths: nothing selected
        if d.train_length_min > self.length_top:
            raise UserError(f"recipe field data.train_length_min = {d.train_length_min}: larger than the longest "
                            f"training prompt allowed, {self.length_top} {unit}"
                            + (" (data.task_length)" if d.task_length else f" (the longest in {path})"))
        lo = d.train_length_min or self.length_top
        pool = {}
        for lv, b in by_length.items():
            pool[lv] = {n: exs for n, exs in b.items() if lo <= n <= self.length_top}
            if not pool[lv]:
                field = "data.train_length_min" if d.train_length_min else "data.task_length"
                want = f"{lo}..{self.length_top}" if d.train_length_min else f"exactly {self.length_top}"
                raise UserError(f"recipe field {field}: {path} has no training line of difficulty {lv} whose prompt is "
                                f"{want} {unit} long; its training lines by length ({unit}, lines): {lengths(lv)}")
        if d.length_curriculum and all(len(b) == 1 for b in pool.values()):
            raise UserError(f"recipe field data.length_curriculum = {d.length_curriculum}: every trained difficulty "
                            f"of {path} has training lines of one length only in {lo}..{self.length_top} {unit}, so "
                            f"there is no length to grow; set it to 0")
        self._length_pool = pool
        self._train_pool = {lv: [ex for exs in b.values() for ex in exs] for lv, b in pool.items()}
        self.train_length_counts = {lv: {n: len(e) for n, e in b.items()} for lv, b in pool.items()}

    def _check_crop(self, d: DataConfig) -> None:
        """data.crop_curriculum keeps the statements a line's chase follows (`chase_links`): find them once per
        training line (meta["links"]), and refuse a file where they cannot be found (no "trace", no queried
        name, or a hop no item names both ends of, which is what a wrong data.item_separator or names run
        into other text look like)."""
        sep = self.item_separator
        for level, pool in self._train_pool.items():
            marked = []
            for ex in pool:
                if "trace" not in ex.meta:
                    raise UserError(f"recipe field data.crop_curriculum = {d.crop_curriculum}: {_where(ex)} has no "
                                    f"\"trace\", so the items its answer needs cannot be told from the others; "
                                    f"give every line a \"trace\" (its intermediate results) or set it to 0")
                try:
                    links = chase_links(ex, sep)
                except UserError:
                    links = None
                if links is None:
                    raise UserError(f"recipe field data.crop_curriculum = {d.crop_curriculum}: {_where(ex)}: split "
                                    f"at data.item_separator = {sep!r}, its chase (the queried name in the last item, "
                                    f"its \"trace\", the answer) has a hop no item but the last names both ends of "
                                    f"as words; a prompt's statements must be its items and name both their ends as "
                                    f"words, or set it to 0")
                marked.append(replace(ex, meta={**ex.meta, "links": tuple(links)}))
            self._train_pool[level] = marked

    def length_window(self, level: int, progress: float = 1.0) -> tuple[int, int] | None:
        """The prompt lengths training can draw at `level` when the length ramp is at `progress`:
        (lo, hi) with hi raised from lo (progress 0) to the longest allowed (progress 1); None
        when there is no length dial."""
        if self.builtin:
            if not self.length_min:
                return None
            lo = min(self.length, max(self.length_min, TASKS[self.task].min_length(level)))
            return lo, ramp(lo, self.length, progress)
        if self._length_pool is None:
            return None
        lo = min(self._length_pool[level])
        return lo, ramp(lo, self.length_top, progress)

    def train_length(self, level: int, index: int, progress: float = 1.0) -> int | None:
        """Prompt length of training micro-batch `index`: task_length, or with data.train_length_min
        drawn per micro-batch from lo = max(train_length_min, the level's minimum) up to a cap that
        data.length_curriculum raises from lo (progress 0) to task_length (progress 1). A JSONL file
        with data.length_unit: the same window, lo being the level's shortest line in
        train_length_min..task_length, and the length drawn uniformly among its lines' lengths in it
        (None: no length dial, every training line)."""
        window = self.length_window(level, progress)
        if window is None:
            return self.length if self.builtin or self._length_pool is None else self.length_top
        rng = random.Random(f"looplm.taskdata/length/{self.seed}/{index}")
        if self.builtin:
            return rng.randint(*window)
        return rng.choice([n for n in self._length_pool[level] if n <= window[1]])

    def train_examples(self, level: int, n: int, index: int, progress: float = 1.0,
                       keep: float = 1.0) -> list[Example]:
        """The n examples of training micro-batch `index`, all of difficulty `level` (and, with a JSONL
        file's length dials, all of one prompt length); with data.crop_curriculum each keeps `keep` of
        the items it does not need (crop_items)."""
        length = self.train_length(level, index, progress)
        if self.builtin:
            return list(TASKS[self.task](self.seed * TRAIN_STRIDE + index, level, n, length))
        pool = self._train_pool[level] if self._length_pool is None else self._length_pool[level][length]
        rng = random.Random(f"looplm.taskdata/batch/{self.seed}/{index}")
        drawn = rng.choices(pool, k=n)
        if not self.crop or keep >= 1.0:
            return drawn
        return [crop_items(ex, self.item_separator, keep, rng) for ex in drawn]

    def eval_sets(self, n: int, seed: int = EVAL_SEED, levels: list[int] | None = None) -> dict[int, list[Example]]:
        """Held-out examples by difficulty: n fresh ones per level (a JSONL file: the first n of
        each level's held-out lines)."""
        levels = self.eval_levels if levels is None else levels
        if self.builtin:
            return {lv: list(TASKS[self.task](seed, lv, n, self.length)) for lv in levels}
        return {lv: self._eval_pool[lv][:n] for lv in levels if lv in self._eval_pool}

    def train_token_count(self) -> int | None:
        """Tokens in the training split of a JSONL file (None for a generator: unbounded)."""
        if self.builtin:
            return None
        return sum(len("".join(format_for_training(ex, self.separator)).encode()) for pool in
                   self._train_pool.values() for ex in pool)


_WORD = re.compile(r"[0-9A-Za-z_]+")
_MARK = re.compile(r"[^\s0-9A-Za-z_]+")


def _names(item: str, name: str) -> bool:
    """Whether `item` holds `name` as a word: not run into letters, digits or _ on either side."""
    return _word_pattern(name).search(item) is not None


@functools.lru_cache(maxsize=65536)
def _word_pattern(name: str) -> re.Pattern:
    """`name` as a whole word, compiled once (every training batch asks about the same few names)."""
    return re.compile(rf"(?<![0-9A-Za-z_]){re.escape(name)}(?![0-9A-Za-z_])")


def chase_links(ex: Example, separator: str) -> list[int] | None:
    """The items (indices, the query excluded) a pointer chase follows: for each hop, from the queried name
    (`queried_name`) through the trace to the answer, the items that name both its source and its target as
    words; None when a hop has none (a wrong data.item_separator, or a trace that is not the chase's)."""
    *items, _ = ex.prompt.split(separator)
    path = [queried_name(ex, "", separator), *ex.meta["trace"], ex.answer]
    runs = [set(_WORD.findall(item)) for item in items]
    # the items naming each name on the path: one of an item's runs for a name of word characters only
    # (what _names asks of it), _names itself for any other
    places = [{i for i, r in enumerate(runs) if name in r} if _WORD.fullmatch(name)
              else {i for i, item in enumerate(items) if _names(item, name)} for name in path]
    links: set[int] = set()
    for src, dst in zip(places, places[1:]):
        if not src & dst:
            return None
        links |= src & dst
    return sorted(links)


def crop_items(ex: Example, separator: str, keep: float, rng: random.Random) -> Example:
    """`ex` with round(keep x m) of its m unneeded items left, chosen by rng, in their order. Needed: the
    last item (the query) and the statements the chase follows (`chase_links`, found once per line and kept
    in meta["links"]), so dropping the others never changes the answer. A statement that only points at a
    name on the chase (a tree hanging into it) or at the answer's value is not needed: it goes like any
    other distractor, so the first steps train the chase alone. (Keeping at least one distractor, so that
    a one-hop prompt is never the lone statement, measured worse: docs/tasks.md.) Blank pieces stay."""
    items = ex.prompt.split(separator)
    links = ex.meta["links"] if "links" in ex.meta else chase_links(ex, separator)
    if links is None:              # TaskSource._check_crop refuses such a line before training
        raise ValueError(f"{_where(ex)}: its chase cannot be found at separator {separator!r}")
    needed = set(links)
    spare = [i for i, item in enumerate(items[:-1]) if item.strip() and i not in needed]
    kept = round(keep * len(spare))
    drop = set(rng.sample(spare, len(spare) - kept))
    return replace(ex, prompt=separator.join(item for i, item in enumerate(items) if i not in drop),
                   meta={**ex.meta, "crop": (kept, len(spare))})


def ramp(lo: int, top: int, progress: float) -> int:
    """The longest prompt a length ramp allows at `progress` (0: lo, 1: top)."""
    return lo + math.ceil(progress * (top - lo))


def prompt_length(prompt: str, unit: str, item_separator: str = "") -> int:
    """A JSONL prompt's length in data.length_unit: its tokens as written (byte tokenizer, as task
    recipes use), or its non-blank pieces split at data.item_separator."""
    if unit == "tokens":
        return len(ByteTokenizer().encode(prompt))
    if unit == "items":
        return sum(1 for piece in prompt.split(item_separator) if piece.strip())
    raise ValueError(f"unknown length unit {unit!r}")


def _by_length(examples: list[Example], unit: str, item_separator: str) -> dict[int, list[Example]]:
    out: dict[int, list[Example]] = {}
    for ex in examples:
        out.setdefault(prompt_length(ex.prompt, unit, item_separator), []).append(ex)
    return dict(sorted(out.items()))


def _by_level(examples: list[Example]) -> dict[int, list[Example]]:
    out: dict[int, list[Example]] = {}
    for ex in examples:
        out.setdefault(ex.difficulty, []).append(ex)
    return out


def _counts(examples: list[Example]) -> dict[int, int]:
    return {lv: len(exs) for lv, exs in sorted(_by_level(examples).items())}


JSONL_SUFFIXES = (".jsonl", ".ndjson")


def read_task_file(path: str | Path, recipe: Recipe, traces: bool = False) -> list[Example]:
    """A JSONL file's examples, checked before anything runs: tasks.load_jsonl's checks, every
    example within model.context, a "difficulty" on every line or on none, and with traces=True
    (training with data.round_targets = "trace" or "query_trace") traces it can build round targets from
    (with "query_trace", one queried name per line). UserError names the line."""
    examples = load_jsonl(path)
    given = [ex for ex in examples if ex.meta["difficulty"] is not None]
    if given and len(given) < len(examples):
        bare = next(ex for ex in examples if ex.meta["difficulty"] is None)
        raise UserError(f"{path}, line {bare.meta['line']}: no \"difficulty\", but line {given[0].meta['line']} "
                        f"has one; give every line a \"difficulty\" or none")
    tok = ByteTokenizer()  # task recipes are byte-tokenized (config.DataConfig)
    context = recipe.model.context
    lengths = []                                   # each line's prompt + answer in tokens, as training encodes it
    for ex in examples:
        prompt, answer = format_for_training(ex, recipe.data.separator)
        lengths.append(len(answer_mask(tok.encode(prompt), tok.encode(answer))[0]))
    over = [(n, ex) for n, ex in zip(lengths, examples) if n - 1 > context]
    if over:                                       # name the longest line, and the context that fits every line
        n, ex = max(over, key=lambda t: t[0])
        raise UserError(f"{_where(ex)}: prompt + answer is {n} tokens, the longest of {len(over)} line(s) over "
                        f"model.context + 1 = {context + 1}; raise model.context to at least {n - 1} "
                        f"(--set model.context={n - 1}) or shorten them")
    if traces:                                     # what a line's round targets need: its trace, its queried name
        split = query_split(recipe)
        for ex in examples:
            example_trace(ex, recipe.data.task, split)
    return examples


def eval_file_sets(path: str, recipe: Recipe) -> dict[int, list[Example]]:
    """`looplm eval TASK_RUN --data FILE.jsonl`: every line of the file by difficulty (a file
    without difficulties: all at 0), read with training's checks."""
    p = Path(path)
    if p.is_dir() or p.suffix.lower() not in JSONL_SUFFIXES:
        raise UserError(f"--data {path}: a task run (data.task = {recipe.data.task}) is scored on a JSONL file of "
                        f"{{\"prompt\": ..., \"answer\": ...}} lines named *.jsonl; got "
                        + ("a folder" if p.is_dir() else
                           "a file without the .jsonl suffix (text is for language-model runs)"))
    return dict(sorted(_by_level(read_task_file(p, recipe)).items()))


# ---------------------------------------------------------------------------------------
# Training batches


class TaskSampler:
    """Training batches as a pure function of (seed, global micro-batch index)."""

    def __init__(self, source: TaskSource, tok: Any, recipe: Recipe):
        self.source, self.tok, self.recipe = source, tok, recipe
        self._seen: set[int] = set()
        self._unique_tokens = 0
        # data.crop_curriculum: lines cut, and their unneeded items (spare) and those kept, as crop_items did it
        self.crop_counts = {"lines": 0, "spare": 0, "kept": 0}

    def in_warmup(self, index: int) -> bool:
        return index // self.recipe.train.grad_accum < self.recipe.data.warmup_steps

    def progress(self, index: int, fraction: float | None = None) -> float:
        """How far a ramp over `fraction` of train.steps (default data.curriculum) has got at
        micro-batch `index`: 0 during warm-up, 1 once it is done."""
        r = self.recipe
        ramp = (r.data.curriculum if fraction is None else fraction) * r.train.steps
        step = index // r.train.grad_accum - r.data.warmup_steps
        if step < 0:
            return 0.0
        return 1.0 if ramp <= 0 else min(1.0, step / ramp)

    def level(self, index: int) -> int:
        """The difficulty of micro-batch `index`: uniform over the levels the curriculum allows."""
        levels, r = self.source.train_levels, self.recipe
        if self.in_warmup(index):
            return levels[0]
        allowed = min(len(levels), 1 + int(len(levels) * self.progress(index)))
        return levels[random.Random(f"looplm.taskdata/level/{r.train.seed}/{index}").randrange(allowed)]

    def depth_plan(self, level: int, index: int) -> tuple[int, SupervisionConfig]:
        """data.depth_by_difficulty: (rounds to run, supervision of every round from `level` on,
        or from round 1 with trace targets); query_trace runs at least level + 1 rounds."""
        d, r = self.recipe.depth, self.recipe
        if r.model.untied or d.kind == "fixed":
            rounds = d.rounds
        else:
            lo = max(level + r.data.answer_round_offset, d.min, 1)   # query_trace: a round before the first hop
            hi = max(lo, d.max)
            rounds = random.Random(f"looplm.taskdata/rounds/{r.train.seed}/{index}").randint(lo, hi)
        first = 1 if r.data.traced else max(1, min(level, rounds))
        return rounds, SupervisionConfig(kind="rounds", rounds=tuple(range(first, rounds + 1)))

    def keep(self, index: int) -> float:
        """data.crop_curriculum: the fraction of their unneeded items micro-batch `index`'s lines keep,
        uniform in [0, progress] (0 in warm-up); 1 without the curriculum."""
        d = self.recipe.data
        if not d.crop_curriculum:
            return 1.0
        top = self.progress(index, d.crop_curriculum)
        return random.Random(f"looplm.taskdata/crop/{self.recipe.train.seed}/{index}").uniform(0.0, top)

    def examples(self, index: int) -> list[Example]:
        level = self.level(index)
        return self.source.train_examples(level, self.recipe.train.batch_size, index,
                                          self.progress(index, self.recipe.data.length_curriculum), self.keep(index))

    def batch(self, index: int, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """(x, y, train_step options) of micro-batch `index`, or of its `rows` (this process's share
        of a multi-process step; every process draws the same examples, so the level and depth
        agree, and counts all of them as seen): the options carry the answer mask and, with
        data.depth_by_difficulty, the rounds and supervision for this micro-batch."""
        drawn = self.examples(index)
        for ex in drawn:
            if "crop" in ex.meta:
                kept, spare = ex.meta["crop"]
                self.crop_counts["lines"] += 1
                self.crop_counts["spare"] += spare
                self.crop_counts["kept"] += kept
        b = encode_examples(self.tok, drawn, self.recipe.model.context, self.recipe.data.separator)
        for ex, n in zip(drawn, b.lengths):
            key = int.from_bytes(hashlib.blake2b(f"{ex.prompt}\0{ex.answer}".encode(), digest_size=8).digest(),
                                 "little", signed=True)
            if key not in self._seen:
                self._seen.add(key)
                self._unique_tokens += n
        examples = drawn
        if rows is not None:   # padded to the global batch's longest, so every process has the same width
            examples = drawn[rows]
            b = TaskBatch(b.x[rows], b.y[rows], b.mask[rows], b.prompt_lens[rows], b.lengths[rows],
                          b.difficulties[rows])
        opts: dict[str, Any] = {"mask": b.mask, "valid": b.real_inputs()}   # valid: what counts as tokens seen
        if self.recipe.data.traced:
            opts["round_targets"] = round_targets(self.tok, examples, b, self.recipe.data.task,
                                                   self.recipe.model.vocab_size, query_split(self.recipe))
        if self.recipe.data.depth_by_difficulty:
            opts["rounds"], opts["supervision"] = self.depth_plan(drawn[0].difficulty, index)
        return b.x, b.y, opts

    def unique_tokens(self) -> int:
        """Tokens of the distinct examples trained on so far."""
        return self._unique_tokens

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"seen": torch.tensor(sorted(self._seen), dtype=torch.long),
                "unique_tokens": torch.tensor(self._unique_tokens, dtype=torch.long),
                "crop_counts": torch.tensor([self.crop_counts[k] for k in ("lines", "spare", "kept")])}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._seen = set(state["seen"].tolist())
        self._unique_tokens = int(state["unique_tokens"])
        if "crop_counts" in state:   # a checkpoint from before data.crop_curriculum has none
            self.crop_counts = dict(zip(("lines", "spare", "kept"), state["crop_counts"].tolist()))


def prepare_task_data(recipe: Recipe, run_dir: Path, write: bool = True):
    """The trainer's data for a task recipe: (tokenizer, TaskSampler, TaskSource); write=False leaves
    the tokenizer files to rank 0."""
    tok = ByteTokenizer()
    if tok.vocab_size > recipe.model.vocab_size:
        raise UserError(f"model.vocab_size {recipe.model.vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
    source = TaskSource(recipe)
    if write:
        tok.save(Path(run_dir) / "checkpoint")
    return tok, TaskSampler(source, tok, recipe), source
