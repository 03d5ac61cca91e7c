"""The Triton kernel of DSpark's pass over a chunk's vocabulary (architectures/dspark/vocab_pass.py says what it
computes and why it is shaped so). Imported only on CUDA, where Triton is.

Model code: no torch.distributed, no deepspeed.
"""

import triton
import triton.language as tl


# Base 2 throughout: x * log2(e) once per value, then exp2 (one FMA and one MUFU op per exp).
# The kernel is bound by arithmetic about as much as by memory (~70 operations per pair of
# values over the three sweeps), so the full blocks run unmasked and only the tail is masked.


@triton.jit
def load(row, at, ok, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(row + at, mask=ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    return tl.load(row + at).to(tl.float32) * 1.4426950408889634


@triton.jit
def normalisers(z_row, t_row, at, ok, acc, MASKED: tl.constexpr):
    # A new maximum on a lane rescales its sum, otherwise the value adds to it: one exp2 per
    # value, 2^-|x - m|. The running maximum is the argmax's value; its first occurrence is
    # kept (columns rise along a lane), as torch.argmax. Masked columns leave a lane as it was.
    m_z, s_z, m_t, s_t, best_at = acc
    z = load(z_row, at, ok, MASKED)
    t = load(t_row, at, ok, MASKED)
    up_z = z > m_z
    e_z = tl.exp2(-tl.abs(z - m_z))
    e_t = tl.exp2(-tl.abs(t - m_t))
    new_s_z = tl.where(up_z, s_z * e_z + 1.0, s_z + e_z)
    new_s_t = tl.where(t > m_t, s_t * e_t + 1.0, s_t + e_t)
    if MASKED:
        new_s_z = tl.where(ok, new_s_z, s_z)
        new_s_t = tl.where(ok, new_s_t, s_t)
    return tl.maximum(m_z, z), new_s_z, tl.maximum(m_t, t), new_s_t, tl.where(up_z, at, best_at)


@triton.jit
def gaps(z_row, t_row, at, ok, lse_z, lse_t, MASKED: tl.constexpr):
    # q - p and q of the columns (0 and 0 where masked: 2^-inf).
    q = tl.exp2(load(z_row, at, ok, MASKED) - lse_z)
    return q - tl.exp2(load(t_row, at, ok, MASKED) - lse_t), q


@triton.jit
def gradient(z_row, t_row, at, ok, lse, coef, label, MASKED: tl.constexpr):
    # s_ce (q - onehot) + s_l1 q (sign(q - p) - <sign, q>) = q (base + s_l1 sign) - s_ce onehot,
    # written over the drafter's logits.
    lse_z, lse_t = lse
    a, c, base = coef
    gap, q = gaps(z_row, t_row, at, ok, lse_z, lse_t, MASKED)
    g = q * tl.where(gap > 0, base + c, tl.where(gap < 0, base - c, base)) - tl.where(at == label, a, 0.0)
    if MASKED:
        tl.store(z_row + at, g.to(z_row.dtype.element_ty), mask=ok)
    else:
        tl.store(z_row + at, g.to(z_row.dtype.element_ty))


@triton.jit
def ce_l1_rows(z_ptr, z_stride, t_ptr, t_stride, t_rows_ptr, labels_ptr, s_ce_ptr, s_l1_ptr, stats_ptr, argmax_ptr,
               vocab, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    t_row = t_ptr + tl.load(t_rows_ptr + row).to(tl.int64) * t_stride
    lanes = tl.arange(0, BLOCK)
    full = (vocab // BLOCK) * BLOCK
    neg = float("-inf")
    acc = (tl.full([BLOCK], neg, tl.float32), tl.zeros([BLOCK], tl.float32), tl.full([BLOCK], neg, tl.float32),
           tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.int32))
    for start in range(0, full, BLOCK):
        acc = normalisers(z_row, t_row, start + lanes, None, acc, False)
    if full < vocab:
        acc = normalisers(z_row, t_row, full + lanes, full + lanes < vocab, acc, True)
    m_z, s_z, m_t, s_t, best_at = acc
    top_z = tl.max(m_z, 0)
    top_t = tl.max(m_t, 0)
    # Lanes that saw only masked columns hold -inf and a zero sum: they add 0.
    lse_z = top_z + tl.log2(tl.sum(tl.where(m_z == neg, 0.0, s_z * tl.exp2(m_z - top_z)), 0))
    lse_t = top_t + tl.log2(tl.sum(tl.where(m_t == neg, 0.0, s_t * tl.exp2(m_t - top_t)), 0))
    argmax = tl.min(tl.where(m_z == top_z, best_at, vocab), 0)
    label = tl.load(labels_ptr + row)
    z_label = tl.load(z_row + label).to(tl.float32)
    l1 = tl.zeros([BLOCK], tl.float32)
    sq = tl.zeros([BLOCK], tl.float32)
    for start in range(0, full, BLOCK):
        gap, q = gaps(z_row, t_row, start + lanes, None, lse_z, lse_t, False)
        l1 += tl.abs(gap)
        sq += tl.where(gap > 0, q, tl.where(gap < 0, -q, 0.0))
    if full < vocab:
        gap, q = gaps(z_row, t_row, full + lanes, full + lanes < vocab, lse_z, lse_t, True)
        l1 += tl.abs(gap)
        sq += tl.where(gap > 0, q, tl.where(gap < 0, -q, 0.0))
    s_dot_q = tl.sum(sq, 0)
    tl.store(stats_ptr + row * 2, lse_z * 0.6931471805599453 - z_label)
    tl.store(stats_ptr + row * 2 + 1, tl.sum(l1, 0))
    tl.store(argmax_ptr + row, argmax)
    if GRAD:
        a = tl.load(s_ce_ptr + row)
        c = tl.load(s_l1_ptr + row)
        coef = (a, c, a - c * s_dot_q)
        for start in range(0, full, BLOCK):
            gradient(z_row, t_row, start + lanes, None, (lse_z, lse_t), coef, label, False)
        if full < vocab:
            gradient(z_row, t_row, full + lanes, full + lanes < vocab, (lse_z, lse_t), coef, label, True)
