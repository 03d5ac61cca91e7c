"""What the bench passes a drafter trainer in place of a launched run's parts: it steps
`DrafterTrainer.train_step` itself, outside a run (no stop votes, no synchronisation timing)."""

from __future__ import annotations


class NullControl:
    """A run control that starts at step 0 and is never asked to stop (guard.control.RunControl's
    part the trainer reads)."""

    start: dict | None = None
    start_step = 0

    def should_stop(self) -> bool:
        return False


class NoSyncTimer:
    """A sync-stall timer (runtime.profiling.SyncStallTimer's face) that measures nothing."""

    seconds = 0.0

    def close(self) -> None:
        pass
