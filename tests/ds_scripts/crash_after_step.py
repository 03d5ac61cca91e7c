"""A rank entry point for the fault tests: `dflash_ds.train.main` with a simulated crash.

`deepspeed ... tests/ds_scripts/crash_after_step.py N RECIPE [key=value ...]` trains exactly as
launch.sh does, except that every drafter rank dies once step N is complete (logged, and
checkpointed when N is a checkpoint step), just before step N+1 starts, the way a preempted job
does (no line, no announced exit). With `N:raise` the drafter ranks raise an unexpected exception
there instead (a bug). The hook wraps `DrafterTrainer.train_step` from here, so the package's
training loop holds no fault injection.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dflash_ds.runtime.trainer import DrafterTrainer  # noqa: E402
from dflash_ds.train import main  # noqa: E402

CRASH_EXIT = 17  # any status but the package's own (safety.Exit) shows a crash, not a handled end


def crash_after(done: int, how: str = "die") -> None:
    train_step = DrafterTrainer.train_step

    def die_before_the_next(self, step: int):
        if step == done:  # train_step(s) runs step s + 1: steps 1 .. done are complete
            if how == "raise":
                raise KeyError(f"an injected fault in the drafter after step {done}")
            os._exit(CRASH_EXIT)
        return train_step(self, step)

    DrafterTrainer.train_step = die_before_the_next


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    step, _, how = argv[0].partition(":")
    crash_after(int(step), how or "die")
    sys.exit(main(argv[1:]))
