"""What a target does around its embedding and lm_head, which the drafter must do too.

The drafter embeds its block tokens with the target's embedding matrix and reads its states out
through the target's lm_head (docs/algorithm.md section 1). Most targets use both as plain
matrices, but some families scale or cap them inside the model:

- Gemma (2, 3, ...) multiplies the input embeddings by sqrt(hidden_size), and Gemma 2 caps its
  logits: `cap * tanh(logits / cap)` (`final_logit_softcapping`);
- Granite multiplies the embeddings by `embedding_multiplier` and divides the logits by
  `logits_scaling`;
- Cohere multiplies the logits by `logit_scale`.

The target's next-token distribution, the one the drafter learns and the verifier samples from,
includes these, so training, evaluation and the export apply the same: the drafter's logits are
`softcap(output_multiplier * hidden @ lm_head.T)` and its block embeddings
`input_embedding_scale * embed[ids]`. The export writes the three values into `dflash_config`
under the names the reference implementation reads (`output_multiplier`,
`final_logit_softcapping`, `input_embedding_scale`), only when they are not the identity.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class LogitTransform(NamedTuple):
    """`z = softcap(multiplier * x)` of raw lm_head logits `x`; softcap(y) = cap * tanh(y / cap)."""

    multiplier: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.multiplier == 1.0 and not self.softcap

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Transformed logits, in `x`'s dtype (pass fp32 or wider: tanh of bf16 loses the top digits)."""
        return scale_logits(x, *self)

    def slope(self, z: torch.Tensor) -> torch.Tensor | float:
        """dz/dx at transformed values `z` (monotonic: always > 0)."""
        return logit_slope(z, *self)


def scale_logits(x: torch.Tensor, multiplier: float, cap: float | None) -> torch.Tensor:
    """`LogitTransform.apply` on its two numbers (cap None or 0 = none), for compiled kernels: the
    branches are on Python numbers, so a compiled graph holds only the arithmetic that applies."""
    if multiplier != 1.0:
        x = x * multiplier
    if cap:
        x = torch.tanh(x / cap) * cap
    return x


def logit_slope(z: torch.Tensor, multiplier: float, cap: float | None) -> torch.Tensor | float:
    """dz/dx of `scale_logits` at its output z, without the raw logits:
    multiplier * (1 - tanh^2) = multiplier * (1 - (z / cap)^2); a plain float without a cap."""
    if not cap:
        return multiplier
    t = z / cap
    return multiplier * (1.0 - t * t)


IDENTITY = LogitTransform()


def target_scales(text_config: Any) -> dict[str, float | None]:
    """The drafter's `output_multiplier`, `final_logit_softcapping` and `input_embedding_scale` for a
    transformers text config, read from the fields the families above use (identity otherwise)."""
    model_type = str(getattr(text_config, "model_type", ""))
    hidden = int(getattr(text_config, "hidden_size", 0) or 0)
    multiplier, embed_scale = 1.0, 1.0
    if model_type.startswith("gemma"):
        embed_scale = hidden ** 0.5
    if getattr(text_config, "embedding_multiplier", None) is not None:  # Granite
        embed_scale = float(text_config.embedding_multiplier)
    if getattr(text_config, "logits_scaling", None):  # Granite divides
        multiplier = 1.0 / float(text_config.logits_scaling)
    logit_scale = getattr(text_config, "logit_scale", None)
    if isinstance(logit_scale, (int, float)) and not isinstance(logit_scale, bool) and logit_scale:  # Cohere
        multiplier = float(logit_scale)
    cap = getattr(text_config, "final_logit_softcapping", None)
    return {"output_multiplier": multiplier, "final_logit_softcapping": float(cap) if cap else None,
            "input_embedding_scale": embed_scale}
