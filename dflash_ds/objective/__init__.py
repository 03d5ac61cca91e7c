"""The training objective: the blocks of a micro-batch (anchors, labels, weights), the fused loss as a
loop over named terms and its lm_head matmuls, and drafter_loss, one micro-batch's loss through the
network. Pure PyTorch, no distributed code."""
