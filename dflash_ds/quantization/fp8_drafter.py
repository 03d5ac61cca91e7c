"""The drafter's float8 training layers (`drafter.fp8.layers`): the mechanism. runtime/engines.py applies the
recipe's setting as a drafter rank builds its model; whether it may run is resolve/quantization.py's.

layers: the attention and MLP projections of every drafter layer become torchao `Float8Linear`s
(float8 training: the weight, its gradient and the fp32 master copy stay as they were; each matmul
of the forward and the backward casts its operands to float8 with dynamic scales). Done before the
ZeRO-2 engine is built: `Float8Linear` keeps the module's own Parameter objects, so the engine
flattens and partitions them as usual, and the state dict keeps the export's names.

Left in bf16, on purpose: `fc`, which fuses the taps (the target's raw residual stream, whose few
very large channels would set every row's FP8 scale) and runs on the context tokens only, a
small share of the step's FLOPs; DFlash2's block convolutions and selector (small, and read by the selector's
exact scores); the frozen embedding and lm_head, which are not modules of the drafter (the lm_head
has its own FP8 path: lm_head, quantization/fp8_head.py).
"""

from __future__ import annotations

from torch import nn

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def fp8_layer_names(drafter: nn.Module) -> list[str]:
    """The modules `convert_layers` turns into float8 training, by name: every plain nn.Linear among
    PROJECTIONS of every drafter layer."""
    return [f"layers.{i}.{p}" for i, layer in enumerate(drafter.layers) for p in PROJECTIONS
            if type(layer.get_submodule(p)) is nn.Linear]


def convert_layers(drafter: nn.Module, recipe_name: str) -> list[str]:
    """Swap in torchao's Float8Linear (recipe `rowwise` or `tensorwise`), in place; returns the names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(fp8_layer_names(drafter))
    convert_to_float8_training(drafter, module_filter_fn=lambda mod, fqn: fqn in names,
                               config=Float8LinearConfig.from_recipe_name(recipe_name))
    return sorted(names)

