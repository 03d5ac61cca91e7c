"""All-reduce, reduce-scatter and all-gather bandwidth between the GPUs of one host (NCCL).

    torchrun --nproc_per_node 2 scripts/nccl_bandwidth.py [--mib 1024]

ZeRO-2 drafter ranks reduce-scatter their gradients and all-gather their parameters every optimizer
step, so this bounds what data-parallel drafters can gain on a machine; prints bus bandwidth
(the nccl-tests convention: all-reduce moves 2(n-1)/n of the buffer per rank, the others (n-1)/n).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1024, help="buffer size per rank")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    n = a.mib * 2**20 // 2
    buf = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    part = torch.empty(n // world, dtype=torch.bfloat16, device="cuda")
    size = buf.numel() * buf.element_size()
    results = {
        "all_reduce": (timed(lambda: dist.all_reduce(buf), a.reps), 2 * (world - 1) / world),
        "reduce_scatter": (timed(lambda: dist.reduce_scatter_tensor(part, buf), a.reps), (world - 1) / world),
        "all_gather": (timed(lambda: dist.all_gather_into_tensor(buf, part), a.reps), (world - 1) / world),
    }
    if rank == 0:
        for name, (sec, factor) in results.items():
            print(f"{name:15s} {a.mib} MiB: {sec * 1e3:8.1f} ms  bus bandwidth {size * factor / sec / 1e9:7.1f} GB/s",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
