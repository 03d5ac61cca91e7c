"""Stop requests on a rank: the first SIGTERM/SIGINT/SIGHUP asks for a checkpoint, a second exits.

CPython runs Python-level signal handlers only on the main thread between bytecodes, so a rank
blocked inside a collective or a receive would not see a signal until that call returns. The C
handler does write the signal number to the wakeup fd at once, though: a thread reading that fd
sees every signal immediately, records the request for the training loop (which acts on it at the
next step boundary) and, on the second signal, exits the process on the spot.
"""

from __future__ import annotations

import os
import signal
import threading

from dflash_ds.safety import STOP_SIGNALS, Exit, exit_now, say


class StopRequest:
    def __init__(self, who: str, saves: bool = True):
        self.who = who
        self.saves = saves  # drafter ranks write the checkpoint; target ranks only wait for them
        self.signum: int | None = None
        self.count = 0
        self._thread: threading.Thread | None = None
        # What the first signal does now, said in its line (`finishing` changes it once training is over).
        self.first = "stopping after the current step" if saves else "serving the drafters until they have stopped"
        # A peer's announced failure code (RunControl sets it): the launcher's SIGTERM that follows a
        # failing rank is no stop request, and this rank then ends with that code, silently.
        self.peer_failed = lambda: None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> "StopRequest":
        """Main thread only (a CPython rule for signal handlers and the wakeup fd)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for s in STOP_SIGNALS:
            # A Python handler must exist, or the default action (terminate) would run; the work
            # happens in the reader thread, which sees the signal even while the main thread waits.
            signal.signal(s, lambda *_: None)
        self._thread = threading.Thread(target=self._read, args=(r,), name="dflash-signals", daemon=True)
        self._thread.start()
        return self

    def _read(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            for signum in data:
                if signum in STOP_SIGNALS:
                    self.on_signal(signum)

    def finishing(self, what: str) -> None:
        """The work left is `what` (the run's end, its checkpoint written), not a step: a first signal
        lets it finish."""
        self.first, self.saves = what, False

    def done(self) -> None:
        """Nothing is left to stop: stop signals are ignored from here until the process exits (a
        Python process tearing down restores the default handlers, and dying of a late SIGTERM would
        make the launcher signal the ranks still at work)."""
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    def on_signal(self, signum: int) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        code = self.peer_failed()
        if code:
            exit_now(code)
            return
        if self.count == 1:
            self.signum = signum
            say(f"{name} received; {self.first} (send it again to stop at once)", self.who)
            return
        what = "exiting now without a checkpoint" if self.saves else "exiting now"
        exit_now(Exit.of_signal(signum), f"{name} received again; {what}", self.who)
