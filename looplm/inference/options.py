"""The decode options as command-line flags, declared once for generate, eval and serve.

Each flag stands for one field of a typed option (`GenerationConfig`, runner.py, or `SamplingParams`,
sampler.py): its help is that field's docstring, its type the field's, its default the field's (engine
options default to None: not given, the run's recipe decides, `Engine.from_run`). A command adds the flags
it takes with `add_flags(parser, names, notes)`, where a note says what the flag means for that command
only (eval measures an exit policy teacher-forced; generate's defaults come from the recipe). A new
sampling option is one field with a docstring and one row of `FLAGS`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

from ..docstrings import attribute_docs
from .capabilities import BATCHINGS
from .runner import GenerationConfig
from .sampler import PROMPT_MODES, SamplingParams

GIVEN = object()
"""Default None: not given, the run's own setting applies (engine options: `Engine.from_run`)."""
FIELD = object()
"""Default the field's own (sampling options)."""


@dataclass(frozen=True)
class Flag:
    """One flag: `owner.field` as `--name` (argparse dest `dest`)."""

    owner: type
    field: str
    name: str
    type: Any = str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    append: bool = False
    default: Any = GIVEN
    """GIVEN (None unless given), FIELD (the field's default) or a value."""

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def field_default(self) -> Any:
        f = next(f for f in fields(self.owner) if f.name == self.field)
        return f.default if f.default is not MISSING else f.default_factory()


G, S = GenerationConfig, SamplingParams
FLAGS: dict[str, Flag] = {f.dest: f for f in (
    Flag(G, "rounds", "--rounds", int),
    Flag(G, "exit", "--exit", metavar="POLICY"),
    Flag(G, "prefill_cache", "--prefill-cache", metavar="full|first|last|average"),
    Flag(G, "decode_cache", "--decode-cache", metavar="full|first|last|average"),
    Flag(G, "missing", "--missing-kv", metavar="copy_forward|mask"),
    Flag(G, "speculative", "--speculative", metavar="ROUNDS:K"),
    Flag(G, "contrast", "--contrast", metavar="ROUND:BETA"),
    Flag(G, "batching", "--batching", choices=BATCHINGS, default="exit"),
    Flag(S, "max_new_tokens", "--max-new-tokens", int, default=FIELD),
    Flag(S, "temperature", "--temperature", float, default=FIELD),
    Flag(S, "seed", "--seed", int, default=FIELD),
    Flag(S, "top_k", "--top-k", int, default=FIELD),
    Flag(S, "top_p", "--top-p", float, default=FIELD),
    Flag(S, "repetition_penalty", "--repetition-penalty", float, default=FIELD),
    Flag(S, "presence_penalty", "--presence-penalty", float, default=FIELD),
    Flag(S, "frequency_penalty", "--frequency-penalty", float, default=FIELD),
    Flag(S, "logit_bias", "--logit-bias", metavar="ID=BIAS", append=True, default=FIELD),
    Flag(S, "stop", "--stop", append=True, default=FIELD),
    Flag(S, "logprobs", "--logprobs", int, metavar="N", default=FIELD),
    Flag(S, "prompt_mode", "--prompt-mode", choices=PROMPT_MODES, default=FIELD),
)}


def help_of(flag: Flag, note: str = "") -> str:
    """The field's docstring (argparse's % escaped), then the command's note."""
    text = attribute_docs(flag.owner).get(flag.field, "")
    return (text + (" " + note if note else "")).replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, names: Sequence[str], notes: dict[str, str] | None = None) -> None:
    """Add these options' flags (FLAGS keys) to a command; `notes`: per flag, what it means for this command."""
    notes = notes or {}
    for dest in names:
        flag = FLAGS[dest]
        kw: dict[str, Any] = {"help": help_of(flag, notes.get(dest, "")), "dest": dest}
        if flag.metavar:
            kw["metavar"] = flag.metavar
        if flag.choices:
            kw["choices"] = flag.choices
        if flag.append:
            kw.update(action="append", default=[])
        else:
            kw["type"] = flag.type
            kw["default"] = (None if flag.default is GIVEN else flag.field_default() if flag.default is FIELD
                             else flag.default)
        action = parser.add_argument(flag.name, **kw)
        action.option = flag                # marks the flags generated here (tests/test_options.py)
