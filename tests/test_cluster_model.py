"""The two-level time model (no MPI): what it charges for each mode, and ``cost --cluster``."""

import pytest

from mpiring import make_plan
from mpiring.__main__ import main
from mpiring.cost.cluster_model import CLUSTERS, Cluster, cluster_time, compare_modes, emulated

SHAPE = dict(batch=1, hq=8, hk=8, dim=64, dim_v=64, itemsize=4)


def _cluster(nodes, node_size, inter_beta, flops=1e10):
    return Cluster("test", nodes, node_size, flops, 0.0, 1e12, 0.0, inter_beta)


def test_a_flat_ring_step_waits_for_the_boundary_transfer():
    """P = 4 on 2 nodes, not causal: 3 transfers of one block cross, each step is max(compute, transfer)."""
    plan = make_plan(4096, 4)
    block = 1024 * 8 * 128 * 4  # one rank's K and V
    step = 4 * 1024 * 1024 * 8 * 64 / 1e10  # one block's compute
    slow = cluster_time(plan, _cluster(2, 2, block / (2 * step)), **SHAPE)  # a transfer takes 2 steps' compute
    assert slow["compute"] == pytest.approx(4 * step)
    assert slow["total"] == pytest.approx(step + 3 * 2 * step)
    fast = cluster_time(plan, _cluster(2, 2, 1e15), **SHAPE)
    assert fast["exposed"] == pytest.approx(0, abs=1e-9)


def test_the_double_ring_crosses_once_per_round():
    """2 nodes of 4, a block crossing takes 2 steps' compute: the flat ring's boundary rank is exposed at each
    of 7 steps (one step each); the double ring's 4 outer blocks of a node take 8 steps behind a round of 4."""
    block = 1024 * 8 * 128 * 4
    step = 4 * 1024 * 1024 * 8 * 64 / 1e10
    results = compare_modes(8192, _cluster(2, 4, block / (2 * step)), causal=False, **SHAPE,
                            modes=("ring", "double_ring"))
    assert results["ring"]["total"] == pytest.approx(7 * 2 * step + step)
    assert results["double_ring"]["total"] == pytest.approx(8 * step + 4 * step)
    assert results["double_ring"]["exposed"] == pytest.approx(4 * step)


def test_ulysses_pays_its_all_to_alls_and_presets_rank_the_modes():
    results = compare_modes(131072, CLUSTERS["ethernet"](2, 8), causal=True, batch=1, hq=16, hk=16, dim=64,
                            dim_v=64, itemsize=2)
    assert set(results) == {"ring", "double_ring", "ulysses", "hybrid"}
    assert results["ulysses"]["exposed"] > 0
    assert min(results, key=lambda m: results[m]["total"]) == "double_ring"
    cluster = emulated(2, 2, 1e8, 1e10, 4e9)
    skipped = compare_modes(4096, cluster, causal=True, **dict(SHAPE, hq=3, hk=3))
    assert "ulysses" not in skipped and "hybrid" in skipped  # 3 heads split over a node of 2, not over 4
    uneven, even = (compare_modes(4096, cluster, causal=True, **dict(SHAPE, hq=h, hk=h)) for h in (6, 8))
    assert uneven["ulysses"]["compute"] == even["ulysses"]["compute"]  # 6 heads over 4: the slowest has 2, as 8
    assert uneven["ulysses"]["exposed"] < even["ulysses"]["exposed"]  # ... but fewer heads move


def test_cost_compares_the_modes(capsys):
    assert main(["cost", "--seq-len", "65536", "-P", "16", "--hidden", "1024", "--heads", "16", "--dim", "64",
                 "--causal", "--cluster", "ethernet", "--node-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "cluster ethernet: 2 nodes x 8 ranks" in text and "fastest: double_ring" in text
    assert main(["cost", "--seq-len", "1024", "-P", "6", "--hidden", "64", "--heads", "8", "--cluster", "h100",
                 "--node-size", "4"]) == 2
    assert "--node-size 4 must divide -P 6" in capsys.readouterr().err
