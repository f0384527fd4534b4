"""The double ring's plan (no MPI): every block once on every rank, who sends what where, bytes between nodes."""

import pytest

from mpiring import make_plan
from mpiring.__main__ import main
from mpiring.cost.nodes import inter_node_bytes, node_ids, predicted_bytes, traffic
from mpiring.plans.hierarchy import INNER, OUTER

SHAPE = dict(batch=1, hq=4, hk=2, dim=8, dim_v=8, itemsize=4)


def _splits(P):
    return [n for n in range(1, P + 1) if P % n == 0]


@pytest.mark.parametrize("P", [1, 2, 3, 4, 6, 8])
def test_every_rank_holds_every_block_once_and_receives_what_was_sent(P):
    for n in _splits(P):
        plan = make_plan(8 * P, P, mode="double_ring", node_size=n, causal=True, layout="zigzag")
        assert (plan.node_size, plan.nodes, plan.n_steps) == (n, P // n, P)
        for r in range(P):
            assert sorted(plan.source_at(r, s) for s in range(P)) == list(range(P))
            for step, dest, source, what, link in plan.sends(r):  # what is sent arrives where it is needed
                later = step + 1 if link == INNER else step + n  # next step, or the next round's first
                assert what == "K/V" and plan.source_at(dest, later) == source
                assert (link == INNER) == (dest // n == r // n)
        for step in range(P):  # the hops home of a round pair every rank with one sender: a permutation
            homes = [d for r in range(P) for s, d, _, what, _ in plan.sends(r, backward=True)
                     if what == "dK/dV home" and s == step]
            assert sorted(homes) == (list(range(P)) if homes else [])


def test_bad_node_sizes():
    with pytest.raises(ValueError, match="node_size 3 does not divide the 4 ranks"):
        make_plan(16, 4, mode="double_ring", node_size=3)
    with pytest.raises(ValueError, match="node_size must be a positive integer"):
        make_plan(16, 4, mode="double_ring", node_size=0)


def test_the_double_ring_crosses_nodes_less():
    """P = 8 on 2 nodes of 4: the flat ring's boundary ranks send 7 blocks across, the double ring's every rank 1."""
    node_of = node_ids(["a"] * 4 + ["b"] * 4)
    block = 8 * 2 * (8 + 8) * 4  # one rank's 8 tokens of K and V
    flat = inter_node_bytes(traffic(make_plan(64, 8), **SHAPE), node_of)
    double = inter_node_bytes(traffic(make_plan(64, 8, mode="double_ring", node_size=4), **SHAPE), node_of)
    assert flat == [7 * block] * 2 and double == [4 * block] * 2
    plan = make_plan(64, 8, mode="double_ring", node_size=4)
    assert predicted_bytes(plan, **SHAPE) == [7 * block] * 8  # in all, as many bytes as the flat ring
    assert [link for *_, link in plan.sends(0)] == [OUTER] + [INNER] * 6


def test_schedule_command(capsys):
    assert main(["schedule", "-P", "4", "--mode", "double_ring", "--node-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "mode=double_ring" in text and "\n   1       1      0      3      2\n" in text  # step 1: next in node


def test_run_names_the_link_of_every_transfer():
    """``run`` labels a flat ring's sends from the ranks' hosts (the double ring names its own)."""
    from mpiring.tools.links import LinkMeter

    meter = LinkMeter.__new__(LinkMeter)  # no MPI: the node of every rank is all it needs here
    meter.node_of = node_ids(["a", "a", "b", "b"])
    records = [{"rank": r, "events": [("send", 0.0, 0.0, {"dest": (r + 1) % 4}), ("wait", 0.0, 0.0, {}),
                                      ("send", 0.0, 0.0, {"dest": "all"})]} for r in range(4)]
    meter.label(records)
    assert [rec["events"][0][3]["link"] for rec in records] == [INNER, OUTER, INNER, OUTER]
    assert all("link" not in rec["events"][2][3] for rec in records)  # a collective has no one link
