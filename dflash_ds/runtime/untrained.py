"""A run that trains nothing stops at a log step, before its next export, with one line naming the
settings to lower.

A setting far too large (`optim.lr=1e4`, a loss weight or a score scale of 1e30) makes the gradients
non-finite: DeepSpeed then skips every optimizer step ("OVERFLOW! Skipping step") and the run would go
on to export the drafter it started with, exit 0, and leave a card saying tau 1.0. Two signs are read at
each log step, from values every drafter rank holds alike (the all-reduced sums, DeepSpeed's count of
skipped steps, agreed across ranks), so that all of them stop together:
  - the step's loss is not finite: the drafter's weights are already lost;
  - every step for MOST_SKIPPED steps in a row was skipped, or every step this process ran was, at the
    run's last step (an fp16 loss scale that starts too high skips a few steps, then trains).
"""

from __future__ import annotations

import math

from dflash_ds.resolve.objective import objective_weights
from dflash_ds.safety import SettingError

MOST_SKIPPED = 50
# A loss weight at least this large is named among the settings that may overflow.
LARGE_WEIGHT = 100.0


class TrainingWatch:
    """Reads each log step's loss and the engine's skipped-step count; raises SettingError when the run
    trains nothing."""

    def __init__(self, spec, engine, *, start: int):
        self.spec, self.engine = spec, engine
        self.step, self.skipped = start, self._skipped()
        self.start, self.in_a_row = start, 0

    def _skipped(self) -> int:
        return int(getattr(self.engine, "skipped_steps", 0) or 0)

    def check(self, step: int, loss: float) -> None:
        """At log step `step` (optimizer steps done), with the last step's loss."""
        skipped = self._skipped()
        ran, lost = step - self.step, skipped - self.skipped
        # Which steps of a window were skipped is not known: only a window skipped whole extends the run.
        self.in_a_row = self.in_a_row + ran if ran > 0 and lost >= ran else 0
        self.step, self.skipped = step, skipped
        if not math.isfinite(loss):
            raise SettingError(f"the loss is {loss} at step {step}: the drafter's weights are no longer finite, so "
                               f"it would export nothing trained; {self._advice()}")
        last = step >= self.spec.plan.total_steps
        if self.in_a_row >= MOST_SKIPPED or (last and self.in_a_row >= step - self.start > 0):
            raise SettingError(f"the last {self.in_a_row} optimizer steps (to step {step}) were all skipped: their "
                               "gradients were not finite (DeepSpeed's 'OVERFLOW! Skipping step'), so the drafter does "
                               f"not train and nothing more is exported; {self._advice()}")

    def _advice(self) -> str:
        """The settings to lower: the loss weights that are large, and the learning rate."""
        r = self.spec.recipe
        weights = objective_weights(self.spec.settings)
        large = sorted(((w, k) for k, w in weights.items() if abs(w) >= LARGE_WEIGHT and k.startswith("objective.")),
                       reverse=True)
        named = [f"{k} = {w:g}" for w, k in large] + [f"optim.lr = {r.optim.lr:g}"]
        return ("lower " + ", ".join(named) + " (or another scale of the objective's terms)")
