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
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ds.config import RecipeError
from dflash_ds.guard import launch
from dflash_ds.guard.lock import RunLock
from dflash_ds.guard.signals import StopRequest
from dflash_ds.runtime import checkpoint, watchdog
from dflash_ds.runtime.watchdog import Peer, Watchdog
from dflash_ds.safety import CheckpointError, Exit, LockError, PeerLost, RunFailure, Stopped, before_exit, exit_now, \
    say, transport_failure

LEFT_DIR = ".left"  # under run.output_dir: ranks that exited on purpose (see watchdog.Watchdog.mark_left)


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
                say(f"error: {c.error}")
            return c
        c.start = decision[0]["start"]
        peers: list = [None] * dist.get_world_size()
        dist.all_gather_object(peers, c.me)
        t = recipe.topology
        c.dog = Watchdog(c.me, {p.rank: p for p in peers}, t.peer_timeout_s, t.peer_report_s, stop=c.stop,
                         left_dir=Path(recipe.run.output_dir) / LEFT_DIR).start()
        c.stop.peer_failed = c.peer_failed
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
            os.environ.update(launch.lead_checks(r))  # the lead alone logs to wandb
        except RecipeError as exc:
            return {"error": str(exc)}
        try:
            self.lock = RunLock(r.run.output_dir).acquire()
        except LockError as exc:
            return {"error": str(exc)}
        before_exit(self.release)  # whichever way this process ends (a watchdog, a second signal), no lock stays
        try:
            start = launch.decide_start(r)
        except (CheckpointError, RecipeError) as exc:
            self.release()
            return {"error": str(exc)}
        if start and "warning" in start:
            say(f"warning: {start['warning']}")
        if start and "changed" in start:
            say(start["changed"])
        if r.checkpoint.resume == "restart":
            try:
                aside = checkpoint.set_aside(r.run.output_dir)
            except OSError as exc:
                self.release()
                return {"error": f"checkpoint.resume=restart: could not move the previous run's checkpoints aside in "
                                 f"{checkpoint.checkpoint_dir(r.run.output_dir)} ({exc.strerror or exc})"}
            if aside is not None:
                say(f"checkpoint.resume=restart: the previous run's checkpoints are now in {aside}; this run starts "
                    "at step 0")
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

    def leaving(self, code: int = Exit.OK) -> None:
        """This rank is about to exit on purpose with `code`: same-host peers must not take its exit for
        a crash, and after a failure (its own line printed) they end with the same code."""
        if self.dog is not None:
            self.dog.mark_left(code)

    def peer_failed(self) -> int | None:
        """The exit code a peer announced failing with (its line said why), None when none did."""
        return self.dog.announced_failure() if self.dog is not None else None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def _exit(control: RunControl, code: Exit | int, line: str | None) -> int:
    if line:
        say(line)
    control.leaving(code)
    control.release()
    exit_now(code)
    return int(code)  # not reached: exit_now ends the process


def run_guarded(fn, control: RunControl) -> int:
    """Run a rank's role; every way it can end early becomes one line and its exit code.

    Failures are told apart by type (safety.RunFailure and its subclasses); an error a
    communication backend raises untyped becomes PeerLost in `safety.transport_failure`. A lost
    peer that announced its own failure is that failure: this rank ends with its code and no line of
    its own. An unexpected error ends with its traceback and Exit.FAILED, announced like the others."""
    me = control.me
    try:
        fn()
    except Stopped as s:
        how = control.stop.name or "a stop signal"
        return _exit(control, s.code, f"{me}: stopped by {how} after step {s.step}; checkpoint {s.where}; run the "
                     "same command to resume")
    except Exception as exc:
        failure = exc if isinstance(exc, RunFailure) else None
        if failure is None and transport_failure(exc):
            cause = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            failure = PeerLost(f"{me}: a peer of the drafter or target group is gone or stalled ({cause}); "
                               "stopping the job")
        if failure is None:
            traceback.print_exc()  # the message of an unexpected error (Exit.FAILED)
            return _exit(control, Exit.FAILED, None)
        if isinstance(failure, PeerLost) and control.stop.requested and control.role == "target":
            # The drafters stopped on request and closed their side: this is the same stop.
            return _exit(control, Exit.STOPPED, f"{me}: stopped ({control.stop.name})")
        if isinstance(failure, PeerLost):
            code = control.peer_failed()
            if code:
                return _exit(control, code, None)
        return _exit(control, failure.code, failure.line(me))
    return Exit.OK
