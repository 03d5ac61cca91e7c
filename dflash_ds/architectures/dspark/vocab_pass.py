"""DSpark's pass over a chunk's vocabulary as one Triton kernel (CUDA): the CE, the argmax hit,
||q - p||_1 and the gradient of `ce * CE + l1 * ||q - p||_1` w.r.t. the drafter's logits.

The compiled generic pass (objective/loss_terms.chunk_math with `l1_to_target`) sweeps each row of
248,320 logits four times: the maxima, the two softmax sums, the L1 sums, the gradient. Here each
program owns one row and sweeps it three times: (1) both softmax normalisers at once, online (a
running maximum and a rescaled sum per lane, one exp per value) with the drafter's argmax; (2) ||q - p||_1 and
<sign(q - p), q>; (3) the gradient `s_ce (q - onehot) + s_l1 q (sign(q - p) - <sign(q - p), q>)`,
written over the logits it was computed from (the loss needs them no more). Each sweep reads the
drafter's logits and the target's (by row index: distinct positions are multiplied once), so a
chunk moves 3 x 2 reads and one write of `[c, V]` where the compiled pass moves 4 x 2 reads and a
write to a new tensor.

`l1_pass` has chunk_math's signature and results (RowTerm.kernel); the loss calls it on CUDA
for the cross-entropy and this term alone, without a logit transform (DSpark refuses it). tests/test_gpu.py holds it to
chunk_math.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

import torch

_BLOCK = 8192  # logits a sweep step reads per row and input: 16 per thread at 16 warps (two 16-byte loads)
_WARPS = 16


def l1_pass(logits, target, labels, weights, *, scales, how):
    """chunk_math for the terms (CrossEntropy, DSpark's L1 RowTerm), identity transform, on CUDA:
    ((sum(w * CE), sum(w * ||q - p||_1)), argmax hit, (None, ||q - p||_1 per row), the logits'
    gradient (written over `logits`) or None without `scales`)."""
    from dflash_ds.architectures.dspark.kernel import ce_l1_rows

    if target is None or len(how.terms) != 2:
        raise ValueError("l1_pass needs the target's logits and the cross-entropy and L1 terms alone")
    c, vocab = logits.shape
    table = target.logits
    rows = target.rows if target.rows is not None else torch.arange(c, device=logits.device)
    if logits.stride(1) != 1 or table.stride(1) != 1:
        raise ValueError("l1_pass reads rows of contiguous logits")
    stats = torch.empty(c, 2, device=logits.device, dtype=torch.float32)
    argmax = torch.empty(c, device=logits.device, dtype=torch.int32)
    grad = scales is not None
    s_ce = scales[0].float().contiguous() if grad else stats
    s_l1 = scales[1].float().contiguous() if grad else stats
    ce_l1_rows[(c,)](logits, logits.stride(0), table, table.stride(0), rows.contiguous(), labels.contiguous(), s_ce,
                     s_l1, stats, argmax, vocab, GRAD=grad, BLOCK=_BLOCK, num_warps=_WARPS)
    ce, l1 = stats.unbind(1)
    w = weights
    hit = (argmax.long() == labels) & (w > 0)
    ce, l1 = ce.to(w.dtype), l1.to(w.dtype)
    return ((ce * w).sum(), (l1 * w).sum()), hit, (None, l1), logits if grad else None
