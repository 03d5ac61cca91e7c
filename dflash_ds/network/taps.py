"""Which target layers a drafter reads (docs/algorithm.md section 2): the default spread (published
presets that differ from it belong to their architecture: `Spec.tap_presets`).

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Target layers whose outputs feed the drafter (docs/algorithm.md section 2).

    Id k is the output of decoder layer k, i.e. HF `output_hidden_states[k + 1]`. Python's
    `round` (half to even) is deliberate: the serving engines compute the same list with it.
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if num_taps < 1:
        raise ValueError(f"the number of target taps must be >= 1, got {num_taps}")
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]
