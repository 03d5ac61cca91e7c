"""The distributed run: topology, process groups and DeepSpeed engines, the payload transport,
the target and drafter roles, checkpoints."""
