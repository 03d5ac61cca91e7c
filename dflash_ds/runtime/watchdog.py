"""Bounded waits on peers: every blocking wait names whom it waits on, and never waits forever.

`waiting_on(what, ranks)` wraps a wait (a payload receive, a send completion, a collective). A
thread checks the innermost wait twice a second: past `topology.peer_report_s` it prints who waits
on whom every that many seconds; past `topology.peer_timeout_s` it prints one line naming this
rank and the peer (role, rank, host) and ends the process, so the launcher ends the job. A peer
that died shows up as an error from the wait (gloo: "Connection closed by peer"), turned into the
same one line. Without an installed watchdog (unit tests, tools) waits run unguarded.

A peer on this host is also watched as a process: under NCCL a rank whose peer was killed does not
get an error, it blocks in the next host synchronisation (no guarded wait, so the timeout above would
be the only bound), and the DeepSpeed launcher's SIGTERM asks it for a checkpoint it can no longer
finish, so it would sit there until the launcher's SIGKILL 30 s later. A peer process that is gone
without having announced its exit (`left`: ranks leaving on purpose write their PID and exit code to
`<left_dir>/rank<N>` first) ends this rank within a second, naming the peer. A peer that announced a
failure (a non-zero code) has said why in its own line: this rank then ends with the same code and
adds nothing, so the job stops with that one line and one exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_ds.safety import Exit, PeerLost, alive, exit_now, say

@dataclass(frozen=True)
class Peer:
    role: str
    rank: int
    host: str
    pid: int

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.role} on {self.host})"


class Watchdog:
    def __init__(self, me: Peer, peers: dict[int, Peer], timeout_s: float, report_s: float, *, stop=None,
                 left_dir: str | Path | None = None):
        self.me, self.peers = me, peers
        self.timeout_s, self.report_s = timeout_s, report_s
        self.stop = stop
        self.left_dir = None if left_dir is None else Path(left_dir)
        # Peers whose processes this rank can see: same host, known PID. Without a left_dir no rank
        # can announce a deliberate exit, so none is watched.
        self.local = {} if self.left_dir is None else {
            r: p for r, p in peers.items() if r != me.rank and p.host == me.host and p.pid > 0}
        self.leaving = False
        self.stack: list[tuple[str, tuple[int, ...], float]] = []
        self.lock = threading.Lock()
        self.last_report = 0.0
        self.thread = threading.Thread(target=self._watch, name="dflash-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        # A marker left by this rank in an earlier run of the directory names another PID, but one
        # reused by this process would hide this rank's crash from its peers: clear it.
        if self.left_dir is not None:
            with contextlib.suppress(OSError):
                (self.left_dir / f"rank{self.me.rank}").unlink()
        self.thread.start()
        return self

    def names(self, ranks: tuple[int, ...]) -> str:
        return ", ".join(str(self.peers.get(r, Peer("?", r, "?", 0))) for r in ranks)

    @contextlib.contextmanager
    def waiting(self, what: str, ranks):
        ranks = tuple(r for r in ([ranks] if isinstance(ranks, int) else ranks) if r != self.me.rank)
        with self.lock:
            self.stack.append((what, ranks, time.monotonic()))
        try:
            yield
        except (RuntimeError, ConnectionError) as exc:
            if isinstance(exc, PeerLost):
                raise
            cause = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise PeerLost(f"{self.me}: lost {self.names(ranks)} during {what} ({cause}); stopping the job") from None
        finally:
            with self.lock:
                self.stack.pop()

    def mark_left(self, code: int = 0) -> None:
        """Announce that this rank exits on purpose with `code` (finished, stopped, or failing with its
        own line)."""
        self.leaving = True
        if self.left_dir is not None:
            with contextlib.suppress(OSError):
                self.left_dir.mkdir(parents=True, exist_ok=True)
                (self.left_dir / f"rank{self.me.rank}").write_text(f"{self.me.pid} {int(code)}")

    def left_code(self, peer: Peer) -> int | None:
        """The exit code `peer` announced before leaving, None when it announced nothing."""
        if self.left_dir is None:
            return None
        try:
            pid, _, code = (self.left_dir / f"rank{peer.rank}").read_text().partition(" ")
            return int(code or 0) if int(pid) == peer.pid else None
        except (OSError, ValueError):
            return None

    def announced_failure(self) -> int | None:
        """The exit code of a peer that left announcing a failure (its own line said why), else None."""
        for r, p in self.peers.items():
            code = self.left_code(p) if r != self.me.rank else None
            if code:
                return code
        return None

    def check_local_peers(self) -> None:
        if self.leaving:  # this rank is finishing: peers may exit in any order now
            return
        for r, p in list(self.local.items()):
            if alive(p.pid):
                continue
            code = self.left_code(p)
            if code is None:
                exit_now(Exit.PEER, f"lost {p}: its process (PID {p.pid}) ended without finishing (killed or "
                         "crashed); stopping the job", self.me)
            if code:
                self.mark_left(code)  # for the peers that watch this rank in turn
                exit_now(code)  # the peer's own line said why: the job ends with its code
            del self.local[r]

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            self.check_local_peers()
            with self.lock:
                top = self.stack[-1] if self.stack else None
            if top is None:
                continue
            what, ranks, since = top
            waited = time.monotonic() - since
            now = time.monotonic()
            if waited >= self.timeout_s:
                self.expire(what, ranks, waited)
            if waited >= self.report_s and now - self.last_report >= self.report_s:
                self.last_report = now
                say(f"{self.me} has waited {waited:.0f}s on {self.names(ranks)} for {what} (gives up after "
                    f"topology.peer_timeout_s={self.timeout_s:g})")

    def expire(self, what: str, ranks: tuple[int, ...], waited: float) -> None:
        if self.stop is not None and self.stop.requested:
            exit_now(Exit.STOPPED, f"stopped ({self.stop.name})", self.me)
        say(f"no progress from {self.names(ranks)} for {waited:.0f}s during {what} "
            f"(topology.peer_timeout_s={self.timeout_s:g}); the peer is stalled or gone; stopping the job", self.me)
        here = socket.gethostname()
        for r in ranks:
            p = self.peers.get(r)
            # A stopped (SIGSTOP) process ignores the launcher's SIGTERM until it is killed 30 s later;
            # on this host it can be ended now, so the whole job ends within the bound.
            if p is not None and p.host == here and p.pid > 0:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGKILL)
        exit_now(Exit.PEER)


_ACTIVE: Watchdog | None = None


def install(dog: Watchdog | None) -> None:
    global _ACTIVE
    _ACTIVE = dog


def waiting_on(what: str, ranks):
    """Guard a blocking wait on `ranks`; a no-op when no watchdog is installed."""
    return _ACTIVE.waiting(what, ranks) if _ACTIVE is not None else contextlib.nullcontext()
