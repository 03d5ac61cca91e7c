"""The objective trains something: a run whose loss has no term with a nonzero weight that reaches a
trainable parameter would spend its steps with a zero gradient and export the initial drafter."""

from __future__ import annotations

from dflash_ds.config import RecipeError
from dflash_ds.model.objective import StepSettings

# The architecture's loss terms (the fields of its `step_term` at full weight) by the recipe key that
# sets each, and the tensor the term trains when only some drafters hold it (None: every drafter of
# the architecture does).
ARCH_TERMS = {
    "l1": ("objective.l1_weight", None),
    "confidence": ("objective.confidence_weight", "confidence_head.proj.weight"),
    "alpha": ("objective.selector_alpha", None),
}


def objective_weights(settings: StepSettings) -> dict[str, float]:
    """Every term of the resolved objective that reaches a trainable parameter, by the recipe key that
    weights it: the cross-entropy, the KL term and the architecture's own terms (after any warm-up)."""
    variant = settings.shape.variant
    term = variant.step_term(settings.arch_loss)
    weights = {"objective.ce_weight": float(variant.ce_weight(term)), "objective.kl_weight": float(settings.kl_weight)}
    fields = term._asdict() if hasattr(term, "_asdict") else {}
    held = variant.tensors(settings.shape)
    for name, (key, tensor) in ARCH_TERMS.items():
        if name in fields and (tensor is None or tensor in held):
            weights[key] = float(fields[name])
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
