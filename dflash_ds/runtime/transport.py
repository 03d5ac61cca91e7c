"""Point-to-point transport of payloads (resolve/payload.py: their layout) between target and drafter ranks.

One send per micro-batch keeps NCCL/gloo overheads to a minimum; the waits on peers are timed
(runtime/profiling.py's `WaitTimer`) and guarded by the watchdog.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from dflash_ds.resolve.payload import PayloadLayout
from dflash_ds.runtime.profiling import WaitTimer
from dflash_ds.runtime.watchdog import waiting_on


class Sender:
    """Asynchronous sends with at most `max_in_flight` outstanding; buffers are recycled."""

    def __init__(self, layout: PayloadLayout, device, max_in_flight: int):
        self.layout = layout
        self.device = device
        self.max_in_flight = max_in_flight
        self.pending: deque[tuple[dist.Work, torch.Tensor, int]] = deque()
        self.free: list[torch.Tensor] = [layout.empty(device) for _ in range(max_in_flight + 1)]
        self.timer = WaitTimer(device)

    @property
    def wait_seconds(self) -> float:
        return self.timer.seconds

    @property
    def in_flight(self) -> int:
        # Sends not yet completed. Not len(pending): under NCCL the host never blocks on a send, so
        # pending stays at max_in_flight whether or not the transfers are done.
        return sum(not entry[0].is_completed() for entry in self.pending)

    def buffer(self) -> torch.Tensor:
        """A payload buffer that no send is still reading."""
        while not self.free:
            self._retire_oldest()
        return self.free.pop()

    def send(self, payload: torch.Tensor, dst: int, group=None) -> None:
        # NCCL orders the send after the work already queued on the current stream (the forward
        # that filled the buffer), so no host synchronisation is needed here.
        with waiting_on("a payload send", dst):  # a peer already gone fails right here
            work = dist.isend(payload, dst=dst, group=group)
        self.pending.append((work, payload, dst))
        while len(self.pending) > self.max_in_flight:
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        work, buf, dst = self.pending.popleft()
        with waiting_on("a payload send", dst):
            self.timer.wait(work)
        self.free.append(buf)

    def flush(self) -> None:
        while self.pending:
            self._retire_oldest()


class Receiver:
    """Receives payloads in schedule order into a ring of pre-posted buffers.

    `sources` is an iterator of source ranks in the order the payloads will be consumed; up to
    `depth` receives are posted ahead so the next payload lands while the current one is used.
    """

    def __init__(self, layout: PayloadLayout, device, depth: int, sources, *, group=None):
        self.layout = layout
        self.sources = iter(sources)
        self.group = group
        self.posted: deque[tuple[dist.Work, torch.Tensor, int]] = deque()
        self.free = [layout.empty(device) for _ in range(depth)]
        self.timer = WaitTimer(device)
        self._fill()

    @property
    def wait_seconds(self) -> float:
        return self.timer.seconds

    def _fill(self) -> None:
        while self.free:
            src = next(self.sources, None)
            if src is None:
                return
            buf = self.free.pop()
            with waiting_on("a payload receive", src):
                self.posted.append((dist.irecv(buf, src=src, group=self.group), buf, src))

    def get(self) -> torch.Tensor:
        """The next payload; hand it back with release() once it is no longer read."""
        work, buf, src = self.posted.popleft()
        with waiting_on("a payload receive", src):
            self.timer.wait(work)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.free.append(buf)
        self._fill()

    def close(self) -> None:
        for work, _, src in self.posted:
            with waiting_on("a payload receive", src):
                work.wait()
        self.posted.clear()
