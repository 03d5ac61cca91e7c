"""DSpark's building blocks (architectures/dspark/): the heads' initialisation, the Markov bias and the
confidence head against float64 element-by-element references, the greedy walk against a
re-implementation of llama.cpp's in-graph chain (`build_dspark_markov_head`, src/models/dflash.cpp)
and its serving loop (common/speculative.cpp), the anchor-first labels and
weights hand-worked, the L1 term and its closed-form gradient against float64 references, and the
probabilistic tau and calibration statistics hand-worked (the whole loss: tests/test_dspark_loss.py)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_ds.objective.blocks import anchor_first_targets
from dflash_ds.architectures.dspark.parts import (ConfidenceHead, MarkovHead, calibration,
                                                   confident_prefix, expected_tau, greedy_walk, l1_to_target,
                                                   shift_in)

V, R, D = 13, 3, 5


def heads(seed=0, scale=1.0):
    """Both heads in float64, with weights large enough that the Markov bias changes the argmax."""
    torch.manual_seed(seed)
    markov, conf = MarkovHead(V, R).double(), ConfidenceHead(D, R).double()
    with torch.no_grad():
        for p in (markov.markov_w1.weight, markov.markov_w2.weight, conf.proj.weight, conf.proj.bias):
            p.normal_(0.0, scale)
    return markov, conf


def test_the_heads_initialise_as_deepspecs():
    """The Markov tables at DeepSpec's initializer_range, the confidence bias at zero. (Their names and
    shapes against what llama.cpp, vLLM and SGLang load: tests/test_export_dspark.py; state dict =
    inventory: the conformance suite.)"""
    torch.manual_seed(0)
    markov, confidence = MarkovHead(V, R), ConfidenceHead(D, R)
    assert float(confidence.proj.bias.detach()) == 0.0
    for p in (markov.markov_w1.weight, markov.markov_w2.weight):
        assert 0.01 < float(p.detach().std()) < 0.04  # DeepSpec's initializer_range 0.02


def test_the_padded_confidence_bias_loads_saves_and_trains_as_a_linear():
    """`Projection` is nn.Linear(width, 1) to everything outside: the same state dict (names, shapes,
    values; strict errors for a wrong shape or an unknown key), loaded in place or assigned onto a meta
    module (load_drafter's path), the same output and gradients; the padding's gradient is zero."""
    torch.manual_seed(0)
    head = ConfidenceHead(D, R).double()
    linear = nn.Linear(D + R, 1).double()
    with torch.no_grad():
        linear.weight.normal_()
        linear.bias.fill_(0.3)
    state = {"proj." + k: v for k, v in linear.state_dict().items()}
    head.load_state_dict(state)
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == {"proj.weight": (1, D + R), "proj.bias": (1,)}
    assert all(torch.equal(head.state_dict()[k], v) for k, v in state.items())
    with torch.device("meta"):
        assigned = ConfidenceHead(D, R)
    assigned.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)
    assert assigned.proj.bias_slots.device.type == "cpu" and assigned.proj.bias_slots.dtype == torch.float32
    slots = assigned.proj.bias_slots.detach()
    assert float(slots[0]) == pytest.approx(0.3) and not slots[1:].any()
    with pytest.raises(RuntimeError, match="size mismatch for proj.bias"):
        head.load_state_dict({"proj.weight": state["proj.weight"], "proj.bias": torch.zeros(2)})
    with pytest.raises(RuntimeError, match="proj.extra"):
        head.load_state_dict({**state, "proj.extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="proj.bias"):
        head.load_state_dict({"proj.weight": state["proj.weight"]})
    h = torch.randn(4, D, dtype=torch.float64)
    e = torch.randn(4, R, dtype=torch.float64)
    got = head(h, e)
    want = linear(torch.cat([h, e], -1)).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (got * torch.arange(4.0, dtype=torch.float64)).sum().backward()
    (want * torch.arange(4.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(head.proj.weight.grad, linear.weight.grad, rtol=0, atol=1e-12)
    assert float(head.proj.bias_slots.grad[0]) == pytest.approx(float(linear.bias.grad[0]))
    assert not head.proj.bias_slots.grad[1:].any()


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
    """`Walk.propose` (what the engine count reads): DSpark's tokens, each block's served
    count under --spec-draft-p-min and the confidences equal llama.cpp's chain and loop on the
    drafter's states (base = h @ lm_head.T, the confidence on h itself); DFlash models no cut."""
    from types import SimpleNamespace

    from dflash_ds.architectures import VARIANTS

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
    dspark = VARIANTS["dspark"].walk
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
    model.config = SimpleNamespace(spec=VARIANTS["dflash"].spec)  # the error names its architecture
    plain = VARIANTS["dflash"].walk.propose(model, hidden, anchors)
    assert plain.served.tolist() == [per] * n_blocks and plain.confidence is None
    with pytest.raises(ValueError, match="--spec-draft-p-min"):
        VARIANTS["dflash"].walk.propose(model, hidden, anchors, 0.5)


def test_teacher_forcing_on_the_walks_own_tokens_reproduces_the_walk():
    markov, _ = heads(seed=4, scale=1.5)
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4, 6, V, generator=g, dtype=torch.float64)
    first = torch.randint(0, V, (4,), generator=g)
    walk = greedy_walk(markov, base, first)
    assert torch.equal(walk.predecessors, shift_in(first, walk.tokens))
    torch.testing.assert_close(markov(base, shift_in(first, walk.tokens)), walk.logits, rtol=0, atol=0)
    assert torch.equal(walk.tokens, walk.logits.argmax(-1))


# ------------------------------------------------------------------------- labels and weights

def test_anchor_first_targets_hand_worked():
    s, block, gamma = 10, 3, 2.0
    ids = 100 + torch.arange(s)[None]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1]])
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 1, 1]], dtype=torch.int32)
    anchors = torch.tensor([[2, 4, 7, 8, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    labels, weights = anchor_first_targets(ids, loss_mask, doc_ids, anchors, valid=valid, block_size=block, gamma=gamma)
    e1, e2 = math.exp(-0.5), math.exp(-1.0)
    assert labels.tolist() == [[[103, 104, 105], [105, 0, 0], [0, 0, 0], [109, 0, 0], [0, 0, 0]]]
    # anchor 2: all three supervised; 4: the unsupervised token at 6 ends the block's supervision;
    # 7: the label at 8 is in the next document; 8: the row ends after 9; the last block is padding.
    expected = torch.tensor([[[1.0, e1, e2], [1, 0, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]])
    torch.testing.assert_close(weights, expected)
    # A loss-mask hole inside a block stops it even when the later slots are supervised.
    hole = torch.tensor([[0, 0, 1, 0, 1, 1, 1, 1, 1, 1]])
    _, w = anchor_first_targets(ids, hole, torch.zeros_like(doc_ids), torch.tensor([[2]]), valid=torch.tensor([[True]]),
                                block_size=block, gamma=gamma)
    assert w.tolist() == [[[0.0, 0.0, 0.0]]]


# ------------------------------------------------------------------------- the loss

def reference_l1(logits, target_logits):
    """||softmax(logits) - softmax(target_logits)||_1 row by row in Python floats."""
    out = []
    for x, y in zip(logits.tolist(), target_logits.tolist()):
        mx, my = max(x), max(y)
        zx, zy = sum(math.exp(a - mx) for a in x), sum(math.exp(a - my) for a in y)
        out.append(sum(abs(math.exp(a - mx) / zx - math.exp(b - my) / zy) for a, b in zip(x, y)))
    return out


def test_l1_to_target_and_its_gradient_match_float64_references():
    """The L1 term of the fused loss: its values row by row, and its closed-form gradient (the
    softmax's Jacobian applied to sign(q - p)) against autograd of the definition, in float64."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(7, V, generator=g, dtype=torch.float64) * 2
    target = torch.randn(7, V, generator=g, dtype=torch.float64) * 2
    q = logits.softmax(-1)
    values, grad = l1_to_target(q, target, True)
    assert values.tolist() == pytest.approx(reference_l1(logits, target), rel=1e-12)
    assert l1_to_target(q, target, False)[1] is None
    torch.testing.assert_close(l1_to_target(q, target, False)[0], values, rtol=0, atol=0)
    upstream = torch.rand(7, generator=g, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    ((x.softmax(-1) - target.softmax(-1)).abs().sum(-1) * upstream).sum().backward()
    torch.testing.assert_close(grad * upstream[:, None], x.grad, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------- tau and calibration

def test_expected_tau_hand_worked():
    accept = torch.tensor([[0.5, 0.5, 1.0], [0.9, 0.9, 0.9]])
    weights = torch.tensor([[1.0, 0.4, 0.0], [0.0, 0.0, 0.0]])
    total, count = expected_tau(accept, weights)
    assert float(count) == 1.0
    assert float(total) == pytest.approx(1 + 0.5 + 0.25)


def test_confident_prefix_hand_worked():
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    c = torch.tensor([[logit(0.9), logit(0.4), logit(0.9)], [logit(0.9), logit(0.8), logit(0.7)]])
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
