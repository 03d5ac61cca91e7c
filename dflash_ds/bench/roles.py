"""The measured roles: target fill, drafter step (alone or colocated with its target), transport.

Every compute role runs the real code path on random weights (speed does not depend on them):
the target is the truncated HF model under the DeepSpeed replica engine filling transport
payloads through TapCapture (TargetWorker.fill), the drafter step is DrafterTrainer.train_step
under the ZeRO-2 engine, colocated mode is trainer.LocalSource feeding that step.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from .flops import drafter_flops_of_steps, target_flops_per_micro
from .lengths import add_useful
from .quantized import run_target_compared
from .setup import Setup, free_port, init_single_process, setup_rows
from .target_side import build_target_model, target_worker, time_target
from .timing import drive, record_rates, synchronize

MASK_METHODS = {
    "flex": "BlockMask.from_kv_blocks from tensor ops (attention._flex_mask), compiled flex_attention",
    "dense": "dense bool [b,1,Q,S+Q] mask (attention._dense_mask), SDPA",
}


# ---------------------------------------------------------------------------- target side


# ---------------------------------------------------------------------------- drafter side


class SyntheticSource:
    """Payload source of the drafter role: a few pre-filled payloads, reused in turn."""

    def __init__(self, payloads: list[torch.Tensor]):
        self.payloads = payloads
        self.i = 0
        self.wait_seconds = 0.0

    def get(self) -> torch.Tensor:
        p = self.payloads[self.i % len(self.payloads)]
        self.i += 1
        return p

    def release(self, buf) -> None:
        pass

    def close(self) -> None:
        pass


def payload_count(setup: Setup) -> int:
    # Full rows are all alike: 2 payloads suffice. From a length mix, 8 give a steadier padding share.
    return 8 if getattr(setup.args, "lengths", None) else 2


def synthetic_payloads(setup: Setup, count: int = 2, rows: dict | None = None) -> list[torch.Tensor]:
    from dflash_ds.resolve.payload import taps_view, write_meta

    a, layout = setup.args, setup.payload
    rows = setup_rows(setup, count * layout.rows) if rows is None else rows
    g = torch.Generator(device=setup.device).manual_seed(a.seed)
    out = []
    for k in range(count):
        buf = layout.empty(setup.device)
        taps_view(buf, layout).normal_(generator=g)
        sl = slice(k * layout.rows, (k + 1) * layout.rows)
        ids, loss_mask, doc_ids = (torch.from_numpy(rows[f][sl]) for f in ("input_ids", "loss_mask", "doc_ids"))
        write_meta(buf, layout, ids, loss_mask, doc_ids=doc_ids)
        out.append(buf)
    return out


def frozen_matrices(setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """Random frozen embedding and lm_head [V, D] in the run's dtype (seeded by --seed + 1)."""
    c = setup.drafter_config
    g = torch.Generator(device=setup.device).manual_seed(setup.args.seed + 1)
    embed = torch.empty(c.vocab_size, c.hidden_size, device=setup.device, dtype=setup.run.dtype)
    head = torch.empty_like(embed)
    return embed.normal_(0, 0.02, generator=g), head.normal_(0, 0.02, generator=g)


def build_drafter(setup: Setup, group, matrices: tuple[torch.Tensor, torch.Tensor], seed: int):
    """A drafter initialised from `seed` under the real ZeRO-2 engine, with the frozen (embed, lm_head)
    `matrices` (drafter.fp8 as the recipe says: its layers converted as the engine is built, the loss's
    lm_head quantized). Returns (DraftModel, engine, the engine's JSON)."""
    from dflash_ds.network.draft_model import DraftModel
    from dflash_ds.network.drafter import DFlashDrafter
    from dflash_ds.runtime.engines import build_drafter_engine, loss_head

    torch.manual_seed(seed)
    drafter = DFlashDrafter(setup.drafter_config).to(setup.device)
    engine, ds_cfg = build_drafter_engine(setup.recipe, drafter, setup.plan, group, rank=0, device=setup.device)
    embed, head = matrices
    return DraftModel(drafter, embed, head, loss_head(setup.recipe, head)), engine, ds_cfg


def build_drafter_side(setup: Setup, group):
    """Drafter under the real ZeRO-2 engine with random frozen embedding and lm_head [V, D]."""
    return build_drafter(setup, group, frozen_matrices(setup), setup.args.seed)


def drafter_step(setup: Setup, engine, model, source, *, group):
    """One optimizer step of a drafter rank: `DrafterTrainer.train_step` itself (payloads -> unpack
    -> make_blocks -> step-wide weight all-reduce -> per micro-batch drafter_loss, engine.backward,
    engine.step -> acceptance proxy bookkeeping). Only the logging done at log steps is left out."""
    from dflash_ds.bench.stand_ins import NoSyncTimer, NullControl
    from dflash_ds.runtime.trainer import DrafterParts, DrafterTrainer

    trainer = DrafterTrainer(setup.run, 0, DrafterParts(engine, model, source, group, NoSyncTimer()), NullControl())
    if setup.args.loss_impl == "autograd":
        from .chunk_autograd import PerChunkBackwardLoss

        trainer.loss_class = PerChunkBackwardLoss

    def step(s: int):
        st = trainer.train_step(s)
        return st.ce_sum, st.weight, st.accept, st.anchors

    return step


def micro_batch_of(setup: Setup, payload: torch.Tensor):
    from dflash_ds.resolve.payload import unpack

    return unpack(payload, setup.payload, setup.run.dtype)


def time_mask(setup: Setup, payload: torch.Tensor, repeats: int = 5) -> dict:
    """Mask construction time: the process's first build (cold), the median warm build, make_blocks.

    Runs before the first training step, so the first build here is the process's first.
    """
    from dflash_ds.network.attention import build_layer_masks
    from dflash_ds.objective.blocks import anchor_generator, make_blocks, sample_anchors

    s = setup.run.settings
    mb = micro_batch_of(setup, payload)
    anchors, valid = sample_anchors(mb.loss_mask.cpu(), mb.doc_ids.cpu(), s.num_anchors, anchor_generator(s.seed, 0),
                                    prompt_end=s.anchor_prompt_end)
    anchors, valid = anchors.to(setup.device), valid.to(setup.device)
    times = []
    for _ in range(repeats + 1):
        synchronize(setup.device)
        t0 = time.perf_counter()
        build_layer_masks(anchors, valid, mb.doc_ids, s.block_size, attentions=s.attentions, kind=s.mask_kind)
        synchronize(setup.device)
        times.append(time.perf_counter() - t0)
    synchronize(setup.device)
    t0 = time.perf_counter()
    make_blocks(mb, s, 0)
    synchronize(setup.device)
    return {"kind": s.mask_kind, "method": MASK_METHODS[s.mask_kind], "first_build_s": times[0],
            "build_s": statistics.median(times[1:]), "make_blocks_s": time.perf_counter() - t0}


# ---------------------------------------------------------------------------- the roles


def run_target(setup: Setup, ceiling: dict) -> dict:
    init_single_process(setup.device)
    if getattr(setup.args, "compare_bf16", False):
        return run_target_compared(setup, ceiling)
    t_build = time.perf_counter()
    model, kind = build_target_model(setup, not setup.args.no_engine)
    worker = target_worker(setup, model)
    synchronize(setup.device)
    return time_target(setup, worker, ceiling, t_build, build_s=time.perf_counter() - t_build, engine=kind)


def run_drafter(setup: Setup, ceiling: dict, colocated: bool = False) -> dict:
    group = init_single_process(setup.device)
    a = setup.args
    t_build = time.perf_counter()
    draft_model, engine, ds_cfg = build_drafter_side(setup, group)
    drafter = draft_model.drafter
    extra = {}
    if colocated:
        from dflash_ds.runtime.trainer import LocalSource

        model, kind = build_target_model(setup, not a.no_engine)
        worker = target_worker(setup, model)
        source = LocalSource(worker, 0, 0)
        extra.update(engine_target=kind, target_flops_per_micro=target_flops_per_micro(setup, model))
        probe = synthetic_payloads(setup, 1)[0]
        row_doc_ids = worker.rows["doc_ids"]
    else:
        rows = setup_rows(setup, payload_count(setup) * setup.payload.rows)
        payloads = synthetic_payloads(setup, payload_count(setup), rows)
        row_doc_ids = rows["doc_ids"]
        source = SyntheticSource(payloads)
        probe = payloads[0]
    step_fn = drafter_step(setup, engine, draft_model, source, group=group)
    synchronize(setup.device)
    build_s = time.perf_counter() - t_build
    mask = time_mask(setup, probe)
    del probe
    result = drive(step_fn, setup.device, a.warmup, a.steps, t_build=t_build, profile=a.profile)
    counted = drafter_flops_of_steps(setup, range(a.warmup, a.warmup + a.steps))
    flops = counted["per_step"]["total"]
    if colocated:
        flops += setup.plan.grad_accum * extra["target_flops_per_micro"]["total"]
    result.update(build_s=build_s, mask=mask, drafter_flops=counted, taps=setup.tap_ids,
                  drafter_params=sum(p.numel() for p in drafter.parameters() if p.requires_grad),
                  architecture=drafter.config.architecture,
                  checkpointed_layers=drafter.checkpoint_layers if drafter.checkpoint_fn is not None else 0,
                  compiled_layers=bool(a.compile_layers), zero_stage=ds_cfg.get("zero_optimization", {}).get("stage"),
                  loss_chunks=setup.recipe.objective.loss_chunks, **extra)
    record_rates(result, setup.plan.grad_accum * setup.payload.rows * a.seq_len, flops, ceiling)
    add_useful(result, row_doc_ids)
    return result


def _transport_worker(rank: int, port: int, layout, args: dict, *, queue) -> None:
    import torch.distributed as dist

    from dflash_ds.resolve.payload import write_meta
    from dflash_ds.runtime.transport import Receiver, Sender

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    nccl = args["backend"] == "nccl"
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group(args["backend"], rank=rank, world_size=2)
    total = args["warmup"] + args["steps"]
    try:
        if rank == 1:  # target: sends the same buffers over and over (the fill is not what is measured)
            tx = Sender(layout, device, args["in_flight"])
            zeros = torch.zeros(layout.rows, layout.seq_len, dtype=torch.long)
            for buf in tx.free:
                write_meta(buf, layout, zeros, zeros, doc_ids=zeros)
            for _ in range(total):
                tx.send(tx.buffer(), dst=0)
            tx.flush()
            queue.put({"rank": 1, "send_wait_s": tx.wait_seconds})
        else:
            rx = Receiver(layout, device, args["depth"], [1] * total)
            for _ in range(args["warmup"]):
                rx.release(rx.get())
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(args["steps"]):
                buf = rx.get()
                synchronize(device)  # NCCL's wait only orders streams; the bytes must have landed
                rx.release(buf)
            seconds = time.perf_counter() - t0
            rx.close()
            queue.put({"rank": 0, "seconds": seconds, "recv_wait_s": rx.wait_seconds})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_transport(setup: Setup, ceiling: dict) -> dict:
    import torch.multiprocessing as mp

    from dflash_ds.resolve.payload import PayloadLayout

    a = setup.args
    layout = PayloadLayout(setup.payload.rows, setup.payload.seq_len, setup.payload.num_taps, setup.payload.hidden, torch.bfloat16)
    if a.transport_backend == "nccl" and torch.cuda.device_count() < 2:
        raise ValueError("--transport-backend nccl needs 2 visible GPUs; use gloo (the host path) on this machine")
    if a.warmup < 1 or a.steps < 1:
        raise ValueError("--warmup and --steps must be >= 1 for the transport role")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    wargs = {"backend": a.transport_backend, "warmup": a.warmup, "steps": a.steps, "in_flight": a.in_flight,
             "depth": a.recv_depth}
    procs = [ctx.Process(target=_transport_worker, args=(r, port, layout, wargs),
                         kwargs={"queue": queue}) for r in range(2)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(2):
            rep = queue.get(timeout=a.transport_timeout)
            reports[rep["rank"]] = rep
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"transport worker exited with {bad}")
    seconds = reports[0]["seconds"]
    per_s = a.steps / seconds
    return {"backend": a.transport_backend, "payload_shape": list(layout.shape), "payload_bytes": layout.nbytes,
            "payloads": a.steps, "seconds": seconds, "payloads_per_s": per_s, "gb_s": per_s * layout.nbytes / 1e9,
            "tok_s": per_s * layout.rows * layout.seq_len, "in_flight": a.in_flight, "recv_depth": a.recv_depth,
            "send_wait_s": reports[1]["send_wait_s"], "recv_wait_s": reports[0]["recv_wait_s"]}
