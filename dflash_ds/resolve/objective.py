"""The objective trains something: a run whose loss has no term with a nonzero weight that reaches a
trainable parameter would spend its steps with a zero gradient and export the initial drafter."""

from __future__ import annotations

import dataclasses

from dflash_ds.config import RecipeError
from dflash_ds.network.arch_types import CE_ALWAYS_ON
from dflash_ds.objective.drafter_loss import StepSettings


def _key(spec, name: str) -> str:
    """The recipe key of a term's weight: its field of `objective.<name>:`, or the words of a term no field weighs."""
    keyed = {f.name for f in dataclasses.fields(spec.objective_keys)} if spec.objective_keys else set()
    return f"objective.{spec.name}.{name}" if name in keyed else name


def objective_weights(settings: StepSettings) -> dict[str, float]:
    """Every term of the resolved objective that reaches a trainable parameter, by the recipe key that
    weights it: the architecture's terms (after any warm-up) and the KL term."""
    spec, keys = settings.shape.spec, settings.keys
    own = keys.weights(settings.shape) if keys is not None else {CE_ALWAYS_ON: 1.0}
    weights = {_key(spec, name): float(w) for name, w in own.items()}
    weights["objective.kl_weight"] = float(settings.kl_weight)
    return weights


def check_objective(settings: StepSettings) -> None:
    """Refuse, naming the weights, an objective whose every term that trains the drafts has weight 0, or
    whose every term that trains one of the architecture's other parts (DSpark's confidence head) has:
    that part would be exported as it was initialised."""
    spec, keys = settings.shape.spec, settings.keys
    weights = objective_weights(settings)
    trained = keys.trained_parts(settings.shape) if keys is not None else ()
    parts = [(part, [_key(spec, n) for n in names]) for part, names in trained]
    elsewhere = {k for _, names in parts for k in names}
    for i, (part, names) in enumerate([("the drafter", [k for k in weights if k not in elsewhere]), *parts]):
        if any(weights[k] != 0 for k in names):
            continue
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"
        verb = "is" if len(names) == 1 else "are all"
        trains = (f"nothing trains {part}: it would be exported untrained" if i else
                  "no term of the loss trains the drafter's drafts (it would draft as initialised)" if parts else
                  "no term of the loss trains the drafter (its gradient would be 0 at every step)")
        raise RecipeError(f"{listed} {verb} 0: {trains}; set {'it' if len(names) == 1 else 'at least one of them'} "
                          "above 0")
