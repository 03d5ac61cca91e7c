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
from dflash_ds.data.prepare import load_training_data
from dflash_ds.network.draft_model import DraftModel
from dflash_ds.objective.blocks import make_blocks
from dflash_ds.objective.drafter_loss import drafter_loss
from dflash_ds.resolve.payload import unpack
from dflash_ds.resolve.run import resolve_run
from dflash_ds.runtime.target_worker import TargetWorker
from dflash_ds.runtime.trainer import build_drafter
from dflash_ds.target_model.model import embed_and_head, load_target, truncate_after


def main(repeats: int = 20) -> None:
    torch.set_num_threads(1)
    specs = {}
    for k, extra in (("ce", []), ("kl", ["objective.kl_weight=0.5"])):
        recipe = load_recipe("recipes/tiny.yaml", extra + ["run.output_dir=/tmp/kl_cost"])
        spec = resolve_run(recipe, world_size=2)
        data = load_training_data(recipe)
        specs[k] = spec.with_rows(data.num_rows)
    ids = specs["ce"].drafter.target_layer_ids
    full = load_target(recipe.target.path, dtype="float32")
    cut = copy.deepcopy(full)
    truncate_after(cut, max(ids))
    workers = {"ce": TargetWorker(specs["ce"], cut, data.rows), "kl": TargetWorker(specs["kl"], full, data.rows)}
    embed, head = embed_and_head(recipe.target.path, torch.float32)
    model = DraftModel(build_drafter(specs["ce"]), embed, head)
    settings = {k: specs[k].settings for k in specs}
    times = {(k, part): [] for k in ("ce", "kl") for part in ("target", "drafter")}
    for i in range(repeats + 2):
        for k in ("ce", "kl"):
            payload = specs[k].payload
            t0 = time.perf_counter()
            mb = unpack(workers[k].fill(payload.empty("cpu"), i), payload, torch.float32)
            t1 = time.perf_counter()
            blocks = make_blocks(mb, settings[k], i)
            out = drafter_loss(model, mb, blocks, blocks.weights.sum(), settings=settings[k])
            out.loss.backward()
            model.drafter.zero_grad(set_to_none=True)
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
