"""lm-evaluation-harness's model for looplm runs: `--model looplm --model_args run=DIR,...`.

    python -m looplm.lm_eval --model looplm --model_args run=runs/quickstart,batch_size=8 \\
        --tasks looplm_next_bytes,looplm_val_bpb --include_path lm_eval_task
    python -m looplm.lm_eval --model looplm --model_args run=DIR,rounds=8,exit=entropy:1.5,device=auto ...
    lm_eval --model looplm --model_args run=DIR ...     # an lm-eval that reads the `lm_eval.models` entry point

Importing this module registers `LoopLM` in lm-eval's model registry as "looplm". Our package
metadata also names it under the `lm_eval.models` entry-point group, for lm-eval versions that
read that group; 0.4.13 does not, so `python -m looplm.lm_eval ARGS` imports this module and then
runs lm-eval's own command line (`lm_eval.__main__.cli_evaluate`) on ARGS.

Model arguments (`--model_args`): run (the run folder, required); rounds (the most rounds per
token; default the recipe's depth); exit (an exit policy as `looplm generate --exit` takes it:
fixed, fixed:R, entropy:TAU, kl:EPS, quantile:Q; default the recipe's); device (cpu by default,
auto = cuda when available); dtype (the weights' precision: fp32, the default and exact; bf16;
fp16); batch_size (prompts per engine batch; default lm-eval's
--batch_size); prompt_mode (a feedback run's: standard, soft or fused, for every request; default
soft); seed (the random initial loop state's seed and sampling's; default 0); max_gen_toks
(generate_until's default length, 256). A model argument wins over lm-eval's own --batch_size and
--device, which lm-eval passes to every model (--batch_size defaults to 1, --device to cuda:0,
which falls back to cpu where torch sees no CUDA device).

Every request runs on the cached engine (`inference.engine.Engine`), the function `looplm
generate` and `looplm serve` compute:

- loglikelihood: lm-eval's `TemplateLM` encodes each (context, continuation) as its HF model
  class does (trailing spaces of the context move to the continuation; an empty context becomes
  the end-of-text token). The engine scores a prompt of at most `context` tokens (it feeds the
  last token too), so context + continuation is cut from the left to `max_length` + 1 = context
  tokens: each continuation token sees at most context - 1 tokens before it (HF's model class,
  which drops the last token, sees one more). Windows are scored in batches of batch_size,
  longest first (`Engine.prompt_logprobs`); a window that begins another one (a repeated
  request, a choice that extends another) is read off the longer one's scores, which are the
  same numbers (causal attention; a row's result does not depend on its batch mates). is_greedy:
  every continuation token is its position's likeliest.
- loglikelihood_rolling: lm-eval's rolling windows (`get_rolling_token_windows`,
  `make_disjoint_window`) of `max_length` tokens, the first token conditioned on the end-of-text
  token, scored as above and summed per document.
- generate_until: `Engine.generate` with the `until` strings as stop strings (the text is cut
  before them), max_gen_toks new tokens (at most the context), greedy unless do_sample or a
  temperature asks to sample (lm-eval's `normalize_gen_kwargs`); top_p, top_k and
  repetition_penalty pass through. Longest prompts first, batch_size per engine batch; a prompt
  is cut from the left so that it and its new tokens fit the context.

Under an early-exit policy every token exits by it, prompt and continuation tokens alike: the
function `looplm eval --exit` measures (to the engine the scored tokens are prompt tokens, so
the engine runs with `exit_in_prefill`, one column at a time).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch
import lm_eval.models  # noqa: F401  lm-eval's own models: get_model adds them only to an empty registry
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.utils import normalize_gen_kwargs
from tqdm import tqdm

from .errors import UserError
from .inference.engine import Engine, SamplingParams
from .runs.checkpoint import Run, load_run

__all__ = ["LoopLM", "NAME", "main"]

NAME = "looplm"
"""The model's name in lm-eval's registry (`--model looplm`)."""

log = logging.getLogger(__name__)

# model_args (and lm-eval's own constructor keywords) LoopLM takes; anything else is a typo
_ARGS = ("run", "rounds", "exit", "device", "batch_size", "max_batch_size", "seed", "max_gen_toks", "prompt_mode")
_SAMPLING_KWARGS = ("top_p", "top_k", "repetition_penalty")   # gen_kwargs passed to SamplingParams as they are

Window = tuple[int, ...]          # a prompt's token ids, as a dict key


def _int_arg(value: Any, name: str, low: int) -> int:
    """A model argument as an integer >= low (lm-eval hands over ints or strings)."""
    try:
        number = int(str(value).strip())
    except ValueError:
        number = None
    if number is None or number < low:
        raise UserError(f"model_args {name}={value!r}: expected an integer >= {low}")
    return number


class LoopLM(TemplateLM):
    """A looplm run as an lm-eval model (see the module docstring)."""

    def __init__(self, run: str | None = None, rounds: int | str | None = None, exit: str | None = None,
                 device: str | None = None, batch_size: int | str = 1, max_batch_size: int | None = None,
                 seed: int | str = 0, max_gen_toks: int | str = 256, prompt_mode: str | None = None,
                 dtype: str = "fp32") -> None:
        super().__init__()
        if run is None:
            raise UserError("model_args: run=DIR (a looplm run folder) is required")
        if str(batch_size).strip().startswith("auto"):
            raise UserError("batch_size auto: not supported by the looplm model; give a number of prompts per batch")
        if max_batch_size is not None:      # lm-eval passes it only when asked (its default is None)
            raise UserError(f"max_batch_size {max_batch_size}: it caps batch_size auto, which the looplm model does "
                            "not support; give batch_size=N (prompts per batch) instead")
        self.run: Run = load_run(str(run), device=device or "cpu", dtype=str(dtype))
        self.engine = _scoring_engine(self.run, None if rounds is None else _int_arg(rounds, "rounds", 1),
                                      None if exit is None else str(exit))
        self.tokenizer = self.run.tokenizer
        self.batch_size = _int_arg(batch_size, "batch_size", 1)
        self.seed = _int_arg(seed, "seed", 0)
        self.max_gen_toks = _int_arg(max_gen_toks, "max_gen_toks", 1)
        # a feedback model's prompt mode for every request (checked here: a mode the model has)
        self.prompt_mode = self.engine.prompt_mode(SamplingParams(prompt_mode=prompt_mode or None))
        self._device = next(self.run.model.parameters()).device

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "LoopLM":
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> "LoopLM":
        """model_args, then lm-eval's own keywords (batch_size, max_batch_size, device) that
        model_args leave unset: lm-eval passes --batch_size (default 1) to every model."""
        unknown = sorted(set(arg_dict) - set(_ARGS))
        if unknown:
            raise UserError(f"model_args {', '.join(unknown)}: not a looplm model argument "
                            f"(expected {', '.join(a for a in _ARGS if a != 'max_batch_size')})")
        extra = {k: v for k, v in (additional_config or {}).items()
                 if v is not None and k in _ARGS and k not in arg_dict}
        if str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's --device defaults to cuda:0: without CUDA, its default (or a --device the
            # run cannot honour) falls back to cpu, as its HF model does; device= in model_args is strict
            log.warning("--device %s: torch sees no CUDA device; running on cpu", extra["device"])
            extra["device"] = "cpu"
        return cls(**arg_dict, **extra)

    # -- what TemplateLM asks of a model -------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def max_length(self) -> int:
        """The most tokens a scored token is conditioned on: the engine scores prompts of at most
        `context` tokens, the last of which is scored, never read."""
        return self.engine.cfg.context - 1

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return list(self.tokenizer.encode(string))      # looplm tokenizers add no special tokens

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in its results' config: the run and the function evaluated."""
        e = self.engine
        return {"looplm_run": str(self.run.path.resolve()), "rounds": e.rounds, "exit": str(e.policy),
                "context": e.cfg.context, "max_length": self.max_length, "seed": self.seed}

    # -- requests -------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(key, context ids, continuation ids) -> (sum of the continuation's log-probabilities,
        whether every continuation token is its position's likeliest)."""
        windows: list[list[int]] = []
        for _, ctx, cont in requests:
            if len(cont) > self.max_length:
                raise UserError(f"loglikelihood: a continuation of {len(cont)} tokens does not fit the model "
                                f"context of {self.engine.cfg.context} (at most {self.max_length} tokens)")
            windows.append((ctx + cont)[-(self.max_length + 1):])          # cut from the left
        scores = self._score(windows, disable_tqdm)
        out: list[tuple[float, bool]] = []
        for (key, _, cont), (lps, greedy) in zip(requests, scores):
            first = len(lps) - len(cont)                                     # the continuation's first position
            answer = (float(sum(lps[first:])), all(greedy[first:]))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each document's total log-probability over lm-eval's rolling windows (see the module docstring)."""
        counts: list[int] = []
        windows: list[tuple[None, list[int], list[int]]] = []
        for (string,) in [req.args for req in requests]:
            doc = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows += [(None, ctx, pred) for ctx, pred in doc]
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows, disable_tqdm)        # every document's windows, batched together
        totals, at = [], 0
        for req, n in zip(requests, counts):
            total = sum(lp for lp, _ in scores[at:at + n])
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            totals.append(total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each request's generated text, cut before its first `until` string."""
        ctx = self.engine.cfg.context
        jobs: list[tuple[list[int], SamplingParams]] = []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kw: dict[str, Any] = dict(normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks))
            until = tuple(s for s in kw.pop("until") if s)
            new = int(kw.pop("max_gen_toks"))
            sample, temperature = bool(kw.pop("do_sample", False)), float(kw.pop("temperature", 0.0) or 0.0)
            temperature = temperature if sample else 0.0     # normalize_gen_kwargs: no do_sample, no sampling
            if sample and temperature == 0.0:
                temperature = 1.0                       # do_sample without a temperature: sample at 1, as HF's generate
            extra = {k: kw.pop(k) for k in _SAMPLING_KWARGS if k in kw}
            if kw:
                raise UserError(f"generate_until: gen_kwargs {', '.join(sorted(kw))} are not supported by the looplm "
                                f"model (it takes until, max_gen_toks, do_sample, temperature, "
                                f"{', '.join(_SAMPLING_KWARGS)})")
            if new > ctx:
                log.warning("generate_until: max_gen_toks %d exceeds the model context; generating %d", new, ctx)
                new = ctx
            ids = self.tok_encode(context) or [self.prefix_token_id]
            ids = ids[-(ctx + 1 - new):]                # prompt + new tokens - 1 positions must fit the context
            # greedy rows share the seed (their only randomness is the initial loop state: a request's
            # answer must not depend on its place); sampled rows each get their own, as repeats must differ
            seed = self.seed if temperature == 0.0 else self.seed + i
            jobs.append((ids, SamplingParams(max_new_tokens=new, temperature=temperature, stop=until, seed=seed,
                                             prompt_mode=self.prompt_mode, **extra)))
        order = sorted(range(len(jobs)), key=lambda i: (-len(jobs[i][0]), i))          # longest first, as HF
        texts = [""] * len(jobs)
        batches = [order[a:a + self.batch_size] for a in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc="looplm generate_until", disable=disable_tqdm):
            done = self.engine.generate([jobs[i][0] for i in batch], [jobs[i][1] for i in batch])
            for i, completion in zip(batch, done):
                texts[i] = completion.text
                self.cache_hook.add_partial("generate_until", requests[i].args, completion.text)
        return texts

    # -- scoring --------------------------------------------------------------------------------------
    def _score(self, prompts: list[list[int]], disable_tqdm: bool = False) -> list[tuple[list[float], list[bool]]]:
        """Per prompt, each token's log-probability given the tokens before it and whether it is
        its position's likeliest token (the first token, never scored: nan and False). A prompt
        that begins another is read off that one; the rest run on the engine, longest first."""
        unique = sorted({tuple(p) for p in prompts})    # lexicographic: the prompts a prompt begins come right after it
        owner: dict[Window, Window] = {}                # prompt -> a prompt it begins that begins none (or itself)
        following: Window = ()
        for p in reversed(unique):
            owner[p] = owner[following] if following[:len(p)] == p else p
            following = p
        roots = sorted(set(owner.values()), key=lambda p: (-len(p), p))
        scored: dict[Window, tuple[list[float], list[bool]]] = {}
        batches = [roots[a:a + self.batch_size] for a in range(0, len(roots), self.batch_size)]
        for batch in tqdm(batches, desc="looplm loglikelihood", disable=disable_tqdm):
            got = self.engine.prompt_logprobs(batch, top=1, seeds=[self.seed] * len(batch), prompt_mode=self.prompt_mode)
            for p, (lps, tops) in zip(batch, got):
                scored[p] = ([float("nan") if lp is None else lp for lp in lps],
                             [top is not None and top[0][0] == tok for top, tok in zip(tops, p)])
        out = []
        for p in prompts:
            lps, greedy = scored[owner[tuple(p)]]
            out.append((lps[:len(p)], greedy[:len(p)]))
        return out


def _scoring_engine(run: Run, rounds: int | None, exit: str | None) -> Engine:
    """The run's engine at these rounds and exit policy (defaults: the recipe's). An early-exit
    policy applies to prompt tokens too: the tokens lm-eval scores are prompt tokens to the engine."""
    overrides: dict[str, Any] = {k: v for k, v in dict(rounds=rounds, exit=exit).items() if v is not None}
    engine = Engine.from_run(run, **overrides)
    if engine.adaptive and not engine.policy.exit_in_prefill:
        engine = Engine.from_run(run, **overrides, exit_in_prefill=True)
    return engine


def _register() -> None:
    """Register LoopLM as NAME, unless the name is an entry point lm-eval read from our package
    metadata (it resolves to this class, and lm-eval's registry refuses to replace one)."""
    held = dict(model_registry.items()).get(NAME)
    if held is None or held is LoopLM or isinstance(held, str):    # lm-eval upgrades a "module:Class" placeholder
        register_model(NAME)(LoopLM)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m looplm.lm_eval ARGS`: lm-eval's own command line (default: sys.argv) with the
    looplm model registered. A looplm error (a bad model argument, a missing run) is one line, exit 2."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except UserError as err:
        print(f"looplm.lm_eval: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # run as a script this file is a second copy of the module: the model lm-eval finds is the
    # module's own (imported here), so that one class is registered under NAME
    from looplm.lm_eval import main as _main
    sys.exit(_main())
else:
    _register()
