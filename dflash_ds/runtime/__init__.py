"""The distributed run: what needs processes and groups. Process groups and DeepSpeed engines, the
payload transport, the target and drafter roles, checkpoints, the wait timers and the profiler, and
the watchdog that bounds every wait on a peer. The resolve step (recipe -> RunSpec) is resolve/, which
imports nothing from here; how a run starts and stops is guard/, which imports from here."""
