from collections import Counter

import pytest

from dflash_ds.resolve.topology import Layout, TopologyError


@pytest.mark.parametrize("world,d,t,gas", [(2, 1, 1, 1), (3, 1, 2, 2), (3, 2, 1, 3), (16, 4, 4, 2), (16, 3, 5, 4), (8, 5, 3, 1)])
def test_schedule_is_a_bijection_inside_nodes(world, d, t, gas):
    lay = Layout(world, d, t)
    assert lay.drafter_ranks[0] == 0 and len(lay.drafter_ranks) == lay.nodes * d
    for step in range(3):
        produced = {}
        for tr in lay.target_ranks:
            work = lay.target_work(tr, step, gas)
            ms = [m for _, _, m in work]
            assert ms == sorted(ms)  # FIFO order per target
            for g, dr, m in work:
                assert lay.node_of(dr) == lay.node_of(tr)  # hidden states never leave a node
                assert lay.source_of(step, g, gas, dr) == tr
                produced[m] = (dr, g)
        expected = {lay.micro_index(step, g, gas, dr): (dr, g) for dr in lay.drafter_ranks for g in range(gas)}
        assert produced == expected
        ids = sorted(expected)
        assert ids == list(range(step * gas * lay.num_drafters, (step + 1) * gas * lay.num_drafters))


def test_targets_share_work_evenly():
    lay = Layout(8, 4, 4)
    counts = Counter(len(lay.target_work(tr, 0, 2)) for tr in lay.target_ranks)
    assert counts == Counter({2: 4})


def test_world_size_must_match_topology():
    with pytest.raises(TopologyError, match="drafters_per_node"):
        Layout(7, 4, 4)


def test_colocated_every_rank_both_roles():
    lay = Layout(2, 2, 0, colocated=True)
    assert lay.role(0) == lay.role(1) == "both"
    assert lay.target_work(1, 5, 2) == [(0, 1, lay.micro_index(5, 0, 2, 1)), (1, 1, lay.micro_index(5, 1, 2, 1))]


def test_payload_group_limits_only_split_nccl_runs(monkeypatch):
    """The payload transfers get their own NCCL group capped at topology.payload_ctas thread blocks
    (the gradient reduction keeps NCCL's default); nothing is created where nothing is limited."""
    from dflash_ds.runtime import engines

    created = []

    class Config:
        min_ctas = max_ctas = None

    class Options:
        def __init__(self):
            self.config = Config()

    monkeypatch.setattr(engines.dist, "ProcessGroupNCCL", type("PG", (), {"Options": Options}), raising=False)
    monkeypatch.setattr(engines.dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(engines.dist, "new_group", lambda ranks, pg_options=None: created.append((ranks, pg_options)) or "g")
    split, colocated = Layout(3, 2, 1), Layout(2, 2, 0, colocated=True)
    backend = {"name": "nccl"}
    monkeypatch.setattr(engines.dist, "get_backend", lambda: backend["name"])
    assert engines.payload_group(split, 1) == "g"
    ranks, opts = created[0]
    assert ranks == [0, 1, 2] and (opts.config.min_ctas, opts.config.max_ctas) == (1, 1)
    assert engines.payload_group(split, 0) is None
    assert engines.payload_group(colocated, 1) is None
    backend["name"] = "gloo"
    assert engines.payload_group(split, 1) is None
    assert len(created) == 1
