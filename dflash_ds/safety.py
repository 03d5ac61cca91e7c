"""The run's safety vocabulary, defined once: exit codes, stop signals, the one-line message, process
liveness, and the typed failures a rank ends with.

Everything here is standard library only, so every entry point (training ranks, launch.sh's checks,
the supervisor, the data / eval / report / bench CLIs) shares it. The mechanisms that use it live in guard/ (the
stop-request thread, signals.py; the run lock, lock.py; `control.run_guarded`, which turns a
`RunFailure` into its line and its exit code) and runtime/watchdog.py (the bound on every wait on a peer).
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import sys
import threading


class Exit(enum.IntEnum):
    """Every exit status the package's processes end with (docs/operating.md, "Operating a long run")."""

    OK = 0
    FAILED = 1
    """An unexpected error: the traceback is the message."""
    USER = 2
    """The user's to fix, one line naming the setting (a bad recipe, a taken run directory, a
    mismatched drafter.init_from, bad data), before any rank has loaded a model."""
    PEER = 3
    """A peer rank died or stalled; the line names it."""
    CHECKPOINT = 4
    """A checkpoint or the export could not be read or written; the line names the file."""
    STOPPED = 75
    """EX_TEMPFAIL: stopped on request with a checkpoint written; run the same command to resume."""

    @staticmethod
    def of_signal(signum: int) -> int:
        """The shell's status for a process ended by signal `signum` (128 + signum)."""
        return 128 + int(signum)


# The signals that ask a run to stop: the first one for a checkpoint, a second one at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def interrupt_in_this_process():
    """Within the block, Ctrl-C (SIGINT to the whole foreground group) raises KeyboardInterrupt in this
    process alone: the workers it forks meanwhile (datasets' map pools) inherit a handler that ignores
    it, and their pool ends them as the interrupt unwinds, so the user gets one line from the caller,
    not a traceback per worker. Outside the main thread (where no handler can be set), and in a process
    that ignores SIGINT (started with `nohup ... &`: its owner asked for no interrupt), it does nothing."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    parent, hit = os.getpid(), []

    def handler(signum, frame):
        if os.getpid() == parent:
            hit.append(signum)
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    except BaseException:
        # Libraries unwinding from the interrupt may raise their own error over it (datasets' pool
        # raises TimeoutError while it drops its workers): the interrupt is what happened.
        if hit:
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


INTERRUPTED = ("interrupted (Ctrl-C) before launch, during the checks or the data preparation; nothing was started "
               "and no partial data cache is kept")


def say(msg: str, who: object = None) -> None:
    """One `[dflash] ...` line on stderr (`who` prefixes it: a rank). Never raises: a closed terminal
    (SIGHUP) must not kill the code that is stopping the job."""
    try:
        print(f"[dflash] {who}: {msg}" if who is not None else f"[dflash] {msg}", file=sys.stderr, flush=True)
    except OSError:
        pass


def alive(pid: int) -> bool:
    """Whether process `pid` can still run: a zombie not yet reaped by its parent counts as gone;
    a process owned by another user counts as alive. Without procfs, existence only."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_BEFORE_EXIT: list = []


def before_exit(fn) -> None:
    """Run `fn` (no arguments, e.g. releasing the run lock) whenever `exit_now` ends the process, from
    whichever thread (the watchdog's, the stop-signal reader's, the main one)."""
    _BEFORE_EXIT.append(fn)


def exit_now(code: Exit | int, line: str | None = None, who: object = None) -> None:
    """Print `line` and end the process at once with `code`. No interpreter teardown: process-group
    destructors can wait on peers that are gone."""
    if line:
        say(line, who)
    for fn in _BEFORE_EXIT:
        try:
            fn()
        except Exception:  # noqa: BLE001 - the process is ending with its own code; nothing may change it
            pass
    sys.stdout.flush()
    os._exit(int(code))


class RunFailure(Exception):
    """A way a rank ends early that has its own exit code; the message is the one line to print."""

    code: Exit = Exit.FAILED

    def line(self, who: object) -> str:
        """The line to print for rank `who`."""
        return f"{who}: {self}"


class PeerLost(RunFailure, RuntimeError):
    """A peer died or stopped answering; the message names both ranks."""

    code = Exit.PEER

    def line(self, who: object) -> str:
        return str(self)  # it already names this rank


class CheckpointError(RunFailure, RuntimeError):
    """A checkpoint or export that cannot be read or written; the message names the file and the way out."""

    code = Exit.CHECKPOINT


class SettingError(RunFailure, RuntimeError):
    """A setting found wrong only after launch (a service refusing the recipe's credentials); the
    message names the setting and the fix."""

    code = Exit.USER


class LockError(RunFailure, RuntimeError):
    """Another run holds the output directory; the message names it and how to clear the lock."""

    code = Exit.USER


class Stopped(RunFailure):
    """Raised on drafter ranks once the agreed stop step is checkpointed."""

    code = Exit.STOPPED

    def __init__(self, step: int, where: str):
        super().__init__(step, where)
        self.step, self.where = step, where


# What the communication backends raise when a peer is gone. NCCL errors arrive typed
# (torch.distributed.DistError); gloo raises a plain RuntimeError ("Connection closed by peer",
# checked on torch 2.13), so its text is read here, once, and nowhere else.
_TRANSPORT_TEXT = ("Connection closed", "Connection reset", "Timed out", "timed out", "Broken pipe", "NCCL")


def transport_failure(exc: BaseException) -> bool:
    """Whether `exc`, raised by a collective or a point-to-point call, means a peer is gone or stalled."""
    if isinstance(exc, (ConnectionError, RunFailure)):
        return isinstance(exc, (ConnectionError, PeerLost))
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(k in str(exc) for k in _TRANSPORT_TEXT)
