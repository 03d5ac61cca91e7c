"""Point-to-point transport of payloads (resolve/payload.py: their layout) between target and drafter ranks.

One send per micro-batch keeps NCCL/gloo overheads to a minimum; the waits on peers are timed
(`WaitTimer`, `SyncStallTimer`) and guarded by the watchdog.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from dflash_ds.runtime.watchdog import waiting_on
from dflash_ds.resolve.payload import PayloadLayout


class WaitTimer:
    """Time a role spent waiting on its transfers, as the device saw it.

    On CPU (gloo) `work.wait()` blocks the host, so host time is the wait. On CUDA (NCCL) it only
    makes the current stream wait and returns at once: the host never sees the stall. There, two
    timing events around the wait measure how long the stream sat idle between the work queued
    before it and the transfer's completion; they are read lazily (no host synchronisation).
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.host = 0.0
        self.stream = 0.0
        self.events: deque = deque()

    def wait(self, work) -> None:
        self.around(work.wait)

    def around(self, call, *args, **kwargs):
        """call(*args, **kwargs), timing the stream's idle across it (the host's time on CPU)."""
        if not self.cuda:
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.host += time.perf_counter() - t0
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        out = call(*args, **kwargs)
        after.record()
        self.events.append((before, after))
        return out

    @property
    def seconds(self) -> float:
        while self.events and self.events[0][1].query():
            before, after = self.events.popleft()
            self.stream += before.elapsed_time(after) / 1000.0
        return self.host + self.stream


class SyncStallTimer:
    """Time a drafter's stream sat idle while its host was blocked in a device-wide synchronisation.

    DeepSpeed's ZeRO-2 (with overlap_comm) synchronises the whole device in every backward's
    epilogue. That also waits for a payload receive posted ahead whose target has not sent it yet,
    so a drafter can idle without its stream ever waiting for data, which the data-wait timer cannot
    see. Wraps the accelerator's synchronize until close(); the events around each call measure from
    the stream's last queued kernel to the host's return, i.e. only the idle part.
    """

    def __init__(self, accelerator, device):
        self.accelerator, self.original = accelerator, accelerator.synchronize
        self.timer = WaitTimer(device)
        accelerator.synchronize = lambda *args, **kwargs: self.timer.around(self.original, *args, **kwargs)

    @property
    def seconds(self) -> float:
        return self.timer.seconds

    def close(self) -> None:
        self.accelerator.synchronize = self.original


class NoSyncTimer:
    """A sync-stall timer that measures nothing: for code that steps a trainer outside a run (the bench)."""

    seconds = 0.0

    def close(self) -> None:
        pass


class Sender:
    """Asynchronous sends with at most `max_in_flight` outstanding; buffers are recycled."""

    def __init__(self, layout: PayloadLayout, device, max_in_flight: int):
        self.layout = layout
        self.device = device
        self.max_in_flight = max_in_flight
        self.pending: deque[tuple[dist.Work, torch.Tensor, int]] = deque()
        self.free: list[torch.Tensor] = [layout.empty(device) for _ in range(max_in_flight + 1)]
        self.timer = WaitTimer(device)
        self.sent = 0

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
        self.sent += 1
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

    def __init__(self, layout: PayloadLayout, device, depth: int, sources, group=None):
        self.layout = layout
        self.sources = iter(sources)
        self.group = group
        self.posted: deque[tuple[dist.Work, torch.Tensor, int]] = deque()
        self.free = [layout.empty(device) for _ in range(depth)]
        self.timer = WaitTimer(device)
        self.received = 0
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
        self.received += 1
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.free.append(buf)
        self._fill()

    def close(self) -> None:
        for work, _, src in self.posted:
            with waiting_on("a payload receive", src):
                work.wait()
        self.posted.clear()
