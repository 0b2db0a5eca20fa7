"""The recipe: every decision a run makes, as typed, frozen, validated config sections.

config.py   the sections (model, depth, backward, supervision, exit, data, optim, train), TOML in and
            out, --set overrides, the filled-in defaults of an older run
builtin/    the built-in recipes, addressed by name (`looplm recipes`)
"""

from .config import (BackwardConfig, DataConfig, DepthConfig, ExitConfig, ModelConfig, OptimConfig, Recipe,
                     SupervisionConfig, TrainConfig, load_recipe)

__all__ = ["BackwardConfig", "DataConfig", "DepthConfig", "ExitConfig", "ModelConfig", "OptimConfig", "Recipe",
           "SupervisionConfig", "TrainConfig", "load_recipe"]
