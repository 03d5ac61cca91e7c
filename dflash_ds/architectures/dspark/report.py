"""DSpark's panel of the run report: the confidence head's reliability curve, from the reliability
bins every training log record carries (`confidence_bin_weight`, `_pred`, `_target`: per bin of
predicted confidence, the bin's share of the step's slot weight and the weighted sums of the
prediction and of the realised 1 - TV, as shares of the same weight).

A record holds the bins of the step it logs, as it holds that step's loss. The curve pools the last
`RECORDS` of them: each bin then holds several steps' slots, and the curve still shows the head as
it is at the end of training (the exported one), not its early, uncalibrated steps. Pooling adds the
records' shares, so every pooled step counts the same.

Drawn on the matplotlib axes the report hands over (nothing here imports matplotlib).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

RECORDS = 10


class Reliability(NamedTuple):
    first_step: int
    last_step: int
    records: int
    weight: list[float]  # per bin: share of the pooled slot weight
    pred: list[float | None]  # per bin: mean predicted confidence (None: an empty bin)
    target: list[float | None]  # per bin: mean realised 1 - TV
    ece: float  # sum over bins of weight * |pred - target|, over the weight
    mae: float  # the pooled records' mean confidence_mae
    bias: float  # the pooled records' mean confidence_bias (predicted minus realised)

    def row(self) -> tuple[str, str]:
        return (f"confidence calibration, last {self.records} logged steps ({self.first_step}-{self.last_step})",
                f"ECE {self.ece:.3f}, MAE {self.mae:.3f}, bias {self.bias:+.3f}")


def reliability(steps: list[dict], last: int = RECORDS) -> Reliability | None:
    """The pooled bins of the last `last` step records that carry them, or None when none does."""
    recs = [r for r in steps if r.get("confidence_bin_weight")][-last:]
    if not recs:
        return None

    def summed(key):
        return [sum(col) for col in zip(*(r[key] for r in recs))]

    weight, pred, target = summed("confidence_bin_weight"), summed("confidence_bin_pred"), summed("confidence_bin_target")
    total = sum(weight)
    mean = [(p / w if w > 0 else None, t / w if w > 0 else None) for w, p, t in zip(weight, pred, target)]
    return Reliability(int(recs[0]["step"]), int(recs[-1]["step"]), len(recs), [w / total for w in weight],
                       [m[0] for m in mean], [m[1] for m in mean],
                       sum(abs(p - t) for p, t in zip(pred, target)) / total,
                       sum(r["confidence_mae"] for r in recs) / len(recs),
                       sum(r["confidence_bias"] for r in recs) / len(recs))


def draw_reliability(ax: Any, rel: Reliability) -> None:
    """Mean realised 1 - TV against mean predicted confidence per bin, the diagonal of a calibrated
    head, and the bins' shares of the slot weight as bars on the same 0-1 scale."""
    bins = len(rel.weight)
    ax.bar([(i + 0.5) / bins for i in range(bins)], rel.weight, width=1.0 / bins, color="tab:gray", alpha=0.35,
           label="share of slot weight in bin")
    ax.plot([0.0, 1.0], [0.0, 1.0], linestyle="--", color="black", linewidth=1, label="calibrated")
    pts = [(p, t) for p, t in zip(rel.pred, rel.target) if p is not None]
    ax.plot(*zip(*pts), marker="o", markersize=4, label="mean 1 - TV per bin")
    ax.text(0.03, 0.97, f"ECE {rel.ece:.3f}\nMAE {rel.mae:.3f}\nbias {rel.bias:+.3f}", transform=ax.transAxes,
            va="top", fontsize=8)
    ax.set_title(f"confidence calibration, steps {rel.first_step}-{rel.last_step} ({rel.records} logged)",
                 fontsize=10)
    ax.set_xlabel("predicted confidence sigmoid(c)")
    ax.set_ylabel("realised acceptance 1 - TV")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
