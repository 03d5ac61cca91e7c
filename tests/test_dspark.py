"""DSpark's building blocks (model/dspark.py): the exported tensor names, the Markov bias and the
confidence head against float64 element-by-element references, the greedy walk against a
re-implementation of llama.cpp's in-graph chain (`build_dspark_markov_head`, src/models/dflash.cpp)
and its serving loop (common/speculative.cpp), the sampled walk's law, the anchor-first labels and
weights hand-worked, the loss terms and their closed-form gradients against float64 references
(autograd and gradcheck), and the probabilistic tau and calibration statistics hand-worked."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.model.variants.dspark_parts import (ConfidenceHead, DSparkChunk, DSparkRows, DSparkTerms, MarkovHead, Sampling,
                                    anchor_first_targets, calibration, chunk_grads, confident_prefix, dspark_loss,
                                    dspark_terms, expected_calibration_error, expected_tau, greedy_walk,
                                    sampled_walk, shift_in, survival)
from dflash_ds.model.logit_transform import LogitTransform

V, R, D = 13, 3, 5


def heads(seed=0, scale=1.0):
    """Both heads in float64, with weights large enough that the Markov bias changes the argmax."""
    torch.manual_seed(seed)
    markov, conf = MarkovHead(V, R).double(), ConfidenceHead(D, R).double()
    with torch.no_grad():
        for p in (markov.markov_w1.weight, markov.markov_w2.weight, conf.proj.weight, conf.proj.bias):
            p.normal_(0.0, scale)
    return markov, conf


def test_exported_tensor_names_and_shapes():
    """The names and shapes llama.cpp's converter (conversion/qwen.py DSparkModel, gguf-py
    tensor_mapping: model.markov_head.markov_w1 / markov_w2, model.confidence_head.proj), vLLM
    (qwen3_dspark.py) and SGLang (models/dspark.py) load."""
    torch.manual_seed(0)
    drafter = nn.Module()
    drafter.markov_head = MarkovHead(V, R)
    drafter.confidence_head = ConfidenceHead(D, R)
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert shapes == {"markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (V, R),
                      "confidence_head.proj.weight": (1, D + R), "confidence_head.proj.bias": (1,)}
    assert tuple(ConfidenceHead(D).proj.weight.shape) == (1, D)
    assert float(drafter.confidence_head.proj.bias.detach()) == 0.0
    for p in (drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight):
        assert 0.01 < float(p.detach().std()) < 0.04  # DeepSpec's initializer_range 0.02


def reference_bias(w1, w2, prev):
    """bias[v] = sum_j w2[v, j] * w1[prev, j], one element at a time."""
    w1, w2 = w1.detach(), w2.detach()
    return torch.tensor([sum(float(w2[v, j]) * float(w1[prev, j]) for j in range(w1.shape[1]))
                         for v in range(w2.shape[0])], dtype=torch.float64)


def test_teacher_forced_logits_add_the_bias_of_the_gold_predecessor():
    markov, _ = heads()
    w1, w2 = markov.markov_w1.weight, markov.markov_w2.weight
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 4, V, generator=g, dtype=torch.float64)
    anchors = torch.tensor([3, 7])
    labels = torch.randint(0, V, (2, 4), generator=g)
    prev = shift_in(anchors, labels)
    assert prev.tolist() == [[3] + labels[0, :3].tolist(), [7] + labels[1, :3].tolist()]
    out = markov(base, prev)
    for n in range(2):
        for k in range(4):
            torch.testing.assert_close(out[n, k], base[n, k] + reference_bias(w1, w2, int(prev[n, k])))


# ------------------------------------------------------------------------- llama.cpp's chain

def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def llama_cpp_dspark(tokens, base, t_embd, weights, layout):
    """build_dspark_markov_head (src/models/dflash.cpp) on one ubatch, loop by loop, in float64.

    tokens [n_tok] and base [n_tok, V] are block-major: block b's token i is row b * block_drafts + i.
    prev starts as token 0 of every block; for i from i_draft_beg (0 if sample_from_anchor, else 1,
    slot 0 then passing through unbiased), col = base_i + w2 @ w1[prev], conf = sigmoid(conf_w .
    [t_embd_i ; w1[prev]] + b), and prev = argmax(col) while i + 1 < block_drafts. A ubatch with more
    tokens per block than the trained block size gets no bias at all. Returns (logits, conf)."""
    w1, w2, conf_w, conf_b = (t.detach() for t in weights)
    n_blocks, block_size, sample_from_anchor = layout
    n_tok = base.shape[0]
    block_drafts = n_tok // n_blocks
    if block_drafts > block_size:
        return base.clone(), None
    out, conf = base.clone(), torch.zeros(n_tok, dtype=torch.float64)
    prev = [int(tokens[b * block_drafts]) for b in range(n_blocks)]
    for i in range(0 if sample_from_anchor else 1, block_drafts):
        for b in range(n_blocks):
            row = b * block_drafts + i
            col = base[row] + reference_bias(w1, w2, prev[b])
            out[row] = col
            feat = [float(x) for x in t_embd[row]] + [float(x) for x in w1[prev[b]]]
            conf[row] = sigmoid(sum(float(conf_w[j]) * feat[j] for j in range(len(feat))) + float(conf_b))
            if i + 1 < block_drafts:
                prev[b] = max(range(col.shape[0]), key=lambda v: float(col[v]))
    return out, conf


def llama_cpp_drafts(logits, conf, n_blocks, begin, p_min):
    """common/speculative.cpp, draft() for DSpark: per block, read slots from i_draft_beg on, stop
    at the first whose confidence is below p_min (when p_min > 0), take the top candidate."""
    per = logits.shape[0] // n_blocks
    drafts = []
    for b in range(n_blocks):
        block = []
        for i in range(begin, per):
            if p_min > 0 and conf[b * per + i] < p_min:
                break
            block.append(int(logits[b * per + i].argmax()))
        drafts.append(block)
    return drafts


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_greedy_walk_equals_llama_cpp_chain(sample_from_anchor):
    markov, conf_head = heads(seed=2, scale=1.5)
    g = torch.Generator().manual_seed(3)
    n_blocks, per = 3, 5
    tokens = torch.randint(0, V, (n_blocks * per,), generator=g)
    base = torch.randn(n_blocks * per, V, generator=g, dtype=torch.float64)
    t_embd = torch.randn(n_blocks * per, D, generator=g, dtype=torch.float64)
    weights = (markov.markov_w1.weight, markov.markov_w2.weight, conf_head.proj.weight[0], conf_head.proj.bias[0])
    ref_logits, ref_conf = llama_cpp_dspark(tokens, base, t_embd, weights, (n_blocks, per, sample_from_anchor))
    begin = 0 if sample_from_anchor else 1

    first = tokens.view(n_blocks, per)[:, 0]
    drafting = base.view(n_blocks, per, V)[:, begin:]
    walk = greedy_walk(markov, drafting, first)
    torch.testing.assert_close(walk.logits, ref_logits.view(n_blocks, per, V)[:, begin:])
    with torch.no_grad():
        c = conf_head(t_embd.view(n_blocks, per, D)[:, begin:], markov.embed(walk.predecessors))
    torch.testing.assert_close(torch.sigmoid(c), ref_conf.view(n_blocks, per)[:, begin:])
    for p_min in (0.0, 0.5):
        served = llama_cpp_drafts(ref_logits, ref_conf, n_blocks, begin, p_min)
        lengths = confident_prefix(c, p_min)
        assert [walk.tokens[b, :int(lengths[b])].tolist() for b in range(n_blocks)] == served
    assert any(len(d) < per - begin for d in llama_cpp_drafts(ref_logits, ref_conf, n_blocks, begin, 0.5))
    # The chain matters on this data: conditioning every slot on the anchor gives other tokens.
    anchor_only = markov(drafting, first.unsqueeze(1).expand(-1, per - begin)).argmax(-1)
    assert not torch.equal(anchor_only, walk.tokens)
    # A ubatch longer than the trained block gets no bias in llama.cpp (the walk is not used there).
    unbiased, none = llama_cpp_dspark(tokens, base, t_embd, weights, (n_blocks, per - 1, sample_from_anchor))
    assert none is None and torch.equal(unbiased, base)


def test_the_proposal_is_llama_cpps_draft_under_its_confidence_cut():
    """`DrafterVariant.propose` (what the engine count reads): DSpark's tokens, each block's served
    count under --spec-draft-p-min and the confidences equal llama.cpp's chain and loop on the
    drafter's states (base = h @ lm_head.T, the confidence on h itself); DFlash models no cut."""
    from types import SimpleNamespace

    from dflash_ds.model.variants import VARIANTS

    markov, conf_head = heads(seed=6, scale=1.5)
    g = torch.Generator().manual_seed(7)
    n_blocks, per = 4, 5
    hidden = torch.randn(n_blocks, per, D, generator=g, dtype=torch.float64)
    lm_head = torch.randn(V, D, generator=g, dtype=torch.float64)
    anchors = torch.randint(0, V, (n_blocks,), generator=g)
    model = SimpleNamespace(drafter=SimpleNamespace(markov_head=markov, confidence_head=conf_head), lm_head=lm_head)
    tokens = torch.cat([anchors[:, None], torch.zeros(n_blocks, per - 1, dtype=torch.long)], 1).flatten()
    flat = hidden.reshape(-1, D)
    weights = (markov.markov_w1.weight, markov.markov_w2.weight, conf_head.proj.weight[0], conf_head.proj.bias[0])
    logits, conf = llama_cpp_dspark(tokens, flat @ lm_head.T, flat, weights, (n_blocks, per, True))
    dspark = VARIANTS["dspark"]
    for p_min in (0.0, 0.5):
        got = dspark.propose(model, hidden, anchors, p_min)
        served = llama_cpp_drafts(logits, conf, n_blocks, 0, p_min)
        assert [got.tokens[b, :int(got.served[b])].tolist() for b in range(n_blocks)] == served
        torch.testing.assert_close(got.confidence, conf.view(n_blocks, per))
    assert any(len(d) < per for d in served)  # the cut at 0.5 shortens some drafts: the check can fail
    bare = SimpleNamespace(drafter=SimpleNamespace(markov_head=markov), lm_head=lm_head)
    assert dspark.propose(bare, hidden, anchors).served.tolist() == [per] * n_blocks
    with pytest.raises(ValueError, match="no confidence head"):
        dspark.propose(bare, hidden, anchors, 0.5)
    plain = VARIANTS["dflash"].propose(model, hidden, anchors)
    assert plain.served.tolist() == [per] * n_blocks and plain.confidence is None
    with pytest.raises(ValueError, match="--spec-draft-p-min"):
        VARIANTS["dflash"].propose(model, hidden, anchors, 0.5)


def test_teacher_forcing_on_the_walks_own_tokens_reproduces_the_walk():
    markov, _ = heads(seed=4, scale=1.5)
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4, 6, V, generator=g, dtype=torch.float64)
    first = torch.randint(0, V, (4,), generator=g)
    walk = greedy_walk(markov, base, first)
    assert torch.equal(walk.predecessors, shift_in(first, walk.tokens))
    torch.testing.assert_close(markov(base, shift_in(first, walk.tokens)), walk.logits, rtol=0, atol=0)
    assert torch.equal(walk.tokens, walk.logits.argmax(-1))


def test_sampled_walk_is_a_gumbel_max_draw_with_the_markov_law():
    g = torch.Generator().manual_seed(7)
    temperature, slots, v = 0.7, 2, 4
    head = MarkovHead(v, R).double()
    with torch.no_grad():
        head.markov_w1.weight.normal_(0.0, 1.2, generator=g)
        head.markov_w2.weight.normal_(0.0, 1.2, generator=g)
    base = torch.randn(1, slots, v, generator=g, dtype=torch.float64)
    n = 40000
    noise = torch.empty(n, slots, v, dtype=torch.float64).exponential_(1.0, generator=g)
    walk = sampled_walk(head, base.expand(n, -1, -1), torch.full((n,), 1), Sampling(temperature, noise))
    # Every draw is the Gumbel-max of the logits over T with Gumbel noise -log(noise).
    gumbel = (walk.logits / temperature - noise.log()).argmax(-1)
    assert torch.equal(walk.tokens, gumbel)
    # The joint law of the two slots is softmax(l0 / T)[t0] * softmax((base1 + bias(t0)) / T)[t1].
    w1, w2 = head.markov_w1.weight.detach(), head.markov_w2.weight.detach()
    p0 = torch.softmax((base[0, 0] + w2 @ w1[1]) / temperature, -1)
    joint = torch.stack([p0[a] * torch.softmax((base[0, 1] + w2 @ w1[a]) / temperature, -1) for a in range(v)])
    counts = torch.bincount(walk.tokens[:, 0] * v + walk.tokens[:, 1], minlength=v * v).double() / n
    assert 0.5 * (counts - joint.reshape(-1)).abs().sum() < 0.02
    with pytest.raises(ValueError, match="temperature"):
        sampled_walk(head, base, torch.ones(1, dtype=torch.long), Sampling(0.0, noise[:1]))


# ------------------------------------------------------------------------- labels and weights

def test_anchor_first_targets_hand_worked():
    s, block, gamma = 10, 3, 2.0
    ids = 100 + torch.arange(s)[None]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1]])
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 1, 1]], dtype=torch.int32)
    anchors = torch.tensor([[2, 4, 7, 8, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    labels, weights = anchor_first_targets(ids, loss_mask, doc_ids, anchors, valid, block, gamma)
    e1, e2 = math.exp(-0.5), math.exp(-1.0)
    assert labels.tolist() == [[[103, 104, 105], [105, 0, 0], [0, 0, 0], [109, 0, 0], [0, 0, 0]]]
    # anchor 2: all three supervised; 4: the unsupervised token at 6 ends the block's supervision;
    # 7: the label at 8 is in the next document; 8: the row ends after 9; the last block is padding.
    expected = torch.tensor([[[1.0, e1, e2], [1, 0, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]])
    torch.testing.assert_close(weights, expected)
    # A loss-mask hole inside a block stops it even when the later slots are supervised.
    hole = torch.tensor([[0, 0, 1, 0, 1, 1, 1, 1, 1, 1]])
    _, w = anchor_first_targets(ids, hole, torch.zeros_like(doc_ids), torch.tensor([[2]]), torch.tensor([[True]]),
                                block, gamma)
    assert w.tolist() == [[[0.0, 0.0, 0.0]]]


# ------------------------------------------------------------------------- the loss

def reference_sums(logits, target_logits, labels, weights, confidence):
    """sum(w CE), sum(w ||q - p||_1), sum(w BCE(c, 1 - TV)), row by row in float64."""
    ce = l1 = bce = 0.0
    for i in range(logits.shape[0]):
        w = float(weights[i])
        if w == 0:
            continue
        x = [float(a) for a in logits[i]]
        m = max(x)
        z = sum(math.exp(a - m) for a in x)
        q = [math.exp(a - m) / z for a in x]
        y = [float(a) for a in target_logits[i]]
        my = max(y)
        zy = sum(math.exp(a - my) for a in y)
        p = [math.exp(a - my) / zy for a in y]
        dist = sum(abs(a - b) for a, b in zip(q, p))
        accept = min(1.0, max(0.0, 1.0 - dist / 2))
        s = sigmoid(float(confidence[i]))
        ce += w * -math.log(q[int(labels[i])])
        l1 += w * dist
        bce += w * -(accept * math.log(s) + (1 - accept) * math.log(1 - s))
    return ce, l1, bce


def loss_case(seed=8, n=7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    target = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (n,), generator=g)
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    weights[2] = 0.0
    labels[2] = V + 5  # an out-of-vocabulary label on a zero-weight row must not matter
    conf = torch.randn(n, generator=g, dtype=torch.float64)
    return logits, target, labels, weights, conf


def test_loss_terms_match_a_float64_reference():
    logits, target, labels, weights, conf = loss_case()
    sums = dspark_terms(DSparkRows(logits, target, labels, weights, conf))
    ce, l1, bce = reference_sums(logits, target, labels, weights, conf)
    torch.testing.assert_close(sums.ce, torch.tensor(ce, dtype=torch.float64))
    torch.testing.assert_close(sums.l1, torch.tensor(l1, dtype=torch.float64))
    torch.testing.assert_close(sums.confidence, torch.tensor(bce, dtype=torch.float64))
    q, p = torch.softmax(logits, -1), torch.softmax(target, -1)
    torch.testing.assert_close(sums.accept, 1 - 0.5 * (q - p).abs().sum(-1))
    assert sums.correct.tolist() == ((logits.argmax(-1) == labels) & (weights > 0)).tolist()
    terms = DSparkTerms(0.1, 0.9, 1.0)
    torch.testing.assert_close(dspark_loss(sums, terms, 3.0), torch.tensor((0.1 * ce + 0.9 * l1 + bce) / 3.0,
                                                                           dtype=torch.float64))


def test_loss_terms_gradcheck_through_both_heads():
    """gradcheck (float64) of CE + L1 through the teacher-forced Markov bias (markov_w1 via take_rows,
    markov_w2) and of the confidence term in the confidence logits. The BCE target 1 - TV is a
    constant of the loss (detached): a finite difference of the logits would move it, so the
    confidence term is checked with the logits held fixed."""
    markov, _ = heads(seed=9)
    logits, target, labels, weights, conf = loss_case(seed=10, n=4)
    prev = torch.tensor([1, 4, 4, 9])

    def drafter_terms(base, w1, w2):
        x = torch.func.functional_call(markov, {"markov_w1.weight": w1, "markov_w2.weight": w2}, (base, prev))
        return dspark_loss(dspark_terms(DSparkRows(x, target, labels, weights, conf)), DSparkTerms(0.3, 0.7, 0.0), 2.0)

    def confidence_term(c):
        return dspark_terms(DSparkRows(logits, target, labels, weights, c)).confidence

    inputs = (logits.clone().requires_grad_(), markov.markov_w1.weight.detach().clone().requires_grad_(),
              markov.markov_w2.weight.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(drafter_terms, inputs)
    assert torch.autograd.gradcheck(confidence_term, (conf.clone().requires_grad_(),))


def dense_reference_loss(hidden, lm_head, e, w2, c, case):
    """The whole loss in float64 autograd, written from the definition: logits = t(h W^T) + e W2^T."""
    target, labels, weights, terms, normaliser = case
    z = hidden @ lm_head.T
    if terms.transform.multiplier != 1.0:
        z = z * terms.transform.multiplier
    if terms.transform.softcap:
        z = terms.transform.softcap * torch.tanh(z / terms.transform.softcap)
    x = z + e @ w2.T
    logq = torch.log_softmax(x, -1)
    keep = weights > 0
    safe = torch.where(keep, labels, 0)
    ce = -logq.gather(1, safe[:, None])[:, 0]
    l1 = (logq.exp() - torch.softmax(target, -1)).abs().sum(-1)
    accept = (1 - l1.detach() / 2).clamp(0, 1)
    bce = -(accept * F.logsigmoid(c) + (1 - accept) * F.logsigmoid(-c))
    total = (weights * (terms.ce * ce + terms.l1 * l1 + terms.confidence * bce)).sum()
    return total / normaliser


def test_autograd_terms_treat_the_confidence_target_as_a_constant():
    """dspark_terms' gradients (the checkpointed path) equal the dense float64 reference, in which
    the BCE target 1 - TV is detached, for the logits and the confidence logits."""
    logits, target, labels, weights, conf = loss_case(seed=12)
    terms = DSparkTerms(0.2, 0.8, 1.0)
    x, c = logits.clone().requires_grad_(), conf.clone().requires_grad_()
    dspark_loss(dspark_terms(DSparkRows(x, target, labels, weights, c)), terms, 2.5).backward()
    xr, cr = logits.clone().requires_grad_(), conf.clone().requires_grad_()
    nothing = torch.zeros(logits.shape[0], 1, dtype=torch.float64)
    dense_reference_loss(xr, torch.eye(V, dtype=torch.float64), nothing, torch.zeros(V, 1, dtype=torch.float64), cr,
                         (target, labels, weights, terms, 2.5)).backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(c.grad, cr.grad)


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(0.8, 3.0)])
def test_chunk_grads_summed_over_chunks_equal_dense_autograd(transform):
    g = torch.Generator().manual_seed(11)
    n = 10
    hidden = torch.randn(n, D, generator=g, dtype=torch.float64)
    lm_head = torch.randn(V, D, generator=g, dtype=torch.float64)
    e = torch.randn(n, R, generator=g, dtype=torch.float64)
    w2 = torch.randn(V, R, generator=g, dtype=torch.float64)
    c = torch.randn(n, generator=g, dtype=torch.float64)
    target = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (n,), generator=g)
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    weights[[1, 6]] = 0.0
    labels[1], labels[6] = -3, V + 2
    terms = DSparkTerms(0.2, 0.8, 0.6, transform)
    normaliser = 4.5
    leaves = [t.clone().requires_grad_() for t in (hidden, e, w2, c)]
    ref = dense_reference_loss(leaves[0], lm_head, leaves[1], leaves[2], leaves[3],
                               (target, labels, weights, terms, normaliser))
    ref.backward()

    total, g_h, g_e, g_c, g_w2 = 0.0, [], [], [], torch.zeros_like(w2)
    for lo in range(0, n, 3):
        part = slice(lo, lo + 3)
        chunk = DSparkChunk(hidden[part], e[part], target[part], labels[part], weights[part], c[part])
        sums, grads = chunk_grads(chunk, lm_head, w2, terms, normaliser)
        total = total + dspark_loss(sums, terms, normaliser)
        g_h.append(grads.hidden)
        g_e.append(grads.embedding)
        g_c.append(grads.confidence)
        g_w2 += grads.markov_w2
    torch.testing.assert_close(total, ref.detach())
    torch.testing.assert_close(torch.cat(g_h), leaves[0].grad)
    torch.testing.assert_close(torch.cat(g_e), leaves[1].grad)
    torch.testing.assert_close(g_w2, leaves[2].grad)
    torch.testing.assert_close(torch.cat(g_c), leaves[3].grad)


# ------------------------------------------------------------------------- tau and calibration

def test_expected_tau_hand_worked():
    accept = torch.tensor([[0.5, 0.5, 1.0], [0.9, 0.9, 0.9]])
    weights = torch.tensor([[1.0, 0.4, 0.0], [0.0, 0.0, 0.0]])
    total, count = expected_tau(accept, weights)
    assert float(count) == 1.0
    assert float(total) == pytest.approx(1 + 0.5 + 0.25)


def test_survival_and_confident_prefix_hand_worked():
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    c = torch.tensor([[logit(0.9), logit(0.4), logit(0.9)], [logit(0.9), logit(0.8), logit(0.7)]])
    torch.testing.assert_close(survival(c), torch.tensor([[0.9, 0.36, 0.324], [0.9, 0.72, 0.504]]))
    assert confident_prefix(c, 0.5).tolist() == [1, 3]
    assert confident_prefix(c, 0.75).tolist() == [1, 2]
    assert confident_prefix(c, 0.0).tolist() == [3, 3]


def test_calibration_hand_worked():
    pred = torch.tensor([[0.1, 0.7], [0.2, 0.9]])
    target = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    weights = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    stats = calibration(pred, target, weights, bins=2)
    assert float(stats.weight) == 4.0
    assert float(stats.abs_error) == pytest.approx(0.1 + 2 * 0.3 + 0.1)
    assert float(stats.bias) == pytest.approx(0.1 - 0.6 - 0.1)
    assert stats.bin_weight.tolist() == [[1.0, 0.0], [0.0, 3.0]]
    torch.testing.assert_close(stats.bin_pred, torch.tensor([[0.1, 0.0], [0.0, 2.3]], dtype=torch.float64))
    torch.testing.assert_close(stats.bin_target, torch.tensor([[0.0, 0.0], [0.0, 3.0]], dtype=torch.float64))
    torch.testing.assert_close(expected_calibration_error(stats), torch.tensor([0.1, 0.7 / 3], dtype=torch.float64))
