"""The decode flags are generated from the typed options (inference/options.py): one declaration, the options'
own docstrings as help and their defaults as the CLI's, in generate, eval and serve."""

from __future__ import annotations

import argparse
from dataclasses import fields

from looplm.cli import build_parser
from looplm.docstrings import attribute_docs
from looplm.inference.options import FIELD, FLAGS
from looplm.inference.runner import GenerationConfig
from looplm.inference.sampler import SamplingParams


def _command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_each_flag_says_what_its_option_says_in_every_command():
    docs = {GenerationConfig: attribute_docs(GenerationConfig), SamplingParams: attribute_docs(SamplingParams)}
    seen = set()
    for command in ("generate", "serve", "eval"):
        for action in _command(command)._actions:
            flag = getattr(action, "option", None)
            if flag is None:
                continue                           # the command's own flag (eval --rounds takes a list)
            seen.add((command, action.dest))
            assert action.help.replace("%%", "%").startswith(docs[flag.owner][flag.field]), (command, action.dest)
    # the flags the issue named are declared once and shared
    for dest in ("exit", "contrast", "missing_kv"):
        assert {("generate", dest), ("serve", dest), ("eval", dest)} <= seen
    assert ("serve", "batching") in seen and ("generate", "temperature") in seen


def test_the_sampling_flags_default_to_the_options_defaults():
    args = build_parser().parse_args(["generate", "RUN", "--prompt", "x"])
    defaults = {f.name: f.default for f in fields(SamplingParams)}
    for dest, flag in FLAGS.items():
        if flag.owner is SamplingParams and flag.default is FIELD and not flag.append:
            assert getattr(args, dest) == defaults[flag.field], dest
    for dest in ("exit", "prefill_cache", "decode_cache", "missing_kv", "rounds", "speculative", "contrast"):
        assert getattr(args, dest) is None            # not given: the run's recipe decides (Engine.from_run)
    assert build_parser().parse_args(["serve", "RUN"]).batching == GenerationConfig().batching
