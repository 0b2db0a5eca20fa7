"""The `looplm` command: a thin layer over the library's typed functions.

Conventions (CONTRACT.md): `--json` prints exactly one JSON object on stdout; progress and
logs go to stderr; bad input exits 2 with one line naming the field or file (a traceback
only with --debug).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .errors import UserError


def _overrides(pairs: list[str] | None) -> dict[str, Any]:
    from .config import parse_override
    return dict(parse_override(p) for p in pairs or [])


def _rounds_arg(text: str) -> list[int]:
    try:
        rounds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--rounds {text!r}: expected comma-separated positive integers, e.g. 1,2,4,8") from None
    if not rounds or min(rounds) < 1:
        raise UserError(f"--rounds {text!r}: expected comma-separated positive integers, e.g. 1,2,4,8")
    return rounds


def _emit(obj: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(obj) if as_json else text)


def cmd_train(args: argparse.Namespace) -> int:
    from .config import load_recipe
    from .train import train

    if args.stage2:  # Ouro stage II: RUN's recipe and weights, only the exit gate trains
        from .train import stage2_recipe
        if args.recipe:
            raise UserError("--stage2 RUN takes its recipe from RUN; change fields with --set, not --recipe")
        recipe = stage2_recipe(args.stage2, _overrides(args.set))
        out = args.out or f"{args.stage2.rstrip('/')}-stage2"
        report = train(recipe, out, resume=args.resume, init_from=args.stage2)
    else:
        recipe = load_recipe(args.recipe or "quickstart", _overrides(args.set))
        out = args.out or f"runs/{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        report = train(recipe, out, resume=args.resume)
    print(f"run written to {out}: train loss {report['train_loss_final']:.4f}, "
          f"val loss by rounds {json.dumps(report['val_loss_by_rounds'])}", file=sys.stderr)
    print(out)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .checkpoint import load_run
    from .evaluate import evaluate_rounds, eval_rounds_list
    from .evaluate import eval_batches_for

    run = load_run(args.run)
    batches = eval_batches_for(run, args.data)
    rounds = _rounds_arg(args.rounds) if args.rounds else eval_rounds_list(run.recipe, run.recipe.depth.rounds)
    if run.recipe.model.untied and rounds != [run.recipe.depth.rounds]:
        raise UserError(f"--rounds: this untied baseline runs exactly {run.recipe.depth.rounds} rounds")
    result: dict[str, Any] = {"rounds": {str(r): v for r, v in evaluate_rounds(run.model, batches, rounds).items()}}
    lines = [f"rounds {r}: loss {v['loss']:.4f} ppl {v['ppl']:.2f}" for r, v in result["rounds"].items()]
    if args.exit or args.exit_sweep:  # per-token early exit that skips the rounds after each token's exit
        from .adaptive import exit_eval
        extra, extra_lines = exit_eval(run, batches, args.exit, args.exit_sweep,
                                       data_label=args.data or "the run's validation split")
        result.update(extra)
        lines += extra_lines
    _emit(result, args.json, "\n".join(lines))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .checkpoint import load_run
    from .sampling import generate_text

    run = load_run(args.run)
    result = generate_text(run, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           seed=args.seed, rounds=args.rounds)
    _emit(result, args.json, result["text"])
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .checkpoint import load_run
    from .checks import run_checks

    results = run_checks(load_run(args.run))
    lines = [f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in results]
    _emit({"checks": [c.to_dict() for c in results]}, args.json, "\n".join(lines))
    return 0 if all(c.passed for c in results) else 1


def cmd_recipes(args: argparse.Namespace) -> int:
    from .config import builtin_recipes
    for name, line in builtin_recipes().items():
        print(f"{name:16s} {line}")
    return 0


def cmd_recipe_show(args: argparse.Namespace) -> int:
    from .config import load_recipe
    recipe = load_recipe(args.name, _overrides(args.set))
    print(json.dumps(recipe.to_dict()) if args.json else recipe.to_toml(), end="" if not args.json else "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="looplm", description="Build, train, evaluate and serve looped language models.")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a recipe into a run folder")
    t.add_argument("--recipe", help="built-in name or TOML path (default quickstart)")
    t.add_argument("--out", help="run folder (default runs/NAME-TIMESTAMP)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field, e.g. depth.mean=6")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    t.add_argument("--stage2", metavar="RUN", help="Ouro stage II: start from RUN's weights and recipe, train only "
                                                   "the exit gate (default --out RUN-stage2)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="held-out loss by rounds")
    e.add_argument("run")
    e.add_argument("--rounds", help="comma-separated round counts, e.g. 1,2,4,8")
    e.add_argument("--data", help="text file/folder (language modelling) to evaluate on instead of the run's split")
    e.add_argument("--exit", metavar="POLICY", help="per-token early exit: fixed:R, quantile:Q, entropy:TAU or kl:EPS")
    e.add_argument("--exit-sweep", metavar="KIND", help="sweep quantile|entropy|kl thresholds (optionally KIND:V1,V2,..)"
                                                        "; writes a table, a plot and a report.md section")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="sample a continuation")
    g.add_argument("run")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--rounds", type=int, default=None, help="rounds per token (default: the recipe's depth.rounds)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("check", help="the seeds' checks before claiming a saving, against a run")
    c.add_argument("run")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)

    sub.add_parser("recipes", help="list built-in recipes").set_defaults(func=cmd_recipes)
    r = sub.add_parser("recipe", help="recipe tools")
    rsub = r.add_subparsers(dest="recipe_command", required=True)
    rs = rsub.add_parser("show", help="print the resolved recipe with defaults filled in")
    rs.add_argument("name")
    rs.add_argument("--set", action="append", metavar="KEY=VALUE")
    rs.add_argument("--json", action="store_true")
    rs.set_defaults(func=cmd_recipe_show)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except UserError as err:
        if debug:
            raise
        print(f"looplm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("looplm: interrupted", file=sys.stderr)
        return 130
