"""Typed recipe: frozen dataclasses mirroring the YAML sections.

Unknown keys are errors naming their dotted path; `key.sub=value` overrides go through the same
validation; nothing mutates a recipe afterwards (resolve.run.resolve_run resolves it into a RunSpec).

One concern per module, importing nothing else from dflash_ds (architectures.py finds the architectures'
sections by importing the module that lists them, by name, the first time a recipe needs one):
  errors.py    RecipeError, the one error a user's recipe raises before launch
  sections.py  one dataclass per YAML section, every key documented where it is declared
  architectures.py  the architectures' own sections (drafter.<name>:, objective.<name>:), registered by them
  recipe.py    Recipe (the sections together; cross-section defaults) and ranks_per_node
  yaml_text.py the YAML text read strictly (a key given twice, a syntax error at its line)
  derive.py    recipes that derive: a `base:` recipe laid under the file, section by section
  load.py      YAML and overrides -> Recipe (types, unknown keys) and dump_yaml back
  checks.py    validate: the value checks, one function per section
Callers import from `dflash_ds.config`; the names below are its public surface."""

from dflash_ds.config.checks import validate
from dflash_ds.config.errors import RecipeError
from dflash_ds.config.load import build_recipe, dump_yaml, load_recipe, parse_overrides, recipe_mapping
from dflash_ds.config.recipe import Recipe, ranks_per_node
from dflash_ds.config.sections import (ANCHORS_PER_TOKEN, BENCHMARK_SETS, CheckpointConfig, DataConfig, DrafterConfig,
                                       EvalConfig, LogConfig, ObjectiveConfig, OptimConfig, RegenerateConfig, RunConfig,
                                       TargetConfig, TopologyConfig, WandbConfig, default_anchors)

__all__ = [
    "ANCHORS_PER_TOKEN", "BENCHMARK_SETS", "CheckpointConfig", "DataConfig", "DrafterConfig", "EvalConfig", "LogConfig",
    "ObjectiveConfig", "OptimConfig", "Recipe", "RecipeError", "RegenerateConfig", "RunConfig", "TargetConfig",
    "TopologyConfig", "WandbConfig", "build_recipe", "default_anchors", "dump_yaml", "load_recipe", "parse_overrides",
    "ranks_per_node", "recipe_mapping", "validate",
]
