"""Performance harness: measured rates of each role, and the targets:drafters split they imply.

Run it as `python -m dflash_ds.bench` (flags: cli.py). One concern a module:

- setup.py: the resolved recipe, target/drafter configs and single-rank world every role runs on;
- lengths.py: rows from a conversation-length mix (--lengths chat|FILE) and the useful-token figures;
- roles.py: the measured roles (target fill, drafter step alone or colocated, transport);
- timing.py: step clock, memory peaks, matmul ceiling, compile counters, the timed loop;
- flops.py: FLOP, parameter and attention-pair counts (the anchor figures' rules);
- planner.py: the targets:drafters split of a node from two per-GPU rates;
- environment.py: device, versions and compile caches recorded in each report;
- cli.py: flags, the plan role, the printed summary and the JSON report.
"""

from .cli import ROLES, main, parse_args, run, run_plan, summary_lines
from .environment import compile_cache_state, environment
from .flops import (count_linear_params, drafter_flops_of_steps, drafter_step_flops, target_flops_per_micro,
                    target_forward_flops, visible_pairs)
from .planner import Split, best_split, fractional_split, plan_splits
from .roles import (MASK_METHODS, SyntheticSource, build_drafter_side, build_target_model, drafter_step,
                    micro_batch_of, run_drafter, run_target, run_transport, synthetic_payloads, target_worker,
                    time_mask)
from .setup import (DEFAULT_RECIPE, REPO, Setup, free_port, init_single_process, pick_device, prompt_tokens,
                    resolve_setup, setup_rows, synthetic_rows)
from .timing import (PROCESS_START, MemoryTrace, StepClock, drive, dynamo_counters, matmul_ceiling, profile_steps,
                     record_rates, step_stats, synchronize)

__all__ = [
    "ROLES", "main", "parse_args", "run", "run_plan", "summary_lines",
    "compile_cache_state", "environment",
    "count_linear_params", "drafter_flops_of_steps", "drafter_step_flops", "target_flops_per_micro",
    "target_forward_flops", "visible_pairs",
    "Split", "best_split", "fractional_split", "plan_splits",
    "MASK_METHODS", "SyntheticSource", "build_drafter_side", "build_target_model", "drafter_step",
    "micro_batch_of", "run_drafter", "run_target", "run_transport", "synthetic_payloads", "target_worker",
    "time_mask",
    "DEFAULT_RECIPE", "REPO", "Setup", "free_port", "init_single_process", "pick_device", "prompt_tokens",
    "resolve_setup", "setup_rows", "synthetic_rows",
    "PROCESS_START", "MemoryTrace", "StepClock", "drive", "dynamo_counters", "matmul_ceiling", "profile_steps",
    "record_rates", "step_stats", "synchronize",
]
