"""Batched decoding at the GPU's pace, for the regeneration of a dataset by a small in-process target.

`generate` (the `generate` decoder of data/regenerate.py) spends most of its time outside the GPU's
work on a small target: a cache that grows by concatenation each step, the Python of every module and
logits processor per step, and a batch that runs until its longest answer ends. `StaticDecoder` runs the
same model's own modules with:

- a static KV cache of `slots` rows, each as long as the longest prompt plus the token budget, written in
  place at each row's own position (so rows of different lengths decode side by side);
- continuous batching: prompts, shortest first, fill the rows; a row whose answer ended takes the next
  prompt (its prefill) at the next synchronisation, every `sync_every` steps, so the batch stays full;
- on CUDA, each decode step captured once as a CUDA graph per attention length (a multiple of 128
  covering the longest row in flight) and replayed: no launch overhead, no host synchronisation
  between two synchronisations.

The attention itself goes through the model's own attention modules (their projections, norms and
rotary embedding), with this module's attention function registered under `ATTENTION` for the prefill
(causal, grouped-query) and the decode step (one query position per row against its row's cache).
Models whose decoder is not embed_tokens -> layers -> norm -> lm_head with the cache protocol of
transformers' attention modules are refused at construction (`Unsupported`), after a check of this
path's logits against the model's own forward; the caller then falls back to `generate`.

Greedy answers equal `generate`'s token for token where the arithmetic is exact (float64: tested);
in bfloat16 two batched decoders round differently and may part at a near tie, as two `generate`
batch sizes do. Sampling (temperature, top_p) draws with the Gumbel-max trick from the same
distribution as `generate`, not the same random stream.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTENTION = "dflash_static_decode"
BUCKET = 128  # attention lengths are multiples of this: one CUDA graph each


class Unsupported(ValueError):
    """The model's layout is not one this decoder drives; use `generate`."""


@dataclass
class Phase:
    """What the attention function does in the forward under way (passed down as a keyword)."""

    prefill: bool
    mask: torch.Tensor | None = None  # decode: [S, 1, 1, L] keys each row may see
    window_mask: torch.Tensor | None = None  # decode, sliding-window layers

    def mask_of(self, sliding_window) -> torch.Tensor | None:
        """A decode step's key mask for a layer (its window's on a sliding-window layer)."""
        return self.window_mask if sliding_window else self.mask


class SlotCache:
    """Per-layer K/V buffers [slots, kv_heads, max_len, head_dim], written in place.

    The attention modules call `update(k, v, layer_idx)`: in a prefill it stores the prompts' states in
    `rows` from position 0 and returns them (the prompts attend to themselves); in a decode step it
    stores each row's one new state at that row's position and returns every row's first `length`
    positions."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, *, head_dim: int, dtype, device):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.kv_heads, self.max_len = slots, kv_heads, max_len
        self.prefill_rows: torch.Tensor | None = None
        self.flat_index: torch.Tensor | None = None  # decode: where each (row, kv head) writes
        self.length = max_len

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        K, V = self.k[layer_idx], self.v[layer_idx]
        if self.prefill_rows is not None:
            n = k.shape[2]
            K[self.prefill_rows, :, :n] = k
            V[self.prefill_rows, :, :n] = v
            return k, v
        hd = K.shape[-1]
        K.view(-1, hd).index_copy_(0, self.flat_index, k.reshape(-1, hd))
        V.view(-1, hd).index_copy_(0, self.flat_index, v.reshape(-1, hd))
        return K[:, :, :self.length], V[:, :, :self.length]


def _attention(module, query, key, value, attention_mask, *, scaling=None, sliding_window=None, phase=None, **kwargs):
    """The attention function registered as ATTENTION; without a `phase` (the model's own forward, as
    in the construction check) it is transformers' SDPA attention."""
    if phase is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if phase.prefill:
        n = query.shape[2]
        if sliding_window:
            i = torch.arange(n, device=query.device)
            seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=seen, scale=scaling, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None
    # One query position per row: the H query heads as kv_heads groups of H / kv_heads "positions", so the
    # cache is read once per kv head (no repeated copy of it for each query head).
    S, H, _, hd = query.shape
    kvh = key.shape[1]
    q = query.reshape(S, kvh, H // kvh, hd)
    mask = phase.mask_of(sliding_window)
    if q.is_cuda:  # the memory-efficient kernel takes a mask and reads each row's cache once
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(S, 1, H, hd), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class Rows:
    """The decode state of one call, on the device; every tensor is updated in place (graph inputs)."""

    cache: SlotCache
    tokens: torch.Tensor  # [S] the last token of each row (the next step's input)
    pos: torch.Tensor  # [S] its position
    n_gen: torch.Tensor  # [S] tokens generated
    done: torch.Tensor  # [S] bool
    out: torch.Tensor  # [S, max_new] the generated tokens
    graphs: dict = field(default_factory=dict)
    pool: object = None  # the memory pool of this call's graphs (one per call: it ends with them)

    def advance(self, nxt: torch.Tensor, stopped: torch.Tensor, max_new: int) -> None:
        """Record a step's chosen tokens `nxt` [S] in place (a finished row's output stays as it is);
        `stopped` [S]: where `nxt` is a stop token."""
        live = ~self.done
        col = self.n_gen.clamp(max=self.out.shape[1] - 1)[:, None]
        self.out.scatter_(1, col, torch.where(live, nxt, self.out.gather(1, col)[:, 0])[:, None])
        self.n_gen.add_(live.long())
        self.done.logical_or_(stopped | (self.n_gen >= max_new))
        self.tokens.copy_(nxt)
        self.pos.add_(1).clamp_(max=self.cache.max_len - 1)


class StaticDecoder:
    """`decoder(prompts, seed) -> [(new ids without the stop token, finished)]` for an HF causal LM."""

    def __init__(self, model, stop_ids, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 slots: int = 1024, memory_fraction: float = 0.5, sync_every: int = 32, graphs: bool | None = None,
                 prefill_tokens: int = 65536):
        self.model, self.max_new = model, int(max_new_tokens)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.max_slots, self.memory_fraction, self.sync_every = int(slots), float(memory_fraction), int(sync_every)
        self.prefill_tokens = int(prefill_tokens)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.use_graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        self.stop = torch.tensor(sorted(int(s) for s in stop_ids), dtype=torch.long, device=self.device)
        self._layout()
        self.graph_failure: str | None = None
        self._check()

    # ------------------------------------------------------------------ the model's layout

    def _layout(self) -> None:
        m = self.model
        dec = m.get_decoder() if hasattr(m, "get_decoder") else None
        parts = [getattr(dec, name, None) for name in ("embed_tokens", "layers", "norm", "rotary_emb")]
        head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
        if dec is None or any(x is None for x in parts) or head is None:
            raise Unsupported(f"{type(m).__name__}: no embed_tokens / layers / norm / rotary_emb / lm_head to drive")
        self.embed, self.layers, self.norm, self.rotary = parts
        self.head = head
        cfg = m.config
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        types = getattr(cfg, "layer_types", None) or []
        if any(t not in ("full_attention", "sliding_attention") for t in types):
            raise Unsupported(f"{type(m).__name__}: layer types {sorted(set(types))} (only attention layers are driven)")
        self.window = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
        if getattr(cfg, "final_logit_softcapping", None):
            raise Unsupported(f"{type(m).__name__}: final_logit_softcapping")

    def _check(self) -> None:
        """This path's logits against the model's own forward on one short sequence: a prefill and two
        decode steps. Catches layouts this decoder would run wrongly (an embedding scale, another cache
        protocol)."""
        cfg = self.model.config
        ids = torch.arange(3, 3 + 12, device=self.device) % cfg.vocab_size
        with torch.inference_mode():
            ref = self.model(ids[None]).logits[0].float()
            _register()
            old = cfg._attn_implementation
            cfg._attn_implementation = ATTENTION
            try:
                got = self._teacher_forced(ids.tolist(), prompt_len=10)
            except Exception as exc:  # any failure of this path on this model means: not supported
                cfg._attn_implementation = old
                raise Unsupported(f"{type(self.model).__name__}: the static decode path failed ({exc})") from None
        want = ref[9:12]
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
        tol = 1e-4 if self.dtype in (torch.float32, torch.float64) else 5e-2
        if not err <= tol:
            cfg._attn_implementation = old
            raise Unsupported(f"{type(self.model).__name__}: the static decode path's logits differ from the model's "
                              f"forward by {err:.2e} (relative; tolerance {tol:g})")

    def _teacher_forced(self, ids: list[int], *, prompt_len: int) -> torch.Tensor:
        """Logits [len(ids) - prompt_len + 1, V] of a prefill of ids[:prompt_len] and decode steps feeding
        the rest (eager, one row)."""
        rows = self._rows(1, _round_up(len(ids) + 1, BUCKET))
        logits = [self._prefill(rows, [ids[:prompt_len]], [0], keep_logits=True)]
        for t in ids[prompt_len:]:
            rows.tokens.fill_(t)
            logits.append(self._step(rows, rows.cache.max_len, keep_logits=True))
        return torch.cat(logits)

    # ------------------------------------------------------------------ one call

    def _slots_for(self, max_len: int, n: int) -> int:
        per_row = 2 * len(self.layers) * self.kv_heads * max_len * self.head_dim * torch.finfo(self.dtype).bits // 8
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # what the allocator holds unused (an earlier call's cache) is free to this one too
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            budget = int(free * self.memory_fraction)
        else:
            budget = 2 << 30
        return max(1, min(self.max_slots, n, budget // per_row))

    def _rows(self, slots: int, max_len: int) -> Rows:
        dev = self.device
        cache = SlotCache(len(self.layers), slots, self.kv_heads, max_len, head_dim=self.head_dim, dtype=self.dtype,
                          device=dev)
        z = torch.zeros(slots, dtype=torch.long, device=dev)
        return Rows(cache, z.clone(), z.clone(), z.clone(), torch.ones(slots, dtype=torch.bool, device=dev),
                    torch.zeros(slots, max(self.max_new, 1), dtype=torch.long, device=dev))

    def __call__(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
        if not prompts:
            return []
        cfg = self.model.config
        cfg._attn_implementation = ATTENTION
        torch.manual_seed(seed)
        max_len = _round_up(max(len(p) for p in prompts) + self.max_new, BUCKET)
        results: list = [None] * len(prompts)
        with torch.inference_mode():
            rows = self._rows(self._slots_for(max_len, len(prompts)), max_len)
            pending = deque(sorted(range(len(prompts)), key=lambda k: len(prompts[k])))  # similar lengths side by side
            owner = [-1] * rows.cache.slots  # the prompt each row decodes, -1 free
            ends = [0] * rows.cache.slots  # prompt length + budget: what the row's attention may reach
            while True:
                free = [s for s in range(rows.cache.slots) if owner[s] < 0]
                if free and pending:
                    take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
                    for s, k in zip(free, take):
                        owner[s], ends[s] = k, len(prompts[k]) + self.max_new
                    self._prefill(rows, [prompts[k] for k in take], free[:len(take)])
                busy = [s for s in range(rows.cache.slots) if owner[s] >= 0]
                if not busy:
                    break
                length = min(_round_up(max(ends[s] for s in busy), BUCKET), max_len)
                if not bool(rows.done[busy].all()):  # a prefill's first token may already end every answer
                    for _ in range(self.sync_every):
                        self._run_step(rows, length)
                state = torch.stack([rows.n_gen, rows.done.long()]).cpu()  # the one synchronisation
                ended = [s for s in busy if state[1, s]]
                if ended:
                    outs = rows.out[ended].cpu()
                    for s, o in zip(ended, outs):
                        results[owner[s]] = self._answer(o[:int(state[0, s])].tolist())
                        owner[s] = -1
        return results

    def _answer(self, ids: list[int]) -> tuple[list[int], bool]:
        stops = set(self.stop.tolist())
        return (ids[:-1], True) if ids and ids[-1] in stops else (ids, False)

    # ------------------------------------------------------------------ prefill and step

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy, or a draw from softmax(logits / T) cut to top_p (Gumbel-max: no host synchronisation)."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(-1, descending=True)
            probs = sorted_logits.softmax(-1)
            # keep the smallest set of most likely tokens whose mass reaches top_p (at least one)
            cut = (probs.cumsum(-1) - probs) >= self.top_p
            logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits.masked_fill(cut, -math.inf))
        noise = torch.empty_like(logits).exponential_()
        return (logits.softmax(-1) / noise).argmax(-1)

    def _layers(self, h: torch.Tensor, position_ids: torch.Tensor, cache: SlotCache, phase: Phase) -> torch.Tensor:
        pe = self.rotary(h, position_ids)
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_embeddings=pe, position_ids=position_ids,
                        past_key_values=cache, use_cache=True, phase=phase)
            h = out[0] if isinstance(out, tuple) else out
        return h

    def _prefill(self, rows: Rows, prompts: list[list[int]], slots: list[int], *, keep_logits: bool = False):
        """The prompts into rows `slots` (in chunks of about `prefill_tokens` padded tokens): their
        states in the cache, their first generated token as the rows' next input."""
        kept = []
        i = 0
        while i < len(prompts):
            width = len(prompts[i])  # prompts come shortest first within a call's order
            n = 1
            while i + n < len(prompts) and (n + 1) * max(width, len(prompts[i + n])) <= self.prefill_tokens:
                width, n = max(width, len(prompts[i + n])), n + 1
            chunk, where = prompts[i:i + n], slots[i:i + n]
            ids = torch.zeros(n, width, dtype=torch.long)
            for r, p in enumerate(chunk):  # right padding: a row's real tokens are its positions 0..len-1
                ids[r, :len(p)] = torch.tensor(p)
            ids = ids.to(self.device)
            lens = torch.tensor([len(p) for p in chunk], device=self.device)
            at = torch.tensor(where, device=self.device)
            rows.cache.prefill_rows = at
            try:
                h = self._layers(self.embed(ids), torch.arange(width, device=self.device)[None].expand(n, -1),
                                 rows.cache, Phase(prefill=True))
            finally:
                rows.cache.prefill_rows = None
            logits = self.head(self.norm(h[torch.arange(n, device=self.device), lens - 1])).float()
            if keep_logits:
                kept.append(logits)
            first = self._choose(logits)
            rows.tokens[at], rows.pos[at], rows.n_gen[at] = first, lens, 1
            rows.out[at, 0] = first
            rows.done[at] = self._is_stop(first) | (self.max_new <= 1)
            i += n
        return torch.cat(kept) if keep_logits else None

    def _is_stop(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.stop[None]).any(1)

    def _step(self, rows: Rows, length: int, *, keep_logits: bool = False):
        """One decode step of every row (finished rows step too, their output frozen): the last token's
        state into the cache at its position, the next token chosen."""
        c = rows.cache
        S, dev = c.slots, self.device
        c.flat_index = (torch.arange(S * c.kv_heads, device=dev) * c.max_len
                        + rows.pos[:, None].expand(S, c.kv_heads).reshape(-1))
        c.length = length
        keys = torch.arange(length, device=dev)[None]
        seen = keys <= rows.pos[:, None]
        window = None if not self.window else (seen & (keys > rows.pos[:, None] - self.window))[:, None, None]
        h = self._layers(self.embed(rows.tokens[:, None]), rows.pos[:, None], c,
                         Phase(prefill=False, mask=seen[:, None, None], window_mask=window))
        logits = self.head(self.norm(h[:, 0])).float()
        nxt = self._choose(logits)
        rows.advance(nxt, self._is_stop(nxt), self.max_new)
        return logits if keep_logits else None

    def _run_step(self, rows: Rows, length: int) -> None:
        """A step, replayed from its CUDA graph (captured at the first step of each attention length)."""
        if not self.use_graphs:
            self._step(rows, length)
            return
        graph = rows.graphs.get(length)
        if graph is not None:
            graph.replay()
            return
        # The first step of this length runs eagerly on a side stream (what capture needs first: lazy
        # initialisations out of the graph), then the same step is captured; capture does not run it.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(rows, length)
        torch.cuda.current_stream(self.device).wait_stream(side)
        try:
            if rows.pool is None:
                rows.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=rows.pool):
                self._step(rows, length)
        except Exception as exc:  # a model whose step cannot be captured still decodes, eagerly
            self.use_graphs, self.graph_failure = False, f"{type(exc).__name__}: {exc}"
            return
        rows.graphs[length] = graph
