"""The distributed run: what needs processes and groups. Process groups and DeepSpeed engines, the
payload transport, the target and drafter roles, checkpoints, the run's safety. The resolve step
(recipe -> RunSpec) is resolve/, which imports nothing from here."""
