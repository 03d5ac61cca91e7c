"""The remote code of a toy_markov export (tests/toy_variant.py): copied into the export beside its
config.json and weights, and loaded from there (torch and safetensors only, nothing of dflash_ds),
as a serving engine's plugin would: the Markov chain over the drafting slots' states."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


class ToyMarkovWalk(torch.nn.Module):
    """The greedy walk of a toy_markov drafter: slot k's logits biased by the token chosen at slot k - 1."""

    def __init__(self, embedding: torch.Tensor, projection: torch.Tensor):
        super().__init__()
        self.embedding = torch.nn.Parameter(embedding, requires_grad=False)
        self.projection = torch.nn.Parameter(projection, requires_grad=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "ToyMarkovWalk":
        path = Path(path)
        rank = json.loads((path / "config.json").read_text())["dflash_config"]["toy_rank"]
        tensors = load_file(str(path / "model.safetensors"))
        embedding, projection = tensors["markov_head.embedding"], tensors["markov_head.projection"]
        if embedding.shape[1] != rank or projection.shape[1] != rank:
            raise ValueError(f"toy_rank {rank} does not match the Markov head's tables {tuple(embedding.shape)}")
        return cls(embedding.to(dtype), projection.to(dtype))

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchors: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """[n, L] drafts from the drafting slots' states [n, L, D], the anchors [n] and the target's lm_head."""
        prev, path = anchors.long(), []
        for slot in range(hidden.shape[1]):
            logits = hidden[:, slot] @ lm_head.T + self.embedding[prev] @ self.projection.T
            prev = logits.argmax(-1)
            path.append(prev)
        return torch.stack(path, dim=1)
