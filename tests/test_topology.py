from collections import Counter

import pytest

from dflash_ds.runtime.topology import Layout, TopologyError


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
