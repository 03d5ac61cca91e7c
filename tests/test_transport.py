import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_ds.guard.launch import free_port
from dflash_ds.resolve.payload import PayloadLayout, read_meta, taps_view, write_meta
from dflash_ds.runtime.profiling import SyncStallTimer, WaitTimer
from dflash_ds.runtime.transport import Receiver, Sender


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_meta_round_trip_is_exact(dtype):
    layout = PayloadLayout(rows=2, seq_len=7, num_taps=3, hidden=4, dtype=dtype)
    buf = layout.empty("cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 248_320, (2, 7), generator=g)  # ids beyond bf16's exact integer range
    lm = torch.randint(0, 2, (2, 7), generator=g).bool()
    docs = torch.randint(-1, 5, (2, 7), generator=g).int()
    taps = torch.randn(2, 7, 12, generator=g).to(dtype)
    taps_view(buf, layout).copy_(taps)
    write_meta(buf, layout, ids, lm, doc_ids=docs)
    i2, l2, d2 = read_meta(buf, layout)
    assert torch.equal(i2, ids) and torch.equal(l2, lm) and torch.equal(d2, docs)
    assert torch.equal(taps_view(buf, layout), taps)  # metadata never overwrites the taps


@pytest.mark.parametrize("dtype,hidden,taps,final", [(torch.bfloat16, 5120, 5, False), (torch.bfloat16, 5120, 5, True),
                                                     (torch.float32, 64, 3, False), (torch.bfloat16, 3, 2, False),
                                                     (torch.float8_e4m3fn, 2048, 4, True)])
def test_payload_rows_are_16_byte_aligned(dtype, hidden, taps, final):
    # The drafter's fc multiplies a strided view of the payload: a row stride that is not a
    # multiple of 16 bytes sends cuBLAS to a fallback kernel (a third of the GEMM rate on an H200).
    layout = PayloadLayout(rows=2, seq_len=3, num_taps=taps, hidden=hidden, dtype=dtype, final_norm=final)
    buf = layout.empty("cpu")
    assert buf.stride(1) * buf.element_size() % 16 == 0
    assert taps_view(buf, layout).stride(1) == buf.shape[-1] and layout.meta_cols * buf.element_size() >= 12
    ids = torch.arange(6).view(2, 3) + 248_000
    write_meta(buf, layout, ids, torch.ones(2, 3), doc_ids=torch.full((2, 3), 7))
    i2, l2, d2 = read_meta(buf, layout)
    assert torch.equal(i2, ids) and bool(l2.all()) and bool((d2 == 7).all())


def _worker(rank, port, n, depth, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    layout = PayloadLayout(rows=1, seq_len=5, num_taps=2, hidden=3, dtype=torch.bfloat16)
    if rank == 1:  # target: sends payload i filled with value i
        tx = Sender(layout, "cpu", max_in_flight=depth)
        for i in range(n):
            buf = tx.buffer()
            taps_view(buf, layout).fill_(float(i))
            write_meta(buf, layout, torch.full((1, 5), 1000 + i), torch.ones(1, 5), doc_ids=torch.zeros(1, 5))
            tx.send(buf, dst=0)
            assert tx.in_flight <= depth
        tx.flush()
    else:
        rx = Receiver(layout, "cpu", depth, [1] * n)
        got = []
        for _ in range(n):
            buf = rx.get()
            ids, _, _ = read_meta(buf, layout)
            got.append((float(taps_view(buf, layout)[0, 0, 0]), int(ids[0, 0])))
            rx.release(buf)
        q.put(got)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.launcher
def test_sender_receiver_order_and_content():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    n = 9
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, n, 2, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = q.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == [(float(i), 1000 + i) for i in range(n)]


def test_wait_timer_reads_the_stream_stall_on_cuda_without_syncing(monkeypatch):
    """On NCCL work.wait() returns at once; the stall comes from timing events read lazily."""
    stalls = iter([0.5, 0.25])

    class FakeEvent:
        log: list = []

        def __init__(self, enable_timing):
            assert enable_timing
            self.done = False
            FakeEvent.log.append(self)

        def record(self):
            pass

        def query(self):
            return self.done

        def elapsed_time(self, other):
            assert other.done  # never read before the stream got there
            return 1000.0 * next(stalls)

    class Work:
        def wait(self):
            pass

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = WaitTimer("cuda")
    timer.wait(Work())
    timer.wait(Work())
    assert timer.seconds == 0.0  # nothing complete yet: no blocking read
    FakeEvent.log[1].done = True
    assert timer.seconds == 0.5
    FakeEvent.log[3].done = True
    assert timer.seconds == 0.75
    cpu = WaitTimer("cpu")
    cpu.wait(Work())
    assert 0.0 <= cpu.seconds < 0.1 and not cpu.events


def test_in_flight_counts_sends_not_completed():
    """Under NCCL the host never blocks on a send, so the ring is always full on the host; the
    progress line's 'in flight' counts the transfers that have not completed."""
    class Work:
        def __init__(self, done):
            self.done = done

        def is_completed(self):
            return self.done

    tx = Sender(PayloadLayout(1, 4, 1, 8, torch.float32), "cpu", max_in_flight=3)
    tx.pending.extend([(Work(True), None), (Work(False), None), (Work(False), None)])
    assert tx.in_flight == 2
    tx.pending[1][0].done = True
    assert tx.in_flight == 1


def test_drafter_posts_the_next_steps_receives_while_a_step_runs(monkeypatch):
    """A drafter step holds all of its payloads (the loss is normalised by the whole step's weight)
    and releases them at its end. The receives for the next step must be posted before that, or
    the target's sends of the next step wait, holding NCCL's thread blocks beside its GEMMs."""
    from dflash_ds.runtime import transport
    from dflash_ds.resolve.plan import receive_depth

    posted = []

    class Work:
        def wait(self):
            pass

    def irecv(buf, src, group=None):
        posted.append(src)
        return Work()

    monkeypatch.setattr(transport.dist, "irecv", irecv)
    grad_accum, steps = 4, 5
    layout = PayloadLayout(1, 4, 1, 8, torch.float32)
    rx = Receiver(layout, "cpu", receive_depth(grad_accum), [1] * (grad_accum * steps))
    for step in range(steps):
        held = [rx.get() for _ in range(grad_accum)]  # the step runs with these
        consumed = (step + 1) * grad_accum
        ahead = len(posted) - consumed
        # Every payload of the next step (none after the last) already has its receive posted.
        assert ahead == min(grad_accum, grad_accum * steps - consumed), (step, ahead)
        for buf in held:
            rx.release(buf)
    assert len(posted) == grad_accum * steps


def test_timer_around_a_call_returns_its_value_and_times_it_even_when_it_raises():
    timer = WaitTimer("cpu")
    assert timer.around(lambda x, y=0: (time.sleep(0.05), x + y)[1], 2, y=3) == 5
    with pytest.raises(ValueError):
        timer.around(lambda: (time.sleep(0.05), int("x")))
    assert 0.1 <= timer.seconds < 1.0


def test_sync_stall_timer_wraps_the_accelerators_synchronize_until_closed():
    """DeepSpeed calls get_accelerator().synchronize(); the timer counts those calls' time (on CPU the
    host's, on GPU the stream's idle across them) and puts the original back on close."""
    class Accelerator:
        calls = 0

        def synchronize(self, device_index=None):
            Accelerator.calls += 1
            time.sleep(0.05)
            return device_index

    acc = Accelerator()
    original = acc.synchronize
    syncs = SyncStallTimer(acc, "cpu")
    assert acc.synchronize(device_index=1) == 1 and acc.synchronize() is None
    assert Accelerator.calls == 2 and 0.1 <= syncs.seconds < 1.0
    syncs.close()
    assert acc.synchronize == original
    counted = syncs.seconds
    acc.synchronize()
    assert Accelerator.calls == 3 and syncs.seconds == counted  # no longer timed
