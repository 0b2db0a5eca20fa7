"""Every subcommand with each of its flags, generated from the argument parser itself, on a tiny run.

For each leaf command of `looplm.cli.build_parser()` (train, eval, data prepare, bench decode, ...) and
each of its options, the command runs once with a value the option accepts and once or twice with
values it must refuse (junk text; a negative number or NaN for numeric options). Whatever the outcome,
no invocation may end in a traceback (an exception out of `main`) or print a multi-line error; an
exit code of 2 comes with exactly one line on stderr naming the problem, and `--json` with exit 0
prints exactly one JSON object. A flag added later is enumerated here without a new test: it needs
at most a sample value in VALID (the parser's own default is used where it has one, so most numeric
flags need nothing), and `test_every_option_has_a_valid_sample` names any that lack one.

Heavy commands run at their smallest honest size through BASE (the experiments' --quick, the
benchmarks' --quick --no-peers, one step of training), and for those (COMBINED) the options' accepted
values are tried together in one run, their refused values one by one. The server's `uvicorn.run` is
replaced by a function that returns at once, so `serve` validates everything and builds its app but
never listens, and `torch.compile` by the identity.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil

import pytest
import torch

from looplm.cli import build_parser, main

from conftest import TINY, tiny_recipe, write_corpus

RUN, TEXT, HF, RECIPE, FRESH, AFILE = "{run}", "{text}", "{hf}", "{recipe}", "{fresh}", "{afile}"
IMPORTED = "{imported}"          # the tiny HF Llama imported (the looping experiment re-cuts a pretrained stack)

# Arguments every invocation of a leaf carries (replaced when the flag under test is one of them).
BASE: dict[str, list[str]] = {
    "train": ["--recipe", RECIPE, "--out", FRESH],
    "import": [HF, "--out", FRESH],
    "export": [RUN, "--hf", FRESH],
    "data prepare": [TEXT, "--out", FRESH, "--quiet"],
    "eval": [RUN, "--rounds", "1"],
    "generate": [RUN, "--prompt", "def f", "--max-new-tokens", "3"],
    "serve": [RUN],
    "bench decode": ["--quick", "--no-peers", "--runs", "1", "--new-tokens", "2"],
    "bench train": ["--quick", "--no-peers", "--runs", "1", "--steps", "1"],
    "bench serve": [RUN, "--requests", "2", "--new-tokens", "2", "--runs", "1", "--prompt-tokens", "4",
                    "--max-batch", "2"],
    "check": [RUN],
    "lens": [RUN, "--rounds", "2"],
    "recirculate": [RUN, "--tokens", "32", "--window", "16"],
    "recipe show": ["quickstart"],
    "experiment extrapolate": ["--quick", "--seeds", "0", "--out", FRESH],
    "experiment deeploop": ["--quick", "--out", FRESH],
    "experiment loopmoe": ["--quick", "--out", FRESH],
    "experiment depth": ["--quick", "--variants", "plain", "--out", FRESH],
    "experiment looping": [IMPORTED, "--spans", "1:3", "--updates", "plain", "--windows", "1", "--length", "16",
                           "--questions", "1", "--out", FRESH],
    "experiment retrofit": ["--from", IMPORTED, "--data", TEXT, "--quick", "--windows", "1", "--out", FRESH],
}

# A value each option accepts, where the parser has no default to use: "*" for every command, or a
# command's own (the same flag name means different things to eval and generate).
VALID: dict[str, dict[str, str]] = {
    "--recipe": {"*": "quickstart", "train": RECIPE},
    "--out": {"*": FRESH},
    "--set": {"*": "train.steps=1", "data prepare": "data.val_fraction=0.2", "recipe show": "model.d_model=64"},
    "--stage2": {"*": RUN}, "--init": {"*": RUN}, "--baseline": {"*": RUN},
    "--hf": {"*": FRESH},
    "--prelude": {"*": "1"}, "--core": {"*": "1:3"}, "--coda": {"*": "1"}, "--context": {"*": "32"},
    "--tokenizer": {"*": "byte"}, "--text-field": {"*": "text"}, "--shard-tokens": {"*": "4096"},
    "--rounds": {"*": "2", "eval": "1,2"},
    "--data": {"*": TEXT},
    "--exit": {"*": "fixed:2"},
    "--exit-sweep": {"*": "entropy:1"},
    "--missing-kv": {"*": "mask"},
    "--batch-size": {"*": "2"},
    "--feedback-passes": {"*": "1,2"},
    "--contrast": {"*": "1:0.5"},
    "--prompt-mode": {"*": "standard"},
    "--prefill-cache": {"*": "last"}, "--decode-cache": {"*": "first"},
    "--speculative": {"*": "1:2"},
    "--logit-bias": {"*": "65=1"}, "--stop": {"*": "\n"}, "--logprobs": {"*": "2"},
    "--recirculate": {"*": "3:1:0.1"},
    "--recirculate-beta": {"*": "one"}, "--beta": {"*": "one"},
    "--recirculate-ramp": {"*": "2"}, "--ramp": {"*": "2"},
    "--recirculate-schedule": {"*": "serial"}, "--schedule": {"*": "serial"},
    "--recirculate-mixer": {"*": FRESH}, "--mixer": {"*": FRESH},     # no mixer file: refused in one line
    "--api-key": {"*": "sk-test-0123456789abcdef"},
    "--pairs": {"*": "3:1"}, "--alphas": {"*": "0.1"},
    "--s": {"*": "3"}, "--d": {"*": "1"}, "--alpha": {"*": "0.1"},
    "--tokens": {"*": "32"}, "--window": {"*": "16"},
    "--prompt": {"*": "def f"},
    "--max-new-tokens": {"*": "2"},
    "--train-mixer": {"*": "constant_scalar"}, "--steps": {"*": "1"},
    "--seeds": {"*": "0"}, "--lookup-threshold": {"*": "0.5"}, "--variants": {"*": "plain"},
    "--spans": {"*": "1:3"}, "--updates": {"*": "plain"}, "--windows": {"*": "1"}, "--length": {"*": "16"},
    "--questions": {"*": "1"},
    "--from": {"*": IMPORTED}, "--minutes": {"*": "0.02"},
}

# Options that need a companion to do anything (alone they must be refused in one line, which the
# run without the companion checks too).
WITH: dict[tuple[str, str], list[str]] = {
    ("recirculate", "--pairs"): ["--calibrate"], ("recirculate", "--alphas"): ["--calibrate"],
    ("recirculate", "--s"): ["--d", "1"], ("recirculate", "--d"): ["--s", "3"],
    ("recirculate", "--alpha"): ["--s", "3", "--d", "1"], ("recirculate", "--prompt"): ["--s", "3", "--d", "1"],
    ("recirculate", "--max-new-tokens"): ["--s", "3", "--d", "1", "--prompt", "def"],
    ("recirculate", "--train-mixer"): ["--s", "3", "--d", "1", "--steps", "1"],
    ("recirculate", "--steps"): ["--s", "3", "--d", "1", "--train-mixer", "constant_scalar"],
    ("recirculate", "--calibrate"): ["--pairs", "3:1", "--alphas", "0.1"],
    ("eval", "--missing-kv"): ["--exit", "entropy:1"],
    ("generate", "--recirculate-beta"): ["--recirculate", "3:1:0.1"],
    ("generate", "--recirculate-ramp"): ["--recirculate", "3:1:0.1"],
    ("generate", "--recirculate-schedule"): ["--recirculate", "3:1:0.1"],
    ("train", "--resume"): ["--out", "{resumable}"],
    ("generate", "--no-cache"): ["--exit", "fixed:2"],           # the reference takes a fixed depth as --exit too
}

SKIP = {"--debug", "--help"}     # --debug shows tracebacks on purpose

# Refused values where junk text would be accepted (any text names a folder to create): a file.
INVALID = {"--out": [AFILE], "--hf": [AFILE]}

# Leaves whose every run costs seconds: their options' valid values are tried together in one run (each
# option still gets its own runs with refused values, which end before any work).
COMBINED = {"train", "check", "bench decode", "bench train", "bench serve", "experiment extrapolate", "experiment deeploop",
            "experiment loopmoe", "experiment depth", "experiment looping", "experiment retrofit"}
# ... except options that pick another mode of the command: each of these gets its own valid run
MODES = {("train", "--resume"), ("train", "--stage2"), ("train", "--init"),
         ("experiment retrofit", "--minutes")}            # the other budget: --tokens and --minutes exclude each other


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, path + (name,))
            return
    yield " ".join(path), parser


LEAVES = dict(_leaves(build_parser()))


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not set(a.option_strings) & SKIP]


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _valid(command: str, action: argparse.Action) -> str | None:
    """BASE's own value of the flag, else VALID's, else the first choice, else the parser's default."""
    flag, base = _flag(action), BASE.get(command, [])
    if flag in base and _takes_value(action):
        return base[base.index(flag) + 1]
    table = VALID.get(flag, {})
    if command in table or "*" in table:
        return table.get(command, table.get("*"))
    if action.choices:
        return str(next(iter(action.choices)))
    if action.default is not None and not isinstance(action.default, (bool, list)) and action.default != "":
        return str(action.default)
    return None


def _invalid(action: argparse.Action) -> list[str]:
    flag = _flag(action)
    if flag in INVALID:
        return INVALID[flag]
    if action.type is int:
        return ["junk", "-7"]
    if action.type is float:
        return ["junk", "-7", "nan"]
    return ["@@junk@@"]


CASES = []
for command, parser in LEAVES.items():
    for action in _options(parser):
        flag = _flag(action)
        if (command not in COMBINED or (command, flag) in MODES) and flag not in BASE.get(command, []):
            CASES.append(pytest.param(command, flag, "valid", id=f"{command}:{flag}:valid"))
        if _takes_value(action):
            for bad in _invalid(action):
                CASES.append(pytest.param(command, flag, bad, id=f"{command}:{flag}:{bad}"))
    CASES.append(pytest.param(command, None, "valid", id=f"{command}:base" + (":all-valid" * (command in COMBINED))))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The files the commands read: a tiny trained run (a copy of its own, as eval --exit-sweep and
    --resume write into it), a text folder, a JSONL file, a tiny recipe and a tiny HF Llama folder."""
    from looplm.train.trainer import train
    root = tmp_path_factory.mktemp("every-flag")
    text = write_corpus(root / "corpus")
    overrides = {**TINY, "data.path": str(text), "train.steps": 2, "train.checkpoint_every": 1,
                 "model.init_std": 0.3}
    train(tiny_recipe(**overrides), root / "run", quiet=True)
    recipe = root / "tiny.toml"
    recipe.write_text(_toml(overrides | {"train.steps": 1, "train.eval_batches": 1}))
    (root / "data.jsonl").write_text("\n".join(json.dumps({"text": f"def g{i}(): return {i}"}) for i in range(20)))
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "hf")
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    vocab = {chr(32 + i): i for i in range(95)} | {"<unk>": 95, "</s>": 96}      # printable ASCII, one id each
    chars = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    chars.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=chars, eos_token="</s>")
    tok.save_pretrained(root / "hf-tok")            # with a context a character-level cloze question fits
    long = transformers.LlamaConfig(**{**cfg.to_dict(), "max_position_embeddings": 512})
    transformers.LlamaForCausalLM(long).save_pretrained(root / "hf-tok")
    from looplm.interop.hf_import import import_hf
    import_hf(root / "hf-tok", root / "imported")
    return {"root": root, "run": root / "run", "text": text, "recipe": recipe, "hf": root / "hf",
            "jsonl": root / "data.jsonl", "imported": root / "imported"}


def _toml(flat: dict) -> str:
    """A recipe TOML from dotted keys (every other field at its default)."""
    sections: dict[str, list[str]] = {}
    for key, value in flat.items():
        section, field = key.split(".", 1)
        sections.setdefault(section, []).append(f"{field} = {json.dumps(value)}")
    return 'name = "tiny"\n\n' + "\n\n".join(f"[{s}]\n" + "\n".join(v) for s, v in sections.items()) + "\n"


@pytest.fixture
def fill(world, tmp_path):
    counter = itertools.count()

    def f(arg: str) -> str:
        if arg == FRESH:
            return str(tmp_path / f"out{next(counter)}")
        if arg == AFILE:
            return str(world["recipe"])                  # an existing file where a folder belongs
        if arg == "{resumable}":
            dst = tmp_path / "resumable"
            shutil.copytree(world["run"], dst)
            return str(dst)
        for key in ("run", "text", "hf", "recipe", "jsonl", "imported"):
            arg = arg.replace("{" + key + "}", str(world[key]))
        return arg
    return f


def _argv(command: str, flag: str | None, value: str | None) -> list[str]:
    """BASE for the command, with `flag value` replacing the base's own value of that flag; flag None:
    BASE alone, or for a COMBINED leaf BASE and every other option's valid value at once."""
    base = list(BASE.get(command, []))
    if flag is None:
        if command in COMBINED:
            for action in _options(LEAVES[command]):
                if _flag(action) not in base and (command, _flag(action)) not in MODES:
                    base += WITH.get((command, _flag(action)), []) + [_flag(action)] + (
                        [_valid(command, action)] if _takes_value(action) else [])
        return base
    if flag in base:
        i = base.index(flag)
        takes = i + 1 < len(base) and not base[i + 1].startswith("--")
        del base[i:i + 2 if takes else i + 1]
    action = next(a for a in _options(LEAVES[command]) if _flag(a) == flag)
    extra = [flag] if not _takes_value(action) else [flag, value]
    return base + WITH.get((command, flag), []) + extra


@pytest.fixture
def no_listen(monkeypatch):
    """`looplm serve` builds its app and returns instead of listening; `bench train --compile` compiles
    nothing (torch.compile returns the module: compiling takes minutes on a small CPU)."""
    import uvicorn
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    monkeypatch.setattr(torch, "compile", lambda model, *a, **kw: model)


@pytest.mark.parametrize("command,flag,value", CASES)
def test_no_command_ends_in_a_traceback(command, flag, value, fill, no_listen, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)                          # default output folders (runs/...) land here
    action = next((a for a in _options(LEAVES[command]) if _flag(a) == flag), None)
    if value == "valid":
        value = _valid(command, action) if action is not None else None
        if action is not None and _takes_value(action) and value is None:
            pytest.fail(f"{command} {flag}: no sample value in VALID")
    argv = [*command.split(), *[fill(a) for a in _argv(command, flag, value)]]
    try:
        code = main(argv)
    except SystemExit as stop:                           # argparse's own refusals
        code = stop.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, f"looplm {' '.join(argv)}"
    lines = [ln for ln in err.splitlines() if ln.startswith("looplm") and "error" in ln]
    if code == 2:
        assert len(lines) == 1, f"looplm {' '.join(argv)}: exit 2 needs one error line, got:\n{err}"
        assert err.rstrip("\n").splitlines()[-1] == lines[0], f"the error line comes last:\n{err}"
        assert not any(ln.startswith("usage:") for ln in err.splitlines()), f"argparse's usage block:\n{err}"
        assert len(lines[0]) < 1000
    else:
        assert code in (0, 1), f"looplm {' '.join(argv)}: exit {code}\n{err}"
        assert not lines, f"looplm {' '.join(argv)}: exit {code} with an error line:\n{err}"
    if code == 0 and "--json" in argv:
        json.loads(out)                                  # exactly one JSON object on stdout


def test_every_option_has_a_valid_sample():
    """A flag added later gets a sample value (or a default in the parser) rather than going untested."""
    missing = [f"{c} {_flag(a)}" for c, p in LEAVES.items() for a in _options(p)
               if _takes_value(a) and _valid(c, a) is None]
    assert not missing, f"add to VALID: {missing}"


def test_the_enumeration_covers_every_leaf_and_flag():
    """The parametrisation is the parser's: every leaf command and every option of each appears."""
    seen = {(c, f) for c, f, _ in (p.values for p in CASES)}
    for command, parser in LEAVES.items():
        for action in _options(parser):
            assert (command, _flag(action)) in seen or _flag(action) in _argv(command, None, None), \
                f"{command} {_flag(action)}"
    assert {"train", "eval", "generate", "serve", "data prepare", "bench decode", "experiment depth"} <= set(LEAVES)
