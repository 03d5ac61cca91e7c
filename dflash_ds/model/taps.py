"""Which target layers a drafter reads (docs/algorithm.md section 2): the default spread and the
published presets that differ from it.

Model code: no torch.distributed, no deepspeed.
"""

from __future__ import annotations

# Published taps that differ from build_target_layer_ids, keyed by (drafter.architecture, target layers,
# taps): z-lab's DFlash2 drafters of the 64-layer Qwen 27B geometry read [5, 19, 33, 47, 61] (v1 reads
# [1, 16, 31, 46, 61] there). Used when drafter.target_layer_ids is null.
TAP_PRESETS = {("dflash2", 64, 5): (5, 19, 33, 47, 61)}


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
