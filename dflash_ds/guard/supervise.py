"""What `bash launch.sh` becomes: the parent of the whole job, which it stops as one.

The DeepSpeed launcher (runner -> deepspeed.launcher.launch -> one process per rank) runs in its
own process group. Signals to launch.sh's PID (kill, a scheduler's preemption, Ctrl-C, a closed
terminal) are handled here:
  first SIGTERM/SIGINT/SIGHUP  forwarded once to every rank process, which finish their step and
                               checkpoint (the drafters agree on the step); after run.stop_grace_s
                               the group is killed
  second signal                the group is killed at once
When the launcher exits, anything left in the group (a rank's helper processes) is killed, so
nothing of the job outlives launch.sh.

The ranks get the signal from here, not through deepspeed.launcher.launch: that one turns a
SIGTERM into SIGTERM for every rank followed by SIGKILL 30 s later, whatever the grace time, and
this process would then deliver a duplicate that the ranks would read as a second signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dflash_ds.safety import STOP_SIGNALS, Exit, say


def rank_processes(root: int) -> list[int]:
    """PIDs of this host's rank processes under `root` (started with --local_rank by the launcher)."""
    import psutil

    out = []
    try:
        for p in psutil.Process(root).children(recursive=True):
            try:
                if any(a.startswith("--local_rank") for a in p.cmdline()):
                    out.append(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    except psutil.NoSuchProcess:
        pass
    return out


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    grace = float(argv[argv.index("--grace") + 1]) if "--grace" in argv else 300.0
    cmd = argv[argv.index("--") + 1:]
    proc = subprocess.Popen(cmd, start_new_session=True)
    pgid = proc.pid
    state = {"signals": 0, "deadline": None}

    def on_signal(signum, _frame):
        state["signals"] += 1
        name = signal.Signals(signum).name
        if state["signals"] > 1:
            say(f"{name} again: killing the job now")
            kill_group(pgid)
            return
        ranks = rank_processes(proc.pid)
        state["deadline"] = time.monotonic() + grace
        if not ranks:
            # Still starting (or ranks on other hosts only): nothing to save here; the launcher
            # forwards to remote hosts itself.
            say(f"{name}: stopping the launcher")
            kill_group(pgid, signal.SIGTERM)
            return
        say(f"{name}: asking {len(ranks)} rank(s) to finish the current step and write a checkpoint (up to "
            f"run.stop_grace_s={grace:g}s; send the signal again to stop at once)")
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM if signum == signal.SIGHUP else signum)
            except ProcessLookupError:
                pass

    for s in STOP_SIGNALS:
        signal.signal(s, on_signal)
    while proc.poll() is None:
        if state["deadline"] is not None and time.monotonic() > state["deadline"]:
            say(f"run.stop_grace_s={grace:g}s passed without the job ending: killing it")
            kill_group(pgid)
            state["deadline"] = None
        time.sleep(0.2)
    # The runner is gone; whatever it leaves behind in the group is an orphan of this job.
    kill_group(pgid)
    return job_status(proc.returncode)


def job_status(rc: int) -> int:
    """launch.sh's exit status for the launcher's return code `rc`.

    The launcher itself killed by signal N: 128 + N. DeepSpeed's launcher reports a rank that died of
    signal N (kill -9, the OOM killer) by exiting with the rank's negative status, which the shell sees
    as 256 - N (247 for SIGKILL): that rank was lost, which the survivors name in their line, so the
    job's status is Exit.PEER. Every status the ranks end with themselves (safety.Exit, 128 + N for a
    second stop signal) is at most 192."""
    if rc < 0:
        return Exit.of_signal(-rc)
    if rc > Exit.of_signal(64):
        return Exit.PEER
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
