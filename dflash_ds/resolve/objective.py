"""The objective trains something: a run whose loss has no term with a nonzero weight that reaches a
trainable parameter would spend its steps with a zero gradient and export the initial drafter."""

from __future__ import annotations

import dataclasses

from dflash_ds.config import RecipeError
from dflash_ds.network.arch_types import CE_ALWAYS_ON
from dflash_ds.objective.drafter_loss import StepSettings


def objective_weights(settings: StepSettings) -> dict[str, float]:
    """Every term of the resolved objective that reaches a trainable parameter, by the recipe key that
    weights it: the architecture's terms (after any warm-up) and the KL term."""
    spec, keys = settings.shape.spec, settings.keys
    keyed = {f.name for f in dataclasses.fields(spec.objective_keys)} if spec.objective_keys else set()
    own = keys.weights(settings.shape) if keys is not None else {CE_ALWAYS_ON: 1.0}
    weights = {(f"objective.{spec.name}.{name}" if name in keyed else name): float(w) for name, w in own.items()}
    weights["objective.kl_weight"] = float(settings.kl_weight)
    return weights


def check_objective(settings: StepSettings) -> None:
    """Refuse, naming the weights, an objective whose every term has weight 0."""
    weights = objective_weights(settings)
    if any(w != 0 for w in weights.values()):
        return
    names = list(weights)
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    raise RecipeError(f"{listed} are all 0: no term of the loss trains the drafter (its gradient would be 0 at every "
                      "step); set at least one of them above 0")
