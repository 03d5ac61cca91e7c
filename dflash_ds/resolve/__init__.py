"""The resolve step: recipe + world size -> RunSpec (topology, plan, DeepSpeed configs, dtypes, payload
layout, the drafter's shape), with every check that needs no process group. Imports nothing from
runtime/: what needs processes and groups lives there."""
