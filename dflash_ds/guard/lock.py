"""One run per output directory: a lock file naming the holder's host, PID and start time.

The lead drafter holds `<run.output_dir>/run.lock` for the whole run; `bash launch.sh` checks it
on the launching host before the launcher starts, so a second run stops before any model loads.
The file is created with O_EXCL, so two runs racing for it cannot both win. A lock whose process
is gone on this host is stale (a run killed with SIGKILL, a machine reboot) and is taken over; a
lock held from another host cannot be checked from here and is refused with the way to clear it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

from dflash_ds.safety import LockError, alive

LOCK_NAME = "run.lock"


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def read_holder(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        # Half-written (the holder died between create and write) or garbled: nobody is named.
        return {}


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("start_time", 0)))
    return f"PID {holder.get('pid')} on host {holder.get('host')} (started {started})"


def check(run_dir: str | Path) -> dict | None:
    """The live holder of the run directory's lock, None when it is free or stale.

    Raises LockError when the directory is taken; used before launch and by acquire().
    """
    path = lock_path(run_dir)
    holder = read_holder(path)
    if holder is None:
        return None
    host = socket.gethostname()
    if not holder:
        age = time.time() - path.stat().st_mtime if path.exists() else 0
        if age < 10:  # being written right now by a run that just started
            raise LockError(f"{path}: another run is starting in run.output_dir {run_dir}; wait for it or pick "
                            "another run.output_dir")
        return None
    if holder.get("host") == host:
        if alive(int(holder.get("pid", -1))):
            raise LockError(f"run.output_dir {run_dir} is in use by another run ({describe(holder)}); stop it "
                            f"(kill {holder.get('pid')}) or set another run.output_dir")
        return None
    raise LockError(f"run.output_dir {run_dir} is locked by a run on another host ({describe(holder)}); if that run "
                    f"is gone, delete {path} and start again, or set another run.output_dir")


class RunLock:
    """Held by the lead drafter; released when the run ends (normally or by a stop signal)."""

    def __init__(self, run_dir: str | Path):
        self.path = lock_path(run_dir)
        self.run_dir = Path(run_dir)
        self.held = False

    def acquire(self) -> "RunLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                check(self.run_dir)  # raises when a live run holds it
                # Stale: remove it and race for it again; O_EXCL decides between racing takers.
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return self
        raise LockError(f"{self.path}: could not take the run lock (another run keeps taking it); set another "
                        "run.output_dir")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = read_holder(self.path)
        # Never remove a lock that is not ours (taken over after we were presumed dead).
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            try:
                os.unlink(self.path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
