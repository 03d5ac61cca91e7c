"""What the KL term costs on CPU with the tiny recipe: the target forward of one micro-batch cut
after its last tap vs. run through its final norm, and one drafter micro-batch (forward + backward)
with CE alone vs. CE + KL. Both variants alternate, so the machine's load hits them alike.

    PYTHONPATH=. python scripts/kl_cost.py [repeats]
"""

import copy
import statistics
import sys
import time

import torch

from dflash_ds.config import load_recipe
from dflash_ds.model.loss import StepSettings, drafter_loss, make_blocks
from dflash_ds.run import finish, load_data, preflight
from dflash_ds.runtime.transport import PayloadSpec
from dflash_ds.runtime.workers import TargetWorker, unpack
from dflash_ds.target.model import embed_and_head, load_target, truncate_after
from dflash_ds.train import build_drafter


def main(repeats: int = 20) -> None:
    torch.set_num_threads(1)
    recipe = load_recipe("recipes/tiny.yaml", ["objective.kl_weight=0.5", "run.output_dir=/tmp/kl_cost"])
    ctx = preflight(recipe, world_size=2)
    ctx.data = load_data(ctx)
    finish(ctx)
    ids = ctx.drafter_cfg.target_layer_ids
    full = load_target(recipe.target.path, dtype="float32")
    cut = copy.deepcopy(full)
    truncate_after(cut, max(ids))
    s = ctx.spec
    spec_ce = PayloadSpec(s.rows, s.seq_len, s.num_taps, s.hidden, s.dtype)
    workers = {"ce": (TargetWorker(cut, ids, ctx.data.rows, ctx.plan, spec_ce, 0, "cpu"), spec_ce),
               "kl": (TargetWorker(full, ids, ctx.data.rows, ctx.plan, s, 0, "cpu"), s)}
    embed, head = embed_and_head(recipe.target.path, torch.float32)
    drafter = build_drafter(ctx)
    settings = {"ce": StepSettings.from_recipe(load_recipe("recipes/tiny.yaml"), torch.device("cpu")),
                "kl": StepSettings.from_recipe(recipe, torch.device("cpu"))}
    times = {(k, part): [] for k in ("ce", "kl") for part in ("target", "drafter")}
    for i in range(repeats + 2):
        for k in ("ce", "kl"):
            worker, spec = workers[k]
            t0 = time.perf_counter()
            mb = unpack(worker.fill(spec.empty("cpu"), i), spec, torch.float32)
            t1 = time.perf_counter()
            blocks = make_blocks(mb, settings[k], i)
            out = drafter_loss(drafter, embed, head, mb, blocks, blocks.weights.sum(), settings[k])
            out.loss.backward()
            drafter.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if i >= 2:  # warm-up
                times[(k, "target")].append(t1 - t0)
                times[(k, "drafter")].append(t2 - t1)
    med = {key: statistics.median(v) for key, v in times.items()}
    for part in ("target", "drafter"):
        print(f"{part}: CE {med[('ce', part)] * 1e3:.1f} ms, CE+KL {med[('kl', part)] * 1e3:.1f} ms, "
              f"ratio {med[('kl', part)] / med[('ce', part)]:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
