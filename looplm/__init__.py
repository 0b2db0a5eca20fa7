"""looplm: build, train, evaluate and serve looped (recurrent-depth) language models.

The public API:
    recipe = looplm.load_recipe("quickstart", overrides={"model.d_model": 64})
    model = looplm.build_model(recipe)
    out = model(idx, rounds=4)          # LoopOutput; out.logits is (B, T, V)
    looplm.unroll(step, state, rounds, backward_window=None, readout_rounds=None)
    run = looplm.load_run("runs/x")     # .model, .tokenizer, .recipe, .report
    looplm.Engine.from_run(run).generate(["def f("], looplm.SamplingParams(max_new_tokens=16))
"""

from .runs.checkpoint import Run, load_run
from .recipe.config import Recipe, load_recipe
from .model.recurrence import Unrolled, unroll
from .errors import UserError
from .inference.engine import Engine, GenerationConfig, SamplingParams
from .model.looped import LoopedLM, LoopOutput, build_model

__all__ = ["Engine", "GenerationConfig", "Recipe", "Run", "LoopOutput", "LoopedLM", "SamplingParams", "Unrolled",
           "UserError", "build_model", "load_recipe", "load_run", "unroll"]
__version__ = "0.1.0"
