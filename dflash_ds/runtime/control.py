"""Run safety on every rank: the run lock, the agreed start point, peer names, stop requests.

`RunControl.setup` runs on every rank right after the process group exists and before any data or
model is loaded. Rank 0 (the lead drafter) takes the run lock and decides where the run starts
(checkpoint.resume); the decision travels to every rank through the process group, so nothing but
the checkpoint files themselves needs a filesystem shared between nodes. Every rank then learns
every other rank's role, host and PID (for error lines), starts the watchdog and listens for stop
signals. `run_guarded` turns the ways a rank can end (stopped, lost peer, damaged checkpoint) into
one line and an exit code.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ds.config import RecipeError
from dflash_ds.runtime import checkpoint, watchdog
from dflash_ds.runtime.prelaunch import check_locations, check_wandb_service
from dflash_ds.spec import contract
from dflash_ds.runtime.lock import LockError, RunLock
from dflash_ds.runtime.signals import EXIT_STOPPED, StopRequest
from dflash_ds.runtime.watchdog import EXIT_PEER, Peer, PeerLost, Watchdog

EXIT_USER = 2
EXIT_CHECKPOINT = 4
LEFT_DIR = ".left"  # under run.output_dir: ranks that exited on purpose (see watchdog.Watchdog.mark_left)


class Stopped(Exception):
    """Raised on drafter ranks once the agreed stop step is checkpointed."""

    def __init__(self, step: int, where: str):
        super().__init__(step, where)
        self.step, self.where = step, where


class RunControl:
    def __init__(self, recipe, layout, rank: int):
        self.recipe, self.layout, self.rank = recipe, layout, rank
        self.role = layout.role(rank)
        self.me = Peer(self.role, rank, socket.gethostname(), os.getpid())
        self.stop = StopRequest(str(self.me), saves=layout.is_drafter(rank))
        self.lock: RunLock | None = None
        self.start: dict | None = None
        self.error: str | None = None
        self.stop_group = None
        self.dog: Watchdog | None = None

    @classmethod
    def setup(cls, recipe, layout, rank: int) -> "RunControl":
        c = cls(recipe, layout, rank)
        c.stop.install()
        decision = [c._decide() if rank == 0 else None]
        dist.broadcast_object_list(decision, src=0)
        if "error" in decision[0]:
            c.error = decision[0]["error"]
            if rank == 0:
                print(f"[dflash] error: {c.error}", file=sys.stderr, flush=True)
            return c
        c.start = decision[0]["start"]
        peers: list = [None] * dist.get_world_size()
        dist.all_gather_object(peers, c.me)
        t = recipe.topology
        c.dog = Watchdog(c.me, {p.rank: p for p in peers}, t.peer_timeout_s, t.peer_report_s, c.stop,
                         left_dir=Path(recipe.run.output_dir) / LEFT_DIR).start()
        watchdog.install(c.dog)
        # The stop vote is a CPU all-reduce per step: on gloo it costs microseconds and never waits
        # for the GPU stream (an NCCL vote would add a host synchronisation to every step).
        # Only the drafter ranks create it (use_local_synchronization). When DeepSpeed binds each rank
        # to its GPU (it does whenever the world has more than one rank), torch makes a rank outside a
        # new group join an NCCL communicator split over WORLD; the group's own members, building a
        # gloo group, never join that split, so a target rank calling new_group here hung the split
        # topology at start-up on GPUs.
        if layout.is_drafter(rank):
            c.stop_group = dist.new_group(layout.drafter_ranks, backend="gloo", use_local_synchronization=True,
                                          timeout=datetime.timedelta(seconds=t.peer_timeout_s))
        return c

    def _decide(self) -> dict:
        r = self.recipe
        try:  # what launch.sh checks before launch, again for runs started by the deepspeed launcher alone
            check_locations(r)
            os.environ.update(check_wandb_service(r))  # the lead alone logs to wandb
        except RecipeError as exc:
            return {"error": str(exc)}
        try:
            self.lock = RunLock(r.run.output_dir).acquire()
        except LockError as exc:
            return {"error": str(exc)}
        try:
            start = checkpoint.resolve(r.run.output_dir, r.checkpoint.resume)
        except checkpoint.CheckpointError as exc:
            self.release()
            return {"error": str(exc)}
        if start and "warning" in start:
            print(f"[dflash] warning: {start['warning']}", file=sys.stderr, flush=True)
        if start:  # a resume: the recipe must keep the run's contract (spec/contract.py)
            try:
                changed = contract.check_resume(r, int(start["step"]))
            except RecipeError as exc:
                self.release()
                return {"error": str(exc)}
            if changed:
                print(f"[dflash] {changed}", file=sys.stderr, flush=True)
        return {"start": start}

    @property
    def start_step(self) -> int:
        return int(self.start["step"]) if self.start else 0

    def should_stop(self) -> bool:
        """Collective over the drafter ranks at a step boundary: true when any of them was signalled."""
        flag = torch.tensor([1 if self.stop.requested else 0], dtype=torch.int32)
        with watchdog.waiting_on("the stop vote", self.layout.drafter_ranks):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.stop_group)
        return bool(flag.item())

    def bound(self, *groups) -> None:
        """Bound every collective on `groups`, DeepSpeed's own included, by the peer timeout.

        WORLD keeps the start-up timeout: rank 0 may prepare data for long before the first
        collective, and target ranks wait at the closing barrier while the drafters evaluate.
        """
        from torch.distributed.distributed_c10d import _set_pg_timeout  # no public setter exists

        timeout = datetime.timedelta(seconds=self.recipe.topology.peer_timeout_s)
        for g in {g for g in groups if g is not None}:
            try:
                _set_pg_timeout(timeout, g)
            except (AttributeError, RuntimeError, ValueError):
                pass  # this backend keeps its own timeout; our waits are still bounded by the watchdog

    def leaving(self) -> None:
        """This rank is about to exit on purpose: same-host peers must not take its exit for a crash."""
        if self.dog is not None:
            self.dog.mark_left()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def _exit(code: int, line: str | None, control: RunControl | None) -> int:
    if line:
        print(line, file=sys.stderr, flush=True)
    if control is not None:
        control.leaving()
        control.release()
    sys.stdout.flush()
    # No interpreter teardown: process-group destructors can wait on peers that are gone.
    os._exit(code)


def run_guarded(fn, control: RunControl) -> int:
    """Run a rank's role; every way it can end early becomes one line and an exit code."""
    me = control.me
    try:
        fn()
    except Stopped as s:
        how = control.stop.name or "a stop signal"
        return _exit(EXIT_STOPPED, f"[dflash] {me}: stopped by {how} after step {s.step}; checkpoint {s.where}; run "
                     "the same command to resume", control)
    except PeerLost as exc:
        if control.stop.requested and control.role == "target":
            return _exit(EXIT_STOPPED, f"[dflash] {me}: stopped ({control.stop.name})", control)
        return _exit(EXIT_PEER, f"[dflash] {exc}", control)
    except checkpoint.CheckpointError as exc:
        return _exit(EXIT_CHECKPOINT, f"[dflash] {me}: {exc}", control)
    except (RuntimeError, ConnectionError) as exc:
        if not any(k in str(exc) for k in ("Connection closed", "Connection reset", "Timed out", "timed out",
                                           "Broken pipe", "NCCL")):
            raise
        if control.stop.requested and control.role == "target":
            return _exit(EXIT_STOPPED, f"[dflash] {me}: stopped ({control.stop.name})", control)
        cause = str(exc).strip().splitlines()[0][:160]
        return _exit(EXIT_PEER, f"[dflash] {me}: a peer of the drafter or target group is gone or stalled ({cause}); "
                     "stopping the job", control)
    return 0
