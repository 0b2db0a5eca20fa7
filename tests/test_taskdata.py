"""Training on prompt/answer task data: the answer-only mask through the real batching code,
exact match vs greedy decoding, the difficulty/length/curriculum dials, JSONL errors via the CLI,
and that training on a task lowers the answer loss."""

from __future__ import annotations

import json

import pytest
import torch

import looplm
from looplm.cli import main
from looplm.errors import UserError
from looplm.data.taskdata import TaskSampler, TaskSource, encode_examples
from looplm.evaluation.tasks import evaluate_examples, greedy_answers, prompt_tokens_by_difficulty
from looplm.data.tasks import ANSWER_END, SEPARATOR, Example
from looplm.data.tokenizer import ByteTokenizer
from looplm.train.trainer import train

TOK = ByteTokenizer()
TASK = {  # a tiny looped model on chains, small enough to train in seconds
    "model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2, "model.n_prelude": 1, "model.n_core": 1,
    "model.n_coda": 0, "model.init_state": "prelude", "model.injection": "add", "model.state_norm": True,
    "depth.kind": "uniform", "depth.min": 1, "depth.max": 3, "depth.rounds": 3, "backward.window": "all",
    "data.task": "chain", "data.difficulty_min": 1, "data.difficulty_max": 2, "data.eval_examples": 16,
    "train.batch_size": 16, "train.steps": 4, "train.log_every": 2, "train.checkpoint_every": 100,
    "train.threads": 1, "optim.warmup_steps": 2,
}


def task_recipe(**overrides):
    return looplm.load_recipe("quickstart", overrides={**TASK, **overrides})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_mask(x, y, mask, examples):
    """Every row's masked targets are exactly its answer + newline; nothing else is masked."""
    for i, ex in enumerate(examples):
        want = TOK.encode(ex.answer + ANSWER_END)
        assert y[i][mask[i]].tolist() == want
        first = int(mask[i].nonzero()[0])
        # the first answer target is predicted from the separator, the prompt's last token
        assert x[i, first].item() == TOK.encode(SEPARATOR)[0]
        assert TOK.decode(x[i, :first + 1].tolist()) == ex.prompt + SEPARATOR
        assert mask[i].sum() == len(want)


def test_answer_mask_covers_exactly_the_answer_through_the_sampler():
    recipe = task_recipe(**{"data.depth_by_difficulty": True})
    sampler = TaskSampler(TaskSource(recipe), TOK, recipe)
    for index in range(3):
        x, y, opts = sampler.batch(index)
        check_mask(x, y, opts["mask"], sampler.examples(index))
        assert x.shape == y.shape == opts["mask"].shape


def test_answer_mask_with_ragged_jsonl_prompts(tmp_path):
    rows = [{"prompt": "a" * n, "answer": "x" * (1 + n % 3), "difficulty": 1 + n % 2} for n in range(1, 13)]
    recipe = task_recipe(**{"data.task": str(write_jsonl(tmp_path / "d.jsonl", rows)), "data.val_fraction": 0.25})
    sampler = TaskSampler(TaskSource(recipe), TOK, recipe)
    x, y, opts = sampler.batch(0)
    examples = sampler.examples(0)
    assert len({len(e.prompt) for e in examples}) > 1  # really ragged
    check_mask(x, y, opts["mask"], examples)
    # padding after a short row is never a target
    lengths = torch.tensor([len(TOK.encode(e.prompt + SEPARATOR + e.answer + ANSWER_END)) - 1 for e in examples])
    pos = torch.arange(x.shape[1])
    assert not opts["mask"][pos[None, :] >= lengths[:, None]].any()


def test_prompt_length_is_the_same_at_every_difficulty():
    source = TaskSource(task_recipe())
    assert source.length == 8  # chain default at eval difficulty 2 x 2 = 4
    sets = source.eval_sets(10)
    assert sorted(sets) == [1, 2, 3, 4]
    assert len(set(prompt_tokens_by_difficulty(TOK, sets).values())) == 1
    # training and held-out streams differ
    train = {e.prompt for e in source.train_examples(2, 50, 0)}
    assert not train & {e.prompt for e in sets[2]}


def test_curriculum_and_depth_by_difficulty():
    recipe = task_recipe(**{"data.difficulty_max": 3, "depth.max": 5, "data.curriculum": 0.5,
                            "data.depth_by_difficulty": True, "train.steps": 100})
    sampler = TaskSampler(TaskSource(recipe), TOK, recipe)
    early = {sampler.level(i) for i in range(0, 16)}  # steps < 100 * 0.5 / 3: only the easiest level
    late = {sampler.level(i) for i in range(60, 100)}
    assert early == {1} and late == {1, 2, 3}
    for i in range(60, 100):
        level = sampler.level(i)
        rounds, sup = sampler.depth_plan(level, i)
        assert level <= rounds <= 5
        assert sup.rounds == tuple(range(level, rounds + 1))
    # deterministic in (seed, index)
    assert [sampler.level(i) for i in range(50)] == [TaskSampler(sampler.source, TOK, recipe).level(i) for i in range(50)]


def test_bad_task_dials_are_user_errors():
    with pytest.raises(UserError, match="data.difficulty_max"):
        task_recipe(**{"data.difficulty_max": 0, "data.difficulty_min": 1})
    with pytest.raises(UserError, match="data.eval_difficulty_max"):
        TaskSource(task_recipe(**{"data.difficulty_max": 14}))  # 2 x 14 > 26 names
    with pytest.raises(UserError, match="data.task_length"):
        TaskSource(task_recipe(**{"data.task_length": 3}))  # 4 hops need 4 statements
    with pytest.raises(UserError, match="data.tokenizer"):
        task_recipe(**{"data.tokenizer": "bpe", "model.vocab_size": 400})
    with pytest.raises(UserError, match="unknown task|cannot read"):
        TaskSource(task_recipe(**{"data.task": "no_such_task"}))


class Bigram(torch.nn.Module):
    """Next token from the current token only: '>' -> '7', '7' -> newline, anything else -> '3'."""

    def forward(self, idx):
        table = torch.full((257, 257), -10.0)
        table[:, ord("3")] = 0.0
        table[ord(">")] = -10.0
        table[ord(">"), ord("7")] = 0.0
        table[ord("7")] = -10.0
        table[ord("7"), ord("\n")] = 0.0
        return table[idx]


def test_exact_match_equals_greedy_decoding():
    examples = [Example(f"q{i}" * (1 + i % 4), a, 0) for i, a in enumerate(["7", "7", "3", "7", "73", "7", "1"])]
    model = Bigram()
    greedy = greedy_answers(model, TOK, [e.prompt for e in examples], max_new_tokens=4, batch_size=3)
    assert greedy == ["7"] * len(examples)
    acc = evaluate_examples(model, TOK, examples, [1], batch_size=3)[1]["accuracy"]
    assert acc == sum(g == e.answer for g, e in zip(greedy, examples)) / len(examples) == 4 / 7


def test_greedy_decoding_of_a_looped_model_matches_exact_match():
    recipe = task_recipe()
    torch.manual_seed(1)
    model = looplm.build_model(recipe)
    examples = TaskSource(recipe).eval_sets(12)[2]
    greedy = greedy_answers(model, TOK, [e.prompt for e in examples], rounds=2, max_new_tokens=3)
    acc = evaluate_examples(model, TOK, examples, [2])[2]["accuracy"]
    assert acc == sum(g == e.answer for g, e in zip(greedy, examples)) / len(examples)


def test_training_on_a_task_reduces_answer_loss(tmp_path):
    recipe = task_recipe(**{"train.steps": 40, "data.difficulty_max": 1, "data.depth_by_difficulty": True,
                            "optim.lr": 3e-3, "optim.warmup_steps": 5})
    source = TaskSource(recipe)
    examples = source.eval_sets(32)[1]
    torch.manual_seed(recipe.train.seed)
    before = evaluate_examples(looplm.build_model(recipe), TOK, examples, [1])[1]["loss"]
    report = train(recipe, tmp_path / "run", quiet=True)
    after = evaluate_examples(looplm.load_run(tmp_path / "run").model, TOK, examples, [1])[1]["loss"]
    assert after < 0.5 * before
    assert report["task"] == "chain"
    assert set(report["task_accuracy"]) == {"1", "2"}
    assert all(0 <= a <= 1 for row in report["task_accuracy"].values() for a in row.values())
    assert "Task accuracy" in (tmp_path / "run" / "report.md").read_text()
    # the chance verdict: each difficulty's accuracies tested against its examples' chance, the same accuracies
    for d, row in report["task_chance"].items():
        assert set(row["by_rounds"]) == set(report["task_accuracy"][d])
        assert all(v["accuracy"] == report["task_accuracy"][d][r] for r, v in row["by_rounds"].items())
        assert 0 < row["chance"] <= 1
    assert report["task_learned"] == any(v["above_chance"] for row in report["task_chance"].values()
                                         for v in row["by_rounds"].values())
    assert "Chance: a guesser" in (tmp_path / "run" / "report.md").read_text()


@pytest.mark.parametrize("content, line, what", [
    (b'{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer": "d"}\n{"prompt": "e"}\n', 3, "answer"),
    (b'{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer": ""}\n', 2, "empty"),
    (b'{"prompt": "a", "answer": "b"}\n\n{"prompt": "\xff\xfe", "answer": "x"}\n', 3, "UTF-8"),
])
def test_jsonl_errors_exit_2_with_the_line_number(tmp_path, capsys, content, line, what):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    code = main(["train", "--recipe", "quickstart", "--out", str(tmp_path / "run"), "--set", f"data.task={path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"line {line}" in err and what in err and str(path) in err
    assert "Traceback" not in err


def test_jsonl_prompt_longer_than_the_context_names_the_line(tmp_path, capsys):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "a", "answer": "b"}] * 3 + [{"prompt": "z" * 500, "answer": "b"}])
    code = main(["train", "--recipe", "quickstart", "--out", str(tmp_path / "run"), "--set", f"data.task={path}"])
    err = capsys.readouterr().err
    assert code == 2 and "line 4" in err and "model.context" in err


def test_of_several_lines_over_the_context_the_longest_is_named_with_the_context_that_fits(tmp_path, capsys):
    rows = [{"prompt": "z" * 300, "answer": "b"}, {"prompt": "a", "answer": "b"}, {"prompt": "y" * 400, "answer": "bc"},
            {"prompt": "x" * 350, "answer": "b"}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    code = main(["train", "--recipe", "quickstart", "--out", str(tmp_path / "run"), "--set", f"data.task={path}",
                 "--set", "model.context=256"])
    err = capsys.readouterr().err
    assert code == 2 and "line 3" in err and "3 line(s)" in err and len(err.strip().splitlines()) == 1
    # the context it names fits the longest line: its 400 prompt bytes and 2 answer bytes at least, and is no
    # larger than that plus the separator's and the answer end's few bytes
    need = int(err.split("--set model.context=")[1].split(")")[0])
    assert 400 + 2 - 1 <= need <= 400 + 2 + 4


def test_warmup_then_length_ramp():
    recipe = task_recipe(**{"data.difficulty_max": 3, "data.task_length": 10, "data.train_length_min": 2,
                            "data.warmup_steps": 10, "data.curriculum": 0.5, "data.length_curriculum": 0.5,
                            "train.steps": 50})
    sampler = TaskSampler(TaskSource(recipe), TOK, recipe)

    def items(i):
        return len(sampler.examples(i)[0].prompt.split("; ")) - 1

    # warm-up: the easiest level on the shortest prompts
    assert all(sampler.level(i) == 1 and items(i) == 2 for i in range(10))
    # the ramp raises the longest prompt from 2 towards task_length; afterwards 2..10 are drawn
    assert max(items(i) for i in range(10, 14)) <= 4
    late = [items(i) for i in range(35, 50)]
    assert min(late) >= 2 and max(late) > 6 and max(late) <= 10
    # evaluation always uses task_length
    assert {len(e.prompt.split("; ")) - 1 for e in sampler.source.eval_sets(5)[1]} == {10}


@pytest.mark.parametrize("kind, extra", [("trace", 0), ("query_trace", 1)])
def test_trace_round_targets_through_the_sampler(kind, extra):
    """data.round_targets = trace: round r < k reads the name r hops along at the answer's one token
    (not at its end mark); rounds from k on read the whole answer; every round is supervised. query_trace:
    the same a round later, round 1 reading the queried name, and a k-hop micro-batch runs at least
    k + 1 rounds."""
    recipe = task_recipe(**{"data.depth_by_difficulty": True, "data.round_targets": kind,
                            "data.difficulty_max": 3, "depth.max": 4})
    sampler = TaskSampler(TaskSource(recipe), TOK, recipe)
    seen = set()
    for index in range(12):
        x, y, opts = sampler.batch(index)
        examples = sampler.examples(index)
        k = examples[0].difficulty
        seen.add(k)
        assert opts["rounds"] >= k + extra and opts["supervision"].rounds == tuple(range(1, opts["rounds"] + 1))
        targets = opts["round_targets"]
        for r in range(1, opts["rounds"] + 1):
            yr, mr = targets(r)
            if r >= k + extra:
                assert torch.equal(yr, y) and torch.equal(mr, opts["mask"])
                continue
            assert mr.sum(-1).tolist() == [1] * len(examples)
            for i, ex in enumerate(examples):
                # walk the bindings by hand: r - extra hops from the query
                binding = dict(s.split("=") for s in ex.prompt.split("; ? ")[0].split("; "))
                name = ex.prompt.rsplit("? ", 1)[1]
                for _ in range(r - extra):
                    name = binding[name]
                j = int(mr[i].nonzero())
                assert j == int(opts["mask"][i].nonzero()[0]) and yr[i, j].item() == TOK.encode(name)[0]
    assert seen == {1, 2, 3}


def test_trace_loss_is_the_mean_of_per_round_target_losses():
    from looplm.model.losses import supervised_loss
    from looplm.recipe.config import SupervisionConfig
    recipe = task_recipe(**{"data.depth_by_difficulty": True, "data.round_targets": "trace", "depth.max": 3})
    sampler = TaskSampler(TaskSource(recipe), TOK, recipe)
    model = looplm.build_model(recipe)
    x, y, opts = sampler.batch(5)
    out = model(x, 3, readout_rounds=(1, 2, 3))
    loss, _ = supervised_loss(SupervisionConfig(kind="every"), out, y, opts["mask"], opts["round_targets"])
    by_hand = []
    for r in (1, 2, 3):
        yr, mr = opts["round_targets"](r)
        ce = torch.nn.functional.cross_entropy(out.round_logits[r][mr], yr[mr])
        by_hand.append(ce)
    assert torch.allclose(loss, sum(by_hand) / 3, atol=1e-6)
    # a model that stops before an example's last step still answers at its final round
    hard = [i for i, t in enumerate(opts["round_targets"].steps.tolist()) if t >= 1]
    assert hard, "the batch should hold multi-hop examples"
    out1 = model(x, 1)
    loss1, _ = supervised_loss(SupervisionConfig(kind="final"), out1, y, opts["mask"], opts["round_targets"])
    m = opts["mask"]
    assert torch.allclose(loss1, torch.nn.functional.cross_entropy(out1.logits[m], y[m]), atol=1e-6)


def test_trace_needs_a_task_with_traces(tmp_path, capsys):
    with pytest.raises(UserError, match="no trace"):
        TaskSource(task_recipe(**{"data.task": "parity", "data.round_targets": "trace"}))
    with pytest.raises(UserError, match="data.round_targets"):
        task_recipe(**{"data.round_targets": "trace", "supervision.kind": "learned_exit", "exit.gate": True})
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a=1; ? a", "answer": "1", "trace": []}] * 3
                       + [{"prompt": "b=a; a=1; ? b", "answer": "1", "trace": [""]}])
    code = main(["train", "--recipe", "quickstart", "--out", str(tmp_path / "run"), "--set", f"data.task={path}",
                 "--set", "data.round_targets=trace"])
    err = capsys.readouterr().err
    assert code == 2 and "line 4" in err and "non-empty" in err


def test_a_trace_entry_of_several_tokens_is_trained_as_the_bag_of_its_tokens(tmp_path):
    """Round r < k reads, at the position of each of the answer's own tokens (its end mark is not
    read), the mean of the cross-entropies of the r-th entry's tokens (each token once per occurrence),
    computed here token by token from the logits; the answer "teal" is four positions, each trained
    on the chase."""
    from looplm.data.taskdata import read_task_file, round_targets
    from looplm.model.losses import supervised_loss
    from looplm.recipe.config import SupervisionConfig
    lines = [{"prompt": "ox>elk; elk>7; q>3; ?ox=", "answer": "7", "difficulty": 2, "trace": ["elk"]},
             {"prompt": "abba>cd; cd>ee; ee>1; ?abba=", "answer": "1", "difficulty": 3, "trace": ["cd", "ee"]},
             {"prompt": "x>5; ?x=", "answer": "5", "difficulty": 1, "trace": []},
             {"prompt": "p>q; q>teal; ?p=", "answer": "teal", "difficulty": 2, "trace": ["q"]}]
    path = write_jsonl(tmp_path / "t.jsonl", lines * 2)
    recipe = task_recipe(**{"data.task": str(path), "data.round_targets": "trace", "data.depth_by_difficulty": True,
                            "depth.max": 3, "data.separator": False})
    examples = read_task_file(path, recipe, traces=True)[:4]
    b = encode_examples(TOK, examples, recipe.model.context, False)
    rt = round_targets(TOK, examples, b, recipe.data.task, recipe.model.vocab_size)
    model = looplm.build_model(recipe)
    out = model(b.x, 3, readout_rounds=(1, 2, 3))
    loss, info = supervised_loss(SupervisionConfig(kind="every"), out, b.y, b.mask, rt)
    for r in (1, 2):
        logp = torch.log_softmax(out.round_logits[r].double(), -1)
        terms = []
        for row, ex in enumerate(examples):
            start = b.prompt_lens[row] - 1                       # the answer's first target index
            answer = range(start, start + len(TOK.encode(ex.answer)))
            if r <= len(ex.meta["trace"]):
                entry = ex.meta["trace"][r - 1]                      # one byte token per letter
                terms += [-sum(logp[row, t, TOK.encode(ch)[0]] for ch in entry) / len(entry) for t in answer]
            else:                                    # the answer and its end mark, at every answer position
                terms += [-logp[row, t, b.y[row, t]] for t in b.mask[row].nonzero().flatten().tolist()]
        assert abs(info["round_losses"][r] - float(sum(terms) / len(terms))) < 1e-5, r


def test_length_curriculum_is_its_own_dial():
    """All difficulties from the start while the longest prompt still grows."""
    recipe = task_recipe(**{"data.difficulty_max": 3, "data.task_length": 10, "data.train_length_min": 2,
                            "data.curriculum": 0.0, "data.length_curriculum": 0.5, "train.steps": 100})
    sampler = TaskSampler(TaskSource(recipe), TOK, recipe)
    assert {sampler.level(i) for i in range(10)} == {1, 2, 3}
    for i in range(4):  # the cap is still one item above the shortest prompt (or the difficulty's minimum)
        ex = sampler.examples(i)[0]
        assert len(ex.prompt.split("; ")) - 1 <= max(2, ex.difficulty) + 1
    late = [len(sampler.examples(i)[0].prompt.split("; ")) - 1 for i in range(60, 100)]
    assert max(late) > 6


def test_exit_policies_on_task_examples():
    """Answer positions follow the exit policy, the prompt runs every round: fixed:R is the plain
    evaluation at R; a policy that always exits at once reads every answer at round 1."""
    from looplm.inference.early_exit import early_exit
    from looplm.evaluation.tasks import evaluate_examples_exit
    recipe = task_recipe(**{"data.difficulty_max": 2})
    torch.manual_seed(0)
    model = looplm.build_model(recipe).eval()
    examples = TaskSource(recipe).eval_sets(12)[2]
    plain = evaluate_examples(model, TOK, examples, [1, 3])
    fixed = evaluate_examples_exit(model, TOK, examples, "fixed:3", 3)
    assert fixed["accuracy"] == plain[3]["accuracy"] and fixed["mean_rounds"] == 3
    assert abs(fixed["loss"] - plain[3]["loss"]) < 1e-5
    at_once = evaluate_examples_exit(model, TOK, examples, "entropy:1000", 3)
    assert at_once["accuracy"] == plain[1]["accuracy"] and at_once["mean_rounds"] == 1
    assert fixed["mean_rounds_first_token"] == 3 and at_once["mean_rounds_first_token"] == 1
    assert abs(at_once["loss"] - plain[1]["loss"]) < 1e-5
    b = encode_examples(TOK, examples)
    out = early_exit(model, b.x, "entropy:1000", 3, may_exit=b.mask)
    assert (out.rounds_used[b.mask] == 1).all() and (out.rounds_used[~b.mask] == 3).all()


def test_eval_exit_on_a_task_run(tmp_path, capsys):
    recipe = task_recipe(**{"data.difficulty_max": 2, "train.steps": 2})
    train(recipe, tmp_path / "run", quiet=True)
    assert main(["eval", str(tmp_path / "run"), "--exit", "entropy:1000", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ex = result["exit"]
    assert ex["mean_rounds"] == 1 and set(ex["by_difficulty"]) == {"1", "2", "3", "4"}
    assert 0 <= ex["accuracy"] <= 1
    assert ex["wall_time_s"] > 0
    # a sweep: one row per threshold; always-exit reads round 1, never-exit (threshold 0) runs the budget
    assert main(["eval", str(tmp_path / "run"), "--rounds", "3", "--exit-sweep", "entropy:1000,0.000001", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert [r["policy"] for r in rows] == ["entropy:1000.0", "entropy:1e-06"]
    assert rows[0]["mean_rounds"] == 1 and rows[1]["mean_rounds"] == 3
    assert main(["eval", str(tmp_path / "run"), "--exit-sweep", "entropy:x"]) == 2


# ---------------------------------------------------------------------------------------
# JSONL difficulties (issue 14): train on difficulty_min..difficulty_max, evaluate beyond;
# `looplm eval TASK_RUN --data FILE.jsonl` scores another file by difficulty x rounds.


def levelled_rows(levels, per_level=6):
    """Lines whose prompt names its difficulty, so a batch's difficulties can be read off its tokens."""
    return [{"prompt": f"d{d} q{i}", "answer": str(i % 10), "difficulty": d} for d in levels for i in range(per_level)]


def test_jsonl_training_draws_only_the_allowed_difficulties_and_evaluates_beyond(tmp_path):
    rows = levelled_rows(range(1, 7))
    path = write_jsonl(tmp_path / "levels.jsonl", rows)
    recipe = task_recipe(**{"data.task": str(path), "data.difficulty_min": 2, "data.difficulty_max": 3,
                            "data.eval_difficulty_max": 5, "data.val_fraction": 0.34, "data.eval_examples": 100,
                            "train.batch_size": 8, "train.steps": 3})
    level_of = {r["prompt"]: r["difficulty"] for r in rows}
    sampler = TaskSampler(TaskSource(recipe), TOK, recipe)
    drawn, trained_prompts = {}, set()
    for index in range(60):  # read the prompts back from the batch's tokens, up to the separator
        x, _, _ = sampler.batch(index)
        for row in x.tolist():
            prompt = TOK.decode(row[:row.index(TOK.encode(SEPARATOR)[0])])
            drawn[level_of[prompt]] = drawn.get(level_of[prompt], 0) + 1
            trained_prompts.add(prompt)
    assert set(drawn) == {2, 3}
    sets = sampler.source.eval_sets(100)
    assert sorted(sets) == [2, 3, 4, 5]  # 1 is below the range, 6 above eval_difficulty_max
    assert all(len(sets[d]) == 6 for d in (4, 5))  # nothing above difficulty_max is trained on: all held out
    held = {e.prompt for d in (2, 3) for e in sets[d]}
    assert held and not held & trained_prompts
    # eval_difficulty_max = 0 means 2 x difficulty_max
    assert sorted(TaskSource(task_recipe(**{"data.task": str(path), "data.difficulty_min": 2,
                                            "data.difficulty_max": 3})).eval_sets(100)) == [2, 3, 4, 5, 6]
    # the report says what was trained, evaluated and left out, with examples per difficulty
    report = train(recipe, tmp_path / "run", quiet=True)
    diff = report["task_difficulties"]
    assert diff["trained"] == [2, 3] and diff["evaluated"] == [2, 3, 4, 5]
    assert diff["unused_examples"] == {"1": 6, "6": 6}
    assert diff["eval_examples"] == {str(d): len(sets[d]) for d in sets}
    assert {d: diff["train_examples"][str(d)] + len(sets[d]) for d in (2, 3)} == {2: 6, 3: 6}
    assert set(report["task_accuracy"]) == {"2", "3", "4", "5"}


def test_jsonl_difficulty_errors_exit_2(tmp_path, capsys):
    def train_on(rows, *sets):
        path = write_jsonl(tmp_path / "f.jsonl", rows)
        argv = ["train", "--recipe", "quickstart", "--out", str(tmp_path / "run"), "--set", f"data.task={path}"]
        code = main(argv + [a for s in sets for a in ("--set", s)])
        return code, capsys.readouterr().err, path

    # no line in the training range: the file and the range are named
    code, err, path = train_on(levelled_rows([1, 5]), "data.difficulty_min=2", "data.difficulty_max=3")
    assert code == 2 and str(path) in err and "2..3" in err and "Traceback" not in err
    # a file without difficulties cannot honour a difficulty range: refused, not ignored
    code, err, _ = train_on([{"prompt": f"p{i}", "answer": "a"} for i in range(4)], "data.difficulty_max=2")
    assert code == 2 and "data.difficulty_max" in err and "difficulty" in err
    # difficulties on some lines only: the first line without one is named
    rows = levelled_rows([1, 2], 2)
    del rows[2]["difficulty"]
    code, err, path = train_on(rows)
    assert code == 2 and f"{path}, line 3" in err
    # a JSONL file's prompts are as written: the built-in prompt-length dial is refused
    code, err, _ = train_on(levelled_rows([1, 2]), "data.task_length=5")
    assert code == 2 and "data.task_length" in err


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """A run trained on a JSONL file whose answer is always "7", so it answers some lines of
    another file right and others wrong."""
    tmp = tmp_path_factory.mktemp("taskrun")
    rows = [{**r, "answer": "7"} for r in levelled_rows([1, 2], 12)]
    torch.manual_seed(0)
    report = train(task_recipe(**{"data.task": str(write_jsonl(tmp / "sevens.jsonl", rows)), "train.steps": 30,
                                  "data.val_fraction": 0.25, "optim.lr": 3e-3, "optim.warmup_steps": 5}),
                   tmp / "run", quiet=True)
    return tmp / "run", report


def answer_hits_by_hand(model, ex, rounds):
    """(exact match, summed answer-token loss, answer tokens) of one example, unpadded, from
    model(x, rounds) directly: the argmax at every position that predicts an answer token."""
    prompt = TOK.encode(ex.prompt + SEPARATOR)
    ids = prompt + TOK.encode(ex.answer + ANSWER_END)
    logits = model(torch.tensor([ids[:-1]]), rounds).logits[0]           # (T, V)
    pos = torch.arange(len(prompt) - 1, len(ids) - 1)
    target = torch.tensor(ids[1:])[pos]
    hit = bool((logits[pos].argmax(-1) == target).all())
    loss = torch.nn.functional.cross_entropy(logits[pos], target, reduction="sum").item()
    return hit, loss, len(pos)


def test_eval_data_jsonl_scores_accuracy_by_difficulty_x_rounds(task_run, tmp_path, capsys):
    run_dir, report = task_run
    model = looplm.load_run(run_dir).model.eval()
    # other prompts, difficulties 1..3 (3 never trained on), half answered "7" as in training
    rows = [{"prompt": f"e{d} r{i}", "answer": "7" if i % 2 else "3", "difficulty": d}
            for d in (1, 2, 3) for i in range(6)]
    path = write_jsonl(tmp_path / "other.jsonl", rows)
    assert main(["eval", str(run_dir), "--data", str(path), "--rounds", "1,2,3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    with torch.no_grad():
        by_hand = {(r, i): answer_hits_by_hand(model, Example(row["prompt"], row["answer"], row["difficulty"]), r)
                   for r in (1, 2, 3) for i, row in enumerate(rows)}
    for r in (1, 2, 3):
        for d in (1, 2, 3):
            hits = [by_hand[r, i][0] for i, row in enumerate(rows) if row["difficulty"] == d]
            assert result["by_difficulty"][str(d)][str(r)] == sum(hits) / len(hits)
        cell = result["rounds"][str(r)]
        assert cell["accuracy"] == sum(by_hand[r, i][0] for i in range(len(rows))) / len(rows)
        loss = sum(by_hand[r, i][1] for i in range(len(rows))) / sum(by_hand[r, i][2] for i in range(len(rows)))
        assert abs(cell["loss"] - loss) < 1e-4 and "ppl" in cell
    assert 0 < result["rounds"]["3"]["accuracy"] < 1  # the model has learnt "7": right on some lines only
    assert result["examples"] == len(rows) and result["examples_by_difficulty"] == {"1": 6, "2": 6, "3": 6}
    # the exit path scores the same file: fixed:3 is the plain evaluation at 3 rounds
    assert main(["eval", str(run_dir), "--data", str(path), "--exit", "fixed:3", "--json"]) == 0
    ex = json.loads(capsys.readouterr().out)["exit"]
    assert ex["accuracy"] == result["rounds"]["3"]["accuracy"] and set(ex["by_difficulty"]) == {"1", "2", "3"}
    # without --data: the run's held-out split through the same scoring as the trainer's report
    rounds = sorted(int(r) for r in report["val_accuracy_by_rounds"])
    assert main(["eval", str(run_dir), "--rounds", ",".join(map(str, rounds)), "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["by_difficulty"] == report["task_accuracy"]


@pytest.mark.parametrize("name, content, words", [
    ("bad.jsonl", '{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer": "d"}\n{"prompt": "e"}\n',
     ["line 3", "answer"]),
    ("long.jsonl", '{"prompt": "a", "answer": "b"}\n' + json.dumps({"prompt": "z" * 500, "answer": "b"}) + "\n",
     ["line 2", "model.context"]),
    ("mixed.jsonl", '{"prompt": "a", "answer": "b", "difficulty": 1}\n{"prompt": "c", "answer": "d"}\n',
     ["line 2", "difficulty"]),
    ("prose.txt", "just some text, which a task run cannot score\n", ["JSONL", "prompt"]),
])
def test_eval_data_on_a_task_run_refuses_bad_input(task_run, tmp_path, capsys, name, content, words):
    path = tmp_path / name
    path.write_text(content)
    code = main(["eval", str(task_run[0]), "--data", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert str(path) in err and all(w in err for w in words) and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_eval_batch_size_on_a_task_run_is_refused_not_ignored(task_run, capsys):
    assert main(["eval", str(task_run[0]), "--batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size" in err and len(err.strip().splitlines()) == 1


def crop_file(tmp_path):
    """Pointer chases "k>p p>3 z>1 ... ?k=" of 1-2 hops, every prompt 6 links, with traces; each line
    queries its own name. A 2-hop line has a tree hanging into its chain (a name pointing at its trace
    entry), and the digit distractors often point at the answer's value."""
    import random as _random
    g, rows, letters = _random.Random(0), [], "abcdefghijklmnopqrstuvwxyz"
    for i in range(26):
        names = [letters[i]] + g.sample(letters.replace(letters[i], ""), 11)
        hops = 1 + i % 2
        links = [(names[h], names[h + 1]) for h in range(hops - 1)] + [(names[hops - 1], str(g.randrange(10)))]
        links += [(names[6 + j], names[1] if hops == 2 and j == 0 else str(g.randrange(10))) for j in range(6 - hops)]
        g.shuffle(links)
        answer = next(b for a, b in links if a == names[hops - 1])
        rows.append({"prompt": " ".join(f"{a}>{b}" for a, b in links) + f" ?{names[0]}=", "answer": answer,
                     "difficulty": hops, "trace": names[1:hops]})
    return write_jsonl(tmp_path / "crop.jsonl", rows)


def followed(statements, query):
    """The statements "a>b" a chase from `query` ("?k=") follows, by walking them."""
    edges = dict(s.split(">") for s in statements)
    node, path = query[1:-1], []
    while node in edges:
        path.append(f"{node}>{edges[node]}")
        node = edges[node]
    return path


def test_the_crop_curriculum_keeps_a_growing_share_of_the_unneeded_statements(tmp_path):
    """Warm-up keeps none of a line's m unneeded statements (all but those the chase follows: a tree hanging
    into the chain and a statement pointing at the answer's value go too); then micro-batch i keeps
    round(q x m), q drawn uniformly from [0, progress(i)], progress growing linearly to 1 over crop_curriculum
    x steps."""
    path = crop_file(tmp_path)
    recipe = task_recipe(**{"data.task": str(path), "data.crop_curriculum": 0.5, "data.item_separator": " ",
                            "data.warmup_steps": 10, "train.steps": 110, "data.separator": False})
    source = TaskSource(recipe)
    sampler = TaskSampler(source, TOK, recipe)
    lines = [ex.prompt.split(" ") for pool in source._train_pool.values() for ex in pool]
    for i in range(0, 110, 3):
        keep = sampler.keep(i)
        top = 0.0 if i < 10 else min(1.0, (i - 10) / 55)
        assert 0.0 <= keep <= top + 1e-12
        for ex in sampler.examples(i):
            *kept, query = ex.prompt.split(" ")
            [full] = [ln[:-1] for ln in lines if ln[-1] == query]            # its line
            needed = followed(full, query)
            spare = len(full) - len(needed)
            assert set(needed) <= set(kept) and len(kept) - len(needed) == round(keep * spare)
    late = [sampler.keep(i) for i in range(65, 110)]
    assert max(late) > 0.8 and min(late) < 0.2           # after the ramp: the whole range


def test_prompts_of_one_length_with_no_curriculum_are_noted_before_training(tmp_path, capsys):
    """A traced file whose training prompts are all near one length, with no curriculum shortening them, gets a
    note naming their byte range (read here off the file); the crop, answer targets or prompts of varied
    lengths take it away. `looplm train` prints it."""
    path = crop_file(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    over = {"data.task": str(path), "data.round_targets": "trace", "data.separator": False}
    source = TaskSource(task_recipe(**over))
    sizes = [len(ex.prompt.encode()) for pool in source._train_pool.values() for ex in pool]
    note = source.short_prompt_note(task_recipe(**over).data)
    assert note is not None and f"{min(sizes)}..{max(sizes)} bytes" in note and "data.crop_curriculum" in note
    crop = task_recipe(**over, **{"data.crop_curriculum": 0.5, "data.item_separator": " "})
    assert TaskSource(crop).short_prompt_note(crop.data) is None
    plain = task_recipe(**{**over, "data.round_targets": "answer"})
    assert TaskSource(plain).short_prompt_note(plain.data) is None
    for r in rows[::2]:           # every other line cut to its needed links and the query: lengths vary
        items = r["prompt"].split(" ")
        r["prompt"] = " ".join([s for s in items[:-1] if s.split(">")[1] in [*r["trace"], r["answer"]]] + items[-1:])
    varied = task_recipe(**{**over, "data.task": str(write_jsonl(tmp_path / "varied.jsonl", rows))})
    assert TaskSource(varied).short_prompt_note(varied.data) is None
    train(task_recipe(**over, **{"train.steps": 1}), tmp_path / "run")
    assert "note: data.task" in capsys.readouterr().err


def test_the_experiment_notes_prompts_of_one_length_once_across_seeds(tmp_path, capsys, monkeypatch):
    """Every seed's plan reads the same file, so the note is said once, before anything trains (the
    training itself stopped here: what is tested is what the plans printed)."""
    from looplm.experiments import extrapolate as ex

    class Stop(Exception):
        pass

    def no_training(plans, threads, quiet=False):
        assert len(plans) == 3                # every seed planned, its task source read
        raise Stop
    monkeypatch.setattr(ex, "train_plans", no_training)
    over = {"data.task": str(crop_file(tmp_path)), "data.round_targets": "trace", "data.separator": False,
            "data.baselines": [], "data.probe_examples": 0}
    with pytest.raises(Stop):
        ex.run_extrapolate(task_recipe(**over), tmp_path / "x", seeds=[0, 1, 2])
    assert capsys.readouterr().err.count("note: data.task") == 1


def test_the_crop_curriculum_is_refused_where_it_cannot_find_the_statements(tmp_path):
    path = crop_file(tmp_path)
    with pytest.raises(UserError, match="data.item_separator"):
        task_recipe(**{"data.task": str(path), "data.crop_curriculum": 0.5})
    with pytest.raises(UserError, match="no item but the last names"):      # the wrong separator
        TaskSource(task_recipe(**{"data.task": str(path), "data.crop_curriculum": 0.5, "data.item_separator": ";"}))
    bare = write_jsonl(tmp_path / "bare.jsonl", [{k: v for k, v in json.loads(line).items() if k != "trace"}
                                                 for line in path.read_text().splitlines()])
    with pytest.raises(UserError, match="has no \"trace\""):
        TaskSource(task_recipe(**{"data.task": str(bare), "data.crop_curriculum": 0.5, "data.item_separator": " "}))
    with pytest.raises(UserError, match="data.crop_curriculum: does not apply"):   # a generator
        task_recipe(**{"data.crop_curriculum": 0.5})


def test_the_report_counts_what_the_crop_curriculum_dropped(tmp_path):
    """report.json's crop_counts against a recount: the same micro-batches drawn without the curriculum
    give the lines as written; each cut line's kept unneeded statements are its written ones (targets
    neither a trace entry nor the answer) less those missing from the cut prompt."""
    path = crop_file(tmp_path)
    over = {"data.task": str(path), "data.separator": False, "train.steps": 3, "train.batch_size": 8}
    recipe = task_recipe(**over, **{"data.crop_curriculum": 0.5, "data.item_separator": " "})
    report = train(recipe, tmp_path / "run", quiet=True)
    plain = TaskSampler(TaskSource(task_recipe(**over)), TOK, task_recipe(**over))
    lines = spare = kept = 0
    for i in range(3):
        for full, cut in zip(plain.examples(i), TaskSampler(TaskSource(recipe), TOK, recipe).examples(i)):
            *items, query = full.prompt.split(" ")
            unneeded = [s for s in items if s not in followed(items, query)]
            lines, spare = lines + 1, spare + len(unneeded)
            kept += sum(s in cut.prompt.split(" ") for s in unneeded)
    assert report["crop_counts"] == {"lines": lines, "spare": spare, "kept": kept}
    assert 0 < kept < spare
    assert "crop_counts" not in train(task_recipe(**over), tmp_path / "plain", quiet=True)


def test_query_trace_on_a_jsonl_file_finds_the_queried_name_in_the_last_item(tmp_path):
    """A JSONL line's queried name: the one word of its last item that another item names (where none is, the
    one run of its other characters another item holds), read here from lines written with it; a several-token
    name is a bag at round 1; lines where the last item names none or
    two, and a file without data.item_separator, are refused naming the line or the field."""
    from looplm.data.taskdata import example_trace, read_task_file, round_targets
    lines = [{"prompt": "ox>elk | elk>7 | q>3 | Where does ox lead?", "answer": "7", "difficulty": 2, "trace": ["elk"]},
             {"prompt": "b>c | c>1 | a>b | follow a", "answer": "1", "difficulty": 3, "trace": ["b", "c"]},
             {"prompt": "x>5 | ?x=", "answer": "5", "difficulty": 1, "trace": []},
             {"prompt": "(C<#) | (k<d) | ask #", "answer": "C", "difficulty": 1, "trace": []}]   # a name in symbols
    path = write_jsonl(tmp_path / "t.jsonl", lines * 2)
    recipe = task_recipe(**{"data.task": str(path), "data.round_targets": "query_trace", "data.item_separator": " | ",
                            "data.depth_by_difficulty": True, "depth.max": 4, "data.separator": False})
    assert [example_trace(ex, str(path), " | ") for ex in read_task_file(path, recipe, traces=True)[:4]] == [
        ["ox", "elk"], ["a", "b", "c"], ["x"], ["#"]]
    examples = read_task_file(path, recipe, traces=True)[:3]
    b = encode_examples(TOK, examples, recipe.model.context, False)
    rt = round_targets(TOK, examples, b, recipe.data.task, recipe.model.vocab_size, " | ")
    y1, m1 = rt(1)
    first = [p - 1 for p in b.prompt_lens]
    assert m1.nonzero()[:, 1].tolist() == first
    assert torch.allclose(y1[0, first[0], [ord("o"), ord("x")]], torch.tensor([0.5, 0.5]))      # "ox": a bag
    assert y1[1, first[1], ord("a")] == 1 and y1[2, first[2], ord("x")] == 1
    y3, m3 = rt(3)
    assert y3[1, first[1], ord("c")] == 1 and torch.equal(m3[[0, 2]], b.mask[[0, 2]])   # rows 0, 2: the answer
    for bad, words in (("y>5 | x>y | ?x= or y", "2 names"), ("x>5 | ?z=", "no name"),
                       ("(C<#) | (k<*) | ask # *", "2 names")):
        path = write_jsonl(tmp_path / "bad.jsonl", lines + [{"prompt": bad, "answer": "5", "difficulty": 1, "trace": []}])
        with pytest.raises(UserError, match=f"line 5: the last item .*holds {words}"):
            read_task_file(path, task_recipe(**{"data.task": str(path), "data.round_targets": "query_trace",
                                                "data.item_separator": " | "}), traces=True)
    with pytest.raises(UserError, match="data.item_separator"):
        task_recipe(**{"data.task": str(path), "data.round_targets": "query_trace"})
    with pytest.raises(UserError, match="no trace of intermediate results and queried name"):
        TaskSource(task_recipe(**{"data.task": "parity", "data.round_targets": "query_trace"}))
