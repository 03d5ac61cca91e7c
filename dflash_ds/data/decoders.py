"""The hf regeneration backend's two decoders of an in-process target, one interface:
`generator(prompts, seed) -> [(new token ids without the stop token, finished)]`.

- `StaticGenerator`: data/static_decode.py (static KV cache, continuous batching, CUDA graphs), the
  default (`data.regenerate.decoder: static`);
- `HFGenerator`: transformers' `generate`, batched with left padding (`decoder: generate`), and what a
  model the static decoder does not drive falls back to.
"""

from __future__ import annotations

import os

from dflash_ds.safety import say


def stop_ids(target_path: str, tokenizer) -> set[int]:
    """The ids that end an answer: the generation config's EOS ids and the tokenizer's."""
    ids = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(target_path).eos_token_id
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def load_causal_lm(target_path: str, device=None, dtype=None):
    """The target in eval mode on `device` (default: this process's GPU, else the CPU), bfloat16 on a
    GPU and float32 on the CPU unless `dtype` says otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    if device is None and torch.cuda.is_available():
        # modulo: main() may have pinned this process to its one GPU already
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"
    device = device or "cpu"
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(device).eval(), device


class HFGenerator:
    """Batched `generate` with left padding; returns (new token ids without the stop token, finished)."""

    def __init__(self, target_path: str, tokenizer, settings, device=None, *, batch_size: int = 32,
                 model=None, dtype=None):
        import torch

        self.torch = torch
        if model is None:
            model, device = load_causal_lm(target_path, device, dtype)
        self.model = model
        self.device = device or next(model.parameters()).device
        self.settings = settings
        self.batch_size = batch_size
        self.stop = stop_ids(target_path, tokenizer)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop)

    def __call__(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
        torch = self.torch
        rs = self.settings
        sample = rs.temperature > 0
        results: list = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))  # less padding per batch
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            width = max(len(prompts[k]) for k in idx)
            ids = torch.full((len(idx), width), self.pad, dtype=torch.long)
            attn = torch.zeros((len(idx), width), dtype=torch.long)
            for r, k in enumerate(idx):
                ids[r, width - len(prompts[k]):] = torch.tensor(prompts[k])
                attn[r, width - len(prompts[k]):] = 1
            torch.manual_seed(seed * 1_000_003 + b)
            # top_k=None: no hidden top-k (generate's default 50) on top of the recipe's top_p
            kw = dict(do_sample=True, temperature=rs.temperature, top_p=rs.top_p) if sample else dict(do_sample=False)
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
                    max_new_tokens=rs.max_new_tokens, eos_token_id=sorted(self.stop),
                    pad_token_id=self.pad, top_k=None, use_cache=True, **kw)
            out = out.cpu()  # one copy: a row's .tolist() on the GPU would wait for the device per row
            for r, k in enumerate(idx):
                new = out[r, width:].tolist()
                end = next((t for t, tok in enumerate(new) if tok in self.stop), None)
                results[k] = (new, False) if end is None else (new[:end], True)
        return results


class StaticGenerator:
    """The static decoder (data/static_decode.py) over the target loaded here; raises
    static_decode.Unsupported for a model it does not drive."""

    def __init__(self, target_path: str, tokenizer, settings, device=None, *, slots: int | None = None,
                 model=None, dtype=None, graphs: bool | None = None):
        from dflash_ds.data.static_decode import StaticDecoder

        if model is None:
            model, device = load_causal_lm(target_path, device, dtype)
        self.model = model
        self.decoder = StaticDecoder(model, stop_ids(target_path, tokenizer), max_new_tokens=settings.max_new_tokens,
                                     temperature=settings.temperature, top_p=settings.top_p,
                                     slots=slots or getattr(settings, "slots", 1024), graphs=graphs)

    def __call__(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
        return self.decoder(prompts, seed)


def hf_generator(target_path: str, tokenizer, settings, *, batch_size: int = 32, slots: int | None = None):
    """`settings.decoder`'s generator (data.regenerate); static falls back to generate, with a note, for a
    model it does not drive."""
    if getattr(settings, "decoder", "static") == "static":
        from dflash_ds.data.static_decode import Unsupported

        model, device = load_causal_lm(target_path)
        try:
            return StaticGenerator(target_path, tokenizer, settings, device, slots=slots, model=model)
        except Unsupported as exc:
            say(f"regenerate: the static decoder does not drive this target ({exc}); decoding with generate "
                "(data.regenerate.decoder=generate says so without this note)")
        return HFGenerator(target_path, tokenizer, settings, device, batch_size=batch_size, model=model)
    return HFGenerator(target_path, tokenizer, settings, batch_size=batch_size)
