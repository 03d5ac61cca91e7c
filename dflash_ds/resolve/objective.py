"""The objective trains something: a run whose loss has no term with a nonzero weight that reaches a
trainable parameter would spend its steps with a zero gradient and export the initial drafter."""

from __future__ import annotations

import dataclasses

from dflash_ds.config import RecipeError
from dflash_ds.objective.drafter_loss import StepSettings

def _key(variant, name: str) -> str:
    keyed = {f.name for f in dataclasses.fields(variant.objective_keys)} if variant.objective_keys else set()
    return f"objective.{variant.name}.{name}" if name in keyed else name


def objective_weights(settings: StepSettings) -> dict[str, float]:
    """Every term of the resolved objective that reaches a trainable parameter, by the recipe key that
    weights it: the architecture's terms (after any warm-up) and the KL term."""
    variant = settings.shape.variant
    own = variant.term_weights(settings.shape, variant.step_term(settings.arch_loss))
    weights = {_key(variant, name): float(w) for name, w in own.items()}
    weights["objective.kl_weight"] = float(settings.kl_weight)
    return weights


def check_objective(settings: StepSettings) -> None:
    """Refuse, naming the weights, an objective whose every term that trains the drafts has weight 0, or
    whose every term that trains one of the architecture's other parts (DSpark's confidence head) has:
    that part would be exported as it was initialised."""
    variant = settings.shape.variant
    weights = objective_weights(settings)
    parts = [(part, [_key(variant, n) for n in names]) for part, names in variant.trained_parts(settings.shape)]
    elsewhere = {k for _, keys in parts for k in keys}
    for i, (part, keys) in enumerate([("the drafter", [k for k in weights if k not in elsewhere]), *parts]):
        if any(weights[k] != 0 for k in keys):
            continue
        listed = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + f" and {keys[-1]}"
        verb = "is" if len(keys) == 1 else "are all"
        trains = (f"nothing trains {part}: it would be exported untrained" if i else
                  "no term of the loss trains the drafter's drafts (it would draft as initialised)" if parts else
                  "no term of the loss trains the drafter (its gradient would be 0 at every step)")
        raise RecipeError(f"{listed} {verb} 0: {trains}; set {'it' if len(keys) == 1 else 'at least one of them'} "
                          "above 0")
