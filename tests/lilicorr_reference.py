"""An independent LiLiCorr draft, written from SGLang's reader (python/sglang/srt/models/lilicorr.py, the
lilicorr_components candidates and selection, kernels/ops/speculative/lilicorr.py's lattice-to-rows and
inverse-CDF walk) rather than from the project's modules: it takes an export's tensors by the names
SGLang's modules have (tests/fixtures/lilicorr_reader_rules.json), computes everything in float64 with plain
tensor algebra (the attention as softmax(q k^T / sqrt(d) + bias) v, the bias filled slot pair by slot
pair), and walks one block at a time.

Used by tests/test_lilicorr_walk.py only."""

from __future__ import annotations

import math

import torch


def head_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head's tensors (the export names them as SGLang's modules are named), float64, without the
    `lilicorr.` prefix."""
    out = {}
    for name, value in state.items():
        if not name.startswith("lilicorr."):
            continue
        out[name[len("lilicorr."):]] = value.detach().double()
    return out


def _linear(w: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def _unit(v: torch.Tensor, eps: float) -> torch.Tensor:
    return v / torch.clamp(torch.sqrt((v * v).sum(-1, keepdim=True)), min=eps)


class ReferenceDraft:
    """One block's draft from an export's tensors and its config's `dflash_config` (plus rms_norm_eps)."""

    def __init__(self, state: dict[str, torch.Tensor], dflash_config: dict, rms_eps: float):
        self.w, c = head_tensors(state), dflash_config
        self.k, self.slots = c["lilicorr_candidate_topk"], c["block_size"] - 1
        self.heads, self.layers = c["lilicorr_num_heads"], c["lilicorr_num_layers"]
        self.scale, self.vector_eps, self.eps = c["lilicorr_logit_scale"], c["lilicorr_vector_eps"], rms_eps

    def candidates(self, states: torch.Tensor, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [S, k], log-probs [S, k]) of one block's drafted states [S, D]: torch.topk and logsumexp of
        the raw logits (SGLang's CPU fallback)."""
        z = states.double() @ lm_head.double().T
        top = torch.topk(z, self.k, dim=-1)
        return top.indices, top.values - torch.logsumexp(z, dim=-1, keepdim=True)

    def factors(self, embeddings: torch.Tensor, log_probs: torch.Tensor, states: torch.Tensor,
                anchor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(start [k], pair [S' - 1, k, k]) log-factors of one block of S' <= S drafted slots (`states`
        [S', D]); anchor None: no anchor row. A block shorter than the trained one (an engine serving
        fewer speculative tokens) is the smaller lattice: the first S' slot embeddings, the same bias by
        slot distance."""
        w, k, S = self.w, self.k, states.shape[0]
        x = embeddings.double()
        if "token_proj.weight" in w:
            x = _linear(w, "token_proj", x)
        x = x + _linear(w, "pass_hidden_proj", states.double())[:, None, :]
        lp = log_probs.double()
        rank = torch.arange(k, dtype=torch.float64)
        feats = torch.stack([lp, torch.exp(lp), lp - lp.max(-1, keepdim=True).values,
                             (rank / (k - 1) if k > 1 else rank * 0).expand(S, k), (rank == 0).double().expand(S, k)], -1)
        mean, var = feats.mean(-1, keepdim=True), feats.var(-1, unbiased=False, keepdim=True)
        feats = (feats - mean) / torch.sqrt(var + 1e-5) * w["feature_norm.weight"] + w["feature_norm.bias"]
        x = x + _linear(w, "feature_mlp.down_proj", _silu(_linear(w, "feature_mlp.up_proj", feats)))
        x = x + w["slot_embedding"].reshape(self.slots, 1, -1)[:S] + w["rank_embedding"].reshape(1, k, -1)
        x = x.reshape(S * k, -1)
        bias = torch.zeros(self.heads, S * k, S * k, dtype=torch.float64)
        for p in range(S * k):
            for q in range(S * k):
                sp, sq = p // k, q // k
                bias[:, p, q] = w["relative_slot_bias"][:, sp - sq + self.slots] + (w["same_slot_bias"] if sp == sq else 0)
        h = x.shape[-1]
        d = h // self.heads
        for layer in range(self.layers):
            pre = f"layers.{layer}."
            y = _rms(x, w[pre + "attn_norm.weight"], self.eps)
            qkv = y @ w[pre + "attn.in_proj_weight"].T + w[pre + "attn.in_proj_bias"]
            q, kk, v = qkv[:, :h], qkv[:, h:2 * h], qkv[:, 2 * h:]
            heads = []
            for n in range(self.heads):
                sl = slice(n * d, (n + 1) * d)
                logits = q[:, sl] @ kk[:, sl].T / math.sqrt(d) + bias[n]
                heads.append(torch.softmax(logits, dim=-1) @ v[:, sl])
            x = x + _linear(w, pre + "attn.out_proj", torch.cat(heads, dim=-1))
            y = _rms(x, w[pre + "mlp_norm.weight"], self.eps)
            x = x + _linear(w, pre + "mlp.down_proj", _silu(_linear(w, pre + "mlp.up_proj", y)))
        x = _rms(x, w["output_norm.weight"], self.eps)
        if anchor is None:
            alpha = _rms(torch.zeros(h, dtype=torch.float64), w["anchor_norm.weight"], self.eps)
        else:
            alpha = _rms(_linear(w, "context_proj", anchor.double()), w["anchor_norm.weight"], self.eps)
        a = alpha.expand_as(x)
        f = _silu(_linear(w, "factor_input_proj", torch.cat([x, a, x * a], dim=-1)))
        out = _unit(_linear(w, "out_head", f), self.vector_eps).reshape(S, k, -1)
        into = _unit(_linear(w, "in_head", f), self.vector_eps).reshape(S, k, -1)
        anchor_out = _unit(_linear(w, "anchor_out_head", alpha), self.vector_eps)
        start = torch.stack([(anchor_out * into[0, j]).sum() for j in range(k)])
        pair = torch.stack([torch.stack([torch.stack([(out[s, i] * into[s + 1, j]).sum() for j in range(k)])
                                         for i in range(k)]) for s in range(S - 1)]) if S > 1 else \
            torch.zeros(0, k, k, dtype=torch.float64)
        return self.scale * start, self.scale * pair

    def walk(self, start: torch.Tensor, pair: torch.Tensor, uniforms: torch.Tensor, temperature: float = 0.0
             ) -> list[int]:
        """SGLang's selection: the start row broadcast over the predecessor axis on top of the pair rows
        ([S, k, k]); at temperature 0 every row turned into the one-hot of its first maximum, else into
        softmax(row / T); then the inverse-CDF walk from predecessor 0 with one uniform a slot (which the
        one-hot rows make irrelevant)."""
        k = self.k
        scores = torch.cat([start.expand(1, k, k), pair], dim=0)
        probs = torch.zeros_like(scores)
        for s in range(scores.shape[0]):
            for i in range(k):
                if temperature > 0:
                    e = [math.exp(float(scores[s, i, j] - scores[s, i].max()) / temperature) for j in range(k)]
                    for j in range(k):
                        probs[s, i, j] = e[j] / sum(e)
                    continue
                best = 0
                for j in range(1, k):
                    if scores[s, i, j] > scores[s, i, best]:
                        best = j
                probs[s, i, best] = 1.0
        previous, out = 0, []
        for s in range(scores.shape[0]):
            q = probs[s, previous]
            cdf = torch.cumsum(q, 0)
            index = int((uniforms[s] >= cdf).sum())
            last = int(torch.nonzero(q > 0).max())
            index = min(index, last)
            out.append(index)
            previous = index
        return out

    def draft(self, states: torch.Tensor, lm_head: torch.Tensor, embed: torch.Tensor, anchor: torch.Tensor | None, *,
              uniforms: torch.Tensor) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """One block's tokens, and its (start, pair) log-factors."""
        ids, lp = self.candidates(states, lm_head)
        start, pair = self.factors(embed.double()[ids], lp, states, anchor)
        index = self.walk(start, pair, uniforms)
        return [int(ids[s, j]) for s, j in enumerate(index)], start, pair
