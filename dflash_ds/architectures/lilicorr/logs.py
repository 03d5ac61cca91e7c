"""LiLiCorr's log: the metrics.jsonl fields made of the sums its loss terms return (its named logs: loss.py,
terms.lattice_logs), pooled over the step (summed over micro-batches and ranks before the
ratios; Model-Optimizer averages per micro-batch instead).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

TOP_LOG_Q = "lilicorr_top_log_q"
"""The zero-weight row term whose per-row values give each row's log-normaliser (loss.py)."""


def _ratio(sums: dict, num: str, den: str) -> float | None:
    d = sums[f"lilicorr_{den}"] if f"lilicorr_{den}" in sums else sums[den]
    n = sums[f"lilicorr_{num}"] if f"lilicorr_{num}" in sums else sums[num]
    return n / d if d > 0 else None


def log_record(sums: dict[str, float]) -> dict[str, float]:
    """The fields: the lattice terms per supervised slot; the reranked walk's, the backbone's top-1 and the
    oracle's prefix lengths, their gap, the exact and zero-prefix shares per valid block; the lattice's
    coverage of the valid blocks' slots; the walk's accuracy, the gap and its hit rate per supervised
    slot; the log-factor spread (the mean unbiased std of the start rows and of the pair matrices, halved
    sum; near 0 when the chain collapses to uniform); per-position acceptance of the walk. A field whose
    denominator is 0 (no valid block, no supervised slot) is left out."""
    fields = {"lilicorr_ce": ("ce_sum", "supervised"), "lilicorr_margin": ("hinge_sum", "supervised"),
              "lilicorr_penalty": ("penalty_sum", "supervised"), "lilicorr_selected_prefix": ("selected_sum", "blocks"),
              "lilicorr_top1_prefix": ("top1_sum", "blocks"), "lilicorr_oracle_prefix": ("oracle_sum", "blocks"),
              "lilicorr_exact": ("exact_sum", "blocks"), "lilicorr_zero_prefix_rate": ("zero_prefix_sum", "blocks"),
              "lilicorr_slot_gt_in_lattice": ("in_lattice_sum", "slot_count"),
              "lilicorr_slot_acc": ("walk_hit_sum", "supervised"), "lilicorr_gap_mean": ("gap_sum", "supervised"),
              "lilicorr_gap_frac_hit": ("gap_hit_sum", "supervised")}
    rec = {}
    for field, (num, den) in fields.items():
        value = _ratio(sums, num, den)
        if value is not None:
            rec[field] = value
    if "lilicorr_selected_prefix" in rec:
        rec["lilicorr_oracle_gap"] = rec["lilicorr_oracle_prefix"] - rec["lilicorr_selected_prefix"]
    if sums["lilicorr_start_std_count"] + sums["lilicorr_pair_std_count"] > 0:
        parts = [_ratio(sums, f"{n}_std_sum", f"{n}_std_count") for n in ("start", "pair")]
        rec["lilicorr_logfactor_spread"] = 0.5 * sum(p for p in parts if p is not None)
    k = 1
    while f"lilicorr_accept_sum_{k}" in sums:
        value = _ratio(sums, f"accept_sum_{k}", f"accept_count_{k}")
        if value is not None:
            rec[f"accept_rate_pos_{k}"] = value
        k += 1
    return rec
