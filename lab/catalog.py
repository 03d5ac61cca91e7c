"""The lab's named runs: each a lab recipe plus recipe overrides, and the run it is measured against.

`bash scripts/quality_lab.sh OUT train NAME` and `... sweep PHASE NAME...` read a run's settings from here
(`python -m lab run-settings NAME`); `lab table` reads the decisions (each run against its
baseline) from here too. The lab target these overrides are sized for: 10 layers, hidden 768, 12 query
heads and 4 KV heads of 64, MLP 2,048 (lab/target.py, shape "lab").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    recipe: str
    """The lab recipe (recipes/lab/*.yaml) the run starts from."""
    overrides: tuple[str, ...] = ()
    """Recipe key=value settings on top of it (no spaces: the shell reads one per line)."""
    baseline: str | None = None
    """The run this one is measured against in the decisions table; None for the baselines."""
    question: str = ""
    """What the comparison decides (the table's row label)."""
    section: str = "decision"
    """Where the table puts the comparison: "noise" (the seed-to-seed difference every other one is
    read against), "ordering" (issue 43's check that the later generations beat v1) or "decision"."""
    per_flop: bool = False
    """Also compare tau per drafting FLOP (lab/decisions.py `drafting_flops`): for a drafter that does
    other work per cycle than its baseline's (another block, other layers)."""
    rounds: bool = False
    """Also compare llama.cpp's first round apart from the later ones: for a setting that acts on the
    first round only (the anchor at the last prompt token)."""
    also: tuple[tuple[str, str], ...] = ()
    """Further (baseline, question) comparisons, each in the decisions table: a run the field ranks
    against more than one other (LiLiCorr against v1 in the ordering and against DFlash2 here)."""
    starts_from: str | None = None
    """A run whose export this one starts from (`drafter.init_from`: the backbone, another architecture's
    heads fresh). The lab trains it once that run has finished training: a sweep starts it then."""


RUNS: dict[str, Run] = {
    "v1": Run("recipes/lab/v1.yaml"),
    # the seed-to-seed noise of v1: the same recipe, another seed (initialisation and data order)
    "v1-seed1": Run("recipes/lab/v1.yaml", ("run.seed=1",), baseline="v1", question="seed-to-seed noise",
                    section="noise"),
    "dflash2": Run("recipes/lab/dflash2.yaml", baseline="v1", question="DFlash2 against v1",
                   section="ordering"),
    "dspark": Run("recipes/lab/dspark.yaml", baseline="v1", question="DSpark against v1",
                  section="ordering"),
    # Model-Optimizer's matched comparison puts LiLiCorr (its reranker over the DFlash lattice) above
    # DFlash2 at block 16 (7.56 against 7.25 on GSM8K); the lab reads it against DFlash2 and, in the
    # differences table, against v1, whose backbone it shares.
    "lilicorr": Run("recipes/lab/lilicorr.yaml", baseline="v1", question="LiLiCorr against v1",
                    section="ordering", also=(("dflash2", "LiLiCorr against DFlash2"),)),
    # LiLiCorr's reranker fresh on v1's trained backbone (trained on jointly, as Model-Optimizer does): at
    # 700 steps from scratch the reranked walk never left the backbone's top-1 path (prefix 0.16 against
    # the oracle's 0.75, docs/quality.md), with a backbone that had not yet learned much to rerank. Its
    # backbone has had twice the steps of v1's, so against v1 it says what a longer LiLiCorr run reaches,
    # not what the reranker alone adds: its log's selected against top-1 prefix says that.
    "lilicorr-v1": Run("recipes/lab/lilicorr.yaml", baseline="lilicorr", starts_from="v1",
                       question="LiLiCorr on v1's trained backbone against LiLiCorr from scratch",
                       also=(("v1", "LiLiCorr on v1's trained backbone (2x its steps) against v1"),
                             ("dflash2", "LiLiCorr on v1's trained backbone against DFlash2"))),
    # The default anchors a block at each turn's last prompt token too; off = the paper's anchors.
    "v1-noanchor": Run("recipes/lab/v1.yaml", ("objective.anchor_last_prompt_token=false",), baseline="v1",
                       question="objective.anchor_last_prompt_token false", rounds=True),
    # The same decision on DFlash2, the lab's strongest drafter: at 1,200 steps v1 accepted its first slot
    # 12% of the time on the held-out prose and DFlash2 38% (docs/quality.md, sixth session), so a setting
    # that acts on the first round moves DFlash2's count several times as much as v1's.
    "dflash2-noanchor": Run("recipes/lab/dflash2.yaml", ("objective.anchor_last_prompt_token=false",),
                            baseline="dflash2", question="objective.anchor_last_prompt_token false, on DFlash2",
                            rounds=True),
    # The layout: v1 has z-lab's 27B layout (4 sliding layers, causal inside the block, then a full
    # bidirectional one), DSpark every layer full and bidirectional. At 700 steps v1 accepted its first
    # drafted token 12% of the time on the held-out prose against DSpark's 28% at the same block
    # (docs/quality.md): this run says how much of that is the layout.
    "v1-full": Run("recipes/lab/v1.yaml", ("drafter.layer_types=null", "drafter.sliding_window=null"),
                   baseline="v1", question="every layer full attention (DSpark's layout) against v1's 4 sliding + 1 full"),
    # The blocks apart from the architectures. The lab's DFlash2 drafts 7 slots (its recipe's block 8) and
    # v1 15, and at 1,200 steps DFlash2 led v1 by 0.2-0.9 tau on every set (docs/quality.md, seventh
    # session) where the field's matched comparison, every drafter at block 16, has it 14% ahead. These two
    # runs swap the blocks: v1 at 8 (gamma 4 follows) says how much of the lead is the block, DFlash2 at 16
    # (gamma 7) is Model-Optimizer's matched comparison against v1.
    "v1-b8": Run("recipes/lab/v1.yaml", ("drafter.block_size=8",), baseline="v1",
                 question="v1 at block 8 (DFlash2's) against 16", per_flop=True,
                 also=(("dflash2", "v1 at block 8 against DFlash2 (both drafting 7 slots)"),)),
    "dflash2-b16": Run("recipes/lab/dflash2.yaml", ("drafter.block_size=16",), baseline="dflash2",
                       question="DFlash2 at block 16 against its recipe's 8", per_flop=True,
                       also=(("v1", "DFlash2 at block 16 against v1 (both drafting 15 slots)"),)),
    # DeepSpec's block. What follows the block is already derived from it: objective.gamma null is
    # DSpark's B + 1 rule (4 at block 7, DeepSpec's loss_decay_gamma), and the anchors per row stay
    # the paper's density per token (each anchor drafts 7 tokens instead of 16).
    "dspark-b7": Run("recipes/lab/dspark.yaml", ("drafter.block_size=7",), baseline="dspark",
                     question="DSpark at block 7 (DeepSpec's) against 16", per_flop=True),
    # The FP8 drafter after a whole run: every layer's projections (rowwise scales) and the frozen
    # lm_head of the loss in FP8 (needs torchao on the GPU machine and drafter.compile, the default).
    "v1-fp8": Run("recipes/lab/v1.yaml", ("drafter.fp8.layers=rowwise", "drafter.fp8.lm_head=true"),
                  baseline="v1", question="FP8 drafter (layers rowwise + lm_head) against bf16"),
    # CE plus forward KL to the target at T = 1 and equal weight: the distillation most drafter
    # trainers add (docs/algorithm.md section 5; on the tiny target it reached CE's tau, docs/performance.md).
    "v1-kl": Run("recipes/lab/v1.yaml", ("objective.kl_weight=1.0", "objective.kl_temperature=1.0"),
                 baseline="v1", question="CE + KL (weight 1, T 1) against CE"),
    # SpecForge's DSpark sizing rules (docs/dspark_draft_backbone_recipe.md) as one experiment:
    # - attention geometry of the target: 12 query / 4 KV heads of 64 (the drafter's default is the
    #   target's; set here so that the run says it);
    # - 8 taps spread uniformly from layer 1, away from the output: [1, L-3] cannot hold 8 distinct
    #   layers of the lab target's 10, so layers 1-8 (the last, 9, left out);
    # - 6 layers with a 3x FFN: intermediate 2,304 = 3 x 768 (the target's 2,048 is 2.7x);
    # - constant learning rate 5e-4 after the 4% warmup (cosine to a floor of 1.0 x lr);
    # - kept from the lab's DSpark, as the rules also say: all layers full attention, 0.1 CE + 0.9 L1 +
    #   1.0 confidence, the block (16; block 7 is its own decision above).
    "dspark-sizing": Run("recipes/lab/dspark.yaml", (
        "drafter.num_layers=6", "drafter.intermediate_size=2304", "drafter.num_attention_heads=12",
        "drafter.num_key_value_heads=4", "drafter.head_dim=64", "drafter.target_layer_ids=[1,2,3,4,5,6,7,8]",
        "optim.lr=5.0e-4", "optim.min_lr_ratio=1.0"), baseline="dspark",
        question="SpecForge's DSpark sizing rules against the lab's DSpark",
        per_flop=True),
}


def run(name: str) -> Run:
    """The named run; an unknown name is the user's error, naming the runs there are."""
    if name not in RUNS:
        raise ValueError(f"unknown lab run {name!r}; one of: {', '.join(RUNS)}")
    return RUNS[name]


def settings_lines(name: str, lab_dir: str = "runs/lab") -> list[str]:
    """What `run-settings NAME` prints: the recipe, then one override a line (the run's seed included:
    run.seed=0 unless the overrides set it; `drafter.init_from` the export of the run it starts from,
    under `lab_dir`)."""
    r = run(name)
    seed = [] if any(o.startswith("run.seed=") for o in r.overrides) else ["run.seed=0"]
    start = [f"drafter.init_from={lab_dir}/runs/{r.starts_from}/export"] if r.starts_from else []
    return [r.recipe, *seed, *r.overrides, *start]
