"""Which decode features combine: one table, consulted wherever a decode is set up.

Every decode feature is a row of `FEATURES`: its name, what turns it on (a predicate on a `Decode`, the
model's settings and the engine's as the user gave them) and what it is. `RULES` lists what a feature
refuses, alone or beside another one, with the message the user reads; the first rule that applies is
the one raised, in the order the rules are listed. `Engine` consults the table at construction
(`check`), so the CLI, the server, lm-eval and everything else that builds an engine refuse the same
combinations with the same words; `looplm serve --batching` and `looplm bench serve` check their
batching here before any engine work. tests/test_capabilities.py enumerates every pair of features:
a pair the table allows must decode, a pair it refuses must raise its message.

Rules about values rather than features (a routed model's trained cache rule, kv_sharing's `first`
policy, an untied baseline's exact depth, a speculative spec's range) stay where the values are parsed
(engine.py); they normalise or refuse one setting, not a combination.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UserError

BATCHINGS = ("exit", "depth", "static")
"""How a server's decode steps group tokens (`GenerationConfig.batching`, `serve --batching`):
exit: a step runs every running row's token from round 1 until the deepest has exited (rows that exit
earlier stop computing and wait); depth: continuous depth batching (depth.py), one round per step for
every token in flight, a row whose token exits takes its next token at once; static: every token runs
the full depth R (the exit policy is not applied) -- the baseline the FLOP bound is measured against."""


@dataclass(frozen=True)
class Decode:
    """What one decode combines, as given (before the engine normalises a routed or shared-cache model's
    settings): the model's settings and the engine's."""

    model: Any
    """ModelConfig (model.cfg)."""
    policy: str
    """The exit policy's kind as given: fixed, entropy, kl or quantile."""
    config: Any
    """GenerationConfig as given."""
    rounds: int = 1
    """The model's nominal depth."""
    gate: bool = False
    feedback: bool = False
    dtype: str = "float32"
    device: str = "cpu"

    @classmethod
    def of(cls, model: Any, config: Any) -> "Decode":
        p = next(model.parameters())
        kind = config.exit.strip().partition(":")[0]
        return cls(model=model.cfg, policy=kind, config=config, rounds=model.nominal_rounds, gate=getattr(model, "gate", None) is not None,
                   feedback=getattr(model, "feedback", None) is not None,
                   dtype=str(p.dtype).removeprefix("torch."), device=p.device.type)


@dataclass(frozen=True)
class Feature:
    name: str
    on: Callable[[Decode], bool]
    what: str


FEATURES: tuple[Feature, ...] = (
    Feature("early_exit", lambda d: d.policy in ("entropy", "kl", "quantile"),
            "an early-exit policy decides each token's depth (--exit entropy:TAU, kl:EPS, quantile:Q)"),
    Feature("quantile_exit", lambda d: d.policy == "quantile", "the exit gate's CDF decides (--exit quantile:Q)"),
    Feature("exit_in_prefill", lambda d: bool(d.config.exit_in_prefill), "prompt tokens exit early too"),
    Feature("missing_mask", lambda d: d.config.missing == "mask",
            "later rounds leave out the tokens that exited before them (--missing-kv mask)"),
    Feature("prefill_cache", lambda d: d.config.prefill_cache != "full",
            "prompt tokens keep one shared entry (--prefill-cache first|last|average)"),
    Feature("decode_cache", lambda d: d.config.decode_cache != "full",
            "generated tokens keep one shared entry (--decode-cache first|last|average)"),
    Feature("speculative", lambda d: bool(d.config.speculative) and not str(d.config.speculative).startswith("exit:"),
            "self-speculative decoding with drafts of a fixed depth (--speculative ROUNDS:K)"),
    Feature("speculative_exit", lambda d: str(d.config.speculative or "").startswith("exit:"),
            "self-speculative decoding with drafts stopped by the exit policy (--speculative exit:K)"),
    Feature("recirculation", lambda d: d.config.recirculation is not None,
            "a frozen model's visits refined by recirculation (--recirculate)"),
    Feature("contrast", lambda d: d.config.contrast is not None, "LoopCD-style contrastive logits (--contrast)"),
    Feature("feedback", lambda d: d.feedback, "full-bandwidth feedback (recipe [feedback])"),
    Feature("mor", lambda d: d.model.mor != "none", "a Mixture-of-Recursions router (model.mor)"),
    Feature("kv_sharing", lambda d: d.model.kv_sharing == "first", "model.kv_sharing = first"),
    Feature("untied", lambda d: bool(d.model.untied), "an untied baseline (a block stack per round)"),
    Feature("damped", lambda d: d.model.round_update == "damped", "damped round updates (model.round_update)"),
    Feature("euler", lambda d: d.model.round_update == "euler", "Euler sub-steps (model.round_update = euler)"),
    Feature("depth_batching", lambda d: d.config.batching == "depth", "continuous depth batching (--batching depth)"),
    Feature("static_batching", lambda d: d.config.batching == "static", "full-depth batching (--batching static)"),
    Feature("half_precision", lambda d: d.dtype in ("bfloat16", "float16"), "bf16/fp16 weights (--dtype)"),
    Feature("cuda", lambda d: d.device == "cuda", "a CUDA device"),
)
NAMES = tuple(f.name for f in FEATURES)


@dataclass(frozen=True)
class Rule:
    """`a` (with `b`, or alone when b is None) is refused with `message` (a text, or made from the Decode)."""

    a: str
    b: str | None
    message: str | Callable[[Decode], str]
    brief: str = ""
    """For a rule of one feature: what it needs, in a few words (the docs' table)."""

    def text(self, d: Decode) -> str:
        return self.message(d) if callable(self.message) else self.message


def routed_depth(rounds: int) -> str:
    """A routed model's depth is its router's (also refused for a fixed depth other than its own: engine.py)."""
    return (f"--exit/--rounds: a Mixture-of-Recursions model's router decides each token's depth (1..{rounds}); "
            "other exit policies or depths are not its function")


def _exit(d: Decode) -> str:
    return d.config.exit.strip()


_FB_FIXED = lambda d: (f"--exit {_exit(d)}: a feedback model decodes at a fixed depth for now (the top state "  # noqa: E731
                       "it carries is the last round's)")
_SPEC = ("speculative", "speculative_exit")        # both kinds of drafts: refused alike


def _each(a: str, bs: tuple[str, ...], message: str) -> tuple[Rule, ...]:
    """`a` refused beside each of `bs`, with one message."""
    return tuple(Rule(a, b, message) for b in bs)


_RC = "recirculation: not available with "
_CT = "--contrast: not available with "
_DB = "--batching depth: not available with "

RULES: tuple[Rule, ...] = (
    Rule("euler", None, "model.round_update = euler: the cached engine holds one key/value entry per block visit and "
                        "Euler sub-steps visit each core block k times a round; evaluate it with whole-sequence "
                        "forwards (looplm eval, lm-eval, generate --no-cache)",
         brief="whole-sequence forwards, not the cached engine"),
    Rule("quantile_exit", None, lambda d: f"--exit {_exit(d)}: quantile needs a model trained with an exit gate "
                                          "(exit.gate)", brief="a model with an exit gate"),
    # a Mixture-of-Recursions router decides every token's depth
    Rule("mor", "early_exit", lambda d: routed_depth(d.rounds)),
    *_each("mor", _SPEC, "--speculative: not available for a Mixture-of-Recursions model (drafts at a fixed depth "
                         "are not the routed function)"),
    *_each("kv_sharing", _SPEC, "--speculative: not available for a model trained with model.kv_sharing = first (its "
                                "verification would need the full per-round cache)"),
    # speculation: drafts verified at full depth against plain decoding
    Rule("speculative", "early_exit", lambda d: "--speculative verifies at full depth; drafts of a fixed ROUNDS "
         f"cannot be combined with the early-exit policy {_exit(d)} (from --exit or the recipe's exit.policy); pass "
         "--exit fixed, or draft with the policy: --speculative exit:K"),
    Rule("speculative_exit", None, lambda d: f"--speculative {d.config.speculative}: exit drafts stop by an early-exit "
         "policy; pass --exit entropy:TAU, kl:EPS or quantile:Q (the output stays full-depth)"
         if d.policy not in ("entropy", "kl", "quantile") else "", brief="an early-exit policy"),
    *(Rule(a, "decode_cache", "--speculative needs --decode-cache full (verification must reproduce plain decoding)")
      for a in _SPEC),
    # full-bandwidth feedback carries the final round's top state
    Rule("feedback", "early_exit", _FB_FIXED),
    Rule("feedback", "exit_in_prefill", _FB_FIXED),
    Rule("feedback", "mor", "full-bandwidth feedback decodes at a fixed depth for now (the top state it carries is the "
                            "last round's); a Mixture-of-Recursions router decides each token's depth"),
    *_each("feedback", _SPEC, "--speculative: not available for a feedback model yet (its carried state would have "
                              "to roll back with the cache)"),
    # recirculation: every position runs every visit once per pass, each visit's entries in a slot of its own
    Rule("recirculation", "early_exit", _RC + "an early-exit policy (visits would differ per token)"),
    Rule("recirculation", "exit_in_prefill", _RC + "an early-exit policy (visits would differ per token)"),
    Rule("recirculation", "mor", _RC + "a Mixture-of-Recursions router"),
    Rule("recirculation", "feedback", _RC + "full-bandwidth feedback"),
    *_each("recirculation", _SPEC, _RC + "--speculative"),
    *_each("recirculation", ("prefill_cache", "decode_cache", "kv_sharing"),
           _RC + "a shared cache policy (each visit's refined entries need their own slot: --prefill-cache full "
                 "--decode-cache full)"),
    # contrastive decoding: a final round R for every token and one earlier round r, plain logits otherwise
    Rule("contrast", "mor", _CT + "a Mixture-of-Recursions router (each token's final round is its own)"),
    Rule("contrast", "early_exit", lambda d: _CT + f"the early-exit policy {_exit(d)} (a token that exits has no "
                                                   "final round R to contrast; pass --exit fixed)"),
    *_each("contrast", _SPEC, _CT + "--speculative (its drafts and their verification read plain logits)"),
    Rule("contrast", "recirculation", _CT + "recirculation (its refined passes read out the plain logits)"),
    Rule("contrast", "feedback", _CT + "full-bandwidth feedback (its carried top state is the final round's plain "
                                       "readout)"),
    # continuous depth batching: one step mixes rounds of one tied block, one column per token
    *_each("depth_batching", _SPEC, _DB + "--speculative (drafts and verification are chunks of one request)"),
    Rule("depth_batching", "recirculation", _DB + "recirculation (its passes rerun every visit of a position)"),
    Rule("depth_batching", "contrast", _DB + "--contrast (it reads out two rounds of every token)"),
    Rule("depth_batching", "feedback", _DB + "full-bandwidth feedback (its tokens carry the last round's top state "
                                             "into the next token's input)"),
    Rule("depth_batching", "mor", _DB + "a Mixture-of-Recursions router (its weights and routes are per round)"),
    Rule("depth_batching", "untied", _DB + "an untied baseline (each round has its own blocks: rows at different "
                                           "rounds cannot share a step)"),
    # static batching is the full-depth baseline
    Rule("static_batching", "early_exit", lambda d: f"--batching static runs every token at full depth (the baseline "
         f"depth batching is measured against); it cannot apply the exit policy {_exit(d)}: drop --exit, or pass "
         "--batching exit|depth"),
    Rule("static_batching", "mor", "--batching static runs every token at full depth: a Mixture-of-Recursions "
                                   "router decides each token's depth"),
    Rule("static_batching", "exit_in_prefill", "--batching static runs every token at full depth: exit_in_prefill "
                                               "does not apply"),
    Rule("static_batching", "speculative_exit", "--batching static runs every token at full depth: exit drafts do not "
                                                "apply"),
)


def active(d: Decode) -> tuple[str, ...]:
    """The features this decode uses, in table order."""
    return tuple(f.name for f in FEATURES if f.on(d))


def refusal(d: Decode) -> str | None:
    """The message of the first rule that refuses this decode, or None when it may run."""
    on = set(active(d))
    for rule in RULES:
        if rule.a in on and (rule.b is None or rule.b in on):
            if rule.a == "quantile_exit" and d.gate:
                continue                               # the rule is a need: quantile with a gate runs
            text = rule.text(d)
            if text:
                return text
    return None


def check(d: Decode) -> None:
    """UserError with the first refusal, else nothing."""
    why = refusal(d)
    if why:
        raise UserError(why)


def refused_pair(a: str, b: str) -> Rule | None:
    """The rule that refuses features a and b together, whichever order it names them (None: they combine)."""
    for rule in RULES:
        if {rule.a, rule.b} == {a, b}:
            return rule
    return None


def check_batching(engine: Any, batching: str) -> None:
    """Whether `engine` can decode with this batching (UserError with the table's message otherwise)."""
    import dataclasses
    if batching not in BATCHINGS:
        raise UserError(f"--batching {batching!r}: expected one of {', '.join(BATCHINGS)}")
    check(Decode.of(engine.model, dataclasses.replace(engine.given, batching=batching)))


def table_markdown() -> str:
    """The table as docs/inference.md shows it: each feature, and what it refuses."""
    lines = ["| feature | what | not with | needs |", "|---|---|---|---|"]
    for f in FEATURES:
        refuses = sorted({r.b if r.a == f.name else r.a for r in RULES
                          if f.name in (r.a, r.b) and r.b is not None})
        needs = "; ".join(r.brief for r in RULES if r.a == f.name and r.b is None)
        what = f.what.replace("|", "\\|")
        lines.append(f"| `{f.name}` | {what} | {', '.join(f'`{x}`' for x in refuses) or '—'} | {needs or '—'} |")
    return "\n".join(lines)
