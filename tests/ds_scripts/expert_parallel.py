"""Expert parallelism over the target group while the drafter rank does other work.

Targets (2 ranks, one expert group): each loads its half of a 4-expert tiny MoE (load_expert_shard:
2 experts of every layer), then
  - runs forward_taps on rows of its own (different on each rank, packed documents), whose taps
    must equal the unsplit model's on the same rows;
  - generates the greedy continuation of one prompt with every rank on the same input
    (GroupComm.same_inputs), which must equal the unsplit model's and come out identical on both.
"""

from __future__ import annotations

import common
import torch
import torch.distributed as dist

from dflash_ds.eval.generate import greedy_continuation
from dflash_ds.objective.blocks import position_ids_from_doc_ids
from dflash_ds.runtime.expert_group import GroupComm
from dflash_ds.target_model import moe
from dflash_ds.target_model.expert_parallel import load_expert_shard
from dflash_ds.target_model.model import TapCapture, forward_taps, load_target

TAPS = [0, 1, 2, 3]
ROWS, SEQ = 2, 24


def rows_of(rank: int, vocab: int):
    g = torch.Generator().manual_seed(200 + rank)
    ids = torch.randint(1, vocab, (ROWS, SEQ), generator=g)
    doc_ids = torch.zeros(ROWS, SEQ, dtype=torch.int32)
    doc_ids[:, 9 + 4 * rank:] = 1  # two documents per row, cut at another place on each rank
    return ids, doc_ids


def taps(model, ids, doc_ids, hidden: int) -> torch.Tensor:
    capture = TapCapture(model, TAPS)
    out = torch.full((ROWS, SEQ, len(TAPS) * hidden), float("nan"))
    forward_taps(model, capture, ids, position_ids_from_doc_ids(doc_ids), out=out, doc_ids=doc_ids)
    capture.remove()
    return out


def run_target(ctx) -> None:
    a = ctx.args
    ref = load_target(a.model, dtype="float32")
    moe.use_experts(ref, "eager")  # transformers' own per-expert loop is the reference
    hidden, vocab = ref.config.hidden_size, ref.config.vocab_size
    ids, doc_ids = rows_of(ctx.rank, vocab)
    expected = taps(ref, ids, doc_ids, hidden)
    prompt = torch.randint(1, vocab, (1, 7), generator=torch.Generator().manual_seed(300))
    expected_gen = greedy_continuation(ref, prompt, max_new_tokens=12, eos_token_id=-1)
    del ref

    comm = GroupComm(ctx.target_group)
    model = load_expert_shard(a.model, comm, dtype="float32")
    experts = moe.experts_modules(model)
    lo = 2 * comm.rank
    assert experts and all(m.expert_range == (lo, lo + 2) and m.gate_up_proj.shape[0] == 2 for _, m in experts)
    for i in range(a.forwards):
        got = taps(model, ids, doc_ids, hidden)
        err = (got - expected).abs().max().item()
        assert err < 1e-5, f"forward {i}: max |diff| {err}"
    with comm.same_inputs():
        gen = greedy_continuation(model, prompt, max_new_tokens=12, eos_token_id=-1)
    assert torch.equal(gen, expected_gen), (gen.tolist(), expected_gen.tolist())
    both = [torch.empty_like(gen) for _ in range(comm.size)]
    dist.all_gather(both, gen, group=ctx.target_group)
    assert torch.equal(both[0], both[1])
    print(f"rank {ctx.rank}: {a.forwards} expert-parallel forwards and the greedy continuation equal the unsplit "
          "model", flush=True)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--forwards", type=int, default=2)
    args = p.parse_args()
    common.targets_work(args, run_target)


if __name__ == "__main__":
    main()
