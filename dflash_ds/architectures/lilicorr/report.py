"""LiLiCorr's panel of the run report: the prefix lengths of a block that the step records carry
(`lilicorr_selected_prefix`: the reranked walk's, `lilicorr_top1_prefix`: the backbone's top-1 path's,
`lilicorr_oracle_prefix`: the longest the lattice holds), over the steps, with the oracle gap between
the walk and the lattice's ceiling shaded. Its summary row averages the last `RECORDS` records that
carry all three: one step's prefix lengths come from a handful of blocks and move a lot from step to
step.

Drawn on the matplotlib axes the report hands over (nothing here imports matplotlib).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

RECORDS = 10
FIELDS = ("lilicorr_selected_prefix", "lilicorr_top1_prefix", "lilicorr_oracle_prefix")


class Prefixes(NamedTuple):
    steps: list[int]
    selected: list[float]
    top1: list[float]
    oracle: list[float]

    def row(self) -> tuple[str, str]:
        n = min(RECORDS, len(self.steps))
        sel, top, ora = (sum(v[-n:]) / n for v in (self.selected, self.top1, self.oracle))
        share = f", {sel / ora:.0%} of the oracle" if ora > 0 else ""
        return (f"prefix of a block, mean of the last {n} logged steps ({self.steps[-n]}-{self.steps[-1]})",
                f"reranked {sel:.2f} / top-1 {top:.2f} / oracle {ora:.2f}: {sel - top:+.2f} over top-1{share}")


def prefixes(steps: list[dict]) -> Prefixes | None:
    """The step records carrying all three prefix lengths, or None when none does (a step with no valid
    block logs none of them)."""
    recs = [r for r in steps if all(isinstance(r.get(f), (int, float)) for f in FIELDS)]
    if not recs:
        return None
    return Prefixes([int(r["step"]) for r in recs], *([float(r[f]) for r in recs] for f in FIELDS))


def draw_prefixes(ax: Any, p: Prefixes) -> None:
    """The three prefix lengths against the step, the walk's gap to the oracle shaded."""
    ax.fill_between(p.steps, p.selected, p.oracle, color="tab:green", alpha=0.15, label="oracle gap")
    ax.plot(p.steps, p.oracle, color="tab:green", label="oracle (lattice ceiling)")
    ax.plot(p.steps, p.selected, color="tab:blue", label="reranked walk")
    ax.plot(p.steps, p.top1, color="tab:orange", linestyle="--", label="backbone top-1")
    ax.set_title("LiLiCorr prefix length per block (training batches)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("accepted slots")
    ax.set_ylim(bottom=0.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
